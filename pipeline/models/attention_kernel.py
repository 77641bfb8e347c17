"""The Triton kernel behind `fixed_attention` (imported only where Triton is installed).

One program takes one slot, one key/value head and a tile of ROWS query rows: the (token, head)
pairs of that slot's pass whose heads share the key/value head, in order. It reads the slot's keys
and values from position 0 in blocks of BLOCK, in order, with an online softmax in float32; each
query row masks the keys past its own `visible` count. A row's arithmetic is then its own: the
tile's products compute each row from that row alone, with the same fixed shapes, and its sums run
over the same blocks whatever the other rows are, so a query gets the same bits in a pass of 1
token or 16, of 1 slot or 64, whatever the slots' length. Keys read once per tile rather than
once per query: a batch-64 verify pass would otherwise read each slot's keys ~100 times.

With TRITON_INTERPRET=1 set before Triton is imported, it runs on CPU tensors in Triton's
interpreter (the tests do).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    visible_ptr,
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
    group,
    width,
    scale,
    DIM: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    slot = tl.program_id(0)
    kv = tl.program_id(1)
    row = tl.program_id(2) * ROWS + tl.arange(0, ROWS)  # token * group + the head's place in it
    real = row < width * group
    token = row // group
    head = kv * group + row % group
    d = tl.arange(0, DIM)
    q_at = q_ptr + slot * q_slot + head[:, None] * q_head + token[:, None] * q_token + d[None, :]
    q = tl.load(q_at, mask=real[:, None], other=0.0)
    if UPCAST:  # the interpreter multiplies bf16 as float32 (numpy has no bf16)
        q = q.to(tl.float32)
    seen = tl.load(visible_ptr + slot * width + token, mask=real, other=0)
    keys = k_ptr + slot * k_slot + kv * k_head
    values = v_ptr + slot * v_slot + kv * v_head
    top = tl.full((ROWS,), float("-inf"), tl.float32)
    total = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, DIM), tl.float32)
    for start in range(0, tl.max(seen, axis=0), BLOCK):
        at = start + tl.arange(0, BLOCK)
        inside = (at < tl.max(seen, axis=0))[:, None]
        k = tl.load(keys + at[:, None] * k_position + d[None, :], mask=inside, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(at[None, :] < seen[:, None], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, axis=1))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # a row that sees nothing yet
        fade = tl.exp(top - shift)
        weights = tl.exp(scores - shift[:, None])
        v = tl.load(values + at[:, None] * v_position + d[None, :], mask=inside, other=0.0)
        p = weights.to(v_ptr.dtype.element_ty)  # the products' dtype: bf16 for a bf16 model
        if UPCAST:
            p, v = p.to(tl.float32), v.to(tl.float32)
        total = total * fade + tl.sum(weights, axis=1)
        acc = acc * fade[:, None] + tl.dot(p, v, input_precision=PRECISION)
        top = new_top
    out = acc / tl.where(total > 0, total, 1.0)[:, None]  # a row that sees nothing (a free slot): zeros
    out_at = out_ptr + slot * out_slot + token[:, None] * out_token + head[:, None] * out_head + d[None, :]
    tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=real[:, None])
