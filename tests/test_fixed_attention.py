"""The static path's GPU attention (`fixed_attention`, a Triton kernel), run here by Triton's
interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET): a query's bits depend on
its keys alone, never on what shares its pass, and the path it serves stays lossless."""

from __future__ import annotations

import random

import pytest
import torch
from decode_case import DEVICE, TRITON_KERNELS, engine_outputs, feed_ragged

from pipeline.decode.batched_lm import BatchedLM
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.settings import EngineConfig
from pipeline.decode.static_lm import StaticLM
from pipeline.models import arrivals, fixed_attention, invariant
from pipeline.models.loading import ModelRef, load_pair

pytestmark = TRITON_KERNELS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_query_gets_the_same_bits_whatever_shares_its_pass(dtype):
    """3 slots × 8 queries in one pass, then each query alone in a pass of 1, its slot shorter
    and the keys past its own spoilt: bitwise the same, and softmax attention within rounding."""
    generator = torch.Generator().manual_seed(0)
    slots, heads, kv_heads, length, dim = 3, 4, 2, 300, 16
    key, value = (
        torch.randn(slots, kv_heads, length, dim, generator=generator).to(DEVICE, dtype) for _ in range(2)
    )
    # [slots, heads, width, dim] as `transformers` hands it over: a transposed view
    query = torch.randn(slots, 8, heads, dim, generator=generator).to(DEVICE, dtype).transpose(1, 2)
    # spans that end inside a block of keys, on its edge, after one key, past two blocks and
    # across a chunk's edge
    ends = torch.tensor(
        [[100 + i for i in range(8)], [1, 2, 63, 64, 65, 128, 129, 5], [250 + i for i in range(8)]],
        device=DEVICE,
    )
    scale = dim**-0.5
    wide = fixed_attention.attend(query, key, value, ends, scale)
    assert wide.shape == (slots, 8, heads, dim) and wide.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 2**-7  # the output's rounding to bf16
    assert torch.allclose(
        wide.double(),
        fixed_attention.reference(query, key, value, ends, scale),
        atol=tolerance,
        rtol=tolerance,
    )
    for slot in range(slots):
        for token in range(8):
            seen = int(ends[slot, token])
            cut = seen + 7  # a shorter slot, its keys past the query's own spoilt
            keys, values = key[slot : slot + 1, :, :cut].clone(), value[slot : slot + 1, :, :cut].clone()
            keys[:, :, seen:], values[:, :, seen:] = float("nan"), float("inf")
            alone = fixed_attention.attend(
                query[slot : slot + 1, :, token : token + 1],
                keys,
                values,
                ends[slot : slot + 1, token : token + 1],
                scale,
            )
            assert torch.equal(alone, wide[slot : slot + 1, token : token + 1]), (slot, token)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_last_chunk_merges_the_chunks_as_a_second_kernel_does(dtype):
    """A tile's chunks merged by its last chunk to finish (one launch) give the second kernel's
    bits, and leave the device's arrival counters at zero for the next launch: 2 slots, 3 chunks
    of keys (one past every query of a slot), 2 tiles of queries a key/value head."""
    generator = torch.Generator().manual_seed(1)
    slots, heads, kv_heads, width, dim = 2, 8, 2, 5, 16
    length = 2 * fixed_attention.CHUNK + 30
    key, value = (
        torch.randn(slots, kv_heads, length, dim, generator=generator).to(DEVICE, dtype) for _ in range(2)
    )
    query = torch.randn(slots, heads, width, dim, generator=generator).to(DEVICE, dtype)
    ends = torch.tensor([[300, 301, 302, 303, 304], [7, 8, 9, length - 1, length]], device=DEVICE)
    arrived = fixed_attention.LAST_MERGES.counters(query.device, 1)
    assert arrived is not None
    last = fixed_attention.attend(query, key, value, ends, dim**-0.5)
    assert torch.equal(last, fixed_attention._attend(query, key, value, ends, dim**-0.5, last_merges=False))
    assert not arrived.any()
    parts = (slots, kv_heads, 2, 3, fixed_attention.ROWS)
    sums = (torch.empty(parts), torch.empty(parts), torch.empty((*parts, dim)))
    counts = ends.to(torch.int32)
    one = fixed_attention.launches(query, key, value, counts, sums, last, arrived, 0.25, False)
    assert (
        len(one) == 1
        and len(fixed_attention.launches(query, key, value, counts, sums, last, None, 0.25, False)) == 2
    )
    assert fixed_attention.LAST_MERGES.counters(query.device, arrivals.SIZE + 1) is None  # too many tiles


