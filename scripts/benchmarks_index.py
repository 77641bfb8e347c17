"""Write or check docs/benchmarks/README.md, the index of every benchmark record beside it.

    python scripts/benchmarks_index.py --write docs/benchmarks/README.md
    python scripts/benchmarks_index.py --check docs/benchmarks/README.md   # exit 1 with a diff if stale

Why generated: the records are written by `pipeline bench`, `calibrate`, `distill`,
`scripts/tiny_job.py` and by hand, dozens of them; an index kept by hand falls behind the first
time someone forgets it. Each entry's machine, commit and headline come from the record itself
(the JSON's `machine` and commit fields, a Markdown report's title or its `Machine:`/`Commit:`
lines); a file without such fields gets what its name says and "—". The output depends only on
the files, never on when it was generated, so a test can compare it with the committed copy.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

INDEX = "README.md"
TOOLS = (
    "bench",
    "calibrate",
    "distill",
    "suffix-bench",
    "tiny-job",
    "job",  # scripts/job_record.py: a real job's shard-by-shard figures
    "scale-run",
    "llama-cpp",
    "gpu-check",
    "profile",  # scripts/gpu_profile.py: where a round's time goes
    "policy-bench",  # scripts/policy_bench.py: the policy's own time a round, synthetic rounds
    "history",
    "notes",
)
# YYYY-MM-DD-<tool>-<machine>-<rest>.{md,json,log}: the date first, so a listing is chronological.
NAME = re.compile(
    r"^(?P<date>\d{4}-\d{2}-\d{2})-(?P<tool>" + "|".join(map(re.escape, TOOLS)) + r")"
    r"-(?P<machine>[a-z0-9]+)(?:-(?P<rest>[A-Za-z0-9][A-Za-z0-9.+-]*))?\.(?P<ext>md|json|log)$"
)
HEADLINE_CHARS = 100
NONE = "—"


@dataclass
class Entry:
    """One record: the files that share a stem (a .md report and its .json measurements)."""

    stem: str
    date: str
    tool: str
    machine: str
    files: list[Path] = field(default_factory=list)
    commit: str = NONE
    headline: str = NONE


def parse_name(name: str) -> dict[str, str] | None:
    """The parts of a record's file name, or None where it does not follow the pattern."""
    match = NAME.match(name)
    return match.groupdict() if match else None


def short_commit(commit: object, dirty: object = False) -> str:
    """A commit as the index shows it: 7 hex digits (a note such as "(before X)" kept), "dirty"
    where the tree had changes."""
    if not commit:
        return NONE
    text = str(commit).strip()
    head, _, note = text.partition(" ")
    if re.fullmatch(r"[0-9a-f]{7,40}", head):
        text = " ".join(filter(None, (head[:7], note)))
    return f"{text} (dirty)" if dirty else text


def describe_machine(machine: dict) -> str:
    """A short machine line from a record's `machine` dict: the GPU, or the CPU and the feature
    that decides its kernels (AVX-512 bf16 or AVX2), and the dtype where the record has one."""
    flags = machine.get("cpu_flags") or machine
    if machine.get("gpu"):
        parts = [str(machine["gpu"])]
    else:
        feature = "AVX-512 bf16" if flags.get("avx512_bf16") else "AVX2" if flags.get("avx2") else None
        parts = [str(machine.get("cpu_model") or "CPU"), *([feature] if feature else [])]
    dtype = {"bfloat16": "bf16"}.get(machine.get("dtype"), machine.get("dtype"))
    return ", ".join(parts + ([dtype] if dtype else []))


def json_machine_commit(data: dict) -> tuple[str | None, str | None]:
    """Machine and commit from a JSON record: bench keeps them under `meta.machine`, calibrate and
    distill under `machine` (`git_commit`, `git_dirty`), tiny_job.py beside it (`commit`, `dirty`)."""
    machine = (data.get("meta") or {}).get("machine") or data.get("machine")
    if not isinstance(machine, dict):
        return None, None
    if "git_commit" in machine:
        return describe_machine(machine), short_commit(machine["git_commit"], machine.get("git_dirty"))
    return describe_machine(machine), short_commit(data.get("commit"), data.get("dirty"))


