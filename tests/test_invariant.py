"""Batch-invariant target numerics: speculative output is bitwise the target's own.

With stock kernels a token's logits depend on how many tokens share its pass (a 1-row matrix
product takes another kernel) and on the masked cache slots around its keys, so a near-tie can
flip between target-only decoding and a wide verify pass. `make_batch_invariant` removes both
dependencies in bf16, and the streamed Linear layers with the same attention do in float32;
these tests check the logits bit for bit, not approximately, for both.
"""

from __future__ import annotations

import logging

import pytest
import torch
from decode_case import DEVICE
from transformers import AutoModelForCausalLM

from pipeline.decode.batched_lm import BatchedLM
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.settings import EngineConfig
from pipeline.models import invariant, streamed
from pipeline.models.loading import ModelRef, load_pair

NUMERICS = [
    "bf16",
    "bf16-row-blocks",  # the GPU's way, wherever the tests run
    pytest.param(
        "float32-streamed",
        marks=pytest.mark.skipif(
            streamed.library() is None,
            reason="no streamed linear kernel on this machine (no AVX2 or compiler)",
        ),
    ),
]


@pytest.fixture(scope="module", params=NUMERICS)
def invariant_pair(request, tiny_pair_dirs):
    """The tiny pair, the target made batch-invariant: in bf16 (on a CPU the 2-row trick, on a
    GPU row blocks), in bf16 with row blocks, or in float32 with streamed Linear layers (the
    session's float32 models stay as they are)."""
    target_dir, draft_dir = tiny_pair_dirs
    dtype = torch.bfloat16 if request.param == "bf16" else torch.float32
    if request.param == "float32-streamed" and DEVICE != "cpu":
        pytest.skip("streamed Linear layers are a CPU kernel")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval().to(DEVICE)
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).eval().to(DEVICE)
    if request.param == "float32-streamed":
        assert streamed.stream_linears(target) == 2 * 7 + 1  # every Linear, the output layer too
    return invariant.make_batch_invariant(
        target, row_blocks=request.param == "bf16-row-blocks" or None
    ), draft


def _prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (count, length), generator=gen).tolist()


@pytest.mark.skipif(
    DEVICE != "cpu" or streamed.library() is None, reason="the kernel's attention is a CPU kernel"
)
def test_a_bf16_target_on_a_cpu_attends_in_the_kernel_not_in_float64(tiny_pair_dirs, monkeypatch):
    """A bf16 target on a CPU attends in the kernel, in float32 over a float32 cache, prefills
    and decode passes alike: float64 products, softmax and mask were some 70% of a bf16 prefill.
    (The tests around this one hold its bits the same in every pass.)"""
    target = AutoModelForCausalLM.from_pretrained(tiny_pair_dirs[0], dtype=torch.bfloat16).eval()
    invariant.make_batch_invariant(target)
    assert invariant.cache_dtype(target) == torch.float32

    def refuse(*args, **kwargs):
        raise AssertionError("float64 attention ran")

    monkeypatch.setattr(invariant, "float64_attention", refuse)
    p = _prompts(2, 40)
    lm = BatchedLM(target, pad_token_id=0)
    lm.reset(2)
    first = lm.forward([p[0], p[1][:30]], [1, 1])
    then = lm.forward([[5, 6, 7], [8]], [3, 1])
    assert all(torch.isfinite(x).all() for x in [*first, *then])


def test_a_token_gets_the_same_logits_alone_in_a_wide_pass_and_in_a_ragged_batch(invariant_pair):
    """A generated token's logits, whatever pass verifies it. Prompts are always prefilled and
    generated tokens never are, so each side is compared with its own kind: on a GPU a prefill
    runs its Linears in a larger row block (`invariant.PREFILL_ROWS`), whose kernel may round
    otherwise than a decode pass's."""
    target, _ = invariant_pair
    p = _prompts(3, 120)
    lm = BatchedLM(target, pad_token_id=0)
    # alone: prefill, then one token per pass (what target-only decoding does)
    lm.reset(1)
    first = lm.forward([p[0][:110]], [1])[0]
    alone = torch.cat([lm.forward([[t]], [1])[0] for t in p[0][110:120]])
    # alone, all ten in one verify pass
    lm.reset(1)
    lm.forward([p[0][:110]], [1])
    wide = lm.forward([p[0][110:120]], [10])[0]
    # in a batch of three rows of other lengths, after a rejected draft left holes in the cache
    lm.reset(3)
    ragged_first = lm.forward([p[0][:110], p[1][:80], p[2][:119]], [1, 1, 1])[0]
    lm.forward([p[0][110:111] + [7, 7], p[1][80:81], p[2][119:120]], [3, 1, 1])
    unfed = lm.sync([p[0][:112], p[1][:82], p[2][:120] + [5]])
    assert unfed == [[p[0][111]], [p[1][81]], [5]]
    batch = lm.forward([p[0][111:120], p[1][81:82], [5]], [9, 1, 1])[0]
    # a prefill's logits, alone and beside other rows: its attention runs in blocks of queries
    lm.reset(1)
    prefill = lm.forward([p[0][:120]], [10])[0]
    lm.reset(2)
    prefill_beside = lm.forward([p[1][:70], p[0][:120]], [1, 10])[1]
    assert torch.equal(alone, wide)
    assert torch.equal(alone[1:], batch)
    assert torch.equal(first, ragged_first)
    assert torch.equal(prefill, prefill_beside)
    if DEVICE == "cpu":  # one row block for both kinds of pass
        assert torch.equal(alone, prefill)


