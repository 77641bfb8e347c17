"""The batch-invariant target's GPU products (`fixed_linear`, a Triton kernel), run here by
Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET): a row's bits
depend on the row and the weight alone, never on how many rows share the product, and the
passes they serve stay lossless."""

from __future__ import annotations

import random

import pytest
import torch
from decode_case import DEVICE, TRITON_KERNELS, engine_outputs, feed_ragged
from torch import nn

from pipeline.decode.static_lm import StaticLM
from pipeline.models import arrivals, fixed_attention, fixed_linear
from pipeline.models.loading import ModelRef, load_pair

pytestmark = TRITON_KERNELS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("outputs, inner, bias", [(48, 700, True), (40, 100, False), (16, 1100, True)])
def test_a_row_gets_the_same_bits_whatever_shares_its_product(dtype, outputs, inner, bias, monkeypatch):
    """40 rows in one product, then each span of them alone (one row, rows across a tile's edge,
    a view of every other row): bitwise the same rows, and the product within rounding. The
    shapes split the inner dimension in 2 and 3 parts of 3 blocks, and not at all (few programs
    wanted: parts of several blocks, whose sums a split in other parts would round otherwise)."""
    monkeypatch.setattr(fixed_linear, "PROGRAMS", 4)
    generator = torch.Generator().manual_seed(outputs)
    x = torch.randn(80, inner, generator=generator).to(DEVICE, dtype)[::2]  # rows 2 apart: a view
    weight = torch.randn(outputs, inner, generator=generator).to(DEVICE, dtype)
    b = torch.randn(outputs, generator=generator).to(DEVICE, dtype) if bias else None
    assert fixed_linear.parts(outputs, inner) == {700: (2, 3), 100: (1, 1), 1100: (3, 3)}[inner]
    whole = fixed_linear.product(x, weight, b)
    assert whole.shape == (40, outputs) and whole.dtype == dtype
    expected = fixed_linear.reference(x, weight, b)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    assert torch.allclose(whole.double(), expected, atol=tolerance * 8, rtol=tolerance)
    for start, end in ((0, 1), (7, 8), (15, 17), (16, 17), (3, 21), (39, 40), (1, 40)):
        part = x[start:end].clone()
        assert torch.equal(fixed_linear.product(part, weight, b), whole[start:end]), (start, end)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 17, 40])
def test_the_last_part_adds_the_parts_as_a_second_kernel_does(dtype, rows, monkeypatch):
    """A split product's parts added by each tile's last part to finish (one launch) give the
    second kernel's bits, and leave the device's arrival counters at zero for the next launch
    (3 parts, 2 output tiles, 1 to 3 row tiles)."""
    monkeypatch.setattr(fixed_linear, "PROGRAMS", 6)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1100, generator=generator).to(DEVICE, dtype)
    weight = torch.randn(48, 1100, generator=generator).to(DEVICE, dtype)
    b = torch.randn(48, generator=generator).to(DEVICE, dtype)
    assert fixed_linear.parts(48, 1100)[0] == 3
    counts = fixed_linear.LAST_ADDS.counters(x.device, 1)
    assert counts is not None
    sums, out = torch.empty((3, rows, 48), device=DEVICE), torch.empty((rows, 48), device=DEVICE, dtype=dtype)
    assert len(fixed_linear.launches(x, weight, b, sums, out, counts, False)) == 1  # one launch
    assert len(fixed_linear.launches(x, weight, b, sums, out, None, False)) == 2
    last = fixed_linear.product(x, weight, b)
    assert torch.equal(last, fixed_linear._multiply(x, weight, b, last_adds=False))
    assert not counts.any()
    assert fixed_linear.LAST_ADDS.counters(x.device, arrivals.SIZE + 1) is None  # too many tiles


def test_where_the_last_part_cannot_add_a_second_kernel_adds(monkeypatch, caplog):
    """The loader's check turns the last part's adding off where it fails and the second kernel
    passes: the kernel still serves, one launch more a split product. The counters a failed
    launch left set are set back: attention's last chunk counts on the same buffer."""
    launches = fixed_linear.launches

    def broken(x, weight, bias, sums, out, counts, gpu):
        if counts is not None:
            counts[:4] += 1  # counted, then failed: set for the next kernel counting on the buffer
            raise RuntimeError("no atomics here")
        return launches(x, weight, bias, sums, out, counts, gpu)

    monkeypatch.setattr(fixed_linear, "launches", broken)
    monkeypatch.setattr(fixed_linear.LAST_ADDS, "failed", set())
    assert fixed_linear.works.__wrapped__(DEVICE, torch.float32) is None
    assert "a second kernel adds" in caplog.text and "row blocks" not in caplog.text
    assert fixed_linear.LAST_ADDS.counters(torch.device(DEVICE), 1) is None
    assert not arrivals.counters(torch.device(DEVICE), 1).any()  # set back for attention's chunks


def test_no_rows_make_no_outputs():
    weight = torch.randn(8, 16, device=DEVICE)
    assert fixed_linear.product(torch.empty(0, 16, device=DEVICE), weight, None).shape == (0, 8)


