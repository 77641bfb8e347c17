"""The Markdown record of a lab measurement, for docs/benchmarks/.

Every report the lab writes (`pipeline bench`, `pipeline calibrate`, `pipeline distill`, each
with `--report`) opens the same way, so that any number in it can be compared with another
run's, or rerun, without asking how it was made: a title, when it ran and a link to the JSON
that holds every figure, the exact command, and the machine and commit it ran on.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from pipeline.machine import machine_table

# Environment variables that change which kernels a run takes (a record without them could not
# be rerun as it ran): ours (`streamed_linear.cpp`) and llama-cpp-python's choice of library.
SWITCHES = ("PIPELINE_KERNEL_AVX512", "PIPELINE_KERNEL_BF16DOT", "LLAMA_CPP_LIB_PATH")


def command_line() -> str:
    """The command this process runs, as a shell line: the switches of `SWITCHES` that are set,
    then `pipeline` and its arguments (argv[0] is whichever entry point ran the CLI)."""
    switches = [f"{name}={shlex.quote(os.environ[name])}" for name in SWITCHES if name in os.environ]
    return " ".join([*switches, shlex.join(["pipeline", *sys.argv[1:]])])


def write_record(
    path: str,
    title: str,
    *,
    date: str,
    command: str,
    machine: dict,
    json_path: str,
    body: list[str],
    linked: str = "Measurements",
    link_note: str = "",
) -> None:
    """Write the record at `path`: the shared header (title, date, a link to `json_path`
    relative to the record, the command, the machine) and then the tool's own `body` lines.
    `linked` names what the JSON holds; `link_note` follows the link in the same sentence."""
    link = os.path.relpath(json_path, os.path.dirname(os.path.abspath(path)))
    lines = [
        f"# {title}",
        "",
        f"Run {date}. {linked}: [{os.path.basename(json_path)}]({link}){link_note}.",
        "",
        "```bash",
        command,
        "```",
        "",
        "## Machine",
        "",
        *machine_table(machine),
        "",
        *body,
    ]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")
