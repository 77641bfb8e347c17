"""Every `pipeline` command the docs show runs as written, as far as this machine can tell (and
every calibrate and bench step of scripts/gpu-check.sh).

A reader copies commands from README.md, docs/*.md and the job specs' usage lines. Each one is
parsed by the command it names, exactly as the shell would hand it over (an unknown option or
a bad value fails here as it would there), without running it; a job spec it names is
validated as `pipeline validate` would, with the same --set, --date and --run-id. A command
that cannot be checked here says so on its line or its fence: `# needs a cluster`,
`# needs a GPU`, `# needs the models installed`; it is then only checked to name a command.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
MARKER = re.compile(r"#\s*needs (a cluster|a GPU|the models installed)\b")
OPERATORS = {"&&", "||", ";", "|"}


@dataclass(frozen=True)
class DocCommand:
    """One `pipeline` command as a document shows it."""

    where: str  # file:line
    args: tuple[str, ...]  # after `pipeline`
    marked: bool  # carries a "needs ..." marker

    def __str__(self) -> str:
        return f"{self.where}: pipeline {shlex.join(self.args)}"


def _shell_lines(text: str) -> list[tuple[int, str, bool]]:
    """(line number, logical line, fence marked) of every shell fence, continuations joined."""
    lines, fence, start, pending = [], None, 0, ""
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            info = stripped[3:].strip()
            fence = (
                None if fence is not None else (info.split()[0] if info else "", bool(MARKER.search(info)))
            )
            continue
        if fence is None or fence[0] not in SHELL_FENCES:
            continue
        stripped = stripped.removeprefix("$ ")
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append((start, pending + stripped, fence[1]))
        pending = ""
    return lines


def _commands(where: str, number: int, line: str, marked: bool) -> list[DocCommand]:
    """The `pipeline` commands of one shell line, also those after `&&` and the like."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # not shell: a table or prose in an untagged fence
        return []
    marked = marked or bool(MARKER.search(line))
    commands, current = [], []
    for word in [*words, ";"]:
        if word in OPERATORS:
            if current[:1] == ["pipeline"]:
                commands.append(DocCommand(f"{where}:{number}", tuple(current[1:]), marked))
            current = []
        else:
            current.append(word)
    return commands


def _spec_usage_lines(path: Path) -> list[tuple[int, str, bool]]:
    """A job spec's usage lines: `#   pipeline ...` in its header comment."""
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        match = re.match(r"#\s+(pipeline\s.*)", line)
        if match:
            found.append((number, match.group(1), False))
    return found


def doc_commands() -> list[DocCommand]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line, marked in _shell_lines(path.read_text(encoding="utf-8")):
            found += _commands(path.relative_to(ROOT).as_posix(), number, line, marked)
    for path in sorted((ROOT / "jobs").glob("*.yaml")):
        for number, line, marked in _spec_usage_lines(path):
            found += _commands(path.relative_to(ROOT).as_posix(), number, line, marked)
    return found


COMMANDS = doc_commands()

GPU_CHECK = ROOT / "scripts" / "gpu-check.sh"
# a step of scripts/gpu-check.sh that runs `pipeline calibrate|bench --pair PAIR --report ... ARGS`
GPU_STEP = re.compile(r'(?:\bstep \S+|"\$0" "\$res") (calibrate|bench) (\S+)(.*)')


def gpu_check_commands() -> list[DocCommand]:
    """The `calibrate` and `bench` commands scripts/gpu-check.sh runs, its variables given the
    values the script gives them (each `flags=` value where a line reads `$flags`).

    Why: a GPU comes to a session rarely and for 15 minutes; an option renamed since the script
    was written would cost a step of that call, found only there."""
    text = GPU_CHECK.read_text(encoding="utf-8")
    flags = re.findall(r'flags="([^"]*)"', text)
    found, pending, start = [], "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if not pending and line.lstrip().startswith("#"):  # a comment, or a step commented out
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        match = GPU_STEP.search(pending + line)
        pending = ""
        if not match:
            continue
        tool, pair, rest = match.groups()
        pair = pair.replace("$pair", "qwen2.5-coder-shaped-random")
        rest = rest.replace('"$docs"', "8")
        for args in [rest.replace("$flags", f) for f in flags] if "$flags" in rest else [rest]:
            words = (tool, "--pair", pair, "--report", "r.md", *shlex.split(args))
            found.append(DocCommand(f"scripts/gpu-check.sh:{start}", words, False))
    return found


