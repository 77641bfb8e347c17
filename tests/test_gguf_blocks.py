"""GGUF blocks streamed by the CPU kernel: each weight is gguf's own dequantized value, bit for
bit, and a row's output does not depend on the width of the pass, the rows beside it, the path
the kernel took (direct or decoded into scratch) or the threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from decode_case import assert_widths_alike
from gguf import GGMLQuantizationType, quants
from gguf_quant import quantize_q4_k, quantize_q6_k, random_blocks
from torch import nn

from pipeline.models import streamed

pytestmark = pytest.mark.skipif(streamed.library() is None, reason="no streamed kernel here (AVX2, C++)")

KINDS = ["Q4_K", "Q6_K"]
# a part strip (7 rows), one super-block; several k slices; rows not a multiple of the block
SHAPES = [(7, 256), (64, 1536), (33, 768), (130, 1280)]


def _layer(kind: str, rows: int, cols: int, seed: int = 0, bias: bool = False):
    raw = random_blocks(kind, rows, cols, seed)
    b = torch.randn(rows, generator=torch.Generator().manual_seed(seed)) if bias else None
    return raw, streamed.BlockLinear(torch.from_numpy(raw), kind, cols, b)


@pytest.mark.parametrize("rows, cols", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_every_weight_is_ggufs_own_dequantized_value(kind, rows, cols):
    """Fed one-hot rows, each output is one weight: gguf's value, bit for bit (Q4_K's min is
    subtracted apart from the sum, and a*q - min is gguf's one rounding)."""
    raw, layer = _layer(kind, rows, cols)
    expected = quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, cols)
    got = layer(torch.eye(cols)).T.numpy()
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("rows, cols", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_the_product_is_close_to_float64_and_a_rows_bits_do_not_depend_on_the_pass(kind, rows, cols):
    raw, layer = _layer(kind, rows, cols, bias=True)
    weights = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, cols))
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(1))
    full = layer(x)
    exact = x.double() @ weights.double().T + layer.bias.double()
    torch.testing.assert_close(full.double(), exact, rtol=1e-5, atol=1e-4 * exact.abs().max().item())
    # widths 1-4 decode in registers, wider ones into scratch; the rows' place changes nothing
    for width in [*range(1, 17), 24, 40]:
        for start in {0, 7 % (41 - width), 40 - width}:
            assert torch.equal(layer(x[start : start + width]), full[start : start + width]), (width, start)


