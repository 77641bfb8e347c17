"""Skip padding: a ragged pass computes its weights' matrix products on real tokens only.

Why: a speculative pass over a batch is ragged. At batch 8 one row may verify 5 copied tokens
while seven rows verify 1, and the rectangle the model runs over is 8 × 5 = 40 positions of
which 12 are real. On a GPU the padding is nearly free (the pass is bound by reading the
weights); on a CPU it is not (measured in docs/engine.md, "Ragged passes on a CPU").

How: while a pass runs under `packed(layout)`, every dense MLP block and every other Linear
layer of a model that went through `install` gathers the real positions of its input into a
dense matrix, computes on that, and scatters the result back into the rectangle (zeros at
padding): through hooks that `install` adds, or, for layers that do it themselves
(`packs_itself`, the CPU kernel's), in their own forward, where two hooks a layer cost more
than the gather. Each real row gets
the bits it gets unpacked: the CPU's kernels give a row the same result whatever the number
of rows (see `invariant.linear_is_row_invariant`). The float64 attention of batch-invariant
models reads `current()` too and attends for each row's real queries only. Everything else
(norms, rotary, activations) is elementwise and cheap at any width.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Layout:
    """Which positions of a [rows, width] pass are real: the first `lengths[i]` of row i."""

    lengths: tuple[int, ...]
    width: int
    index: torch.Tensor  # the real positions, flat (row * width + column)

    @classmethod
    def of(cls, lengths: list[int], width: int, device: torch.device | str) -> Layout:
        real = [i * width + j for i, n in enumerate(lengths) for j in range(n)]
        return cls(tuple(lengths), width, torch.tensor(real, device=device))

    @property
    def positions(self) -> int:
        return len(self.lengths) * self.width


_current: ContextVar[Layout | None] = ContextVar("packing_layout", default=None)


def current() -> Layout | None:
    """The layout of the pass running now, if it runs packed. Never inside a compiled pass: only
    the static path's every-slot passes are compiled (`load_pair(compiled_passes=True)`), and
    they are never packed."""
    if torch.compiler.is_compiling():
        return None
    return _current.get()


@contextmanager
def packed(layout: Layout | None) -> Iterator[None]:
    """Run the passes inside this block on `layout`'s real positions (None: as they are)."""
    token = _current.set(layout)
    try:
        yield
    finally:
        _current.reset(token)


def real_rows(x: torch.Tensor) -> Layout | None:
    """The layout of the packed pass running now if `x` is one of its token-wise inputs (a
    [rows, width, ...] rectangle of it), else None: `x` is to be taken as it is."""
    layout = _current.get()
    if layout is None or x.shape[:-1].numel() != layout.positions:
        return None
    return layout


def gather(x: torch.Tensor, layout: Layout) -> torch.Tensor:
    """`x`'s real positions under `layout`, [real, features]."""
    return x.reshape(-1, x.shape[-1])[layout.index]


def scatter(out: torch.Tensor, shape: torch.Size, layout: Layout) -> torch.Tensor:
    """`out` [real, features] back into the rectangle of `shape` (zeros at the padding)."""
    full = out.new_zeros(shape[:-1].numel(), out.shape[-1])
    full[layout.index] = out
    return full.view(*shape[:-1], out.shape[-1])


def _gather(linear: nn.Module, args: tuple) -> tuple | None:
    layout = real_rows(args[0])
    if layout is None:
        return None  # not a token-wise input of this pass (or no packed pass running)
    linear._packed = (args[0].shape, layout)
    return (gather(args[0], layout), *args[1:])


def _scatter(linear: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    if linear._packed is None:
        return None
    (shape, layout), linear._packed = linear._packed, None
    return scatter(out, shape, layout)


def _dense_mlp(name: str, module: nn.Module) -> bool:
    """A decoder layer's feed-forward block whose weights all sit in Linear layers (wrapped or
    not, say in int8) with no lists of experts: it works token by token, so it can run packed
    as a whole, with one gather and one scatter instead of one per Linear. A mixture of
    experts (a router, expert lists or fused expert tensors) does not qualify."""
    if name.rsplit(".", 1)[-1] != "mlp":
        return False
    parts = list(module.modules())
    in_linears = {id(p) for m in parts if _token_wise(m) for p in m.parameters()}
    return not any(isinstance(m, (nn.ModuleList, nn.ModuleDict)) for m in parts) and all(
        id(p) in in_linears for p in module.parameters()
    )


def _token_wise(module: nn.Module) -> bool:
    """A Linear layer, or a module that computes token by token like one (`token_wise`)."""
    return isinstance(module, nn.Linear) or getattr(module, "token_wise", False)


def install(model: nn.Module) -> nn.Module:
    """Let `model`'s Linear layers run packed under `packed`; idempotent.

    Dense MLP blocks run packed as a whole: per Linear, the gather, the zero-filled rectangle
    and the scatter cost a few hundred small operations per pass, a visible share of a
    ragged pass on a CPU.
    The Linear layers inside then see packed inputs and leave them as they are.
    The gather runs before any other pre-hook and the scatter after the other forward hooks,
    so that hooks which reshape a layer's rows (the batch-invariant 2-row trick, which
    registers its forward hook in front) see the packed rows, whichever was installed first.
    """
    if getattr(model, "_packing", False):
        return model
    for name, module in model.named_modules():
        if getattr(module, "packs_itself", False):
            continue  # it takes `real_rows` itself (the kernel's layers: no hooks to call)
        if _token_wise(module) or _dense_mlp(name, module):
            module._packed = None
            module.register_forward_pre_hook(_gather, prepend=True)
            module.register_forward_hook(_scatter)
    model._packing = True
    return model
