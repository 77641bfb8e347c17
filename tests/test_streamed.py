"""Streamed Linear layers: the product torch computes, and bitwise the same for a row whatever
the width of the pass or the rows beside it (widths 1-16, batches 1-8)."""

from __future__ import annotations

import logging
from functools import partial

import pytest
import torch
from decode_case import assert_widths_alike
from torch import nn

from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.settings import EngineConfig
from pipeline.models import invariant, streamed
from pipeline.models.loading import ModelRef, load_pair

pytestmark = pytest.mark.skipif(streamed.library() is None, reason="no streamed kernel here (AVX2, C++)")


def _linear(rows: int, features: int, bias: bool, bf16_exact: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(features, rows, bias=bias)
    if bf16_exact:  # as the offline pair's weights are: installed in bf16, loaded in float32
        with torch.no_grad():
            linear.weight.copy_(linear.weight.to(torch.bfloat16).float())
    return linear


# odd row counts (a padded pair), inputs narrower than one k slice and wider than several, and
# a block of rows that is not a multiple of the threads
SHAPES = [(7, 24), (64, 1536), (33, 520), (1100, 1064)]


@pytest.mark.parametrize("rows, features", SHAPES)
@pytest.mark.parametrize("bf16_exact", [True, False])
def test_the_product_is_torchs_and_a_rows_bits_do_not_depend_on_the_width(rows, features, bf16_exact):
    """On a CPU with AVX-512, tiles of 4 or more token rows run the 16-lane kernel (`micro_512`)
    and narrower ones the 8-lane one: there the widths compare the two chains too."""
    linear = _linear(rows, features, bias=rows % 2 == 1, bf16_exact=bf16_exact)
    layer = streamed.StreamedLinear(linear)
    assert layer.packed.dtype == (torch.int16 if bf16_exact else torch.int32)  # half the bytes if exact
    x = torch.randn(24, features)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)
    full = layer(x)
    for width in range(1, 17):
        for start in (0, 24 - width):  # the rows' place in the pass changes nothing either
            assert torch.equal(layer(x[start : start + width]), full[start : start + width])


@pytest.mark.parametrize("rows, features", SHAPES)
def test_int8_weights_for_a_draft_give_the_product_of_their_dequantized_values(rows, features):
    linear = _linear(rows, features, bias=True, bf16_exact=False)
    layer = streamed.StreamedLinear(linear, int8=True)
    assert layer.kind == "i8" and layer.packed.dtype == torch.int8
    q = torch.round(linear.weight / layer.scale[:, None]).clamp(-127, 127)
    x = torch.randn(9, features)
    with torch.no_grad():
        expected = torch.nn.functional.linear(x, q * layer.scale[:, None], linear.bias)
        torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(layer(x), linear(x), rtol=0.05, atol=0.05 * linear(x).abs().max().item())
    assert torch.equal(layer(x[:1]), layer(x)[:1])


def test_the_threads_that_compute_a_row_change_no_bit():
    layer = streamed.StreamedLinear(_linear(300, 256, bias=True, bf16_exact=True))
    x = torch.randn(9, 256)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        assert torch.equal(layer(x), one)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def streamed_target(tiny_pair_dirs):
    loaded = load_pair(ModelRef(str(tiny_pair_dirs[0])), None, dtype="float32", device="cpu")
    return loaded


def test_the_loader_streams_float32_cpu_targets_and_makes_them_invariant(streamed_target):
    loaded = streamed_target
    assert loaded.streamed and loaded.batch_invariant
    assert loaded.manifest()["streamed_linears"] is True
    assert not any(isinstance(m, nn.Linear) for m in loaded.target.modules())
    assert isinstance(loaded.target.get_output_embeddings(), streamed.StreamedLinear)
    assert loaded.target.config._attn_implementation == invariant.NAME
    layer = loaded.target.model.layers[0]  # the layers' small steps are the kernel's too
    assert all(isinstance(m.forward, partial) for m in (layer.input_layernorm, loaded.target.model.norm))


