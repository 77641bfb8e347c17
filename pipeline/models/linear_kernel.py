"""The Triton kernels behind `fixed_linear` (imported only where Triton is installed).

`product` runs one program per tile of ROWS input rows × BLOCK_N outputs and per part of the
inner dimension (a fixed split-K, so that a product of few rows still spreads over the whole
GPU): it sums its part in blocks of BLOCK_K, in order, on the tensor cores with a float32
accumulator. Where the inner dimension has one part, the program adds the bias and writes the
output itself; else it writes its part's sums and `combine` adds the parts in order, then the
bias. Every tile runs the same compiled program whatever the number of rows (ROWS and the
blocks are constants, the rows past the input's end read as zeros), and a product computes each
output from its own row alone, so a row's bits do not depend on how many rows share the call.

With TRITON_INTERPRET=1 set before Triton is imported, they run on CPU tensors in Triton's
interpreter (the tests do).
"""

from __future__ import annotations

import triton
import triton.language as tl


# Triton compiles a kernel apart for an integer argument of 1 or one divisible by 16: the row
# count (and the parts' stride, which follows it) must not choose the program a row runs.
@triton.jit(do_not_specialize=["rows", "out_split"])
def product(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    rows,
    outputs,
    inner,
    x_row,
    w_row,
    out_split,
    out_row,
    blocks_per_part,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PARTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    column = tl.program_id(1)
    part = tl.program_id(2)
    row = tile * ROWS + tl.arange(0, ROWS)
    col = column * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    start = part * blocks_per_part * BLOCK_K
    for block in range(0, blocks_per_part):
        k = start + block * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + row[:, None] * x_row + k[None, :],
            mask=(row[:, None] < rows) & (k[None, :] < inner),
            other=0.0,
        )
        w = tl.load(
            w_ptr + col[:, None] * w_row + k[None, :],
            mask=(col[:, None] < outputs) & (k[None, :] < inner),
            other=0.0,
        )
        if UPCAST:
            # The interpreter (numpy, which has no bf16) multiplies in float64, where every
            # product is exact: its BLAS fuses a product into its sum (or not) by a row's place
            # in the tile, which in float32 would move a row's bits with its company.
            acc += tl.dot(x.to(tl.float64), tl.trans(w.to(tl.float64))).to(tl.float32)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    keep = (row[:, None] < rows) & (col[None, :] < outputs)
    if PARTS == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + col, mask=col < outputs, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + row[:, None] * out_row + col[None, :], acc.to(out_ptr.dtype.element_ty), mask=keep)
    else:
        tl.store(out_ptr + part * out_split + row[:, None] * out_row + col[None, :], acc, mask=keep)


@triton.jit(do_not_specialize=["rows", "parts_split"])
def combine(
    parts_ptr,
    b_ptr,
    out_ptr,
    rows,
    outputs,
    parts_split,
    parts_row,
    out_row,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = (row[:, None] < rows) & (col[None, :] < outputs)
    where = row[:, None] * parts_row + col[None, :]
    total = tl.load(parts_ptr + where, mask=keep, other=0.0)
    for part in tl.static_range(1, PARTS):  # in order: part of the order a row's sums take
        total += tl.load(parts_ptr + part * parts_split + where, mask=keep, other=0.0)
    if HAS_BIAS:
        total += tl.load(b_ptr + col, mask=col < outputs, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + row[:, None] * out_row + col[None, :], total.to(out_ptr.dtype.element_ty), mask=keep)
