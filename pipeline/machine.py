"""What machine and code a measurement ran on, in one form for every recorded result.

Timings on these machines differ by 2x with the CPU's instruction set (AVX512-BF16 or AVX2
only), the dtype, the thread count and the engine's commit, and a number without them cannot
be compared with anything. `pipeline calibrate`, `pipeline bench` and `pipeline distill` all
record `describe_machine()`, so their results name the same fields, and their reports show
it as one table (`machine_table`).
"""

from __future__ import annotations

import os
import platform
import subprocess
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

# The CPU features that decide which kernels a bf16 or float32 pass runs (see docs/engine.md).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma")


# AMD's cores by (family, models): virtual machines often show only "AMD EPYC", and two hosts so
# named may be generations apart with the same flags, one paying twice the other for a wide pass
# (docs/cpu-kernels.md); the family and model tell them apart.
_AMD_CORES = (
    (23, range(0x00, 0x30), "Zen"),
    (23, range(0x30, 0x100), "Zen 2"),
    (25, range(0x10, 0x20), "Zen 4"),
    (25, range(0x60, 0x80), "Zen 4"),
    (25, range(0xA0, 0xB0), "Zen 4"),
    (25, range(0x00, 0x100), "Zen 3"),
    (26, range(0x00, 0x100), "Zen 5"),
)


@lru_cache(maxsize=1)
def cpu_info() -> tuple[str, frozenset[str]]:
    """The CPU's model name, with its family and model numbers (and the AMD core they make),
    and its feature flags, from /proc/cpuinfo (Linux); elsewhere the platform's processor
    string and no flags."""
    try:
        with open("/proc/cpuinfo") as fh:
            model, flags = parse_cpuinfo(fh.read())
    except OSError:
        model, flags = "", frozenset()
    return model or platform.processor() or platform.machine(), flags


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """The first processor's "model name", followed by "(family F model M)" where /proc/cpuinfo
    gives them (with the core's name for AMD's: "AMD EPYC (Zen 2, family 23 model 49)"), and
    its flags."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if not key and fields:  # the first processor's block ends
            break
        fields.setdefault(key, value.strip())
    name = fields.get("model name", "")
    family, number = fields.get("cpu family", ""), fields.get("model", "")
    if name and family.isdigit() and number.isdigit():
        core = ""
        if fields.get("vendor_id") == "AuthenticAMD" or name.startswith("AMD"):
            core = next((c for f, models, c in _AMD_CORES if f == int(family) and int(number) in models), "")
        name = f"{name} ({core + ', ' if core else ''}family {family} model {number})"
    return name, frozenset(fields.get("flags", "").split())


def git_state(directory: Path | None = None) -> tuple[str | None, bool | None]:
    """(commit, whether the work tree has uncommitted changes) of the checkout holding the
    `pipeline` package. A copied tree (a container build, a remote GPU machine) names the commit
    it was copied from in `PIPELINE_SOURCE_COMMIT`: (that, None), whatever .git came along (a
    GPU machine's copy once carried a stale one). Else (None, None) for an installed package or
    without git."""
    if os.environ.get("PIPELINE_SOURCE_COMMIT"):
        return os.environ["PIPELINE_SOURCE_COMMIT"], None
    directory = directory or Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=directory, capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip()

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return commit, (bool(status) if status is not None else None)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def describe_machine(loaded: Any = None) -> dict[str, Any]:
    """The machine, the software versions and the commit; with a `LoadedPair`, also the dtype,
    device and kernels its models run with (what a timing depends on besides the machine)."""
    model, flags = cpu_info()
    commit, dirty = git_state()
    described: dict[str, Any] = {
        "cpu_model": model,
        "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS},
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "package": _version("spec-pipeline"),
        "git_commit": commit,
        "git_dirty": dirty,
    }
    if loaded is not None:
        described.update(
            dtype=str(loaded.dtype).removeprefix("torch."),
            device=loaded.device,
            kernels={
                "batch_invariant": loaded.batch_invariant,
                "draft_int8": loaded.draft_int8,
                "streamed": bool(getattr(loaded, "streamed", False)),
                "gguf_blocks": getattr(loaded, "weights", "dense") == "gguf-blocks",
                "block_activations": getattr(loaded, "block_activations", None),
                "block_prefill": _block_prefill(loaded),
                "kernel_isa": _kernel_isa(loaded),
                "static_passes": bool(getattr(loaded, "static_passes", False)),
                "compiled_passes": bool(getattr(loaded, "compiled_passes", False)),
                "fused_projections": bool(getattr(loaded, "fused_projections", ())),
            },
        )
    return described


def _block_prefill(loaded) -> str | None:
    """What a block target's prefill multiplies (`streamed.prefill_numbers`): "bf16", "int8" or
    "float32"."""
    if getattr(loaded, "weights", "dense") != "gguf-blocks":
        return None
    from pipeline.models import streamed

    return streamed.prefill_numbers(getattr(loaded, "block_activations", None) == "int8")


def _kernel_isa(loaded) -> str | None:
    """The vector instructions the CPU kernel runs (`streamed.instruction_set`), where it runs."""
    if not getattr(loaded, "streamed", False) and getattr(loaded, "weights", "dense") != "gguf-blocks":
        return None
    from pipeline.models import streamed

    return streamed.instruction_set()


def _yes(value: bool | None) -> str:
    return "?" if value is None else ("yes" if value else "no")


def _said(value: bool | str | None) -> str:
    return value if isinstance(value, str) else _yes(value)


def machine_table(machine: dict) -> list[str]:
    """The machine as `describe_machine` records it, as a two-column Markdown table."""
    flags = ", ".join(f"{flag} {_yes(has)}" for flag, has in machine["cpu_flags"].items())
    kernels = machine.get("kernels", {})
    commit = machine["git_commit"] or "unknown (not a git checkout)"
    if machine["git_commit"]:
        dirty = machine["git_dirty"]
        commit += {True: " (uncommitted changes)", False: " (clean)", None: " (a copied tree)"}[dirty]
    rows = [
        ("CPU", machine["cpu_model"]),
        ("CPU flags", flags),
        ("cores, threads", f"{machine['cores']}, {machine['threads']}"),
        ("GPU", machine["gpu"] or "none"),
        ("dtype, device", f"{machine.get('dtype', '?')}, {machine.get('device', '?')}"),
        ("kernels", ", ".join(f"{name} {_said(on)}" for name, on in kernels.items()) or "?"),
        ("torch, transformers", f"{machine['torch']}, {machine['transformers']}"),
        ("spec-pipeline", f"{machine['package']}, commit {commit}"),
        ("platform", f"{machine['platform']}, Python {machine['python']}"),
    ]
    return ["| | |", "| --- | --- |"] + [f"| {name} | {value} |" for name, value in rows]
