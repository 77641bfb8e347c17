"""Batch-invariant numerics: a token gets bitwise the same logits from the target model whether
it is decoded alone, verified inside a wide speculative pass, or decoded in a batch of eight.

Why this exists: speculative decoding promises exactly the target's own greedy text, and in
bf16 two kernels break that promise at near-ties, even though the model is the same:

1. Linear layers. oneDNN computes a 1-row input with a different kernel than an input of 2 or
   more rows, and the two round differently (a few outputs of a 1536-wide layer differ by one
   bf16 ulp); any 2 or more rows give every row the same bits. So a 1-row input is computed
   as 2 rows (itself twice) and the copy dropped. On this kind of CPU the 2-row kernel is no
   slower than the 1-row one.
2. Attention. The fused kernel's result for one query depends on how many queries share the
   call and how many masked key slots surround its keys (the speculative cache has holes and
   padding). For float32 and bf16 models on CPUs with the streamed kernel, attention is the
   kernel's (`streamed.attention`, in float32 over a float32 cache): each query one fixed chain
   over the keys it sees, so its bits cannot depend on the pass. Elsewhere it runs in float64
   and is rounded back to the model's dtype:
   the summation order then moves the result by ~1e-16, which survives the rounding to bf16
   only if it straddles a rounding boundary (odds ~2^-40 per value).

Measured on Qwen2.5-Coder 1.5B in bf16 (docstring summaries, 64 new tokens): without this,
every speculative configuration, ours and HF's assisted generation alike, left target-only
greedy output at a near-tie on one of 2 documents; with the Linear half alone, on 1 to 2 of 4;
with both, all outputs are identical at every batch size and drafter.
In float32 one ulp is 65,000 times smaller and such flips are rare, while the 2-row trick
doubles the cost of a 1-token pass on CPUs without AVX512-BF16; see `wanted`.

On a GPU the 2-row trick is no cure: cuBLAS picks a kernel by the number of rows, and row
reductions (RMSNorm) split their work by it. There every Linear and RMSNorm input goes in blocks
of GPU_ROWS rows, the last one padded, so one kernel shape serves every pass; a memory-bound
decode or verify pass of up to GPU_ROWS tokens costs what a 1-row one does (docs/benchmarks/,
the GPU runs). The static path's decode and verify passes multiply in `fixed_linear`'s kernel
instead where it works on the device (one fixed order per row, tiles of 16 rows, no padding to 128).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from pipeline.models import fixed_attention, packing, streamed

NAME = "batch_invariant"
# Rows per Linear or RMSNorm call on a GPU: a verify pass of batch 8 × 16 tokens in one block.
GPU_ROWS = 128
# Rows per call in a prefill. Prompt tokens are always prefilled and generated ones never are,
# in target-only and speculative decoding alike (the runners mark every prefill), so prefills may
# have their own fixed block without breaking the invariance; in blocks of 128 rows, 64 prompts of
# 400 tokens made 200 calls per Linear and prefilled at 0.081 ms a token on an H200, against
# 0.013 ms with stock kernels (docs/gpu.md).
PREFILL_ROWS = 2048
# Queries per float64 product in a long pass (a prefill): each block of queries reads only the
# keys up to the last one any of them may see, which skips most of the masked causal half.
QUERY_BLOCK = 64


def cache_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype a model's KV cache keeps its keys and values in (None: as they come): float32
    where the kernel's attention reads them (a float32 or bf16 batch-invariant model on a CPU
    with the streamed kernel), float64 for the float64 attention of other batch-invariant models, so that
    a pass converts only its own keys, never the whole cache again."""
    if getattr(model.config, "_attn_implementation", None) != NAME:
        return None
    if kernel_attends(next(model.parameters()).dtype, next(model.parameters()).device.type):
        return torch.float32
    return torch.float64


def kernel_attends(dtype: torch.dtype, device: str) -> bool:
    """Does attention for a model of `dtype` on `device` run in the kernel (`streamed.attention`,
    in float32)?"""
    return dtype in (torch.float32, torch.bfloat16) and device == "cpu" and streamed.library() is not None


