"""Issue 37's acceptance lines, read off the reports a GPU check wrote (`gpu-check.sh all`,
`smol`, `job`): each line's figure, its bar and whether it holds, so that the session that
gets a GPU reads the verdicts from the reports rather than by hand.

    python3 scripts/gpu_acceptance.py DIR [--pair qwen2.5-coder-shaped-random]

DIR holds the reports (`OUT/reports`, unpacked from reports.tgz, or docs/benchmarks/ after they
are copied there; with several dates, the newest of each). A line whose report is missing says
so. The figures are the reports' own (medians of their runs); this only reads and compares.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PAIR = "qwen2.5-coder-shaped-random"


def newest(directory: Path, pattern: str) -> dict | None:
    """The newest report matching `pattern` (names begin with their date), as JSON."""
    found = sorted(directory.glob(pattern))
    return json.loads(found[-1].read_text()) if found else None


def rows(bench: dict | None, batch: int) -> dict[str, dict]:
    """A bench report's rows at `batch`, by method."""
    return {r["method"]: r for r in (bench or {}).get("rows", []) if r["batch"] == batch}


def line(name: str, figure: str | None, holds: bool | None, bar: str) -> str:
    verdict = "missing" if figure is None else ("holds" if holds else "FAILS")
    return f"{verdict:<8} {name}: {figure if figure is not None else 'no report'} (bar: {bar})"


def check(directory: Path, pair: str = PAIR) -> list[str]:
    """One line per acceptance line of issue 37 that a report can answer."""
    calibrate = newest(directory, f"*calibrate-*-{pair}-batch1.json")
    stock = newest(directory, f"*calibrate-*-{pair}-stock-kernels.json")
    bench1 = newest(directory, f"*bench-*-{pair}-batch1.json")
    bench64 = newest(directory, f"*bench-*-{pair}-batch64.json")
    smol1 = newest(directory, "*bench-*-smollm2-licenses-batch1.json")
    smol64 = newest(directory, "*bench-*-smollm2-licenses-batch64.json")
    job = newest(directory, "*tiny-job-*-ray.json")
    machine = next((r["machine"] for r in (calibrate, stock) if r), None)
    machine = machine or (bench1 or {}).get("meta", {}).get("machine") or {}
    gpu, commit = machine.get("gpu") or "no GPU", machine.get("git_commit") or "?"
    out = [f"issue 37 from {directory}: {gpu}, commit {commit}"]

    ours = rows(bench1, 1).get("ours target-only")
    rate = ours["tokens_per_second"] if ours else None
    out.append(
        line(f"{pair}, batch 1, target-only", rate and f"{rate:,.0f} tok/s", rate and rate >= 600, ">= 600")
    )

    passes = (calibrate or {}).get("target_pass_seconds_by_batch", {}).get("1")
    achieved, pace = (
        (calibrate or {}).get("bandwidth_gb_s", {}).get("target"),
        (calibrate or {}).get("read_bandwidth_gb_s"),
    )
    share = achieved / pace if achieved and pace else None
    out.append(
        line(
            "bandwidth of a width-1 target pass",
            achieved
            and f"{achieved:,.0f} GB/s"
            + (f", {share:.0%} of the {pace:,.0f} GB/s a large read reaches" if share else ""),
            share is not None and share >= 0.4,
            ">= 40% of the card's; here of the read, below its rated figure",
        )
    )
    if passes:
        widths = {w: passes[w] for w in ("1", "8", "16") if w in passes}
        spread = max(widths.values()) / min(widths.values())
        figure = ", ".join(f"w={w} {1000 * s:.2f} ms" for w, s in widths.items()) + f": {spread:.2f}x apart"
        out.append(line("target pass at widths 1, 8, 16, batch 1", figure, spread <= 1.15, "<= 1.15x"))
    else:
        out.append(line("target pass at widths 1, 8, 16, batch 1", None, None, "<= 1.15x"))
    draft = ((calibrate or {}).get("draft_step_seconds_by_batch") or {}).get("1", {}).get("1")
    ratio = draft / passes["1"] if draft and passes else None
    out.append(
        line(
            "draft step / target pass", ratio and f"{ratio:.2f}", ratio is not None and ratio <= 0.4, "<= 0.4"
        )
    )

    plain = ((stock or {}).get("target_pass_seconds_by_batch") or {}).get("1", {}).get("1")
    price = passes["1"] / plain if passes and plain else None
    out.append(
        line(
            "price of exactness (invariant / stock, width 1)",
            price and f"{price:.2f}x",
            price is not None and price <= 1.2,
            "<= 1.2x",
        )
    )

    ours64 = rows(bench64, 64).get("ours target-only")
    rate64 = ours64["tokens_per_second"] if ours64 else None
    out.append(
        line(
            f"{pair}, batch 64, target-only",
            rate64 and f"{rate64:,.0f} tok/s",
            rate64 and rate64 >= 15000,
            ">= 15,000",
        )
    )

    smol = rows(smol1, 1)
    mine, hf = (
        smol.get("ours prompt_lookup"),
        next((r for m, r in smol.items() if m.startswith("hf prompt lookup")), None),
    )
    times = mine["tokens_per_second"] / hf["tokens_per_second"] if mine and hf else None
    out.append(
        line(
            "SmolLM2 batch 1: ours prompt lookup / HF's (k=3)",
            times and f"{times:.2f}x",
            times is not None and times >= 3,
            ">= 3x",
        )
    )
    by = rows(smol64, 64)
    speedups = {
        m.removeprefix("ours "): r["speedup"]
        for m, r in by.items()
        if m.startswith("ours ") and m != "ours target-only"
    }
    drafters_ok = bool(speedups) and all(s >= 0.97 for s in speedups.values())
    auto_ok = speedups.get("auto", 0) >= 1.2
    figure = ", ".join(f"{m} {s:.2f}x" for m, s in speedups.items()) if speedups else None
    out.append(
        line(
            "SmolLM2 batch 64: every drafter / target-only, auto",
            figure,
            drafters_ok and auto_ok,
            ">= 0.97x each, auto >= 1.2x",
        )
    )

    every = [
        r
        for b in (bench1, bench64, smol1, smol64)
        for r in (b or {}).get("rows", [])
        if r["method"].startswith("ours ")
    ]
    same = sum(1 for r in every if r.get("identical"))
    figure = f"{same}/{len(every)} rows" if every else None
    out.append(line("speculative outputs identical to our target-only", figure, same == len(every), "all"))

    if job:
        manifest = job.get("manifest", {})
        gpu = (manifest.get("models") or {}).get("gpu")
        done = manifest.get("totals", {}).get("shards") == manifest.get("shards_total") and not manifest.get(
            "failed"
        )
        out.append(
            line(
                "a pipeline run job on a GPU actor",
                f"{manifest.get('totals', {}).get('shards')} shards, GPU {gpu}",
                bool(done and gpu),
                "succeeds, names the GPU",
            )
        )
    else:
        out.append(line("a pipeline run job on a GPU actor", None, None, "succeeds, names the GPU"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument("--pair", default=PAIR)
    args = parser.parse_args()
    print("\n".join(check(args.directory, args.pair)))


if __name__ == "__main__":
    main()