def bench_headline(data: dict) -> str:
    """`pipeline bench`: the pair, tasks and batches, and the best speedup of ours over target-only."""
    meta = data["meta"]
    tasks, batches = meta.get("tasks", []), [str(b) for b in meta.get("batches", [])]
    scope = f"{meta.get('pair')}, {'+'.join(tasks)}, batch {','.join(batches)}"
    ours = [
        r
        for r in data["rows"]
        if r["method"].startswith("ours ") and "target-only" not in r["method"] and r.get("speedup")
    ]
    if not ours:
        plain = [r for r in data["rows"] if r["method"] == "ours target-only"]
        return f"{scope}: target-only {plain[0]['tokens_per_second']:.0f} tok/s" if plain else scope
    best = max(ours, key=lambda r: r["speedup"])
    where = f" ({best['task']}, batch {best['batch']})" if len(tasks) > 1 or len(batches) > 1 else ""
    return f"{scope}: best {best['method'].removeprefix('ours ')} {best['speedup']:.2f}×{where}"


def calibrate_headline(data: dict) -> str:
    """`pipeline calibrate`: the target's 1-token pass at the first batch size measured, and the
    speedup those costs predict at α 0.8."""
    batch, widths = next(iter(data["target_pass_seconds_by_batch"].items()))
    text = f"{data['pair'].get('name')}: target pass {widths['1'] * 1000:.3g} ms at batch {batch}, width 1"
    predicted = (data.get("predicted_speedup") or {}).get("0.8")
    return text + (f"; predicted {predicted['speedup']:.2f}× at α 0.8" if predicted else "")


def distill_headline(data: dict) -> str:
    """`pipeline distill`: the draft model's α and speedup before and after, on held-out documents;
    its top-1 agreement where the engine never let it draft (no α to read)."""
    rows = {r["draft"]: r for r in data["evaluation"]["rows"] if r["drafter"] == "draft_model"}
    before, after = rows["before"], rows["after"]
    if before["alpha"] is None or after["alpha"] is None:
        top1 = data["top1_agreement"]
        alpha = f"top-1 {top1['before']:.2f} → {top1['after']:.2f} (never drafted)"
    else:
        alpha = f"α {before['alpha']:.2f} → {after['alpha']:.2f}"
    speedup = f"{before['speedup']:.2f}× → {after['speedup']:.2f}×"
    return f"{data['source_pair']} → {data['pair']}: draft_model {alpha}, {speedup}"


def tiny_job_headline(data: dict) -> str:
    """`scripts/tiny_job.py`: the job's pooled speedup, its interval and verdict."""
    totals, drafter = data["manifest"]["totals"], data["manifest"]["spec"]["drafter"]["kind"]
    low, high = totals["speedup_ci95"]
    return (
        f"{totals['shards']} shards, {drafter}: {totals['speedup']:.2f}× [{low:.2f}, {high:.2f}], "
        f"{totals['speedup_verdict']}"
    )


def json_headline(data: dict) -> str | None:
    """The headline of a JSON record, by the kind of record it is (None: a kind not known here)."""
    if "rows" in data and "meta" in data:
        return bench_headline(data)
    if "target_pass_seconds_by_batch" in data:
        return calibrate_headline(data)
    if "evaluation" in data and "source_pair" in data:
        return distill_headline(data)
    if "manifest" in data:
        return tiny_job_headline(data)
    return None


def markdown_fields(text: str) -> dict[str, str]:
    """A Markdown record's title (its first `# ` line) and its `Machine:`/`Commit:` header lines."""
    fields: dict[str, str] = {}
    for line in text.splitlines()[:20]:
        if line.startswith("# ") and "title" not in fields:
            fields["title"] = line[2:].strip()
        for key in ("Machine", "Commit"):
            if line.startswith(f"{key}: "):
                fields.setdefault(key.lower(), line[len(key) + 2 :].strip())
    return fields


def clip(text: str) -> str:
    """One table cell: no pipes, at most HEADLINE_CHARS characters."""
    text = text.replace("|", "/")
    return text if len(text) <= HEADLINE_CHARS else text[: HEADLINE_CHARS - 1] + "…"