def test_where_the_last_chunk_cannot_merge_a_second_kernel_merges(monkeypatch, caplog):
    """The loader's check turns the last chunk's merging off where it fails and the second
    kernel passes: the kernel still attends, one launch more a layer."""
    launches = fixed_attention.launches

    def broken(query, key, value, counts, chunk_sums, out, arrived, scale, gpu):
        if arrived is not None:
            raise RuntimeError("no atomics here")
        return launches(query, key, value, counts, chunk_sums, out, arrived, scale, gpu)

    monkeypatch.setattr(fixed_attention, "launches", broken)
    monkeypatch.setattr(fixed_attention.LAST_MERGES, "failed", set())
    assert fixed_attention.works.__wrapped__(DEVICE, torch.float32, 16) is None
    assert "a second kernel adds" in caplog.text and "float64 attention instead" not in caplog.text
    assert fixed_attention.LAST_MERGES.counters(torch.device(DEVICE), 1) is None


def test_a_query_that_sees_no_key_gets_zeros():
    """A free slot's padding (the static path feeds every slot) must not make NaNs."""
    query = torch.randn(1, 2, 1, 16, device=DEVICE)
    key = value = torch.randn(1, 1, 8, 16, device=DEVICE)
    out = fixed_attention.attend(query, key, value, torch.zeros(1, 1, dtype=torch.int32, device=DEVICE), 0.25)
    assert torch.equal(out, torch.zeros(1, 1, 2, 16, device=DEVICE))


@pytest.fixture(scope="module")
def kernel_pair(tiny_pair_dirs):
    """The tiny pair with batch-invariant numerics on the static path, its target attending with
    the kernel, as on a GPU."""
    fixed_attention.CPU_INTERPRETED = True
    try:
        target, draft = (ModelRef(path=str(d)) for d in tiny_pair_dirs)
        kernels = {"batch_invariant": True, "static_passes": True}
        yield load_pair(target, draft, dtype="float32", device=DEVICE, **kernels)
    finally:
        fixed_attention.CPU_INTERPRETED = False


@pytest.fixture
def counted(monkeypatch):
    """How many times the kernel attends (the tests must not pass on the float64 path)."""
    calls = []
    attend = fixed_attention.attend

    def counting(*args):
        calls.append(args[0].shape)
        return attend(*args)

    monkeypatch.setattr(fixed_attention, "attend", counting)
    return calls


def test_a_rows_logits_do_not_depend_on_its_pass_or_its_company(
    kernel_pair, counted, tiny_pair_dirs, monkeypatch
):
    """Rows decoded together in ragged verify passes (drafts of 0 to 7 tokens) get, at each
    position, bitwise the logits each row gets alone one token a pass; and within float32
    rounding the float64 attention's (the dynamic path's). Chunks of 48 positions: the rows'
    keys span several, each read in blocks that cross its end."""
    monkeypatch.setattr(fixed_attention, "CHUNK", 48)
    model = kernel_pair.target
    rng = random.Random(3)
    seqs = [[rng.randrange(3, 300) for _ in range(rng.randrange(5, 70))] for _ in range(3)]
    together = StaticLM(model, 0)
    assert together.fixed_attention and together.store.dtype == model.dtype  # no float64 cache
    fed = [[rng.randrange(3, 300) for _ in range(12)] for _ in seqs]
    widths = [[1, 2, 4, 1, 4], [4, 4, 2, 1, 1], [8, 1, 1, 1, 1]]  # 12 tokens a row in 5 passes
    logits = feed_ragged(together, seqs, fed, widths)  # per row, the logits after each fed token
    assert counted and max(shape[2] for shape in counted) > 1
    dynamic = BatchedLM(
        load_pair(*(ModelRef(path=str(d)) for d in tiny_pair_dirs), dtype="float32").target, 0
    )
    for row, seq in enumerate(seqs):
        alone = StaticLM(model, 0)
        alone.reset(1)
        alone.forward([list(seq)], [1])
        dynamic.reset(1)
        dynamic.forward([list(seq)], [1])
        for n, token in enumerate(fed[row]):
            (own,) = alone.forward([[token]], [1])
            assert torch.equal(own[0], logits[row][n]), (row, n)
            (theirs,) = dynamic.forward([[token]], [1])
            assert torch.allclose(own[0], theirs[0], atol=1e-4)