GPU_COMMANDS = gpu_check_commands()


def resolve(args: tuple[str, ...]) -> tuple[click.Command, list[str], list[str]]:
    """The command `pipeline ARGS` names, the names leading to it, and the args it parses."""
    command, names, rest = main, [], list(args)
    while isinstance(command, click.Group):
        assert rest, f"`pipeline {' '.join(names)}` names a group, not a command"
        sub = command.get_command(click.Context(command), rest[0])
        assert sub is not None, f"`pipeline {' '.join(names)}` has no command {rest[0]!r}"
        command, names, rest = sub, [*names, rest.pop(0)], rest
    return command, names, rest


def test_the_docs_show_commands():
    """The extraction finds what the docs show, chains and continuation lines included."""
    shown = {c.args[:1] for c in COMMANDS}
    assert {("run",), ("submit",), ("distill",), ("models",), ("demo-data",)} <= shown
    assert any(c.where.startswith("README.md") and c.args == ("run", "jobs/demo.yaml") for c in COMMANDS)
    assert any(c.args[0] == "distill" and "--report" in c.args for c in COMMANDS)


def test_extraction_reads_chains_comments_continuations_and_markers():
    text = (
        "```bash\nls && pipeline run a.yaml --set x=1 \\\n  --wait  # why\n"
        "pipeline status J  # needs a cluster\n```\n"
        "```sh # needs a GPU\npipeline bench --batches 8\n```\n"
    )
    found = [c for n, line, m in _shell_lines(text) for c in _commands("f", n, line, m)]
    assert [(c.args, c.marked) for c in found] == [
        (("run", "a.yaml", "--set", "x=1", "--wait"), False),
        (("status", "J"), True),
        (("bench", "--batches", "8"), True),
    ]
    assert _shell_lines("```yaml\npipeline: x\n```\n") == []


def test_the_gpu_check_shows_its_steps():
    """The extraction finds every calibrate and bench step of the GPU check."""
    tools = [c.args[0] for c in GPU_COMMANDS]
    assert tools.count("bench") >= 5 and tools.count("calibrate") >= 6, GPU_COMMANDS
    assert any("--fused-projections" in c.args for c in GPU_COMMANDS)
    assert any("--eager-passes" in c.args and c.args[0] == "calibrate" for c in GPU_COMMANDS)


@pytest.mark.parametrize("doc", COMMANDS + GPU_COMMANDS, ids=str)
def test_doc_command_parses(doc: DocCommand):
    command, names, rest = resolve(doc.args)
    if doc.marked:
        return
    try:
        command.make_context(" ".join(["pipeline", *names]), list(rest))
    except click.ClickException as exc:
        pytest.fail(f"{doc}\n  {exc.format_message()}")


@pytest.mark.parametrize(
    "doc", [c for c in COMMANDS if not c.marked and c.args[0] in ("run", "submit", "validate")], ids=str
)
def test_doc_command_spec_validates(doc: DocCommand):
    command, names, rest = resolve(doc.args)
    params = command.make_context(" ".join(["pipeline", *names]), list(rest)).params
    args = [params["spec_path"], "--no-models"]
    args += [
        a
        for key in ("run_id", "date")
        if params.get(key)
        for a in (f"--{key.replace('_', '-')}", params[key])
    ]
    args += [a for value in params.get("sets", ()) for a in ("--set", value)]
    result = CliRunner().invoke(main, ["validate", *args])
    assert result.exit_code == 0, f"{doc}\n{result.output}"
    if names[0] in ("run", "submit") and load_spec(ROOT / params["spec_path"]).execution.num_gpus > 0:
        # without --address the job runs on the reader's machine, GPU-sized model and all
        assert params.get("address"), f"{doc}: a spec that asks for GPUs needs --address"