def invariant_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs
) -> tuple[torch.Tensor, None]:
    """Attention whose result for a query does not depend on the pass: the kernel's, in float32,
    for a float32 or bf16 model on a CPU (a bf16 model's tensors converted: in a bf16 prefill
    the float64 products were some 70% of the time); where the static path names each query's
    keys (`visible_keys`: a GPU's decode and verify passes), `fixed_attention`'s kernel; else
    `float64_attention`."""
    scaling = kwargs.get("scaling")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    visible = kwargs.pop("visible_keys", None)
    if visible is not None:  # the static path's decode and verify passes on a GPU
        return fixed_attention.attend(query, key, value, visible, scale), None
    kernel = kernel_attends(query.dtype, key.device.type) and query.shape[-1] % 8 == 0
    if attention_mask is not None and kernel:
        layout = packing.current()
        rows = None  # a ragged pass: each row's real queries only
        if layout is not None and layout.width == query.shape[2] and len(layout.lengths) == query.shape[0]:
            rows = layout.lengths
        mask = attention_mask[:, :, :, : key.shape[2]].float()
        # keys and values come in float32 from the runners' caches, in the model's dtype from a
        # pass without one (`architecture.plain_head`'s check, Hugging Face's generate)
        out = streamed.attention(query.float(), key.float(), value.float(), mask, scale, rows)
        return out.to(query.dtype), None
    return float64_attention(module, query, key, value, attention_mask, **kwargs)


def float64_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Softmax attention in float64 (query [B, H, q, D], key/value [B, H_kv, k, D]).

    Query heads that share a key/value head are stacked into one matrix product with it
    rather than copying the keys per head: the copies in float64 would cost more than the
    attention itself at batch 8. Long passes go in blocks of QUERY_BLOCK queries, each over
    the keys it can see: in a 400-token prefill that is 45% fewer products, and the float64
    attention was 15% of such a prefill. Fewer masked keys in a sum moves the float64 result
    by ~1e-16, which the rounding to bf16 absorbs (as it absorbs the cache's holes). In a
    packed ragged pass (see `packing`) each row attends for its real queries only.
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    key, value = key.double(), value.double()
    mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[2]]
    layout = packing.current()
    if layout is None or layout.width != query.shape[2] or len(layout.lengths) != query.shape[0]:
        out = _blocked(query, key, value, mask, scale)
    else:  # a ragged pass: real queries only, padding left zero
        out = query.new_zeros(query.shape)
        # The columns every row fills go in one call for the whole batch; only the rows that
        # are longer run alone, for their remaining queries. A call per row for all of them
        # cost 10-15 ms more per pass of the 1.5B target at batch 8 (small float64 copies).
        common = min(layout.lengths)
        common_mask = None if mask is None else mask[:, :, :common]
        out[:, :, :common] = _blocked(query[:, :, :common], key, value, common_mask, scale)
        for row, n in enumerate(layout.lengths):
            if n > common:
                part = slice(row, row + 1)
                row_mask = None if mask is None else mask[part, :, common:n]
                out[part, :, common:n] = _blocked(
                    query[part, :, common:n], key[part], value[part], row_mask, scale
                )
    return out.transpose(1, 2).contiguous(), None