def test_a_free_slot_attends_to_one_key_not_over_its_whole_slot(kernel_pair, monkeypatch):
    """A pass of every slot computes the free ones too (their padding at the slot's scratch
    positions, their outputs never read): each attends to one key, not over the whole slot, which
    in a draining batch of 64 would read every free slot's keys each pass. The rows' own counts
    are their positions; that their outputs stay target-only's, the drains of the tests beside
    this one hold."""
    seen = []
    attend = fixed_attention.attend

    def recorded(query, key, value, visible, scale):
        seen.append(visible.clone())
        return attend(query, key, value, visible, scale)

    monkeypatch.setattr(fixed_attention, "attend", recorded)
    lm = StaticLM(kernel_pair.target, 0)
    lm.reserve(4, 60)
    lm.reset(2)  # two rows in four slots
    lm.forward([[5 + i % 40 for i in range(30)], [6 + i % 30 for i in range(20)]], [1, 1])
    seen.clear()
    lm.forward([[7], [8]], [1, 1])
    (visible,) = seen[:1]
    free = [slot for slot in range(4) if slot not in lm.row_slots]
    assert visible.shape == (4, 1) and visible[free].eq(1).all()
    assert visible[lm.row_slots, 0].tolist() == [31, 21]  # each row's keys up to its new token's own


@pytest.mark.parametrize("drafter, batch_size", [("none", 3), ("prompt_lookup", 3), ("draft_model", 2)])
def test_speculative_outputs_equal_target_only_one_row_at_a_time(kernel_pair, counted, drafter, batch_size):
    """Greedy speculative decoding at a batch on the kernel's passes gives target-only's
    outputs at batch 1, token for token."""
    assert engine_outputs(kernel_pair, drafter, batch_size) == engine_outputs(kernel_pair, "none", 1)
    assert counted


def test_the_loader_says_which_attention_runs_and_an_ab_can_keep_float64(kernel_pair, tiny_pair_dirs):
    """The manifest and the calibration's key name the kernel; `float64_attention` (calibrate's
    and bench's `--float64-attention`) keeps the float64 attention, under another key."""
    from pipeline.decode.calibration import calibration_key

    assert kernel_pair.fixed_attention and kernel_pair.manifest()["fixed_attention"] is True
    assert StaticLM(kernel_pair.target, 0).graph_record()["fixed_attention"] is True
    target, draft = (ModelRef(path=str(d)) for d in tiny_pair_dirs)
    kernels = {"batch_invariant": True, "static_passes": True, "float64_attention": True}
    float64 = load_pair(target, draft, dtype="float32", device=DEVICE, **kernels)
    assert not float64.fixed_attention and not StaticLM(float64.target, 0).fixed_attention
    assert calibration_key(float64, 2) != calibration_key(kernel_pair, 2)


@pytest.mark.parametrize("fault", ["raises", "miscomputes"])
def test_a_kernel_that_fails_or_miscomputes_here_leaves_float64_attention(
    kernel_pair, monkeypatch, caplog, fault
):
    """A Triton or driver the kernel does not work on costs speed, never outputs or the start."""

    def broken(query, key, value, visible, scale):
        if fault == "raises":
            raise RuntimeError("no kernel for this device")
        return torch.zeros(
            query.shape[0],
            query.shape[2],
            query.shape[1],
            query.shape[3],
            dtype=query.dtype,
            device=query.device,
        )

    fixed_attention.works.cache_clear()
    monkeypatch.setattr(fixed_attention, "attend", broken)
    monkeypatch.setattr(fixed_attention.LAST_MERGES, "failed", set())  # the check tries both mergings
    try:
        assert not fixed_attention.serves(kernel_pair.target)
        assert not StaticLM(kernel_pair.target, 0).fixed_attention
        assert "float64 attention instead" in caplog.text
    finally:
        fixed_attention.works.cache_clear()


def test_compiled_passes_call_the_kernel_and_keep_target_onlys_outputs(tiny_pair_dirs, counted):
    """`torch.compile`d layers (a GPU's default) take the kernel as an op of its own (its fake
    shapes traced, its body run as it is), and greedy speculative decoding over them gives
    target-only's outputs."""
    from transformers import AutoModelForCausalLM

    fixed_attention.CPU_INTERPRETED = True
    try:
        target, draft = (
            AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval().to(DEVICE)
            for d in tiny_pair_dirs
        )
        target = invariant.make_batch_invariant(target, True)
        for model in (target, draft):  # as load_pair(static_passes=True, compiled_passes=True) marks them
            model._static_passes = model._compiled_passes = True
        prompts = [list(range(5, 40)) * 2, list(range(60, 75)) * 3, list(range(7, 90, 3))]
        outputs = {}
        for drafter, batch_size in (("none", 1), ("prompt_lookup", 2)):
            config = EngineConfig(drafter=drafter, gamma_max=3)
            engine = SpeculativeEngine(target, draft, eos_token_ids=[1], pad_token_id=0, config=config)
            assert engine.target.compiled and engine.target.fixed_attention
            before = len(counted)  # (the loader's own check of the kernel calls it too)
            done, _ = engine.generate(prompts, 16, batch_size=batch_size)
            assert len(counted) > before
            outputs[drafter] = [o.tokens for o in done]
    finally:
        fixed_attention.CPU_INTERPRETED = False
    assert outputs["prompt_lookup"] == outputs["none"]