@pytest.mark.parametrize("per_row", [True, False])
def test_a_prefill_from_a_template_or_row_by_row_gives_the_logits_of_one_padded_pass(invariant_pair, per_row):
    """Prompts that share a start: after two different ones showed it, later rows copy its keys
    and values instead of computing them; on a CPU each row is prefilled in a pass of its own.
    Neither may change a bit of what the rows decode next."""
    target, _ = invariant_pair
    template = _prompts(1, 24, seed=3)[0]
    docs = _prompts(4, 60, seed=4)
    prompts = [template + d[: 20 + 10 * i] for i, d in enumerate(docs)]
    nexts = [[5, 9, 11], [7], [3, 4], [8, 8]]

    fresh = BatchedLM(target, pad_token_id=0, per_row_prefill=False)
    fresh.reset(3)
    expected = fresh.forward(prompts[1:], [1, 1, 1])
    expected_next = fresh.forward(nexts[1:], [len(n) for n in nexts[1:]])
    assert fresh.fed_tokens == sum(map(len, nexts[1:]))

    lm = BatchedLM(target, pad_token_id=0, per_row_prefill=per_row)
    lm.reset(1)
    lm.forward(prompts[:1], [1])  # the first prompt: nothing to share with yet
    assert lm.template is None and lm.fed_tokens == len(prompts[0])
    lm.reset(3)
    got = lm.forward(prompts[1:], [1, 1, 1])
    assert lm.template is not None and lm.template.tokens[:24] == template
    shared = len(lm.template.tokens)
    assert lm.fed_tokens == sum(map(len, prompts[1:])) - 3 * shared
    got_next = lm.forward(nexts[1:], [len(n) for n in nexts[1:]])
    for a, b in zip(got + got_next, expected + expected_next):
        assert torch.equal(a, b)
    # a twin of the previous prompt reuses the template only, not its twin's whole cache
    lm.reset(1)
    lm.forward([prompts[3]], [1])
    assert lm.fed_tokens == len(prompts[3]) - shared
    assert lm.prefill_tokens([prompts[3], prompts[0]]) == len(prompts[3]) + len(prompts[0]) - 2 * shared


