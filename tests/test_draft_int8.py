"""Int8 draft weights: close to the draft's own products on decode steps, the loaded weights for
prefills, the output layer untouched, and loaded that way by default on CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipeline.models import streamed
from pipeline.models.draft_int8 import (
    INT8_MAX_ROWS,
    Int8Linear,
    kernel_works,
    loaded_weights,
    quantize_draft,
)
from pipeline.models.loading import ModelRef, load_pair


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_products_are_close_for_decode_steps_and_exact_for_prefills(dtype):
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 48).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=gen) / 8)
    quantized = Int8Linear(linear)
    assert quantized.weight_int8.dtype == torch.int8 and quantized.scales.dtype == dtype
    with torch.no_grad():
        step = torch.randn(1, INT8_MAX_ROWS, 64, generator=gen).to(dtype)
        got, expected = quantized(step).float(), linear(step).float()
        # int8 rounding, not a different product: within 2% of the largest output
        assert (got - expected).abs().max() <= 0.02 * expected.abs().max()
        assert not torch.equal(got, expected)  # the int8 path ran
        prefill = torch.randn(2, INT8_MAX_ROWS, 64, generator=gen).to(dtype)
        assert torch.equal(quantized(prefill), linear(prefill))
    assert kernel_works(dtype)


def test_quantize_draft_replaces_the_layers_but_not_the_output_layer(tiny_models):
    _, draft, _ = tiny_models
    model = copy.deepcopy(draft)
    head = model.get_output_embeddings()
    layers = model.config.num_hidden_layers
    assert quantize_draft(model) == 7 * layers  # q, k, v, o, gate, up, down per layer
    assert quantize_draft(model) == 0  # once is all
    assert model.get_output_embeddings() is head and isinstance(head, nn.Linear)
    ids = torch.tensor([[5, 17, 42, 9] * (INT8_MAX_ROWS // 4 + 1)])
    with torch.no_grad():
        # a prefill wider than INT8_MAX_ROWS runs on the loaded weights: the draft's own logits
        assert torch.equal(model(ids).logits, draft(ids).logits)
        # one token on int8 weights: close, and the same favourite
        one, ref = model(ids[:, :1]).logits[0, -1], draft(ids[:, :1]).logits[0, -1]
    assert (one - ref).abs().max() < 0.05 * ref.abs().max()
    assert one.argmax() == ref.argmax()
    with loaded_weights(model), torch.no_grad():  # the draft as it came, for a reference run
        assert torch.equal(model(ids[:, :1]).logits[0, -1], ref)
    with torch.no_grad():
        assert torch.equal(model(ids[:, :1]).logits[0, -1], one)


def test_load_pair_quantizes_the_draft_on_cpu_unless_told_not_to(tiny_pair_dirs):
    target_dir, draft_dir = tiny_pair_dirs
    refs = ModelRef(str(target_dir)), ModelRef(str(draft_dir))
    default = load_pair(*refs, dtype="float32", device="cpu", streamed_linears=False)
    assert default.draft_int8 and default.manifest()["draft_int8"] is True
    assert any(isinstance(m, Int8Linear) for m in default.draft.modules())
    assert not any(isinstance(m, Int8Linear) for m in default.target.modules())
    off = load_pair(*refs, dtype="float32", device="cpu", draft_int8=False, streamed_linears=False)
    assert not off.draft_int8 and not any(isinstance(m, Int8Linear) for m in off.draft.modules())
    assert load_pair(refs[0], None, dtype="float32", device="cpu").draft_int8 is False
    if streamed.library() is not None:  # float32 on AVX2: int8 in the streamed kernel, not torch's
        fast = load_pair(*refs, dtype="float32", device="cpu")
        assert fast.draft_int8 and fast.streamed
        layers = [m for m in fast.draft.modules() if isinstance(m, (streamed.StreamedLinear, Int8Linear))]
        assert layers and {getattr(m, "kind", None) for m in layers} == {"i8"}
        exact = load_pair(*refs, dtype="float32", device="cpu", draft_int8=False)
        assert not exact.draft_int8 and {
            m.kind for m in exact.draft.modules() if isinstance(m, streamed.StreamedLinear)
        } == {"f32"}  # the tiny models' weights are not bf16 values
        assert isinstance(fast.draft.get_output_embeddings(), torch.nn.Linear)  # gathered per job