def _blocked(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """`_grouped`, for a long pass in blocks of QUERY_BLOCK queries over the keys each can see."""
    q_len, k_len = query.shape[2], key.shape[2]
    # cutting the keys reads the mask on the host: not in a compiled or captured pass (the
    # static path's prefill pieces), whose queries then attend over every key, masked
    fixed = torch.compiler.is_compiling() or (query.is_cuda and torch.cuda.is_current_stream_capturing())
    if mask is None or q_len <= QUERY_BLOCK or fixed:
        return _grouped(query, key, value, mask, scale)
    blocks = []
    for start in range(0, q_len, QUERY_BLOCK):
        block_mask = mask[:, :, start : start + QUERY_BLOCK]
        seen = (block_mask > torch.finfo(mask.dtype).min / 2).any(dim=(0, 1, 2)).nonzero()
        end = int(seen[-1]) + 1 if len(seen) else k_len
        block = query[:, :, start : start + QUERY_BLOCK]
        kv = key[:, :, :end], value[:, :, :end]
        blocks.append(_grouped(block, *kv, block_mask[..., :end], scale))
    return torch.cat(blocks, dim=2)


def _grouped(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v in float64 (key and value already float64), the query
    heads grouped by their key/value head; [B, H, q, D] in the query's dtype."""
    batch, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    q = query.double().reshape(batch, kv_heads, groups * q_len, dim)
    scores = (torch.matmul(q, key.transpose(2, 3)) * scale).view(batch, kv_heads, groups, q_len, k_len)
    if mask is not None:  # [B, 1, q, k], additive
        scores = scores + mask[:, :, None].double()
    probs = torch.softmax(scores, dim=-1).view(batch, kv_heads, groups * q_len, k_len)
    return torch.matmul(probs, value).view(batch, heads, q_len, dim).to(query.dtype)


AttentionInterface.register(NAME, invariant_attention)
AttentionMaskInterface.register(NAME, eager_mask)  # an additive mask, always materialized


def _widen(linear: nn.Linear, args: tuple) -> tuple | None:
    x = args[0]
    linear._widened = x.shape[:-1].numel() == 1
    return (torch.cat([x, x], dim=-2), *args[1:]) if linear._widened else None


def _narrow(linear: nn.Linear, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    if linear._widened:
        linear._widened = False
        return out[..., :1, :]
    return None


def _in_row_blocks(forward, prefill_rows: int = PREFILL_ROWS):
    """`forward` (row-wise over the last dimension) computed GPU_ROWS rows at a time
    (`prefill_rows` in a prefill), the last block padded with zeros, so every call runs the
    kernels of one shape."""

    def run(x: torch.Tensor) -> torch.Tensor:
        size = prefill_rows if streamed.is_prefilling() else GPU_ROWS
        rows = x.reshape(-1, x.shape[-1])
        n = len(rows)
        rows = nn.functional.pad(rows, (0, 0, 0, -n % size))
        blocks = rows.split(size)
        out = forward(blocks[0]) if len(blocks) == 1 else torch.cat([forward(b) for b in blocks])
        return out[:n].reshape(*x.shape[:-1], out.shape[-1])

    return run


def wanted(dtype: torch.dtype, device: str) -> bool:
    """The default: on for 16-bit dtypes on CPUs, where kernel rounding flips near-ties and the
    fix is cheap, and for every dtype on GPUs, where even float32 kernels change with the shape
    and a padded block costs a memory-bound pass nothing."""
    return device.startswith("cuda") or (device == "cpu" and dtype in (torch.bfloat16, torch.float16))


def linear_is_row_invariant(
    dtype: torch.dtype, features: int = 1536, rows: tuple[int, ...] = (3, 8, 64, 512)
) -> bool:
    """Does a matrix product give a row the same bits whatever the number of rows (from 2 on)?

    The 2-row trick rests on this property of the CPU's kernels (true of oneDNN on AVX-512 here);
    a CPU whose library switches kernels with the row count (say to AMX for large inputs)
    breaks it, and the loader says so rather than promise exact output silently.
    """
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(features, features, generator=gen) / features**0.5).to(dtype)
    x = torch.randn(max(rows), features, generator=gen).to(dtype)
    reference = torch.nn.functional.linear(x[:2], weight)[1]
    return all(torch.equal(torch.nn.functional.linear(x[:n], weight)[1], reference) for n in rows)


def make_batch_invariant(model: nn.Module, row_blocks: bool | None = None) -> nn.Module:
    """Give `model` batch-invariant numerics in place (see the module docstring); idempotent.
    `row_blocks`: Linear and RMSNorm in blocks of GPU_ROWS rows (None: on a GPU), else the
    2-row trick."""
    if getattr(model, "_batch_invariant", False):
        return model
    if row_blocks is None:
        row_blocks = next(model.parameters()).device.type == "cuda"
    # The output layer sees, in a prefill, only the rows that want logits (the prompts' last
    # tokens, a few), never a whole prompt: in a prefill's block it computed 2,048 rows of the
    # whole vocabulary for each admission. Its decode passes' block serves it in prefills too.
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for module in model.modules():
        if getattr(module, "_fused_into", None):
            continue  # a part of a fused product (`fusion`): the product itself is wrapped
        if row_blocks and (isinstance(module, nn.Linear) or type(module).__name__.endswith("RMSNorm")):
            module.forward = _in_row_blocks(module.forward, GPU_ROWS if module is head else PREFILL_ROWS)
        elif isinstance(module, nn.Linear):
            module._widened = False
            module.register_forward_pre_hook(_widen)
            module.register_forward_hook(_narrow, prepend=True)  # before a packing scatter
    model.set_attn_implementation(NAME)
    model._batch_invariant = True
    return model
