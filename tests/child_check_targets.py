"""Checks for tests/test_child_check.py's child processes: one that passes, one that finds the
kernel wrong, one that ends its process as a faulting kernel's sticky error would, one that hangs."""

from __future__ import annotations

import os
import time


def passes(device: str) -> None:
    return None


def finds_it_wrong(device: str) -> str:
    return f"its result is 1.0e+00 from float64's on {device}"


def faults(device: str) -> None:
    os.write(2, b"CUDA error: an illegal memory access was encountered\n")
    os.abort()


def hangs(device: str) -> None:
    time.sleep(60)
