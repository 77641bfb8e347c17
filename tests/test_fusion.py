"""Fused projections (`pipeline.models.fusion`): q/k/v and gate/up one product each, the
separate layers views into them. The contract on fused compiled passes: tests/test_static_lm.py."""

from __future__ import annotations

import pytest
import torch
from decode_case import DEVICE
from transformers import AutoModelForCausalLM

from pipeline.decode.head import _copy_layer
from pipeline.models import fusion
from pipeline.models.loading import ModelRef, load_pair


def _plain(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(DEVICE)


def test_the_fused_products_hold_the_weights_and_give_the_models_logits(tiny_pair_dirs):
    plain, fused = _plain(tiny_pair_dirs[0]), fusion.fuse_projections(_plain(tiny_pair_dirs[0]))
    attention = fused.model.layers[0].self_attn
    assert attention.q_proj.weight.data_ptr() == attention.qkv_proj.weight.data_ptr()
    assert torch.equal(attention.v_proj.weight, plain.model.layers[0].self_attn.v_proj.weight)
    assert fusion.fuse_projections(fused) is fused  # idempotent
    ids = torch.tensor([list(range(5, 60)), list(range(70, 125))], device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    head_layer = type(plain.model.layers[-1])(plain.config, layer_idx=0).to(DEVICE)
    _copy_layer(fused.model.layers[-1], head_layer)  # a draft head grown from a fused target
    for name, value in plain.model.layers[-1].state_dict().items():
        assert torch.equal(head_layer.state_dict()[name], value), name


def test_the_loader_fuses_where_asked_and_the_layers_allow(tiny_pair_dirs):
    refs = [ModelRef(path=str(d)) for d in tiny_pair_dirs]
    plain = {"dtype": "float32", "device": DEVICE, "streamed_linears": False, "draft_int8": False}
    loaded = load_pair(*refs, **plain, fused_projections=True)
    assert loaded.fused_projections == ("target", "draft")
    assert loaded.manifest()["fused_projections"] == ["target", "draft"]
    assert hasattr(loaded.target.model.layers[0].mlp, "gate_up_proj")
    assert load_pair(*refs, **plain).fused_projections == ()  # off unless asked
    if DEVICE == "cpu":  # streamed layers are the CPU's own kernels: left as loaded
        streamed = {**plain, "streamed_linears": True}
        assert load_pair(*refs, **streamed, fused_projections=True).fused_projections == ()


def test_a_model_whose_layers_are_not_plain_linears_is_refused(tiny_pair_dirs):
    model = _plain(tiny_pair_dirs[0])
    model.model.layers[1].mlp.up_proj = torch.nn.Identity()
    assert "gate_proj, up_proj" in fusion.fusable(model)
    with pytest.raises(ValueError, match="cannot fuse"):
        fusion.fuse_projections(model)