def test_the_kernels_norm_and_activation_are_torchs_and_a_rows_bits_depend_on_that_row_alone():
    """RMSNorm and silu(gate) * up by the kernel: within float32 rounding of the float64 result,
    and each row the same bits alone and beside others (at every width a pass may have)."""
    torch.manual_seed(0)
    x, weight = torch.randn(9, 1536) * 3, torch.randn(1536)
    norm = streamed.rms_norm(x, weight, 1e-6)
    x64 = x.double()
    expected = weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm.double(), expected, rtol=1e-5, atol=1e-6)
    gate_up = torch.randn(9, 2 * 8960) * 4
    gate_up[0, :8] = torch.tensor([-200.0, -90.0, -30.0, 0.0, 1e-30, 30.0, 90.0, 200.0])  # exp's ends
    act = streamed.silu_mul(*gate_up.split(8960, dim=-1))  # a fused product's halves, in place
    assert torch.equal(streamed.silu_mul(*(t.contiguous() for t in gate_up.split(8960, dim=-1))), act)
    assert torch.equal(streamed.silu_mul(gate_up), act)  # the fused output as it is
    g, u = gate_up.double().split(8960, dim=-1)
    torch.testing.assert_close(act.double(), g * torch.sigmoid(g) * u, rtol=1e-5, atol=1e-6)
    for width in (1, 2, 4, 8):
        for start in (0, 9 - width):
            rows = slice(start, start + width)
            assert torch.equal(streamed.rms_norm(x[rows], weight, 1e-6), norm[rows])
            assert torch.equal(streamed.silu_mul(*gate_up[rows].split(8960, dim=-1)), act[rows])
            assert torch.equal(streamed.silu_mul(gate_up[rows]), act[rows])


