"""Which blocks a packed pass runs as a whole: dense MLPs (also int8-wrapped), not experts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeline.models import invariant, packing
from pipeline.models.draft_int8 import Int8Linear


class DenseMLP(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.gate_proj = nn.Linear(width, 2 * width, bias=False)
        self.up_proj = nn.Linear(width, 2 * width, bias=False)
        self.down_proj = nn.Linear(2 * width, width, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.gate = nn.Linear(width, 2, bias=False)  # a router: chooses per token among experts
        self.experts = nn.ModuleList([DenseMLP(width), DenseMLP(width)])


class FusedExperts(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.weights = nn.Parameter(torch.zeros(2, width, width))  # experts as one tensor


class Layer(nn.Module):
    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp


def test_dense_mlps_run_packed_as_a_whole_and_mixtures_of_experts_do_not():
    assert packing._dense_mlp("layers.0.mlp", DenseMLP())
    assert not packing._dense_mlp("layers.0.feed", DenseMLP())  # only a layer's "mlp"
    assert not packing._dense_mlp("layers.0.mlp", Experts())
    assert not packing._dense_mlp("layers.0.mlp", FusedExperts())
    mlp = DenseMLP().to(torch.bfloat16)
    for name in ("gate_proj", "up_proj", "down_proj"):  # as the loader quantizes a CPU draft
        setattr(mlp, name, Int8Linear(getattr(mlp, name)))
    assert packing._dense_mlp("layers.0.mlp", mlp)  # the wrappers keep their weights in Linears


@pytest.mark.skipif(
    not invariant.linear_is_row_invariant(torch.bfloat16),
    reason="bitwise only where the CPU's products give a row the same bits whatever the row count",
)
@torch.no_grad()
def test_a_packed_mlp_gives_its_real_rows_the_unpacked_bits_and_zeros_for_padding():
    torch.manual_seed(0)
    layer = packing.install(Layer(DenseMLP().to(torch.bfloat16)))
    x = torch.randn(3, 4, 32).to(torch.bfloat16)  # 3 rows x 4 columns; real: 4, 1 and 2 tokens
    layout = packing.Layout.of([4, 1, 2], 4, "cpu")
    expected = layer.mlp(x)
    with packing.packed(layout):
        got = layer.mlp(x)
    real = torch.zeros(3, 4, dtype=torch.bool)
    real[0, :4], real[1, :1], real[2, :2] = True, True, True
    assert torch.equal(got[real], expected[real])
    assert not got[~real].any()
