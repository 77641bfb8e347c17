"""C++ sources of the package compiled with the system's compiler on first use, cached per
machine under the pipeline's cache directory (keyed by the source and the flags, so an edit
or a flag rebuilds), and loaded with ctypes.

Why a compiler rather than a build step: the package installs as pure Python everywhere (CI,
Ray workers, the GPU machine) and each user of a library keeps a Python path for when it
cannot be built; one log line says why.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def _build(source: Path, flags: list[str], target: Path) -> None:
    """Compile `source` into `target` (atomically: other processes may be loading it)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler (g++ or c++) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        done = subprocess.run(
            [compiler, *flags, "-o", str(partial), str(source)], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            raise OSError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def compiled(source: Path, flags: list[str]) -> ctypes.CDLL:
    """`source` built with `flags` (once per machine, one build at a time) and loaded; OSError
    or SubprocessError where it cannot be."""
    from pipeline.models.pairs import cache_dir

    key = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_dir().parent / "kernels" / f"{source.stem}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.exists():
                _build(source, flags, target)
    return ctypes.CDLL(str(target))


def optional(source: Path, flags: list[str], switch: str, what: str) -> ctypes.CDLL | None:
    """`source` built and loaded as `compiled` does; None, with one warning saying why, where it
    cannot be or where the environment sets `switch` to 0: the caller then runs its Python,
    which computes the same."""
    log = logging.getLogger(__name__)
    if os.environ.get(switch) == "0":
        log.warning("%s off (%s=0); they run in Python", what, switch)
        return None
    try:
        return compiled(source, flags)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("%s off (%s); they run in Python", what, e)
        return None
