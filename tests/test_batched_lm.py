"""BatchedLM: the model plus its ragged, rollback-able cache."""

from __future__ import annotations

import random

import torch

from pipeline.decode.batched_lm import BatchedLM, agreeing


def test_logits_that_are_more_than_the_output_layer_come_from_the_models_own_forward(tiny_models):
    """Only the wanted positions go through the output layer, where that is all a model's
    logits are (Llama); Granite divides them by `logits_scaling`, so its own forward runs."""
    from transformers import GraniteConfig, GraniteForCausalLM

    target, _, _ = tiny_models
    torch.manual_seed(0)
    config = GraniteConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        logits_scaling=8.0,
    )
    granite = GraniteForCausalLM(config).eval()
    seqs = [list(range(3, 40)), list(range(50, 70))]
    for model, plain in ((target, True), (granite, False)):
        lm = BatchedLM(model, pad_token_id=0)
        lm.reset(2)
        lm.forward([seqs[0][:30], seqs[1][:19]], [1, 1])
        got = lm.forward([seqs[0][30:], seqs[1][19:]], [7, 1])  # a ragged 2 × 7 pass
        assert model._plain_head is plain
        with torch.no_grad():
            for row, seq in enumerate(seqs):
                ids = torch.tensor([seq], device=lm.device)
                want = model(input_ids=ids).logits[0, -len(got[row]) :].float()
                torch.testing.assert_close(got[row], want, rtol=1e-4, atol=1e-4)


def test_rows_admitted_into_a_running_batch_keep_no_autograd_graph(tiny_models):
    """Admission prefills beside running rows; without no_grad there, every admitted row's
    activations stayed alive through its cache (a batch-8 benchmark grew to 17 GB)."""
    target, _, _ = tiny_models
    lm = BatchedLM(target, pad_token_id=0)
    lm.reset(1)
    lm.forward([list(range(3, 30))], [1])
    logits = lm.admit([list(range(5, 20)), list(range(7, 12))], [1, 1])
    assert len(lm.tokens) == 3 and not any(t.requires_grad for t in logits)
    assert not any(layer.keys.requires_grad or layer.values.requires_grad for layer in lm.cache.layers)


def test_a_cache_keeps_exactly_the_longest_prefix_that_agrees_with_the_row():
    """`agreeing` skips a rejected tail token by token and then checks the whole prefix once:
    against a plain walk from the start, over tails rejected, disagreements further in, and
    rows shorter than their caches."""
    rng = random.Random(3)

    def reference(cached, seq):
        n = 0
        while n < min(len(cached), len(seq) - 1) and cached[n] == seq[n]:
            n += 1
        return n

    for _ in range(3000):
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        cached = seq[: rng.randrange(len(seq) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(6))]
        if cached and rng.random() < 0.3:  # a disagreement further in
            cached[rng.randrange(len(cached))] = rng.randrange(4)
        assert agreeing(cached, seq) == reference(cached, seq), (cached, seq)
        known = rng.randrange(reference(cached, seq) + 1)  # any count found to agree before
        assert agreeing(cached, seq, known) == reference(cached, seq), (cached, seq, known)


def test_a_sync_compares_only_what_a_row_grew_by_since_the_last(tiny_models, monkeypatch):
    """`sync` remembers what agreed of each row: given the same list again, grown by tokens and
    drafts, it compares only past it (at 64 rows of 2,000 tokens the whole prefixes cost 0.66 ms
    a round); a new list, or a cache replaced, is compared whole, and so rolled back right even
    where it differs far back. Every unfed block is what a sync from nothing would give."""
    from pipeline.decode import batched_lm

    target, _, _ = tiny_models
    known_args = []
    compare = batched_lm.agreeing
    monkeypatch.setattr(batched_lm, "agreeing", lambda c, s, k=0: known_args.append(k) or compare(c, s, k))
    lm = BatchedLM(target, pad_token_id=0)
    rows = [list(range(3, 40)), list(range(50, 70))]
    lm.reset(2)
    lm.forward(lm.sync(rows), [1, 1])
    assert known_args == [0, 0]  # nothing known yet
    for _ in range(4):
        drafts = [[5, 6, 7], [8]]
        unfed = lm.sync(rows)
        assert unfed == [[rows[0][-1]], [rows[1][-1]]]
        lm.forward([u + d for u, d in zip(unfed, drafts)], [4, 2])
        rows[0] += [5, 9]  # the first draft kept, then the target's own token
        rows[1] += [3]  # the draft rejected
        del known_args[:]
        assert lm.sync(rows) == [[9], [3]]
        assert known_args == [len(rows[0]) - 3, len(rows[1]) - 2]  # what agreed at the last sync
        assert [len(t) for t in lm.tokens] == [len(rows[0]) - 1, len(rows[1]) - 1]
        lm.forward([[9], [3]], [1, 1])
        rows[0].append(11)
        rows[1].append(12)
    changed = [rows[0][:5] + [99] + rows[0][6:], rows[1]]  # a new list differing far back
    del known_args[:]
    assert lm.sync(changed) == [changed[0][5:], [rows[1][-1]]]
    assert known_args[0] == 0 and len(lm.tokens[0]) == 5
