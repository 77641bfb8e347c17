"""Linear layers whose cost hardly grows with the tokens in a pass, for float32 models on CPUs.

Why: speculative decoding pays only when checking γ drafted tokens costs about what producing
one costs. A pass is bound by reading the weights once, so that holds in principle; but on
CPUs without AVX512-BF16 (where float32 is the model dtype) PyTorch's matrix-matrix kernel
repacks the whole weight on every call, and a verify pass of 8 tokens cost 3x a 1-token pass.
`streamed_linear.cpp` reads each weight once per call and keeps tiles of token rows in
registers, and where the loaded weights are exactly bfloat16 (the offline pair is) it keeps
them as bfloat16 and widens them in registers, which halves the bytes a pass reads and makes
plain decoding faster too. Measured figures are in docs/engine.md.

Every output element is one fixed chain of float operations on its weight row and token row,
so a row's logits are bitwise the same whatever the width of the pass or the other rows in
it: with the float64 attention of `invariant`, the target is batch-invariant in float32 too.

Where a model directory keeps its GGUF file's own blocks (`gguf_blocks`), `BlockLinear` streams
those instead: about a third of the bf16 bytes, each weight rebuilt in registers from its 4- or
6-bit code and its block's scales, in float32 and row-invariant like the rest.

The kernel is compiled with the system's C++ compiler on first use and cached under the
pipeline's cache directory. Where that cannot happen (no compiler, no AVX2/FMA, not x86) the
model keeps PyTorch's kernels and one log line says why.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache, lru_cache, partial
from pathlib import Path

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from pipeline import native
from pipeline.models import packing

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("streamed_linear.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
K_SLICE = 512  # k values a micro-kernel call covers: its token rows' slices stay in L1
BLOCK_BYTES = 192 * 1024  # weight bytes of a block of output rows, re-read from L2 per token tile
MAX_BLOCK_ROWS = 64  # the kernel's limit (its accumulators live on the stack)

_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None (and one warning) where it cannot be."""
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= _cpu_flags():
        log.warning("streamed linear kernel off: the CPU lacks AVX2/FMA; float32 passes use torch's kernels")
        return None
    try:
        lib = native.compiled(SOURCE, FLAGS)  # torch is loaded: its OpenMP runtime serves this one too
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("streamed linear kernel off (%s); float32 passes use torch's kernels", e)
        return None
    for name in ("pack_f32", "pack_bf16", "pack_i8"):
        getattr(lib, name).argtypes = [_POINTER, _INT, _INT, _INT, _INT, _POINTER]
    lib.pack_q4k.argtypes = [_POINTER, _INT, _INT, _INT, _INT, _POINTER, _POINTER, _POINTER]
    lib.pack_q6k.argtypes = [_POINTER, _INT, _INT, _INT, _INT, _POINTER]
    for name in ("packed_bytes_q4k", "packed_bytes_q6k"):
        getattr(lib, name).argtypes = [_INT, _INT]
        getattr(lib, name).restype = _INT
    # x, rows, in, weights, out, [dmin, mins,] bias, y, block rows, k slice, threads
    head, tail = [_POINTER, _INT, _INT, _POINTER, _INT], [_POINTER, _POINTER, _INT, _INT, ctypes.c_int]
    lib.linear_q4k.argtypes = [
        *head,
        _POINTER,
        _POINTER,
        *tail,
        ctypes.c_int,
        ctypes.c_int,
    ]  # ..., prefill, q8
    lib.linear_q6k.argtypes = [*head, *tail, ctypes.c_int, ctypes.c_int]
    for name in ("linear_f32", "linear_bf16", "linear_i8"):
        getattr(lib, name).argtypes = [
            _POINTER,
            _INT,
            _INT,
            _POINTER,
            _INT,
            _POINTER,
            _POINTER,
            _POINTER,
            _INT,
            _INT,
            ctypes.c_int,
        ]
    for name in ("prefill_reads_bf16_rows", "prefill_rounds_rows", "kernel_avx512"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [], ctypes.c_int
    # query, B, H, Q, D, keys, values, Hkv, key/value strides, keys, mask, its strides, scale,
    # real queries per row, out, threads
    lib.attend_f32.argtypes = [_POINTER, *[_INT] * 4, _POINTER, _POINTER, *[_INT] * 6, _POINTER, _INT, _INT,
                               ctypes.c_float, _POINTER, _POINTER, ctypes.c_int]  # fmt: skip
    lib.rms_norm_f32.argtypes = [_POINTER, _INT, _INT, _POINTER, ctypes.c_float, _POINTER]
    lib.silu_mul_f32.argtypes = [_POINTER, _POINTER, _INT, _INT, _INT, _POINTER]
    # q, k, B, T, heads, kv heads, head dim, q's and k's floats a token, cos, sin, q out, k out
    lib.rotary_f32.argtypes = [_POINTER, _POINTER, *[_INT] * 7, *[_POINTER] * 4]
    return lib


def attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float,
    queries: tuple[int, ...] | None = None,
) -> torch.Tensor:  # fmt: skip
    """softmax(q k^T * scale + mask) v by the kernel's row-invariant attention (`attend` in
    `streamed_linear.cpp`): each query one fixed chain over the keys its additive mask leaves
    visible, in cache order, whatever shares the call. query [B, H, Q, D], key and value
    [B, Hkv, k, D] (views into a longer cache are fine), mask [B, 1, Q, >= k], all float32 on
    the CPU; `queries`: each row's real queries (the first ones; the others come out zero).
    Returns [B, Q, H, D]."""
    batch, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    dtypes = {query.dtype, key.dtype, value.dtype, mask.dtype}
    if dtypes != {torch.float32} or mask.shape[-1] < k_len or dim % 8:
        raise ValueError("kernel attention: float32 tensors, heads of 8n values, a mask over every key")
    if batch * heads * q_len == 0:
        return query.new_empty(batch, q_len, heads, dim)
    query = query.contiguous()
    key = key if key.stride(-1) == 1 and key.stride(-2) == dim else key.contiguous()
    value = value if value.stride(-1) == 1 and value.stride(-2) == dim else value.contiguous()
    mask = mask.expand(batch, 1, q_len, mask.shape[-1])
    mask = mask if mask.stride(-1) == 1 else mask.contiguous()
    out = torch.empty(batch, q_len, heads, dim, dtype=torch.float32)
    rows = torch.tensor(queries, dtype=torch.int64) if queries is not None else None
    library().attend_f32(
        query.data_ptr(), batch, heads, q_len, dim, key.data_ptr(), value.data_ptr(), kv_heads,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_len,
        mask.data_ptr(), mask.stride(0), mask.stride(2), scale,
        rows.data_ptr() if rows is not None else None, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


# The decoder layers' small steps the kernel takes in one call each (`stream_layer_steps`): norms
# and MLPs of these classes, whose forwards are y = w * x / sqrt(mean(x^2) + eps) and
# down(silu(gate(x)) * up(x)), and the rotary embeddings of these attention classes, whose
# forwards are o(attention(rotary(q(x)), rotary(k(x)), v(x))) with the keys and values through
# the cache (transformers' code, read for each).
RMS_NORMS = ("Qwen2RMSNorm", "Qwen3RMSNorm", "LlamaRMSNorm", "MistralRMSNorm")
SILU_MLPS = ("Qwen2MLP", "Qwen3MLP", "LlamaMLP", "MistralMLP")
ROTARY_ATTENTIONS = ("Qwen2Attention", "LlamaAttention")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """An RMSNorm by the kernel (float32, last dimension a multiple of 8): each row one fixed chain."""
    x = x.contiguous()
    out = torch.empty_like(x)
    width = x.shape[-1]
    library().rms_norm_f32(x.data_ptr(), x.numel() // width, width, weight.data_ptr(), eps, out.data_ptr())
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up by the kernel, one call where torch takes a silu and a multiply; gate and
    up [..., I] float32, rows of either the same number of floats apart (the halves of a fused
    gate/up product, or two products). `up` None: `gate` is a fused product's output [..., 2I],
    contiguous, its halves read in place (a split and its views cost more than the call)."""
    if up is None:
        width = gate.shape[-1] // 2
        fused = gate if gate.is_contiguous() else gate.contiguous()
        out = fused.new_empty(*fused.shape[:-1], width)
        start, rows = fused.data_ptr(), out.numel() // width
        library().silu_mul_f32(start, start + 4 * width, 2 * width, rows, width, out.data_ptr())
        return out
    shape, width = gate.shape, gate.shape[-1]
    gate, up = (t.reshape(-1, width) for t in (gate, up))
    if gate.stride(0) != up.stride(0) or gate.stride(1) != 1 or up.stride(1) != 1:
        gate, up = gate.contiguous(), up.contiguous()
    out = gate.new_empty(gate.shape)
    library().silu_mul_f32(gate.data_ptr(), up.data_ptr(), gate.stride(0), len(gate), width, out.data_ptr())
    return out.view(shape)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [B, T, heads * dim] (a fused projection's parts are fine) rotated by cos and sin
    [B, T, dim] as `transformers`' `apply_rotary_pos_emb` rotates them, bit for bit, in one
    kernel call where torch takes 14 ops; returned as [B, heads, T, dim], contiguous."""
    batch, tokens = q.shape[:2]
    heads, kv_heads = q.shape[-1] // dim, k.shape[-1] // dim
    # the kernel steps from token to token (across rows too) by one stride
    evenly = lambda t: t.stride(-1) == 1 and t.stride(0) == tokens * t.stride(1)  # noqa: E731
    q, k = (t if evenly(t) else t.contiguous() for t in (q, k))
    cos, sin = (t.expand(batch, tokens, dim).contiguous() for t in (cos, sin))
    q_out = q.new_empty(batch, heads, tokens, dim)
    k_out = k.new_empty(batch, kv_heads, tokens, dim)
    library().rotary_f32(
        q.data_ptr(), k.data_ptr(), batch, tokens, heads, kv_heads, dim, q.stride(1), k.stride(1),
        cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr(),
    )  # fmt: skip
    return q_out, k_out


def stream_layer_steps(model: nn.Module) -> int:
    """Give `model`'s RMSNorms and SiLU MLPs the kernel's one-call steps, in place; returns how
    many. Why: outside its products a CPU pass is mostly small torch ops, each paying its
    dispatch (docs/cpu-kernels.md); a norm is 8 of them, an MLP's activation 3, the rotary
    embeddings of q and k 14. Each step computes a row from that row alone, so a token's bits
    still do not depend on the pass; norms and activations are float32 as torch's, not its bits
    (its reductions and `expf` round in their own order), so call it on every pass path of a
    model or on none. The rotary embeddings are torch's bits."""
    if library() is None:
        return 0
    changed = 0
    for module in model.modules():
        name = type(module).__name__
        if name in RMS_NORMS and _norm_fits(module):
            module.forward = partial(_norm_forward, module)
            changed += 1
        elif name in SILU_MLPS and _mlp_fits(module):
            module.forward = partial(_mlp_forward, module)
            changed += 1
        elif name in ROTARY_ATTENTIONS and _attention_fits(module):
            module.forward = partial(_attention_forward, module)
            changed += 1
    return changed


def _norm_fits(norm: nn.Module) -> bool:
    weight = getattr(norm, "weight", None)
    return (
        isinstance(getattr(norm, "variance_epsilon", None), float)
        and weight is not None
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.dim() == 1
        and weight.numel() % 8 == 0
    )


def _outside(x: torch.Tensor) -> bool:
    """Is `x` not the kernel's (float32 on the CPU), or the pass compiled (its own fusions)?"""
    return x.dtype != torch.float32 or x.device.type != "cpu" or torch.compiler.is_compiling()


def _norm_forward(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if _outside(x):
        return type(norm).forward(norm, x)
    return rms_norm(x, norm.weight.detach(), norm.variance_epsilon)


def _mlp_fits(mlp: nn.Module) -> bool:
    config = getattr(mlp, "config", None)
    return getattr(config, "hidden_act", None) == "silu" and all(
        hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")
    )


def _mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)); a fused gate/up product (`fusion.share`) once, its halves
    read in place, so that fused and separate projections give the same bits."""
    if _outside(x):
        return type(mlp).forward(mlp, x)
    if hasattr(mlp, "gate_up_proj"):
        return mlp.down_proj(silu_mul(mlp.gate_up_proj(x)))
    return mlp.down_proj(silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))


def _attention_fits(attention: nn.Module) -> bool:
    dim = getattr(attention, "head_dim", None)
    parts = ("q_proj", "k_proj", "v_proj", "o_proj", "layer_idx", "scaling", "config")
    return (
        isinstance(dim, int)
        and dim % 2 == 0
        and all(hasattr(attention, n) for n in parts)
        and not hasattr(attention, "q_norm")
    )


def _attention_forward(
    attention: nn.Module, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs
):
    """The attention module's own forward with q's and k's rotary embeddings in one kernel call
    (`rotary`), which lays out their heads too: the projections, the cache, the attention
    function the config names and the output projection are the module's."""
    # outside the kernel (a compiled pass too), the module's forward untouched
    implementation = attention.config._attn_implementation
    interface = None if _outside(hidden_states) else ALL_ATTENTION_FUNCTIONS.get(implementation)
    cos, sin = position_embeddings if position_embeddings is not None else (None, None)
    if (
        interface is None
        or attention.training
        or cos is None
        or cos.dtype != torch.float32
        or cos.shape[-1] != attention.head_dim
    ):
        forward = type(attention).forward
        return forward(attention, hidden_states, position_embeddings, attention_mask, **kwargs)
    # `transformers` renamed the cache argument (`batched_lm._cache_keyword`)
    cache = kwargs.pop("cache", None) if "cache" in kwargs else kwargs.pop("past_key_values", None)
    batch, tokens = hidden_states.shape[:2]
    dim = attention.head_dim
    q = attention.q_proj(hidden_states)
    k = attention.k_proj(hidden_states)
    v = attention.v_proj(hidden_states).view(batch, tokens, -1, dim).transpose(1, 2)
    q, k = rotary(q, k, cos, sin, dim)
    if cache is not None:
        k, v = cache.update(k, v, attention.layer_idx, kwargs=kwargs)
    if hasattr(attention, "sliding_window"):  # Qwen2's, None but on its sliding layers
        kwargs["sliding_window"] = attention.sliding_window
    scaling = attention.scaling
    out, weights = interface(attention, q, k, v, attention_mask, dropout=0.0, scaling=scaling, **kwargs)
    return attention.o_proj(out.reshape(batch, tokens, -1).contiguous()), weights


class StreamedLinear(nn.Module):
    """A Linear (float32 in and out) over weights packed for `streamed_linear.cpp`.

    The weights are kept as bfloat16 when every value is exactly a bfloat16 (then the product
    is the float32 model's, bit for bit), as float32 otherwise, or, with `int8=True` (a draft,
    whose proposals the target checks), as int8 with one scale per output row: half the bytes
    again. They are stored as integers so that `model.to(dtype)` leaves them as they are.
    """

    token_wise = True  # it computes token by token, as a Linear (`packing`)
    # ... and takes a ragged pass's real rows itself, where `packing` would hook a gather and a
    # scatter around it: two hooks on each of a pass's 250 layers cost 0.8 ms of 35
    packs_itself = True

    def __init__(self, linear: nn.Linear, int8: bool = False):
        super().__init__()
        weight = linear.weight.detach()
        self.out_features, self.in_features = weight.shape
        scale = None
        if int8:
            scale = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127.0
            source, kind = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), "i8"
        else:
            bf16 = weight.to(torch.bfloat16)
            if weight.dtype == torch.bfloat16 or torch.equal(bf16.to(weight.dtype), weight):
                source, kind = bf16.view(torch.int16), "bf16"
            else:
                source, kind = weight.float(), "f32"
        source = source.contiguous()
        self.kind = kind
        self.block_rows = max(
            2, min(MAX_BLOCK_ROWS, BLOCK_BYTES // (self.in_features * source.element_size())) // 2 * 2
        )
        packed = torch.empty((self.out_features + 1) // 2 * 2 * self.in_features, dtype=source.dtype)
        getattr(library(), f"pack_{kind}")(
            source.data_ptr(),
            self.out_features,
            self.in_features,
            self.block_rows,
            K_SLICE,
            packed.data_ptr(),
        )
        self.register_buffer("packed", packed.view(torch.int32) if kind == "f32" else packed)
        self.register_buffer("scale", scale)
        bias = linear.bias.detach().float().contiguous() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self._product = getattr(library(), f"linear_{kind}")

    def _weights(self) -> list:
        """The kernel's arguments between the output width and the bias (see `linear_*`)."""
        return [self.scale.data_ptr() if self.scale is not None else None]

    def _options(self) -> list:
        """The kernel's arguments after the threads."""
        return []

    def _fixed(self) -> tuple:
        """The kernel's arguments from the input width to the bias: the same in every call, so
        taken once (reading the buffers' addresses in every call was about half of a small
        layer's 11 µs call). Anything that may move the buffers goes through `_apply`."""
        if self._held is None:
            bias = self.bias.data_ptr() if self.bias is not None else None
            self._held = (self.in_features, self.packed.data_ptr(), self.out_features, *self._weights(), bias)
        return self._held

    _held: tuple | None = None

    def _apply(self, fn, recurse: bool = True):
        self._held = None  # `to()`, `share_memory_()`: the buffers may be new tensors
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_cpu:
            raise TypeError(f"{type(self).__name__} takes float32 CPU inputs, got {x.dtype} on {x.device}")
        layout = packing.real_rows(x)  # a ragged pass: its real rows only (see `packs_itself`)
        rows = x.reshape(-1, self.in_features) if layout is None else packing.gather(x, layout)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features)
        self._product(
            rows.data_ptr(), rows.shape[0], *self._fixed(), out.data_ptr(), self.block_rows, K_SLICE,
            torch.get_num_threads(), *self._options(),
        )  # fmt: skip
        if layout is not None:
            return packing.scatter(out, x.shape, layout)
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def weight_bytes(self) -> int:
        """Bytes a pass reads for this layer's weights (what `pipeline calibrate` divides by time)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights={self.kind}"


_prefill: ContextVar[bool] = ContextVar("prefill", default=False)


@contextmanager
def prefilling(on: bool = True) -> Iterator[None]:
    """Passes in this block are prefills (`on`; False: are not): block weights run as their
    bf16 rounding, or by the int8 GEMM on rounded rows (`prefill_numbers`).

    Why: a prefill is hundreds of token rows, and bound by arithmetic. Read as bf16 (the values
    the install's bf16 weights hold, gguf's dequantization rounded), the kernel runs it as fast
    as the dense path does; read as exact float32, the wider values cost about a third more.
    Decoding passes read the blocks' exact values. A row's numbers stay one fixed chain either
    way, since the runner (`BatchedLM`) marks every prefill, in target-only and speculative
    decoding alike: a prompt is always prefilled, a generated token never is. (The int8 GEMM's
    chain is the decoding passes' own.)
    """
    global _traced_prefill
    token, traced = _prefill.set(on), _traced_prefill
    _traced_prefill = on
    try:
        yield
    finally:
        _prefill.reset(token)
        _traced_prefill = traced


# `_prefill` as a compiled pass reads it: a module global, which `torch.compile` guards on (the
# static path's prefill passes and its decode passes compile apart), where a context variable
# cannot be traced
_traced_prefill = False


def is_prefilling() -> bool:
    """Is the pass running now a prefill (see `prefilling`)?"""
    if torch.compiler.is_compiling():
        return _traced_prefill
    return _prefill.get()


# The GGUF block types the kernel reads, by their names there.
BLOCK_KINDS = {"Q4_K": "q4k", "Q6_K": "q6k"}
SUPER_BLOCK = 256  # weights of a row per Q4_K / Q6_K super-block
_GGUF_BYTES = {"Q4_K": 144, "Q6_K": 210}  # a super-block of one row, in the file


class BlockLinear(StreamedLinear):
    """A Linear whose weight is a GGUF file's own Q4_K or Q6_K blocks (`gguf_blocks`), repacked
    once for `streamed_linear.cpp`, which rebuilds the weights from their codes and their blocks'
    scales in registers: about a third of the bf16 bytes. A decoding pass computes with the
    blocks' exact values (for Q4_K, sum a*q*x less the mins' sum b*X, taken apart), against the
    activations as they are or, `rounded`, rounded to int8 per 256 values; a prefill
    (`prefilling`) with gguf's values rounded to bf16, or, `rounded`, against rows rounded to
    int8 (see `prefill_numbers`). Row-invariant like every kind of the
    kernel. `blocks` is uint8 [out_features, bytes per row] as the GGUF file has them;
    `in_features` must be a multiple of 256."""

    def __init__(
        self,
        blocks: torch.Tensor,
        gguf_type: str,
        in_features: int,
        bias: torch.Tensor | None = None,
        rounded: bool = False,
    ):
        nn.Module.__init__(self)
        lib = library()
        kind = BLOCK_KINDS[gguf_type]
        rows, columns = blocks.shape
        if in_features % SUPER_BLOCK or columns != in_features // SUPER_BLOCK * _GGUF_BYTES[gguf_type]:
            raise ValueError(
                f"{gguf_type} blocks [{rows}, {columns}] do not hold rows of {in_features} weights"
            )
        self.out_features, self.in_features, self.kind = rows, in_features, kind
        # decoding passes against activations rounded to 8 bits (the kernel's `quantize_q8`)
        self.rounded = rounded
        size = getattr(lib, f"packed_bytes_{kind}")(rows, in_features)
        per_row = size // ((rows + 7) // 8 * 8)
        self.block_rows = max(8, min(MAX_BLOCK_ROWS, BLOCK_BYTES // per_row) // 8 * 8)
        source = blocks.contiguous()
        packed = torch.empty(size, dtype=torch.uint8)
        if kind == "q4k":  # the mins apart, strip by strip of 8 rows: the epilogue reads them
            strips = (rows + 7) // 8 * 8
            dmin = torch.empty(strips * in_features // SUPER_BLOCK)
            mins = torch.empty(strips * in_features // 32, dtype=torch.uint8)
            lib.pack_q4k(source.data_ptr(), rows, in_features, self.block_rows, K_SLICE, packed.data_ptr(),
                         dmin.data_ptr(), mins.data_ptr())  # fmt: skip
            self.register_buffer("dmin", dmin.view(torch.int32))  # integers: `model.to(dtype)` leaves them
            self.register_buffer("mins", mins)
        else:
            lib.pack_q6k(source.data_ptr(), rows, in_features, self.block_rows, K_SLICE, packed.data_ptr())
        self.register_buffer("packed", packed)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._product = getattr(lib, f"linear_{kind}")

    def _weights(self) -> list:
        return [self.dmin.data_ptr(), self.mins.data_ptr()] if self.kind == "q4k" else []

    def _options(self) -> list:
        return [int(_prefill.get()), int(self.rounded)]

    def extra_repr(self) -> str:
        return super().extra_repr() + (", activations rounded to int8" if self.rounded else "")


@cache
def _reads_right(gguf_type: str, sample: bytes) -> bool:
    """Does the kernel read `gguf_type` blocks as gguf's own dequantization does? Checked on a
    strip of 8 rows of one super-block (`sample`) of the model's own blocks, fed one-hot rows:
    each output is then one weight, which must equal gguf's value bit for bit."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[gguf_type]
    raw = torch.frombuffer(bytearray(sample), dtype=torch.uint8).view(8, -1)
    expected = torch.from_numpy(quants.dequantize(raw.numpy(), qtype).reshape(8, SUPER_BLOCK))
    got = BlockLinear(raw, gguf_type, SUPER_BLOCK)(torch.eye(SUPER_BLOCK)).T
    return torch.equal(got, expected)


def use_blocks(
    model: nn.Module, blocks: dict[str, tuple[str, torch.Tensor]], rounded: bool = False
) -> dict[str, int]:
    """Replace each Linear of `model` whose weight has blocks of a type the kernel reads (see
    `gguf_blocks.read_blocks`) by a BlockLinear, in place; returns how many Linears, by type. A
    type whose blocks the kernel does not read as gguf does (`_reads_right`) stays dense, with a
    warning. Projections of one input with blocks of one type (q, k and v; gate and up) become one
    BlockLinear over their rows (`fusion.share`): each output is the same chain of operations as
    apart, so the same bits, for one kernel call instead of several. `rounded`: decoding passes
    against activations rounded to int8 (`models.block_activations`)."""
    from pipeline.models import fusion

    trusted: dict[str, bool] = {}

    def weight(prefix: str, name: str) -> str:
        return f"{prefix}.{name}.weight" if prefix else f"{name}.weight"

    def readable(prefix: str, name: str, child: nn.Module | None) -> str | None:
        """The GGUF type of `child`'s blocks where the kernel takes them in its place."""
        key = weight(prefix, name)
        if not isinstance(child, nn.Linear) or key not in blocks:
            return None
        gguf_type, raw = blocks[key]
        if gguf_type not in BLOCK_KINDS or child.in_features % SUPER_BLOCK or raw.dim() != 2:
            return None
        row_bytes = child.in_features // SUPER_BLOCK * _GGUF_BYTES[gguf_type]
        if tuple(raw.shape) != (child.out_features, row_bytes) or raw.shape[0] < 8:
            return None
        if gguf_type not in trusted:
            sample = raw[:8, : _GGUF_BYTES[gguf_type]].contiguous().numpy().tobytes()
            trusted[gguf_type] = _reads_right(gguf_type, sample)
            if not trusted[gguf_type]:
                log.warning(
                    "the block kernel does not read %s blocks as gguf does: they stay dense", gguf_type
                )
        return gguf_type if trusted[gguf_type] else None

    used: dict[str, int] = {}
    for prefix, parent in list(model.named_modules()):
        for names, fused_name in fusion.SHARED:
            children = [getattr(parent, n, None) for n in names]
            kinds = [readable(prefix, n, c) for n, c in zip(names, children)]
            for kind in dict.fromkeys(k for k in kinds if k):  # each type's projections, in call order
                group = [(n, c) for n, c, k in zip(names, children, kinds) if k == kind]
                if len(group) < 2 or len({(c.in_features, c.bias is None) for _, c in group}) != 1:
                    continue
                raw = torch.cat([blocks[weight(prefix, n)][1] for n, _ in group])
                bias = None if group[0][1].bias is None else torch.cat([c.bias.detach() for _, c in group])
                fused = BlockLinear(raw, kind, group[0][1].in_features, bias, rounded)
                label = fused_name  # or, say, qk_proj where v's blocks are of another type
                if len(group) < len(names):
                    label = "".join(n.removesuffix("_proj") for n, _ in group) + "_proj"
                fusion.share(parent, tuple(n for n, _ in group), fused, label, keep=False)
                used[kind] = used.get(kind, 0) + len(group)
        for name, child in list(parent.named_children()):
            gguf_type = readable(prefix, name, child)
            if gguf_type:
                raw = blocks[weight(prefix, name)][1]
                setattr(parent, name, BlockLinear(raw, gguf_type, child.in_features, child.bias, rounded))
                used[gguf_type] = used.get(gguf_type, 0) + 1
    return used


def prefill_reads_bf16_rows() -> bool:
    """Do block prefills here multiply bf16-rounded token rows by the weights' bf16 rounding
    (`micro_dot_512`: CPUs with AVX512_BF16, unless PIPELINE_KERNEL_BF16DOT=0)? Twice the
    products per instruction of the float32 chain, which every other CPU runs (the same bits on
    AVX2 and AVX-512 alike). Either way a prompt's bits do not depend on the rows beside it."""
    lib = library()
    return bool(lib is not None and lib.prefill_reads_bf16_rows())


def prefill_numbers(rounded: bool) -> str:
    """What a block prefill multiplies here, by the layers' `rounded` (`models.block_activations:
    int8`): "bf16", bf16 token rows by the weights' bf16 rounding (`prefill_reads_bf16_rows`);
    "int8", token rows rounded to int8 by the blocks' own codes (`micro_q8_gemm`: rounded layers
    on every other CPU, unless PIPELINE_KERNEL_Q8GEMM=0), about 2.5x the float32 chain's products
    a second in AVX2 code; "float32", float32 rows by the bf16 rounding."""
    lib = library()
    if lib is not None and lib.prefill_reads_bf16_rows():
        return "bf16"
    return "int8" if rounded and lib is not None and lib.prefill_rounds_rows() else "float32"


def instruction_set() -> str | None:
    """The vector instructions the kernel runs here: "avx512" (16-lane kernels: CPUs with
    AVX-512F and DQ, unless PIPELINE_KERNEL_AVX512=0), "avx2", or None (no kernel). Reports name
    it beside the CPU's flags: the flags say what the CPU has, this what ran."""
    lib = library()
    return None if lib is None else "avx512" if lib.kernel_avx512() else "avx2"


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a pass of `model` reads: its Linear layers' (streamed, blocks or torch's),
    not the input embeddings, of which a pass reads a few rows."""
    total = 0
    for module in model.modules():
        if isinstance(module, StreamedLinear):
            total += module.weight_bytes
        elif isinstance(module, nn.Linear):
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return total


def wanted(dtype: torch.dtype, device: str) -> bool:
    """The default: float32 models on CPUs, where torch's kernels make wide passes dear."""
    return device == "cpu" and dtype == torch.float32 and library() is not None


def stream_linears(model: nn.Module, output_layer: bool = True, int8: bool = False) -> int:
    """Replace every Linear of `model` whose input width is a multiple of 8 (the kernel's step)
    by a StreamedLinear (int8 ones with `int8`), in place; returns how many. Tied weights stay
    shared with what ties them (the input embeddings keep their own copy). `output_layer=False`
    keeps a draft's as loaded: `BatchedLM.restrict_head` gathers the rows it proposes from,
    and streams those."""
    head = None if output_layer else model.get_output_embeddings()
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (
                isinstance(child, nn.Linear)
                and child is not head
                and child.in_features % 8 == 0
                and child.weight.device.type == "cpu"
            ):
                setattr(parent, name, StreamedLinear(child, int8=int8))
                replaced += 1
    model._streamed = "int8" if int8 else "exact"
    return replaced
