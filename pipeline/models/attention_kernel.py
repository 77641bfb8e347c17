"""The Triton kernel behind `fixed_attention` (imported only where Triton is installed).

One program computes one query of one slot and head: it reads the keys and values at positions
0 .. visible-1 of its slot in blocks of BLOCK, in order, with an online softmax in float32. Its
arithmetic is a function of the query, those keys and BLOCK alone (the grid only says which
query a program takes), so a query gets the same bits in a pass of 1 token or 16, of 1 slot or
64, whatever the slots' length. With TRITON_INTERPRET=1 set before Triton is imported, it runs
on CPU tensors in Triton's interpreter (the tests do).
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
    heads_per_kv,
    width,
    scale,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    slot = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.program_id(2)
    kv = head // heads_per_kv
    d = tl.arange(0, DIM)
    q = tl.load(q_ptr + slot * q_slot + head * q_head + token * q_token + d).to(tl.float32) * scale
    seen = tl.load(visible_ptr + slot * width + token)
    keys = k_ptr + slot * k_slot + kv * k_head
    values = v_ptr + slot * v_slot + kv * v_head
    top = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((DIM,), tl.float32)
    for start in range(0, seen, BLOCK):
        at = start + tl.arange(0, BLOCK)
        ok = at < seen
        k = tl.load(keys + at[:, None] * k_position + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        scores = tl.where(ok, tl.sum(k * q[None, :], axis=1), float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, axis=0))
        fade = tl.exp(top - new_top)
        weights = tl.exp(scores - new_top)
        v = tl.load(values + at[:, None] * v_position + d[None, :], mask=ok[:, None], other=0.0).to(
            tl.float32
        )
        total = total * fade + tl.sum(weights, axis=0)
        acc = acc * fade + tl.sum(weights[:, None] * v, axis=0)
        top = new_top
    out = acc / tl.where(total > 0, total, 1.0)  # a query that sees nothing (a free slot): zeros
    tl.store(
        out_ptr + slot * out_slot + token * out_token + head * out_head + d, out.to(out_ptr.dtype.element_ty)
    )
