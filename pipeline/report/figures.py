"""The report's figures, drawn with matplotlib into PNG bytes.

Each function takes the loaded run and returns a :class:`Figure` (PNG bytes plus the caption
the HTML shows under it), or None when the run has nothing to draw for it (no errors, no
reference column, no speedup samples). Shard bars get their names as labels only while they
stay readable; a corpus of thousands of shards is drawn by shard index instead.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from matplotlib.figure import Figure as _Canvas

from pipeline.job.stats import ShardStats
from pipeline.report.quality import QualityScores
from pipeline.report.results import RunData

MAX_LABELLED_SHARDS = 40


@dataclass
class Figure:
    name: str  # file name stem: figures/<name>.png
    title: str
    caption: str
    png: bytes


def _subplots(rows: int, cols: int, width: float, height: float, **kwargs):
    """A figure without pyplot: no global state, no display backend, safe in any thread."""
    fig = _Canvas(figsize=(width, height))
    return fig, fig.subplots(rows, cols, **kwargs)


def _png(fig: _Canvas) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _ok(run: RunData) -> list[ShardStats]:
    return [s for s in run.records if s.ok]


def _shard_axis(ax, names: list[str]) -> list[int]:
    xs = list(range(len(names)))
    if len(names) <= MAX_LABELLED_SHARDS:
        ax.set_xticks(xs, names, rotation=45, ha="right", fontsize=8)
    else:
        ax.set_xlabel("shard index")
    return xs


def shard_acceptance(run: RunData) -> Figure | None:
    """α and τ per shard: where drafts were accepted, and how many tokens each pass produced."""
    ok = _ok(run)
    if not ok:
        return None
    fig, (top, bottom) = _subplots(2, 1, 9, 6, sharex=True)
    names = [s.shard for s in ok]
    xs = list(range(len(names)))
    alphas = [s.decoded.alpha for s in ok]
    top.bar(xs, [float("nan") if a is None else a for a in alphas], color="tab:blue")
    top.set_ylabel("α (accepted / drafted)")
    top.set_ylim(0, 1)
    bottom.bar(xs, [s.decoded.tau for s in ok], color="tab:green")
    bottom.axhline(1.0, color="grey", lw=0.8, ls="--")
    bottom.set_ylabel("τ (tokens per target pass)")
    _shard_axis(bottom, names)
    return Figure(
        "acceptance",
        "Acceptance per shard",
        "α is the share of drafted tokens the target accepted; τ the tokens produced per target "
        "forward pass (1.0 = no gain from speculation).",
        _png(fig),
    )


def speedup(run: RunData) -> Figure | None:
    """Measured speedup with its 95% interval beside the speedup the measured pass costs predict;
    the job's pooled figure and interval as a band across all shards."""
    sampled = [(s, s.speedup.measured) for s in _ok(run)]
    sampled = [(s, m) for s, m in sampled if m["measured"]]
    if not sampled:
        return None
    fig, ax = _subplots(1, 1, 9, 4)
    xs = _shard_axis(ax, [s.shard for s, _ in sampled])
    width = 0.4
    measured = [m["measured"] for _, m in sampled]
    intervals = [m["ci95"] or [m["measured"]] * 2 for _, m in sampled]
    errors = [
        [m - low for m, (low, _) in zip(measured, intervals)],
        [high - m for m, (_, high) in zip(measured, intervals)],
    ]
    ax.bar(
        [x - width / 2 for x in xs], measured, width, yerr=errors, capsize=3, label="measured (95% interval)"
    )
    ax.bar(
        [x + width / 2 for x in xs],
        [s.speedup.predicted or 0.0 for s, _ in sampled],
        width,
        label="predicted (measured pass costs)",
    )
    pooled = run.job.speedup.measured["ci95"]
    if pooled:
        ax.axhspan(*pooled, color="tab:blue", alpha=0.12, label="job, pooled (95% interval)")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("speedup over target-only")
    ax.legend()
    return Figure(
        "speedup",
        "Speedup: measured vs predicted",
        "Measured: target-only over speculative seconds in matched pairs of the same rows on the "
        "same actor, with its 95% interval; a bar whose interval holds 1.0 is no measurable "
        "difference. Predicted: the shard's rounds as they ran, priced with the measured cost of "
        "each verify pass at its width and of each draft step. See docs/stats.md.",
        _png(fig),
    )


def acceptance_by_position(run: RunData) -> Figure | None:
    """Per drafter, how often the k-th draft was accepted; per shard, the rounds that drafted
    nothing (where τ over all passes and τ over drafted rounds part)."""
    job = run.job.decoded
    if not job.rounds.by_drafter:
        return None
    fig, (left, right) = _subplots(1, 2, 9, 3.5)
    for drafter, counts in sorted(job.rounds.by_drafter.items()):
        rates = counts.by_position()
        left.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{drafter} ({counts.rounds} rounds)")
    left.set_xlabel("draft position k")
    left.xaxis.get_major_locator().set_params(integer=True)
    left.set_ylabel("k-th draft accepted")
    left.set_ylim(-0.03, 1.03)
    left.legend()
    ok = _ok(run)
    xs = _shard_axis(right, [s.shard for s in ok])
    right.bar(xs, [s.decoded.rounds.undrafted_share for s in ok], color="tab:gray")
    right.set_ylabel("rounds that drafted nothing")
    right.set_ylim(0, 1)
    return Figure(
        "acceptance_by_position",
        "Acceptance by position",
        "Left: of the rounds that drafted at least k tokens, the share whose k-th draft was "
        f"accepted, per drafter (all shards). Right: rounds that drafted nothing, per shard "
        f"({job.rounds.undrafted_share:.0%} of the job's). Tokens per target pass: {job.tau:.2f} over "
        f"all passes, {job.rounds.tau_drafted:.2f} over rounds that drafted.",
        _png(fig),
    )


