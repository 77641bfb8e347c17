"""The Triton kernels behind `fixed_linear` (imported only where Triton is installed).

`product` runs one program per tile of ROWS input rows × BLOCK_N outputs and per part of the
inner dimension (a fixed split-K, so that a product of few rows still spreads over the whole
GPU): it sums its part in blocks of BLOCK_K, in order, on the tensor cores with a float32
accumulator. Where the inner dimension has one part, the program adds the bias and writes the
output itself. Else it writes its part's sums, and the parts are added in order, then the bias
(`add_parts`): with LAST_ADDS by the tile's last part to finish, which counts the parts done in
`counts` (an arrival counter a tile, left at zero for the next launch), else by a second kernel,
`combine`. Which part finishes last does not matter: the last one adds part 0, 1, ... in that
order, as `combine` does, so both give the same bits; the first saves a launch a split product.
Every tile runs the same compiled program whatever the number of rows (ROWS and the blocks are
constants, the rows past the input's end read as zeros), and a product computes each output
from its own row alone, so a row's bits do not depend on how many rows share the call.

With TRITON_INTERPRET=1 set before Triton is imported, they run on CPU tensors in Triton's
interpreter (the tests do).
"""

from __future__ import annotations

import triton
import triton.language as tl


# Triton compiles a kernel apart for an integer argument of 1 or one divisible by 16: the row
# count (and the parts' stride, which follows it) must not choose the program a row runs.
@triton.jit(do_not_specialize=["rows", "sums_split"])
def product(
    x_ptr,
    w_ptr,
    b_ptr,
    sums_ptr,
    out_ptr,
    counts_ptr,
    rows,
    outputs,
    inner,
    x_row,
    w_row,
    sums_split,
    sums_row,
    out_row,
    blocks_per_part,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PARTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    LAST_ADDS: tl.constexpr,
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
        tl.store(sums_ptr + part * sums_split + row[:, None] * sums_row + col[None, :], acc, mask=keep)
        if LAST_ADDS:
            # Counted done only once every thread's sums are stored; the count releases them to
            # the GPU and, for the last part, acquires the others' (CUTLASS's serial split-K).
            tl.debug_barrier()
            counter = counts_ptr + tile * tl.num_programs(1) + column
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == PARTS - 1:
                tl.debug_barrier()
                add_parts(sums_ptr, b_ptr, out_ptr, row, col, rows, outputs, sums_split, sums_row, out_row,
                          PARTS, HAS_BIAS, ".cg")  # fmt: skip
                tl.store(counter, 0)  # for the next launch, which runs after this one ends


@triton.jit
def add_parts(
    sums_ptr, b_ptr, out_ptr, row, col, rows, outputs, sums_split, sums_row, out_row,
    PARTS: tl.constexpr, HAS_BIAS: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """A tile's parts added in order, then the bias: the order a row's sums take past its parts
    (`CACHE` ".cg": read from L2, where the other programs' parts are)."""
    keep = (row[:, None] < rows) & (col[None, :] < outputs)
    where = row[:, None] * sums_row + col[None, :]
    total = tl.load(sums_ptr + where, mask=keep, other=0.0, cache_modifier=CACHE)
    for part in tl.static_range(1, PARTS):  # in order: part of the order a row's sums take
        total += tl.load(sums_ptr + part * sums_split + where, mask=keep, other=0.0, cache_modifier=CACHE)
    if HAS_BIAS:
        total += tl.load(b_ptr + col, mask=col < outputs, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + row[:, None] * out_row + col[None, :], total.to(out_ptr.dtype.element_ty), mask=keep)


@triton.jit(do_not_specialize=["rows", "sums_split"])
def combine(
    sums_ptr,
    b_ptr,
    out_ptr,
    rows,
    outputs,
    sums_split,
    sums_row,
    out_row,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    add_parts(
        sums_ptr, b_ptr, out_ptr, row, col, rows, outputs, sums_split, sums_row, out_row, PARTS, HAS_BIAS, ""
    )
