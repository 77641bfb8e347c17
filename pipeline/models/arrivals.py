"""Arrival counters for the fixed-order kernels whose last program to finish adds up the others'
sums in order (a split product's parts, `linear_kernel`; attention's chunks, `attention_kernel`)
rather than leaving that to a second kernel, one launch more.

One int32 buffer a device, shared by both kernels: each launch counts on its own tiles'
counters and its last programs set them back to zero, and launches on the passes' stream run one
after another. It is made as a model loads (the kernels' loader checks call it first), never
inside a CUDA graph's capture, where the buffer would be the graph's own memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

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


class LastAdds:
    """Whether a kernel's last program to finish adds the others' sums: yes, unless the loader's
    check found it wrong on a device (`failed`), where a second kernel adds instead: the same
    bits, one launch more."""

    def __init__(self) -> None:
        self.failed: set[str] = set()

    def counters(self, device: torch.device, needed: int) -> torch.Tensor | None:
        """The arrival counters where the last program adds on `device` (None: a second kernel)."""
        if str(device) in self.failed:
            return None
        return counters(device, needed)

    def checked(self, check: Callable[[], str | None], device: str, what: str) -> str | None:
        """`check()`'s reason the kernel cannot run on `device` (None: it can), asked again with
        a second kernel adding where it fails with the last program adding."""
        reason = check()
        buffer = self.counters(torch.device(device), 1)
        if reason is not None and buffer is not None:
            log.warning("%s on %s: %s; a second kernel adds the sums instead", what, device, reason)
            self.failed.add(device)
            # a launch that counted wrong may have left counts set, and the other kernel, checked
            # right, goes on counting on the same buffer
            buffer.zero_()
            reason = check()
        return reason