def row_alpha(run: RunData) -> Figure | None:
    """How acceptance spreads over documents: a few bad rows or a uniformly weak draft?"""
    if "drafted" not in run.rows.column_names:
        return None
    drafted = run.rows.column("drafted").to_pylist()
    alphas = [a for a, d in zip(run.rows.column("alpha").to_pylist(), drafted) if d]
    if not alphas:
        return None
    fig, ax = _subplots(1, 1, 9, 3.5)
    ax.hist(alphas, bins=20, range=(0, 1), color="tab:blue")
    ax.set_xlabel("α of one row")
    ax.set_ylabel("rows")
    undrafted = len(drafted) - len(alphas)
    return Figure(
        "row_alpha",
        "Per-row acceptance",
        f"{len(alphas)} rows with drafts, mean α {sum(alphas) / len(alphas):.2f}; "
        f"{undrafted} rows were decoded without drafting (target-only chosen or nothing to draft).",
        _png(fig),
    )


def throughput(run: RunData) -> Figure | None:
    """Tokens/s over the job's wall time: each shard as a segment, and the cumulative tokens."""
    timed = [(s, s.context.get("started"), s.context.get("finished")) for s in _ok(run)]
    ok = sorted(((s, a, b) for s, a, b in timed if a and b), key=lambda t: t[2])
    if not ok:
        return None
    t0 = min(a for _, a, _ in ok)
    fig, (top, bottom) = _subplots(2, 1, 9, 6, sharex=True)
    for s, a, b in ok:
        top.plot([(a - t0) / 60, (b - t0) / 60], [s.decoded.tokens_per_second] * 2, lw=3)
    top.set_ylabel("tokens/s of a shard")
    top.set_ylim(bottom=0)
    times, cumulative = [0.0], [0]
    for s, _, b in ok:
        times.append((b - t0) / 60)
        cumulative.append(cumulative[-1] + s.decoded.new_tokens)
    bottom.step(times, cumulative, where="post", color="tab:purple")
    bottom.set_ylabel("tokens written")
    bottom.set_xlabel("minutes since the first shard started")
    return Figure(
        "throughput",
        "Throughput over time",
        "Top: each shard's decode rate over the time it ran (overlaps = shards decoded in "
        "parallel). Bottom: output tokens written so far.",
        _png(fig),
    )


def gamma(run: RunData) -> Figure | None:
    """The γ the cost model chose: per shard, and per row (drafted tokens per round)."""
    ok = _ok(run)
    if not ok:
        return None
    fig, (left, right) = _subplots(1, 2, 9, 3.5)
    xs = _shard_axis(left, [s.shard for s in ok])
    left.bar(xs, [s.decoded.mean_gamma for s in ok], color="tab:orange")
    left.set_ylabel("mean γ per round")
    if "rounds" in run.rows.column_names:
        pairs = zip(run.rows.column("drafted").to_pylist(), run.rows.column("rounds").to_pylist())
        right.hist([d / r for d, r in pairs if r], bins=20, color="tab:orange")
    right.set_xlabel("mean γ of one row")
    right.set_ylabel("rows")
    return Figure(
        "gamma",
        "Draft length γ chosen",
        "γ = 0 means the engine judged that no draft would pay and decoded target-only.",
        _png(fig),
    )


def errors(run: RunData) -> Figure | None:
    """Rows and shards that did not produce output, by reason."""
    counts = error_counts(run)
    if not counts:
        return None
    reasons = sorted(counts, key=counts.get)
    fig, ax = _subplots(1, 1, 9, 0.5 * len(reasons) + 1.5)
    ax.barh(reasons, [counts[r] for r in reasons], color="tab:red")
    ax.set_xlabel("count")
    return Figure(
        "errors",
        "Errors by reason",
        "Row-level reasons count rows (written to errors/); shard_failed counts shards that "
        "exhausted their retries (listed in manifest.json).",
        _png(fig),
    )


def error_counts(run: RunData) -> Counter:
    counts: Counter = Counter()
    for s in run.records:
        counts.update(s.errors_by_reason)
    counts["shard_failed"] += len((run.manifest or {}).get("failed") or [])
    return +counts  # drops zero counts


def quality(scores: QualityScores | None) -> Figure | None:
    if scores is None:
        return None
    fig, ax = _subplots(1, 1, 9, 3.5)
    ax.hist(scores.per_row, bins=20, range=(0, 100), color="tab:cyan")
    ax.set_xlabel(f"{scores.headline} of one row")
    ax.set_ylabel("rows")
    return Figure(
        "quality",
        f"Quality against references ({scores.headline})",
        f"{scores.rows} rows with a reference; {scores.signature}.",
        _png(fig),
    )


RUN_FIGURES: tuple[Callable[[RunData], Figure | None], ...] = (
    shard_acceptance,
    acceptance_by_position,
    speedup,
    row_alpha,
    throughput,
    gamma,
    errors,
)