def test_the_kernels_attention_is_softmax_attention_and_a_querys_bits_depend_on_its_keys_alone():
    """Against float64 attention: close. Bitwise: a query alone, beside other queries and rows,
    and over a cache with masked slots (holding NaN, as a cache's holes may) between its keys."""
    torch.manual_seed(0)
    batch, heads, kv_heads, queries, dim, keys = 3, 12, 2, 5, 64, 70
    q = torch.randn(batch, heads, queries, dim)
    cache_k, cache_v = torch.randn(batch, kv_heads, 100, dim), torch.randn(batch, kv_heads, 100, dim)
    k, v = cache_k[:, :, :keys], cache_v[:, :, :keys]  # views into a longer cache, as `_Room` gives
    hidden = torch.finfo(torch.float32).min
    mask = torch.zeros(batch, 1, queries, keys)
    mask[0, :, :, 10:20] = hidden
    mask[2] = torch.triu(torch.full((queries, keys), hidden), diagonal=keys - queries + 1)
    got = streamed.attention(q, k, v, mask, dim**-0.5)
    assert got.shape == (batch, queries, heads, dim)
    expected, _ = invariant.float64_attention(None, q, k, v, mask, dim**-0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    alone = streamed.attention(q[2:, :, 3:4], k[2:], v[2:], mask[2:, :, 3:4], dim**-0.5)
    assert torch.equal(alone[0, 0], got[2, 3])
    nan = torch.full((1, kv_heads, 3, dim), float("nan"))
    holed_k = torch.cat([k[2:, :, :5], nan, k[2:, :, 5:]], dim=2)
    holed_v = torch.cat([v[2:, :, :5], nan, v[2:, :, 5:]], dim=2)
    gap = torch.full((1, 1, 1, 3), hidden)
    holed_mask = torch.cat([mask[2:, :, 3:4, :5], gap, mask[2:, :, 3:4, 5:]], dim=3)
    holed = streamed.attention(q[2:, :, 3:4], holed_k, holed_v, holed_mask, dim**-0.5)
    assert torch.equal(holed[0, 0], got[2, 3])
    # a ragged pass: a row's queries past its length come out zero, the others unchanged
    ragged = streamed.attention(q, k, v, mask, dim**-0.5, queries=(5, 2, 4))
    assert torch.equal(ragged[1, :2], got[1, :2]) and not ragged[1, 2:].any()


@pytest.mark.parametrize("dim", [128, 20])
def test_the_kernels_rotary_embeddings_are_transformers_bit_for_bit(dim):
    """q and k read in place from one fused projection's output, several rows and tokens, heads
    of 128 (the vector loop) and of 20 (its scalar tail): transformers' bits, its layout."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    batch, tokens, heads, kv_heads = 3, 5, 6, 2
    qkv = torch.randn(batch, tokens, (heads + 2 * kv_heads) * dim) * 4
    q, k = qkv[..., : heads * dim], qkv[..., heads * dim : (heads + kv_heads) * dim]
    angles = torch.randn(batch, tokens, dim // 2) * 50
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1) for f in (torch.cos, torch.sin))
    got_q, got_k = streamed.rotary(q, k, cos, sin, dim)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    expected_q, expected_k = apply_rotary_pos_emb(
        q.reshape(batch, tokens, heads, dim).transpose(1, 2),
        k.reshape(batch, tokens, kv_heads, dim).transpose(1, 2),
        cos,
        sin,
    )
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)
    # rows that are not one stride apart (a transposed input) are copied, not misread
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(streamed.rotary(q_t, k, cos, sin, dim)[0], expected_q)


def test_attention_with_the_kernels_rotary_embeddings_gives_the_modules_own_logits(streamed_target):
    """The loader gives the attention modules the kernel's rotary embeddings; a model's logits
    over a ragged batch are bitwise those of the modules' own forward (Llama here; Qwen2, with
    its biases and fused projections, in test_gguf_blocks)."""
    model = streamed_target.target
    attentions = [layer.self_attn for layer in model.model.layers]
    assert all(isinstance(a.forward, partial) for a in attentions)
    ids = torch.randint(3, 300, (3, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a left-padded row
    with torch.no_grad():
        lean = model(input_ids=ids, attention_mask=mask).logits
        own = [a.__dict__.pop("forward") for a in attentions]
        try:
            expected = model(input_ids=ids, attention_mask=mask).logits
        finally:
            for a, forward in zip(attentions, own):
                a.forward = forward
    assert torch.equal(lean, expected)


def test_a_float32_targets_cache_keeps_float32_for_the_kernels_attention(streamed_target):
    assert invariant.cache_dtype(streamed_target.target) == torch.float32


@pytest.mark.parametrize("batch", [1, 2, 5, 8])
def test_a_rows_logits_are_the_same_at_every_width_and_batch(streamed_target, batch):
    """Row 0 verifies 1 to 16 tokens beside batch - 1 rows of other lengths: its logits are
    those of feeding the same tokens one pass at a time."""
    assert_widths_alike(streamed_target.target, batch, (1, 2, 3, 7, 8, 9, 16))


def test_without_a_compiler_the_model_keeps_torchs_kernels_and_says_so(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))
    caplog.set_level(logging.WARNING, logger="pipeline.models.streamed")
    streamed.library.cache_clear()
    try:
        assert streamed.library() is None
        assert not streamed.wanted(torch.float32, "cpu")
        assert [r.getMessage() for r in caplog.records if "streamed linear kernel off" in r.getMessage()]
    finally:
        streamed.library.cache_clear()  # the next caller builds (or finds) the real one again


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_streamed_pair_decodes_exactly_the_targets_greedy_text(tiny_pair_dirs, batch_size):
    """Both models stream, the draft proposing from a gathered (and streamed) part of its
    output layer: the speculative output is the target-only output, token for token."""
    pair = load_pair(*(ModelRef(str(d)) for d in tiny_pair_dirs), dtype="float32", device="cpu")
    assert pair.streamed and any(isinstance(m, streamed.StreamedLinear) for m in pair.draft.modules())
    engine = SpeculativeEngine(
        pair.target,
        pair.draft,
        eos_token_ids=[1],
        pad_token_id=0,
        config=EngineConfig(drafter="draft_model", adaptive=False, gamma_max=4, draft_vocab=200),
    )
    prompts = torch.randint(3, 300, (6, 30), generator=torch.Generator().manual_seed(7)).tolist()
    reference = [engine.generate([p], 20, drafter="none")[0][0].tokens for p in prompts]
    outputs, stats = engine.generate(prompts, 20, drafter="draft_model", batch_size=batch_size)
    assert [o.tokens for o in outputs] == reference and stats.accepted > 0
    assert isinstance(engine.draft.lm._head, streamed.StreamedLinear)
