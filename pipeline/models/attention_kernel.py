"""The Triton kernels behind `fixed_attention` (imported only where Triton is installed).

A tile is one slot, one key/value head and ROWS query rows: the (token, head) pairs of that
slot's pass whose heads share the key/value head, in order. `attend_chunks` runs one program per
tile and CHUNK of the slot's positions (the split of flash-decoding, so that one slot's long
context is read by many programs at once): it reads that chunk's keys and values in blocks of
BLOCK, in order, with an online softmax in float32, each row masked past its own `visible` count,
and writes the chunk's running maximum, sum and weighted values. A tile's chunks are then merged
in order (`merge_chunks`): with LAST_MERGES by the tile's last chunk to finish, which counts the
chunks done in `counts` (an arrival counter a tile, left at zero for the next launch; the
pattern of `linear_kernel`'s split products), else by a second kernel, `combine`; the same code
either way, so the same bits. A row's arithmetic is its own: a tile's products compute each row from that row
alone, with fixed shapes, and its sums run over the same chunks and blocks whatever the other rows
are, so a query gets the same bits in a pass of 1 token or 16, of 1 slot or 64, whatever the
slots' length. Keys are read once per tile and chunk rather than once per query: a batch-64 verify
pass would otherwise read each slot's keys ~100 times.

With TRITON_INTERPRET=1 set before Triton is imported, they run on CPU tensors in Triton's
interpreter (the tests do).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Triton compiles a kernel apart for an integer argument of 1 or one divisible by 16: the pass's
# width, the tiles it makes and the cache's chunks must not choose the program a query runs
# (tests/test_kernel_programs.py asks Triton's launcher which program each pass selects).
PASS_SHAPE = ["tiles", "chunks", "width"]


@triton.jit(do_not_specialize=PASS_SHAPE)
def attend_chunks(
    q_ptr,
    k_ptr,
    v_ptr,
    visible_ptr,
    top_ptr,
    total_ptr,
    acc_ptr,
    out_ptr,
    counts_ptr,
    q_slot,
    q_head,
    q_token,
    k_slot,
    k_head,
    k_position,
    v_slot,
    v_head,
    v_position,
    out_slot,
    out_token,
    out_head,
    kv_heads,
    tiles,
    chunks,
    group,
    width,
    scale,
    DIM: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    LAST_MERGES: tl.constexpr,
):
    slot = tl.program_id(0)
    kv = tl.program_id(1)
    tile = tl.program_id(2) // chunks
    chunk = tl.program_id(2) % chunks
    row = tile * ROWS + tl.arange(0, ROWS)  # token * group + the head's place in it
    real = row < width * group
    token = row // group
    head = kv * group + row % group
    seen = tl.load(visible_ptr + slot * width + token, mask=real, other=0)
    last = tl.max(seen, axis=0)
    if chunk * CHUNK < last:  # a chunk past every row's keys: the merge never reads it
        d = tl.arange(0, DIM)
        q_at = q_ptr + slot * q_slot + head[:, None] * q_head + token[:, None] * q_token + d[None, :]
        q = tl.load(q_at, mask=real[:, None], other=0.0)
        if UPCAST:
            # The interpreter (numpy, which has no bf16) multiplies in float64, where every
            # product is exact: its BLAS fuses a product into its sum (or not) by a row's place
            # in the tile, which in float32 moved a query's bits with its place in the pass.
            q = q.to(tl.float64)
        keys = k_ptr + slot * k_slot + kv * k_head
        values = v_ptr + slot * v_slot + kv * v_head
        top = tl.full((ROWS,), float("-inf"), tl.float32)
        total = tl.zeros((ROWS,), tl.float32)
        acc = tl.zeros((ROWS, DIM), tl.float32)
        end = tl.minimum(chunk * CHUNK + CHUNK, last)
        for start in range(chunk * CHUNK, end, BLOCK):
            at = start + tl.arange(0, BLOCK)
            inside = (at < end)[:, None]
            k = tl.load(keys + at[:, None] * k_position + d[None, :], mask=inside, other=0.0)
            if UPCAST:
                scores = tl.dot(q, tl.trans(k.to(tl.float64))).to(tl.float32) * scale
            else:
                scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where((at[None, :] < seen[:, None]) & (at < end)[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, axis=1))
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # a row that sees nothing yet
            fade = tl.exp(top - shift)
            weights = tl.exp(scores - shift[:, None])
            v = tl.load(values + at[:, None] * v_position + d[None, :], mask=inside, other=0.0)
            p = weights.to(v_ptr.dtype.element_ty)  # the products' dtype: bf16 for a bf16 model
            total = total * fade + tl.sum(weights, axis=1)
            if UPCAST:
                acc = acc * fade[:, None] + tl.dot(p.to(tl.float64), v.to(tl.float64)).to(tl.float32)
            else:
                acc = acc * fade[:, None] + tl.dot(p, v, input_precision=PRECISION)
            top = new_top
        part = ((slot * kv_heads + kv) * tiles + tile) * chunks + chunk
        r = tl.arange(0, ROWS)
        tl.store(top_ptr + part * ROWS + r, top)
        tl.store(total_ptr + part * ROWS + r, total)
        tl.store(acc_ptr + (part * ROWS + r[:, None]) * DIM + d[None, :], acc)
    if LAST_MERGES:
        # Counted done only once every thread's sums are stored (a chunk past every row's keys
        # counts too); the count releases them to the GPU and, for the last chunk, acquires the others'.
        tl.debug_barrier()
        counter = counts_ptr + (slot * kv_heads + kv) * tiles + tile
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == chunks - 1:
            tl.debug_barrier()
            merge_chunks(visible_ptr, top_ptr, total_ptr, acc_ptr, out_ptr, out_slot, out_token, out_head,
                         slot, kv, tile, kv_heads, tiles, chunks, group, width,
                         DIM, ROWS, CHUNK, ".cg")  # fmt: skip
            tl.store(counter, 0)  # for the next launch, which runs after this one ends


@triton.jit(do_not_specialize=PASS_SHAPE)
def combine(
    visible_ptr,
    top_ptr,
    total_ptr,
    acc_ptr,
    out_ptr,
    out_slot,
    out_token,
    out_head,
    kv_heads,
    tiles,
    chunks,
    group,
    width,
    DIM: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    merge_chunks(visible_ptr, top_ptr, total_ptr, acc_ptr, out_ptr, out_slot, out_token, out_head,
                 tl.program_id(0), tl.program_id(1), tl.program_id(2), kv_heads, tiles, chunks, group, width,
                 DIM, ROWS, CHUNK, "")  # fmt: skip


@triton.jit
def merge_chunks(
    visible_ptr, top_ptr, total_ptr, acc_ptr, out_ptr, out_slot, out_token, out_head,
    slot, kv, tile, kv_heads, tiles, chunks, group, width,
    DIM: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """A tile's chunks merged in order, each row's own sums, into its output (`CACHE` ".cg":
    read from L2, where the other programs' chunks are)."""
    row = tile * ROWS + tl.arange(0, ROWS)
    real = row < width * group
    token = row // group
    head = kv * group + row % group
    seen = tl.load(visible_ptr + slot * width + token, mask=real, other=0)
    d = tl.arange(0, DIM)
    r = tl.arange(0, ROWS)
    top = tl.full((ROWS,), float("-inf"), tl.float32)
    total = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, DIM), tl.float32)
    for chunk in range(0, tl.cdiv(tl.max(seen, axis=0), CHUNK)):  # in order, each row's own sums
        part = ((slot * kv_heads + kv) * tiles + tile) * chunks + chunk
        their_top = tl.load(top_ptr + part * ROWS + r, cache_modifier=CACHE)
        their_total = tl.load(total_ptr + part * ROWS + r, cache_modifier=CACHE)
        their_acc = tl.load(acc_ptr + (part * ROWS + r[:, None]) * DIM + d[None, :], cache_modifier=CACHE)
        new_top = tl.maximum(top, their_top)
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        ours, theirs = tl.exp(top - shift), tl.exp(their_top - shift)
        total = total * ours + their_total * theirs
        acc = acc * ours[:, None] + their_acc * theirs[:, None]
        top = new_top
    out = acc / tl.where(total > 0, total, 1.0)[:, None]  # a row that sees nothing (a free slot): zeros
    out_at = out_ptr + slot * out_slot + token[:, None] * out_token + head[:, None] * out_head + d[None, :]
    tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=real[:, None])