def _rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it for int8 activations: per row and 256 values, x8 = x * 127/max|x|
    to the nearest integer (ties to even), times max|x|/127."""
    blocks = x.reshape(x.shape[0], -1, 256)
    amax = blocks.abs().amax(-1, keepdim=True)
    codes = torch.round(torch.clamp(blocks * torch.where(amax > 0, 127 / amax, 0), -127, 127))
    return (codes * (amax / 127)).reshape(x.shape)


@pytest.mark.parametrize("rows, cols", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_int8_activations_multiply_the_blocks_with_the_rounded_rows_whatever_the_pass(kind, rows, cols):
    """`block_activations: int8`: a layer's decoding passes give the blocks' product with each
    row rounded to 8 bits per 256 values (integer sums, then one float step a super-block), the
    same bits for a row at every width and place. Prefills keep the float path's bf16 reading
    where they multiply bf16 rows (AVX512_BF16); elsewhere they round too (next tests)."""
    raw = random_blocks(kind, rows, cols, 3)
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(3))
    exact = streamed.BlockLinear(torch.from_numpy(raw), kind, cols, bias)
    layer = streamed.BlockLinear(torch.from_numpy(raw), kind, cols, bias, rounded=True)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(4))
    x[3] = 0  # a row of zeros rounds to zeros
    full = layer(x)
    want = exact(_rounded_rows(x))
    torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert not torch.equal(full, exact(x))  # the rounding shows
    for width in [*range(1, 17), 24, 40]:
        for start in {0, 7 % (41 - width), 40 - width}:
            assert torch.equal(layer(x[start : start + width]), full[start : start + width]), (width, start)
    with streamed.prefilling():
        if streamed.prefill_numbers(rounded=True) == "bf16":
            assert torch.equal(layer(x), exact(x))
        else:  # the decoding passes' own chain, by the GEMM
            assert torch.equal(layer(x), full)


@pytest.mark.parametrize("kind", KINDS)
def test_in_avx2_code_wide_decoding_passes_take_the_gemm_and_keep_a_rows_bits(kind):
    """With AVX2's decoding kernels, passes of 12 token rows or more on rounded rows take the
    GEMM (`micro_q8_gemm`), whose chain is the decoding kernels': a row's bits are the same at
    every width on either side of that line. Run where the AVX-512 kernels are off."""
    name = "test_int8_activations_multiply_the_blocks_with_the_rounded_rows_whatever_the_pass"
    for rows, cols in SHAPES:
        if streamed.instruction_set() == "avx512":
            _in_a_process_with(f"t.{name}({kind!r}, {rows}, {cols})", PIPELINE_KERNEL_AVX512="0")
        else:
            globals()[name](kind, rows, cols)


@pytest.mark.parametrize("kind", KINDS)
def test_the_threads_that_compute_a_row_change_no_bit(kind):
    raw, layer = _layer(kind, 300, 512)
    layers = [layer, streamed.BlockLinear(torch.from_numpy(raw), kind, 512, rounded=True)]
    x = torch.randn(9, 512)
    threads = torch.get_num_threads()
    try:
        for layer in layers:
            torch.set_num_threads(1)
            one = [layer(x), layer(x[:1])]
            torch.set_num_threads(2)
            assert torch.equal(layer(x), one[0]) and torch.equal(layer(x[:1]), one[1])
    finally:
        torch.set_num_threads(threads)


def test_a_quantized_linear_reads_close_to_its_float_weights():
    """The test quantizers themselves (used to build GGUF models for the install tests)."""
    x = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32) * 0.05
    for quantize, kind, tol in ((quantize_q4_k, "Q4_K", 0.08), (quantize_q6_k, "Q6_K", 0.02)):
        values = quants.dequantize(quantize(x), GGMLQuantizationType[kind]).reshape(x.shape)
        assert np.abs(values - x).max() <= tol * np.abs(x).max(), kind


def test_use_blocks_replaces_the_linears_it_has_blocks_for():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 16), nn.ReLU(), nn.Linear(256, 8), nn.Linear(256, 4))
    raw = random_blocks("Q4_K", 16, 512)
    blocks = {
        "0.weight": ("Q4_K", torch.from_numpy(raw)),
        "2.weight": ("Q6_K", torch.from_numpy(random_blocks("Q6_K", 8, 256))),
        "3.weight": ("Q8_0", torch.zeros(4, 272, dtype=torch.uint8)),  # a type the kernel does not read
    }
    assert streamed.use_blocks(model, blocks) == {"Q4_K": 1, "Q6_K": 1}
    assert isinstance(model[0], streamed.BlockLinear) and isinstance(model[2], streamed.BlockLinear)
    assert type(model[3]) is nn.Linear
    # the bias stays; the weight is the blocks'
    x = torch.randn(3, 512)
    weights = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q4_K).reshape(16, 512))
    torch.testing.assert_close(model[0](x), x @ weights.T + model[0].bias, rtol=1e-5, atol=1e-5)
    assert (
        streamed.weight_bytes(model)
        == sum(m.weight_bytes for m in (model[0], model[2]))
        + model[3].weight.numel() * 4
        + model[3].bias.numel() * 4
    )


@pytest.mark.parametrize("rows, cols", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_prefill_reads_the_blocks_as_the_bf16_weights_the_install_wrote(kind, rows, cols):
    """Marked as a prefill, the layer computes exactly what a streamed Linear over the install's
    bf16 weights (gguf's values rounded to bf16) computes, bit for bit, at every width. On a CPU
    with AVX-512 the prefill takes the 512-bit kernel (`micro_512`) and the reference the
    8-lane one, so this also shows the two chains equal there. With AVX512_BF16 the prefill
    multiplies bf16 token rows instead (see the next test); this one then runs in a process with
    that switched off."""
    if streamed.prefill_reads_bf16_rows():
        name = "test_a_prefill_reads_the_blocks_as_the_bf16_weights_the_install_wrote"
        _in_a_process_without_bf16_rows(f"t.{name}({kind!r}, {rows}, {cols})")
        return
    raw, layer = _layer(kind, rows, cols, bias=True)
    values = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, cols))
    dense = nn.Linear(cols, rows)
    with torch.no_grad():
        dense.weight.copy_(values.to(torch.bfloat16).float())
        dense.bias.copy_(layer.bias)
    reference = streamed.StreamedLinear(dense)
    assert reference.kind == "bf16"
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(2))
    with streamed.prefilling():
        for width in (1, 3, 7, 40):
            assert torch.equal(layer(x[:width]), reference(x[:width])), width
    assert not torch.equal(layer(x), reference(x))  # outside a prefill: the exact values


def _in_a_process_without_bf16_rows(call: str) -> None:
    """Run `call` (on this module as `t`) where prefills take no bf16 rows
    (PIPELINE_KERNEL_BF16DOT=0; the kernel reads the switch once a process)."""
    _in_a_process_with(call, PIPELINE_KERNEL_BF16DOT="0")


def _in_a_process_with(call: str, **switches: str) -> None:
    """Run `call` (on this module as `t`) in a process with the kernel's `switches` set."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = str(Path(__file__).parent)
    script = f"import sys; sys.path.insert(0, {here!r}); import test_gguf_blocks as t; {call}"
    env = {**os.environ, **switches}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _assert_a_rows_bits_hold(layer, x: torch.Tensor, full: torch.Tensor) -> None:
    """`layer` gives each row of `x` the bits of `full` at any width and place in the pass, and
    on one thread as on several."""
    for rows_from, rows_to in ((0, 1), (0, 3), (0, 7), (5, 17), (39, 40), (3, 40)):
        assert torch.equal(layer(x[rows_from:rows_to]), full[rows_from:rows_to]), (rows_from, rows_to)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(
    not streamed.prefill_reads_bf16_rows(), reason="the CPU has no AVX512_BF16 (or it is off)"
)
@pytest.mark.parametrize("rows, cols", [*SHAPES, (200, 2560)])
@pytest.mark.parametrize("kind", KINDS)
def test_a_prefill_on_avx512_bf16_multiplies_bf16_rows_and_keeps_a_rows_bits(kind, rows, cols):
    """With AVX512_BF16 a prefill rounds its token rows to bf16 and multiplies them by the
    weights' bf16 rounding in pairs of k (`micro_dot_512`): within float32 rounding of that
    product taken in float64, and a row's bits the same at every width and place in the pass
    and with one thread or two."""
    raw, layer = _layer(kind, rows, cols, bias=True)
    values = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, cols))
    weights = values.to(torch.bfloat16).double()
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(3))
    with streamed.prefilling():
        full = layer(x)
        reference = x.to(torch.bfloat16).double() @ weights.T + layer.bias.double()
        scale = x.to(torch.bfloat16).double().abs() @ weights.abs().T  # the sum of |products|
        assert ((full.double() - reference).abs() <= 1e-6 * scale + 1e-30).all()
        _assert_a_rows_bits_hold(layer, x, full)
    assert not torch.equal(layer(x), full)  # outside a prefill: the blocks' exact values, float rows