def describe(entry: Entry) -> None:
    """Fill in an entry's machine, commit and headline from its files: the JSON's fields first,
    then the Markdown's title and header lines; a log keeps what its name says."""
    by_ext = {p.suffix: p for p in entry.files}
    md = markdown_fields(by_ext[".md"].read_text()) if ".md" in by_ext else {}
    headline = machine = commit = None
    if ".json" in by_ext:
        data = json.loads(by_ext[".json"].read_text())
        machine, commit = json_machine_commit(data)
        headline = json_headline(data)
    if ".log" in by_ext and not md:
        headline = (
            f"console output of scripts/{entry.tool}.sh" if entry.tool == "gpu-check" else "console output"
        )
        if entry.tool == "profile":  # its first line names the commit, its second the run
            first, second = by_ext[".log"].read_text().splitlines()[:2]
            headline = "gpu_profile.py: " + second
            commit = (re.findall(r"commit (\w+)", first) or [None])[0]
    entry.machine = machine or md.get("machine") or entry.machine
    entry.commit = commit or md.get("commit") or NONE
    entry.headline = clip(headline or md.get("title") or NONE)


def collect(directory: Path) -> tuple[list[Entry], list[str]]:
    """Every record in `directory` (not the index itself), paired by stem and described, sorted
    by date and name; and the names that do not follow the pattern."""
    entries: dict[str, Entry] = {}
    strays = []
    for path in sorted(directory.iterdir()):
        if path.name == INDEX or not path.is_file():
            continue
        parts = parse_name(path.name)
        if parts is None:
            strays.append(path.name)
            continue
        entry = entries.setdefault(
            path.stem, Entry(path.stem, parts["date"], parts["tool"], parts["machine"])
        )
        entry.files.append(path)
    for entry in entries.values():
        describe(entry)
    return sorted(entries.values(), key=lambda e: (e.date, e.stem)), strays


def render(entries: list[Entry], strays: list[str]) -> str:
    """The index as Markdown: one table per date, oldest first."""
    lines = [
        "# Benchmark records",
        "",
        "Generated by `python scripts/benchmarks_index.py --write docs/benchmarks/README.md` from the",
        "files beside it; do not edit it by hand (`tests/test_benchmarks_index.py` fails when it is stale).",
        "File names follow `YYYY-MM-DD-<tool>-<machine>-<rest>.{md,json,log}`, tool one of",
        ", ".join(f"`{t}`" for t in TOOLS) + "; a `.md` report and its `.json` measurements share a stem.",
        'Machine and commit come from each record\'s own fields ("—" where it has none).',
    ]
    for date in sorted({e.date for e in entries}):
        lines += [
            "",
            f"## {date}",
            "",
            "| record | tool | machine | commit | headline |",
            "| --- | --- | --- | --- | --- |",
        ]
        for e in (e for e in entries if e.date == date):
            links = " ".join(
                f"[{p.suffix[1:]}]({p.name})"
                for p in sorted(e.files, key=lambda p: (p.suffix != ".md", p.suffix))
            )
            name = e.stem.removeprefix(f"{e.date}-")
            lines.append(f"| {name} {links} | {e.tool} | {clip(e.machine)} | {e.commit} | {e.headline} |")
    if strays:
        lines += ["", "## Not following the pattern", "", *(f"- [{name}]({name})" for name in strays)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--write", type=Path, metavar="PATH", help="write the index of PATH's directory to PATH"
    )
    mode.add_argument("--check", type=Path, metavar="PATH", help="exit 1 with a diff when PATH is stale")
    args = parser.parse_args(argv)
    path = args.write or args.check
    text = render(*collect(path.parent))
    if args.write:
        path.write_text(text)
        return 0
    current = path.read_text() if path.exists() else ""
    if current == text:
        return 0
    sys.stdout.writelines(
        difflib.unified_diff(current.splitlines(True), text.splitlines(True), str(path), "generated")
    )
    print(f"\n{path} is stale: run python scripts/benchmarks_index.py --write {path}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