def test_in_a_prefill_the_output_layer_keeps_the_decode_passes_row_block(tiny_pair_dirs, monkeypatch):
    """A GPU's row blocks: a prefill's layers take PREFILL_ROWS rows a call, its output layer,
    which sees only the rows that want logits, the decode passes' GPU_ROWS (a 2,048-row block
    computed the whole vocabulary 2,048 times over for each admission)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_pair_dirs[0], dtype=torch.float32).eval()
    invariant.make_batch_invariant(model, row_blocks=True)
    seen = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, *a: seen.append(len(x)) or linear(x, *a))
    head, layer = model.get_output_embeddings(), model.base_model.layers[0].mlp.down_proj
    with torch.no_grad(), streamed.prefilling():
        head(torch.zeros(3, head.in_features))
        layer(torch.zeros(3, layer.in_features))
    with torch.no_grad():
        head(torch.zeros(3, head.in_features))
    assert seen == [invariant.GPU_ROWS, invariant.PREFILL_ROWS, invariant.GPU_ROWS]


def test_float64_attention_computes_the_same_attention(tiny_pair_dirs):
    """Same function as the stock attention, to float64 precision rather than bitwise."""
    target_dir, _ = tiny_pair_dirs
    ids = torch.tensor(_prompts(2, 40, seed=1))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # a left-padded row
    stock = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        expected = stock(input_ids=ids, attention_mask=mask).logits
        got = invariant.make_batch_invariant(stock)(input_ids=ids, attention_mask=mask).logits
    assert stock.config._attn_implementation == invariant.NAME
    torch.testing.assert_close(got[0], expected[0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got[1, 7:], expected[1, 7:], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("drafter", ["draft_model", "prompt_lookup", "auto"])
def test_speculative_output_is_bitwise_target_only(invariant_pair, drafter, batch_size):
    target, draft = invariant_pair
    prompts = _prompts(6, 30, seed=2)
    engine = SpeculativeEngine(
        target, draft, eos_token_ids=[1], pad_token_id=0, config=EngineConfig(adaptive=False, gamma_max=5)
    )
    reference = [engine.generate([p], 24, drafter="none")[0][0].tokens for p in prompts]
    drafted = 0
    for start in range(0, len(prompts), batch_size):
        outputs, stats = engine.generate(prompts[start : start + batch_size], 24, drafter=drafter)
        assert [o.tokens for o in outputs] == reference[start : start + batch_size]
        drafted += stats.drafted
    assert drafted > 0


def test_the_loader_makes_16_bit_cpu_targets_invariant(tiny_pair_dirs, caplog):
    target_dir, draft_dir = tiny_pair_dirs
    caplog.set_level(logging.WARNING, logger="pipeline.models.loading")
    bf16 = load_pair(ModelRef(str(target_dir)), ModelRef(str(draft_dir)), dtype="bf16", device="cpu")
    assert bf16.batch_invariant and bf16.manifest()["batch_invariant"] is True
    assert bf16.target.config._attn_implementation == invariant.NAME
    assert bf16.draft.config._attn_implementation != invariant.NAME  # drafts are checked anyway
    # where this CPU's kernels cannot keep the promise, the loader says so
    warned = any("near-ties" in r.getMessage() for r in caplog.records)
    assert warned is not invariant.linear_is_row_invariant(torch.bfloat16)
    fp32 = load_pair(ModelRef(str(target_dir)), None, dtype="float32", device="cpu", streamed_linears=False)
    assert not fp32.batch_invariant and fp32.target.config._attn_implementation != invariant.NAME
    off = load_pair(ModelRef(str(target_dir)), None, dtype="bf16", device="cpu", batch_invariant=False)
    assert not off.batch_invariant


@pytest.mark.parametrize("lengths", [(7, 1, 2), (3, 2, 4)])
def test_a_ragged_pass_computes_only_its_real_tokens_and_changes_no_bit(invariant_pair, lengths):
    """At batch 8 one row may verify 5 copied tokens while seven verify 1: packed, the weights'
    products run over the real tokens only (see `packing`), and every logit keeps its bits.
    Attention runs the columns all rows fill as one batch and the rest row by row; (3, 2, 4)
    has two such common columns."""
    target, _ = invariant_pair
    p = _prompts(3, 60, seed=5)
    starts = (40, 50, 55)
    blocks = [row[s : s + n] for row, s, n in zip(p, starts, lengths)]
    real, rectangle = sum(lengths), len(lengths) * max(lengths)
    mlp = target.model.layers[0].mlp
    seen: list[int] = []
    gathered_alone: list[bool] = []  # did a Linear inside the MLP gather its own input?
    results = {}
    for pack in (False, True):
        lm = BatchedLM(target, pad_token_id=0, pack=pack)
        lm.reset(3)
        lm.forward([row[:s] for row, s in zip(p, starts)], [1, 1, 1])
        seen.clear()
        gathered_alone.clear()
        hooks = [
            mlp.down_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[:-1].numel())),
            mlp.gate_proj.register_forward_pre_hook(
                lambda m, args: gathered_alone.append(getattr(m, "_packed", None) is not None)
            ),
        ]
        results[pack] = lm.forward(blocks, list(lengths))
        for hook in hooks:
            hook.remove()
        assert seen == ([real] if pack else [rectangle])
        assert gathered_alone == [False]  # packed, the MLP gathered its input once, as a whole
        assert lm.pass_tokens(list(lengths)) == (real if pack else rectangle)
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("drafter", ["draft_model", "prompt_lookup", "auto"])
def test_rows_admitted_into_a_running_batch_decode_bitwise_as_alone(invariant_pair, drafter):
    target, draft = invariant_pair
    prompts = [p[: 12 + 5 * i] for i, p in enumerate(_prompts(7, 50, seed=6))]
    engine = SpeculativeEngine(
        target, draft, eos_token_ids=[1], pad_token_id=0, config=EngineConfig(adaptive=False, gamma_max=4)
    )
    reference = [engine.generate([p], 16, drafter="none")[0][0].tokens for p in prompts]
    # rows that accept more drafts finish sooner and free their places for waiting ones
    outputs, stats = engine.generate(prompts, 16, drafter=drafter, batch_size=3)
    assert [o.tokens for o in outputs] == reference
    assert stats.drafted > 0
