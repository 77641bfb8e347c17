"""Arrival counters for the fixed-order kernels whose last program to finish adds up the others'
sums in order (a split product's parts, `linear_kernel`; attention's chunks, `attention_kernel`)
rather than leaving that to a second kernel, one launch more.

One int32 buffer a device, shared by both kernels: each launch counts on its own tiles'
counters and its last programs set them back to zero, and launches on the passes' stream run one
after another. It is made as a model loads (the kernels' loader checks call it first), never
inside a CUDA graph's capture, where the buffer would be the graph's own memory.
"""

from __future__ import annotations

import torch

# Counters a device: a product of up to 4,096 rows (256 row tiles × at most 170 output tiles,
# past which a product is not split), attention over 64 slots × 16 tokens × 6 query heads a
# key/value head × 2 key/value heads (768 tiles).
SIZE = 1 << 16
_buffers: dict[str, torch.Tensor] = {}


def counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """The device's arrival counters, zero, if they hold `needed` tiles (None: a second kernel
    must add, as it must during a capture before any was made)."""
    buffer = _buffers.get(str(device))
    if buffer is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buffer = _buffers[str(device)] = torch.zeros(SIZE, dtype=torch.int32, device=device)
    return buffer if needed <= buffer.numel() else None
