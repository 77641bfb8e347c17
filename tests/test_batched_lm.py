"""BatchedLM: the model plus its ragged, rollback-able cache."""

from __future__ import annotations

import torch

from pipeline.decode.batched_lm import BatchedLM


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