@pytest.mark.parametrize("rows, cols", [*SHAPES, (48, 8960)])
@pytest.mark.parametrize("kind", KINDS)
def test_a_prefill_on_rounded_rows_multiplies_int8_codes_and_keeps_a_rows_bits(kind, rows, cols):
    """Where prefills do not take bf16 rows, a layer whose decoding passes round their rows to
    int8 (`models.block_activations: int8`) prefills on rounded rows too, by the blocks' integer
    codes 8 rows abreast (`micro_q8_gemm`): the blocks' values against the rounded rows, within
    float32 rounding of that product in float64, and a row's bits the same at every width and
    place in the pass and with one thread or two."""
    if streamed.prefill_reads_bf16_rows():
        name = "test_a_prefill_on_rounded_rows_multiplies_int8_codes_and_keeps_a_rows_bits"
        _in_a_process_without_bf16_rows(f"t.{name}({kind!r}, {rows}, {cols})")
        return
    assert streamed.prefill_numbers(rounded=True) == "int8"
    raw = random_blocks(kind, rows, cols, 4)
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(4))
    layer = streamed.BlockLinear(torch.from_numpy(raw), kind, cols, bias, rounded=True)
    values = quants.dequantize(raw, GGMLQuantizationType[kind])
    weights = torch.from_numpy(values).reshape(rows, cols).double()
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(5))
    with streamed.prefilling():
        full = layer(x)
        rounded = _rounded_rows(x).double()
        reference = rounded @ weights.T + bias.double()
        scale = rounded.abs() @ weights.abs().T + bias.double().abs()
        assert ((full.double() - reference).abs() <= 2e-6 * scale).all()
        _assert_a_rows_bits_hold(layer, x, full)
    assert torch.equal(layer(x), full)  # a decoding pass: the same chain


