"""One matrix product where a decoder layer makes several of the same input: q, k and v, and
gate with up.

Why: on a GPU a decode pass is a few dozen layers of small products, each one kernel of the
captured graph. The small ones (k and v) cost a kernel's latency rather than the reading of
their weights (docs/gpu.md). One product over the concatenated weights reads the same bytes in
one kernel. On a CPU the GGUF blocks' layers share products too (`streamed.use_blocks`,
where the projections' blocks are of one type): a 1-token pass of the 1.5B target makes 127
kernel calls instead of 197, each of which costs some µs besides reading its weights
(docs/cpu-kernels.md).

The fused weights are the parameters: q, k and v (gate and up) become views into them, so the
model's memory does not grow and its state dict keeps its names. The attention module still
calls q_proj, k_proj and v_proj in that order (`transformers`' code is left as it is): q_proj
runs the fused product and hands k_proj and v_proj their parts of it.

Exactness: every pass of a fused model runs the fused products, so a token's logits still do not
depend on the pass (`invariant`); the fused product may round otherwise than the three separate
ones, which matters only beside a model loaded without fusion.
"""

from __future__ import annotations

import torch
from torch import nn

ATTENTION = ("q_proj", "k_proj", "v_proj")
MLP = ("gate_proj", "up_proj")
SHARED = ((ATTENTION, "qkv_proj"), (MLP, "gate_up_proj"))  # the projections, the fused one's name


def fusable(model: nn.Module) -> str | None:
    """Why `model`'s layers cannot be fused (None: they can): every projection a plain
    `nn.Linear` (not a streamed or quantized kernel) of the same input width."""
    layers = getattr(getattr(model, "base_model", None), "layers", None)
    if not layers:
        return "no decoder layers found"
    for layer in layers:
        if not (hasattr(layer, "self_attn") and hasattr(layer, "mlp")):
            return f"{type(layer).__name__} has no self_attn and mlp"
        for owner, names in ((layer.self_attn, ATTENTION), (layer.mlp, MLP)):
            parts = [getattr(owner, n, None) for n in names]
            if not all(type(p) is nn.Linear for p in parts):
                return f"{type(owner).__name__}'s {', '.join(names)} are not all plain Linear layers"
            if len({p.in_features for p in parts}) != 1 or len({p.bias is None for p in parts}) != 1:
                return f"{type(owner).__name__}'s {', '.join(names)} differ in input or bias"
    return None


def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuse q/k/v and gate/up in every decoder layer of `model`, in place; idempotent. Call it
    before `invariant.make_batch_invariant`, whose row blocks then wrap the fused products."""
    if getattr(model, "_fused_projections", False):
        return model
    problem = fusable(model)
    if problem:
        raise ValueError(f"cannot fuse this model's projections: {problem}")
    for layer in model.base_model.layers:
        for owner, (names, fused_name) in zip((layer.self_attn, layer.mlp), SHARED):
            _fuse(owner, names, fused_name)
    model._fused_projections = True
    return model


def _fuse(owner: nn.Module, names: tuple[str, ...], fused_name: str) -> None:
    parts = [getattr(owner, n) for n in names]
    weight = torch.cat([p.weight.detach() for p in parts])
    bias = torch.cat([p.bias.detach() for p in parts]) if parts[0].bias is not None else None
    fused = nn.Linear(parts[0].in_features, len(weight), bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    start = 0
    for part in parts:  # the separate layers' parameters: views of the fused
        size = part.out_features
        part.weight = nn.Parameter(weight[start : start + size], requires_grad=False)
        if bias is not None:
            part.bias = nn.Parameter(bias[start : start + size], requires_grad=False)
        start += size
    share(owner, names, fused, fused_name)


class Part(nn.Module):
    """A projection whose product a fused layer computes (`share`): it holds no weights; its
    outputs are the fused layer's `rows`."""

    token_wise = True  # it works token by token, as a Linear (`packing`)

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.rows = torch.arange(out_features)


def share(
    owner: nn.Module, names: tuple[str, ...], fused: nn.Module, fused_name: str, keep: bool = True
) -> None:
    """Make `fused` (whose outputs are `owner`'s projections `names`, in that order) the product
    those projections run: it becomes `owner.<fused_name>`; the first projection the module calls
    computes it and the others return their parts of it. `keep=False`: the projections' own
    layers go (their weights live in `fused` alone, as the blocks' do) and `Part`s take their
    names."""
    setattr(owner, fused_name, fused)
    if not keep:
        start = 0
        for name in names:
            layer = getattr(owner, name)
            part = Part(layer.in_features, layer.out_features)
            part.rows += start
            # a fused layer that takes a ragged pass's real rows itself hands out whole rectangles
            part.packs_itself = getattr(fused, "packs_itself", False)
            start += part.out_features
            setattr(owner, name, part)
    parts = [getattr(owner, name) for name in names]
    sizes = [p.out_features for p in parts]
    held: list[torch.Tensor] = []

    def first(x: torch.Tensor) -> torch.Tensor:
        held[:] = fused(x).split(sizes, dim=-1)
        return held[0]

    def later(index: int):
        return lambda x: held[index]

    parts[0].forward = first
    for index, part in enumerate(parts[1:], start=1):
        part.forward = later(index)
    for part in parts:
        part._fused_into = fused_name  # `invariant` wraps the fused product, not these
