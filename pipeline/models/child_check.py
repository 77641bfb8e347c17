"""A kernel's check on a GPU, run first in a child process: a kernel that faults there costs the
job its speed, not its device.

Why: the loader checks each of its own kernels before a model uses it (`fixed_linear.works`,
`fixed_attention.works`), and falls back to the paths they replaced where a check fails. That
holds for a wrong result or a failed compile, which raise. A kernel that reads or writes out of
bounds on a GPU does not: CUDA's error is sticky, and every later call of the process fails, the
fallback paths' and the job's own included. The fixed-order kernels were built and tested in
Triton's interpreter and compiled for sm_90 without a GPU (docs/gpu.md); their first launches
on a GPU are the ones that could fault. So on CUDA each check runs first in a child process
(`verdict`), where a fault, a crash or a hang ends the child only; the parent then uses the
kernel only where the child found it right, and checks it again itself.

The child's answer is kept on disk, keyed by the device's name, the torch and Triton versions,
the kernels' sources and the check's arguments, so a machine's actors pay it once (a process,
CUDA's start and the kernels' compile, which Triton's own cache then keeps for the parent). A
child that ended without an answer (a fault, a crash, a hang, perhaps a passing shortage of
memory) is not kept: the next process asks again rather than lose the kernel for good.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from pipeline.models.pairs import cache_dir

log = logging.getLogger(__name__)

IN_CHILD = "PIPELINE_KERNEL_CHECK_CHILD"  # set in the child: its checks run in-process
TIMEOUT_S = 300.0  # a cold compile of a kernel family takes tens of seconds; a hang ends here
# the sources whose change makes a kept verdict stale: the kernels and their launchers
SOURCES = ("linear_kernel.py", "attention_kernel.py", "fixed_linear.py", "fixed_attention.py", "arrivals.py")


def isolates(device: str) -> bool:
    """Whether checks on `device` run in a child first: a GPU's, outside such a child."""
    return device.startswith("cuda") and not os.environ.get(IN_CHILD)


def first_in_child(
    device: str, target: str, args: tuple[str, ...], check: Callable[[], str | None]
) -> str | None:
    """Why a kernel cannot run on `device` (None: it can): on a GPU, `target` called with `args`
    in a child first (`verdict`), and only where the child found it right, `check()` here."""
    if isolates(device):
        reason = verdict(target, *args)
        if reason is not None:
            return reason
    return check()


def verdict(target: str, *args: str, timeout: float = TIMEOUT_S) -> str | None:
    """Why the check `target` ("module:function", called with `args`, returning a reason or
    None) fails in a child process, or why the child ended without an answer (None: the check
    passed there). Kept on disk per device, versions and kernel sources (`_key`)."""
    path = cache_dir() / "kernel-checks" / f"{_key(target, args)}.json"
    try:
        return json.loads(path.read_text())["reason"]
    except (OSError, ValueError, KeyError):  # none kept (or unreadable): ask a child
        pass
    answered, reason = _run(target, args, timeout)
    if answered:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"target": target, "args": list(args), "reason": reason}))
        except OSError as error:  # a read-only cache: asked again next time, no harm
            log.info("kernel check not kept at %s: %s", path, error)
    return reason


def _run(target: str, args: tuple[str, ...], timeout: float) -> tuple[bool, str | None]:
    """(whether the child answered, the reason): a child that answered gives the check's own
    reason; one that ended otherwise, how it ended."""
    env = {**os.environ, IN_CHILD: "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    command = [sys.executable, "-m", __name__, target, *args]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"its check did not end within {timeout:.0f} s in a child process"
    answer = done.stdout.strip().splitlines()[-1:] if done.returncode == 0 else []
    if not answer or not answer[0].startswith("{"):
        tail = " ".join(done.stderr.strip().splitlines()[-3:])[-300:]
        how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}"
        return False, f"its check ended a child process ({how}): {tail}"
    return True, json.loads(answer[0])["reason"]


def _key(target: str, args: tuple[str, ...]) -> str:
    """What a kept verdict depends on: the check, the device, the versions, the kernels' code."""
    import torch

    device = next((a for a in args if a.startswith("cuda")), None)
    name = torch.cuda.get_device_name(device) if device and torch.cuda.is_available() else "cpu"
    if device == "cuda" and torch.cuda.is_available():  # the loader names it "cuda:0", scripts "cuda"
        args = tuple(f"cuda:{torch.cuda.current_device()}" if a == device else a for a in args)
    try:
        triton = importlib.import_module("triton").__version__
    except ImportError:
        triton = None
    here = Path(__file__).parent
    digest = hashlib.sha256(json.dumps([target, args, name, torch.__version__, triton]).encode())
    for source in SOURCES:
        digest.update((here / source).read_bytes())
    return digest.hexdigest()[:20]


def _main(target: str, *args: str) -> None:
    """The child: call the check and print its reason as JSON, the last line of its output."""
    module, _, function = target.partition(":")
    reason = getattr(importlib.import_module(module), function)(*args)
    print(json.dumps({"reason": reason}), flush=True)


if __name__ == "__main__":
    _main(*sys.argv[1:])