EXTREMES = [("Q4_K", 0xFF, 0xFF), ("Q6_K", 0xFF, 0x80), ("Q6_K", 0, 0x80), ("Q6_K", 0xFF, 0x7F)]


@pytest.mark.parametrize("kind, code_byte, scale_byte", EXTREMES)
def test_rounded_rows_sum_the_largest_codes_without_overflow(kind, code_byte, scale_byte):
    """The int8 prefill and decoding passes add 8 (Q4_K) or 2 (Q6_K) `maddubs` of a sub-block in
    int16 before the scale: with every code, scale and x8 at its extreme (Q4_K q = 15, sc = 63;
    Q6_K u = 63 or 0, sc = -128 or 127; x8 = +-127), each output is still the exact sum, at
    every width of a decoding pass."""
    if streamed.prefill_reads_bf16_rows():
        name = "test_rounded_rows_sum_the_largest_codes_without_overflow"
        _in_a_process_without_bf16_rows(f"t.{name}({kind!r}, {code_byte}, {scale_byte})")
        return
    rows, cols = 16, 512
    one = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    raw = np.zeros((rows, cols // 256, 144 if kind == "Q4_K" else 210), dtype=np.uint8)
    if kind == "Q4_K":  # d = 1, dmin = 0, every 6-bit scale and min 63, every code 15
        raw[..., 0:2], raw[..., 4:16], raw[..., 16:] = one, scale_byte, code_byte
    else:  # every u (low 4 bits, high 2 bits) from `code_byte`, every scale `scale_byte`, d = 1
        raw[..., 0:192], raw[..., 192:208], raw[..., 208:210] = code_byte, scale_byte, one
    raw = raw.reshape(rows, -1)
    layer = streamed.BlockLinear(torch.from_numpy(raw), kind, cols, rounded=True)
    values = quants.dequantize(raw, GGMLQuantizationType[kind])
    weights = torch.from_numpy(values).reshape(rows, cols).double()
    x = torch.ones(4, cols)
    x[1] = -1
    x[2, ::2] = -1  # pairs of opposite signs
    x[3, 256:] = -1
    expected = x.double() @ weights.T  # +-1 rounds to +-127 / 127: exactly +-1 up to float32
    scale = x.double().abs() @ weights.abs().T  # an overflow would be off by 2^16 products
    assert scale.min() > 0
    with streamed.prefilling():
        prefill = layer(x)
    singles = torch.cat([layer(x[i : i + 1]) for i in range(4)])  # decoding passes of width 1, then 4
    for got in (prefill, singles, layer(x)):
        assert ((got.double() - expected).abs() <= 1e-6 * scale).all()


def _block_model(rounded: bool = False, v_kind: str = "Q4_K", fuse: bool = True):
    """A tiny Qwen2 model whose every Linear reads random Q4_K / Q6_K blocks (a Q4_K_M-like mix:
    down_proj and the output layer Q6_K, v_proj `v_kind`), made batch-invariant as the loader
    makes a float32 target on a CPU; its decoding passes' activations as they are or `rounded`
    to int8 (`models.block_activations`); `fuse=False`: no projection shares a product."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipeline.models import fusion, invariant

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=320,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    blocks = {}
    for seed, (name, module) in enumerate(model.named_modules()):
        if isinstance(module, nn.Linear):
            kind = (
                "Q6_K" if "down_proj" in name or "lm_head" in name else v_kind if "v_proj" in name else "Q4_K"
            )
            raw = random_blocks(kind, module.out_features, module.in_features, seed, scale=0.01)
            blocks[f"{name}.weight"] = (kind, torch.from_numpy(raw))
    shared = fusion.SHARED
    fusion.SHARED = shared if fuse else ()
    try:
        used = streamed.use_blocks(model, blocks, rounded)
    finally:
        fusion.SHARED = shared
    q6k = 3 if v_kind == "Q4_K" else 5
    assert used == {"Q4_K": 15 - q6k, "Q6_K": q6k}  # every Linear, fused or not
    streamed.stream_linears(model)
    streamed.stream_layer_steps(model)  # as the loader does
    return invariant.make_batch_invariant(model)


@pytest.fixture(scope="module", params=["float32", "int8"])
def block_target(request):
    """`_block_model`, its decoding passes with float32 or int8 activations."""
    return _block_model(rounded=request.param == "int8")


@pytest.mark.parametrize("v_kind", ["Q4_K", "Q6_K"])
def test_projections_of_one_input_share_one_product_and_keep_their_bits(v_kind):
    """q, k and v (gate and up) whose blocks are of one type run as one BlockLinear over their
    rows (v apart where its type differs); each output is the chain it was apart, so a model's
    logits are bitwise those of the same model with every projection its own layer."""
    fused, apart = _block_model(v_kind=v_kind), _block_model(v_kind=v_kind, fuse=False)
    attention, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert isinstance(mlp.gate_up_proj, streamed.BlockLinear) and mlp.gate_up_proj.out_features == 1024
    names = ("qkv_proj",) if v_kind == "Q4_K" else ("qk_proj", "v_proj")
    assert {n for n, m in attention.named_children() if isinstance(m, streamed.BlockLinear)} == {
        "o_proj",
        *names,
    }
    blocks = lambda model: [m for m in model.modules() if isinstance(m, streamed.BlockLinear)]  # noqa: E731
    assert len(blocks(apart)) == 15 and len(blocks(fused)) == 15 - 2 * 3 + (v_kind == "Q6_K") * 2
    assert streamed.weight_bytes(fused) == streamed.weight_bytes(apart)
    lean = _passes(fused)
    for a, b in zip(lean, _passes(apart)):
        assert torch.equal(a, b)
    # q and k rotated by the kernel in place in the fused product's output: the bits of
    # Qwen2's own attention forward (its biases, its views)
    attentions = [layer.self_attn for layer in fused.model.layers]
    own = [a.__dict__.pop("forward") for a in attentions]
    try:
        for a, b in zip(lean, _passes(fused)):
            assert torch.equal(a, b)
    finally:
        for a, forward in zip(attentions, own):
            a.forward = forward


def test_a_kernel_layer_computes_a_ragged_passs_real_rows_only():
    """In a packed pass (`packing.packed`) a kernel layer takes the real rows of its rectangle
    itself, without hooks: the kernel sees only them, each gets the bits it gets alone, and the
    padding comes back as zeros."""
    from pipeline.models import packing

    _, layer = _layer("Q4_K", 64, 512, bias=True)
    x = torch.randn(3, 5, 512)  # rows of 5, 2 and 1 real tokens
    lengths = [5, 2, 1]
    layout = packing.Layout.of(lengths, 5, "cpu")
    rows_computed = []
    product = layer._product
    layer._product = lambda *args: (rows_computed.append(args[1]), product(*args))[1]
    with packing.packed(layout):
        out = layer(x)
    assert rows_computed == [8] and not layer._forward_pre_hooks and not layer._forward_hooks
    packing.install(nn.Sequential(layer))  # a model's install leaves it unhooked
    assert not layer._forward_pre_hooks
    for i, n in enumerate(lengths):
        assert torch.equal(out[i, :n], layer(x[i, :n])), i
        assert not out[i, n:].any()


def test_a_head_reads_a_shared_products_rows_back_as_its_projections_weights():
    """A draft head starts as a copy of the target's last layer (`DraftHead.from_target`); where
    q, k and v share one product, each is read back from its own rows of it."""
    from pipeline.decode.head import DraftHead

    heads = []
    for fuse in (True, False):
        torch.manual_seed(0)  # the same random start for the head's `fc`
        heads.append(DraftHead.from_target(_block_model(v_kind="Q6_K", fuse=fuse)).state_dict())
    assert heads[0].keys() == heads[1].keys()
    for name in heads[0]:
        assert torch.equal(heads[0][name], heads[1][name]), name


def _passes(model) -> list[torch.Tensor]:
    """Logits of a prefill of 2 rows and then passes of 1, 4 and 9 tokens a row (the kernel's
    three paths)."""
    from pipeline.decode.batched_lm import BatchedLM

    tokens = torch.randint(3, 300, (2, 60), generator=torch.Generator().manual_seed(1)).tolist()
    lm = BatchedLM(model, pad_token_id=0)
    lm.reset(2)
    out = lm.forward([row[:30] for row in tokens], [30, 30])
    at = 30
    for width in (1, 4, 9):
        out += lm.forward([row[at : at + width] for row in tokens], [width, width])
        at += width
    return out


@pytest.mark.parametrize("batch", [1, 2, 5, 8])
def test_a_block_targets_logits_are_the_same_at_every_width_and_batch(block_target, batch):
    """Row 0 verifies 1 to 16 tokens beside batch - 1 rows of other lengths: its logits are
    those of feeding the same tokens one pass at a time (the kernel's three paths included)."""
    assert_widths_alike(block_target, batch, (1, 2, 3, 5, 8, 9, 16))


def _every_path_outputs() -> list[torch.Tensor]:
    """Outputs of each kind of layer the kernel runs (GGUF blocks with float and int8 activations,
    prefills; float32, bf16 and int8 streamed Linears) at widths 1-9 and 40."""
    g = torch.Generator().manual_seed(5)
    outputs = []
    for kind in KINDS:
        raw = torch.from_numpy(random_blocks(kind, 72, 512, 6))
        bias = torch.randn(72, generator=g)
        x = torch.randn(40, 512, generator=g)
        for rounded in (False, True):
            layer = streamed.BlockLinear(raw, kind, 512, bias, rounded=rounded)
            outputs += [layer(x[:width]) for width in (*range(1, 10), 40)]
            with streamed.prefilling():
                outputs.append(layer(x))
    for kind in ("f32", "bf16", "i8"):
        dense = nn.Linear(512, 70)
        if kind == "bf16":
            with torch.no_grad():
                dense.weight.copy_(dense.weight.to(torch.bfloat16).float())
        layer = streamed.StreamedLinear(dense, int8=kind == "i8")
        assert layer.kind == kind
        x = torch.randn(40, 512, generator=g)
        outputs += [layer(x[:width]) for width in (*range(1, 10), 40)]
    return outputs


@pytest.mark.skipif(
    not {"avx512f", "avx512dq", "avx512bw"} <= streamed._cpu_flags(), reason="the CPU has no AVX-512 kernels"
)
def test_the_avx512_kernels_give_the_avx2_kernels_bits(tmp_path):
    """Where the CPU has AVX-512, wide passes and prefills on float rows run 16-lane kernels
    (`micro_512`); every output is bitwise what the AVX2 kernels give, computed
    in a process that has them switched off (PIPELINE_KERNEL_AVX512=0). Prefills on bf16 rows
    (AVX512_BF16) have numbers of their own, so both processes run with those off."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    def outputs(switches: dict[str, str], name: str) -> list[torch.Tensor]:
        path = tmp_path / name
        script = (
            f"import sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r}); torch.manual_seed(0); "
            f"import test_gguf_blocks as t; torch.save(t._every_path_outputs(), {str(path)!r})"
        )
        env = {**os.environ, "PIPELINE_KERNEL_BF16DOT": "0", **switches}
        subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
        return torch.load(path)

    ours = outputs({}, "avx512.pt")
    theirs = outputs({"PIPELINE_KERNEL_AVX512": "0"}, "avx2.pt")
    assert len(ours) == len(theirs) == 2 * 2 * 11 + 3 * 10
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), [
        i for i, (a, b) in enumerate(zip(ours, theirs)) if not torch.equal(a, b)
    ]
