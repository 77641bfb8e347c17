"""Int8 weights for the draft model's decode steps: half the bytes a step reads.

Why: on a CPU a draft step at batch 1 is bound by memory bandwidth, not arithmetic. Profiled
on the 0.5B Qwen draft in bf16 (2 cores), its matrix products took 42 of a 65 ms step at
about 17 GB/s, reading 0.7 GB of weights. Stored as int8 with one bf16 scale per output row
they read half of that, at the price of a second copy of the weights in memory (prefills
keep the loaded ones, see INT8_MAX_ROWS). The draft only proposes and the target checks every
token, so a quantized draft cannot change the output, only how often it is accepted.

The product runs in `aten._weight_int8pack_mm` (int8 weights, activations and scales in the
model's dtype), PyTorch's own CPU kernel for weight-only int8 (it serves gpt-fast and torchao
too). It is used only where it was checked to work: on CPU, for input widths that are a
multiple of 16 (the bf16 kernel crashed on a width of 37), and after `kernel_works` agrees
with a float product on this machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

IN_FEATURES_MULTIPLE = 16
# The int8 kernel's time grows with the rows faster than bf16's. Whole 0.5B Qwen draft passes
# (2 cores, restricted output layer, ~330 cached tokens), int8 against bf16: 4 rows 24 against
# 42-50 ms, 8 rows 37-43 against 47-59, 12 rows 50 against 58, 16 a tie (64), 32 rows 103
# against 77, 64 rows 211 against 125. Steps and short catch-ups of up to 12 rows use int8;
# prefills and longer catch-ups keep the loaded weights.
INT8_MAX_ROWS = 12


class Int8Linear(nn.Module):
    """A Linear that reads an int8 copy of its weight (one scale per output row) for inputs of
    up to INT8_MAX_ROWS rows, and its own weight for wider ones."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        quantized = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("weight_int8", quantized)
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.use_int8 = True  # see loaded_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_int8 or x.shape[:-1].numel() > INT8_MAX_ROWS:
            return self.linear(x)
        rows = x.reshape(-1, self.linear.in_features).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales)
        y = y.reshape(*x.shape[:-1], self.linear.out_features)
        return y + self.linear.bias if self.linear.bias is not None else y


def wanted(device: str) -> bool:
    """The default: on for CPUs (memory-bound draft steps); GPUs keep the draft as loaded."""
    return device == "cpu"


def kernel_works(dtype: torch.dtype) -> bool:
    """Does the int8 kernel agree with a float product here (within int8 rounding)?"""
    try:
        gen = torch.Generator().manual_seed(0)
        linear = nn.Linear(128, 96, bias=False).to(dtype)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(96, 128, generator=gen) / 128**0.5)
            x = torch.randn(3, 128, generator=gen).to(dtype)
            got, expected = Int8Linear(linear)(x).float(), linear(x).float()  # 3 rows: int8
        return bool((got - expected).abs().max() <= 0.05 * expected.abs().max())
    except RuntimeError:  # also what a missing kernel for this dtype raises
        return False


def quantize_draft(model: nn.Module) -> int:
    """Replace the draft's decoder-layer Linears by Int8Linear in place; returns how many.

    The output layer stays as loaded: the engine gathers the rows of it the draft may propose
    (see BatchedLM.restrict_head), and the embeddings are a lookup, not a product.
    """
    head = model.get_output_embeddings()
    replaced = 0
    for parent in list(model.modules()):
        if isinstance(parent, Int8Linear):
            continue  # quantized already: its `linear` is the loaded layer it falls back to
        for name, child in list(parent.named_children()):
            if (
                isinstance(child, nn.Linear)
                and child is not head
                and child.weight.device.type == "cpu"
                and child.in_features % IN_FEATURES_MULTIPLE == 0
            ):
                setattr(parent, name, Int8Linear(child))
                replaced += 1
    return replaced


@contextmanager
def loaded_weights(model: nn.Module) -> Iterator[nn.Module]:
    """Run `model` on its loaded weights alone for a while: the draft as it came, for a
    reference implementation that users would run with the stock model."""
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    for layer in layers:
        layer.use_int8 = False
    try:
        yield model
    finally:
        for layer in layers:
            layer.use_int8 = True