def test_the_split_follows_the_weights_shape_alone():
    """Enough programs for a product of one row tile, never more parts than blocks: the 1.5B
    target's shapes (gate/up, q/k/v fused, o, down, k alone, the output layer)."""
    shapes = {
        (8960, 1536): 1,
        (2048, 1536): 4,
        (1536, 1536): 4,
        (1536, 8960): 5,
        (256, 1536): 12,
        (151936, 1536): 1,
    }
    for (outputs, inner), count in shapes.items():
        parts, per_part = fixed_linear.parts(outputs, inner)
        assert parts == count, (outputs, inner)
        blocks = -(-inner // fixed_linear.BLOCK_K)
        assert (parts - 1) * per_part < blocks <= parts * per_part  # no part left empty


@pytest.fixture(scope="module")
def kernel_pair(tiny_pair_dirs):
    """The tiny pair with batch-invariant numerics on the static path, its target multiplying
    and attending with the kernels, as on a GPU (plain Linear layers: no streamed kernel). Tiles
    of 128 outputs: fewer programs for the interpreter to run (BLOCK_N does not touch a row's sums)."""
    fixed_attention.CPU_INTERPRETED = True
    block_n, fixed_linear.BLOCK_N = fixed_linear.BLOCK_N, 128
    try:
        target, draft = (ModelRef(path=str(d)) for d in tiny_pair_dirs)
        kernels = {"batch_invariant": True, "static_passes": True, "streamed_linears": False}
        yield load_pair(target, draft, dtype="float32", device=DEVICE, **kernels)
    finally:
        fixed_attention.CPU_INTERPRETED = False
        fixed_linear.BLOCK_N = block_n


@pytest.fixture
def counted(monkeypatch):
    """The rows of each product the kernel computes (the tests must not pass on the row blocks)."""
    calls = []
    product = fixed_linear.product

    def counting(x, weight, bias):
        calls.append(x.shape[0])
        return product(x, weight, bias)

    monkeypatch.setattr(fixed_linear, "product", counting)
    return calls


def test_decode_passes_multiply_in_the_kernel_and_prefills_do_not(kernel_pair, counted):
    model = kernel_pair.target
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert kernel_pair.fixed_linears and kernel_pair.manifest()["fixed_linears"] is True
    assert all(m._fixed_linear for m in linears)
    runner = StaticLM(model, 0)
    assert runner.graph_record()["fixed_linears"] is True
    runner.reset(2)
    runner.forward([list(range(3, 40)), list(range(5, 20))], [1, 1])
    assert not counted  # a prefill
    runner.forward([[7, 8, 9], [10]], [3, 1])
    assert len(counted) == len(linears)  # each product once a pass


def test_a_rows_logits_do_not_depend_on_its_pass_or_its_company(kernel_pair, counted):
    """Rows decoded together in ragged verify passes (drafts of 0 to 7 tokens) get, at each
    position, bitwise the logits each row gets alone one token a pass."""
    model = kernel_pair.target
    rng = random.Random(5)
    seqs = [[rng.randrange(3, 300) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    together = StaticLM(model, 0)
    fed = [[rng.randrange(3, 300) for _ in range(8)] for _ in seqs]
    widths = [[1, 2, 4, 1], [4, 2, 1, 1], [5, 1, 1, 1]]  # 8 tokens a row in 4 passes
    logits = feed_ragged(together, seqs, fed, widths)  # per row, the logits after each fed token
    assert counted and max(counted) >= 15  # 3 rows x width 5
    for row, seq in enumerate(seqs):
        alone = StaticLM(model, 0)
        alone.reset(1)
        alone.forward([list(seq)], [1])
        for n, token in enumerate(fed[row]):
            (own,) = alone.forward([[token]], [1])
            assert torch.equal(own[0], logits[row][n]), (row, n)


def test_speculative_outputs_equal_target_only_one_row_at_a_time(kernel_pair, counted):
    """Greedy speculative decoding at a batch on the kernels' passes (verify passes of 1 to 5
    tokens a row) gives target-only's outputs at batch 1, token for token."""
    assert engine_outputs(kernel_pair, "prompt_lookup", 3) == engine_outputs(kernel_pair, "none", 1)
    assert counted


def test_an_ab_keeps_the_row_blocks_under_its_own_calibration(kernel_pair, tiny_pair_dirs):
    """`block_linears` (calibrate's and bench's `--block-linears`) keeps the row blocks; the
    calibration's key tells the two apart."""
    from pipeline.decode.calibration import calibration_key

    target, draft = (ModelRef(path=str(d)) for d in tiny_pair_dirs)
    kernels = {
        "batch_invariant": True,
        "static_passes": True,
        "streamed_linears": False,
        "block_linears": True,
    }
    fixed_attention.CPU_INTERPRETED = True
    try:
        blocks = load_pair(target, draft, dtype="float32", device=DEVICE, **kernels)
    finally:
        fixed_attention.CPU_INTERPRETED = False
    assert not blocks.fixed_linears and not fixed_linear.used(blocks.target)
    assert calibration_key(blocks, 2) != calibration_key(kernel_pair, 2)


@pytest.mark.parametrize("fault", ["raises", "miscomputes", "varies"])
def test_a_kernel_that_fails_or_miscomputes_here_leaves_the_row_blocks(
    kernel_pair, monkeypatch, caplog, fault
):
    """A Triton or driver the kernel does not work on costs speed, never outputs or the start."""
    product = fixed_linear.product

    def broken(x, weight, bias):
        if fault == "raises":
            raise RuntimeError("no kernel for this device")
        out = product(x, weight, bias)
        if fault == "miscomputes":
            return out * 2
        return out + (len(x) > 1) * 1e-6  # a row among others rounds otherwise than alone

    fixed_linear.works.cache_clear()
    monkeypatch.setattr(fixed_linear, "product", broken)
    monkeypatch.setattr(fixed_linear.LAST_ADDS, "failed", set())  # the check tries both addings
    fixed_attention.CPU_INTERPRETED = True
    try:
        assert not fixed_linear.serves(kernel_pair.target)
        assert "row blocks instead" in caplog.text
    finally:
        fixed_attention.CPU_INTERPRETED = False
        fixed_linear.works.cache_clear()
