"""README's "Where it pays" tables, generated from the committed bench reports in docs/benchmarks/.

A speed claim in the README is only as good as the measurement under it, so each table is
rendered from one `pipeline bench --report` JSON and names it; a hand-edited figure, or a report
renamed or changed, makes `--check` fail until `--write` renders the tables again.

    python scripts/readme_tables.py --write    # rewrite the tables between their markers
    python scripts/readme_tables.py --check    # exit 1 when a table differs from its JSON

A table sits between `<!-- table:NAME -->` and `<!-- /table:NAME -->` in README.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline.lab.bench import DENSE_ROW  # the target on its dense weights (`--dense-reference`)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = "docs/benchmarks"


@dataclass(frozen=True)
class Table:
    """One machine kind's table: the report it comes from and the methods it shows."""

    report: str  # file name under docs/benchmarks/
    methods: tuple[str, ...]  # bench's method labels, shown in this order within each batch size


TABLES = {
    "avx512bf16": Table(
        "2026-12-03-bench-avx512bf16-zen4-float32-gguf-blocks-cheap-asking-licenses.json",
        ("ours target-only", "ours auto"),
    ),
    "avx2": Table(
        "2026-12-02-llama-cpp-avx2-float32-gguf-blocks-non-temporal-rerun-licenses.json",
        ("ours target-only", "ours auto"),
    ),
    "h200": Table(
        "2026-11-26-bench-h200-bf16-smollm2-licenses-translate-batch8.json",
        ("ours target-only", "ours prompt_lookup", "ours auto"),
    ),
}


def _machine(meta: dict) -> str:
    """The machine in a few words: the GPU where there is one, else the CPU and its widest
    floating-point instructions, which decide whether a verify pass costs what a step costs."""
    machine = meta["machine"]
    if machine.get("gpu"):
        return machine["gpu"]
    flags = machine.get("cpu_flags") or {}
    kind = "AVX-512 BF16" if flags.get("avx512_bf16") else "AVX2 only" if flags.get("avx2") else "no AVX2"
    # an AVX-512 CPU told to run AVX2 code (PIPELINE_KERNEL_AVX512=0; llama.cpp built without it)
    if flags.get("avx512f") and (machine.get("kernels") or {}).get("kernel_isa") == "avx2":
        llama_avx2 = "AVX2" in (meta.get("llama_cpp") or "") and "AVX512" not in meta["llama_cpp"]
        kind += ", both in AVX2 code" if llama_avx2 else ", ours in AVX2 code"
    return f"{machine['cpu_model']}, {kind}, {machine['threads']} threads"


def _caption(name: str, meta: dict) -> str:
    commit = (meta["machine"].get("git_commit") or "")[:7] or "unknown"
    draft = "" if meta["models"].get("draft") else " (no draft model)"
    return (
        f"[`{name}`]({BENCHMARKS}/{name}), {meta['date'][:10]}, commit `{commit}`: {_machine(meta)}, "
        f"{meta['models']['dtype']}, pair `{meta['pair']}`{draft}, {', '.join(meta['tasks'])}, "
        f"{meta['docs']} `{meta['corpus']}` documents, {meta['max_new_tokens']} new tokens, "
        f"{meta['runs']} run{'s' if meta['runs'] > 1 else ''}:"
    )


def _cell(value: float | None, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def render_table(table: Table, root: Path = ROOT) -> str:
    """The Markdown of one table: a caption naming its report, then one line per method and
    batch size (speedups over target-only at the same batch size, as bench measures them)."""
    report = json.loads((root / BENCHMARKS / table.report).read_text(encoding="utf-8"))
    rows = [r for r in report["rows"] if r["method"] in table.methods]
    missing = set(table.methods) - {r["method"] for r in rows}
    if missing:
        raise SystemExit(f"{table.report} has no rows for {sorted(missing)}")
    tasks = report["meta"]["tasks"]
    rows.sort(key=lambda r: (tasks.index(r["task"]), r["batch"], table.methods.index(r["method"])))
    several = len(tasks) > 1  # a task column where the report ran more than one
    lines = [
        _caption(table.report, report["meta"]),
        "",
        ("| task " if several else "") + "| batch | method | tok/s | speedup | α | τ | = target-only |",
        ("| --- " if several else "") + "| ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        # the dense row is the target on other weights: its text is not meant to be the same
        same = "other weights" if r["method"] == DENSE_ROW else "yes" if r["identical"] else "no"
        lines.append(
            (f"| {r['task']} " if several else "")
            + f"| {r['batch']} | {r['method'].removeprefix('ours ')} | {r['tokens_per_second']:.2f} "
            f"| {r['speedup']:.2f}× | {_cell(r['alpha'], '.2f')} | {_cell(r['tau'], '.2f')} | {same} |"
        )
    return "\n".join(lines)


# The sentence on llama.cpp: one `pipeline bench --llama-cpp` report per kind of machine, its
# rows at batch 1.
LLAMA_CPP_REPORTS = (
    "2026-12-02-llama-cpp-avx2-float32-gguf-blocks-non-temporal-rerun-licenses.json",
    "2026-12-03-llama-cpp-avx512bf16-zen4-float32-gguf-blocks-cheap-asking-licenses.json",
)
TASK_NOUNS = {"summarize": "summaries", "translate": "translations"}


def _ratios(rows: dict, tasks: list[str], method: str, nouns: bool) -> str:
    """`method`'s tok/s over llama.cpp's target-only per task, "0.89× (summaries) and ..."."""
    return " and ".join(
        f"{rows[(t, method)]['vs_llama_cpp']:.2f}×" + (f" ({TASK_NOUNS.get(t, t)})" if nouns else "")
        for t in tasks
    )


def render_llama_cpp(report_names: tuple[str, ...] = LLAMA_CPP_REPORTS, root: Path = ROOT) -> str:
    """One sentence: per report, ours (default `auto`, and target-only) over llama.cpp's
    target-only tok/s per task, and the prefill share of ours, from `vs_llama_cpp` and shares."""
    clauses = []
    for number, report_name in enumerate(report_names):
        report = json.loads((root / BENCHMARKS / report_name).read_text(encoding="utf-8"))
        rows = {(r["task"], r["method"]): r for r in report["rows"] if r["batch"] == 1}
        ours = ("ours auto", "ours target-only")
        tasks = [t for t in report["meta"]["tasks"] if all((t, m) in rows for m in ours)]
        if not tasks or any(rows[(t, m)].get("vs_llama_cpp") is None for t in tasks for m in ours):
            raise SystemExit(f"{report_name} has no llama.cpp comparison for ours auto and target-only")

        shares = sorted(round(100 * rows[(t, "ours target-only")]["prefill_share"]) for t in tasks)
        link = f"{BENCHMARKS}/{report_name.removesuffix('.json')}.md"
        clauses.append(
            f"on {_machine(report['meta'])}, ours is {_standing(rows, tasks)}: `auto` made "
            f"{_ratios(rows, tasks, 'ours auto', number == 0)}, "
            f"target-only {_ratios(rows, tasks, 'ours target-only', False)}, "
            f"{shares[0]}–{shares[-1]}% of it prefill ([report]({link}))"
        )
    return "Against llama.cpp's target-only on the same GGUF, " + "; ".join(clauses)


def _standing(rows: dict, tasks: list[str]) -> str:
    """Where default `auto` stands against llama.cpp per task: ahead from 1.1x (a run of this
    bench moves by about a twentieth), behind under 0.9x, level between."""

    def word(ratio: float) -> str:
        return "ahead" if ratio >= 1.1 else "behind" if ratio < 0.9 else "level"

    words = {t: word(rows[(t, "ours auto")]["vs_llama_cpp"]) for t in tasks}
    if len(set(words.values())) == 1:
        where = "both tasks" if len(tasks) == 2 else TASK_NOUNS.get(tasks[0], tasks[0])
        return f"{next(iter(words.values()))} on {where}"
    return " and ".join(f"{w} on {TASK_NOUNS.get(t, t)}" for t, w in words.items())


def _block(name: str, kind: str = "table") -> re.Pattern[str]:
    name = re.escape(name)
    newline = "\n" if kind == "table" else ""
    return re.compile(rf"(<!-- {kind}:{name} -->{newline})(.*?)(<!-- /{kind}:{name} -->)", re.S)


def _blocks(root: Path) -> list[tuple[str, str, str]]:
    """(kind, name, rendered text) of every generated block: the tables, then the sentences."""
    blocks = [("table", name, render_table(table, root) + "\n") for name, table in TABLES.items()]
    return [*blocks, ("figure", "llama-cpp", render_llama_cpp(root=root))]


def render_readme(text: str, root: Path = ROOT) -> str:
    """`text` with every table and figure between its markers rendered again; a missing marker
    pair is an error, since a figure the README lost would otherwise pass the check."""
    for kind, name, rendered in _blocks(root):
        pattern = _block(name, kind)
        if not pattern.search(text):
            raise SystemExit(f"README.md has no <!-- {kind}:{name} --> ... <!-- /{kind}:{name} --> block")
        text = pattern.sub(lambda m, rendered=rendered: m.group(1) + rendered + m.group(3), text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", action="store_true", help="rewrite the tables in README.md")
    action.add_argument("--check", action="store_true", help="exit 1 when a table is stale")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    text = args.readme.read_text(encoding="utf-8")
    rendered = render_readme(text)
    if args.write:
        if rendered != text:
            args.readme.write_text(rendered, encoding="utf-8")
        return 0
    if rendered != text:
        stale = [
            name
            for kind, name, _ in _blocks(ROOT)
            if _block(name, kind).search(text).group(2) != _block(name, kind).search(rendered).group(2)
        ]
        hint = "run python scripts/readme_tables.py --write"
        print(f"{args.readme}: stale tables {stale}; {hint}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
