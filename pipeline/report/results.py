"""Reading a job's results back: per-shard stats, per-row records and the terminal table (the
paths and the stats files are `pipeline.job.layout`'s, the record and its totals
`pipeline.job.stats`')."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import click
import pyarrow as pa

from pipeline.job.layout import is_job_complete, output_files, read_manifest, read_stats
from pipeline.job.speedup import verdict
from pipeline.job.stats import JobTotals, ShardStats
from pipeline.storage import Storage

# the per-row columns the report plots; `generated` and the reference only when scoring quality.
# Not the id: the report never shows it, and its type follows the input's (outputs of older
# versions mixed string and integer ids across shards, which no table can hold at once).
ROW_COLUMNS = ("new_tokens", "alpha", "drafted", "accepted", "rounds", "latency_s")


def load_stats(output_url: str, storage_options: dict | None = None) -> list[dict]:
    return read_stats(Storage(output_url, storage_options))


@dataclass
class RunData:
    """Everything a finished (or running) job has written, loaded for the report."""

    output_url: str
    stats: list[dict]  # one per shard, sorted by shard name
    manifest: dict | None  # None while the first run of the job is still going
    rows: pa.Table  # per-row records of every shard plus a `shard` column
    reference_column: str | None  # the column the report compares `generated` with, if present
    complete: bool  # _SUCCESS is there: every shard done

    @cached_property
    def records(self) -> list[ShardStats]:
        """The shards' stats files read as records (`pipeline.job.stats`), in shard order."""
        return [ShardStats.from_json(s) for s in self.stats]

    @cached_property
    def job(self) -> JobTotals:
        """The job's figures over every shard."""
        return JobTotals(self.records)

    @cached_property
    def totals(self) -> dict:
        """`job` as manifest.json writes it (the report page reads these)."""
        return self.job.to_json()

    @property
    def task_kind(self) -> str | None:
        return ((self.manifest or {}).get("spec") or {}).get("task", {}).get("kind")


def load_run(
    output_url: str, storage_options: dict | None = None, reference_column: str = "reference"
) -> RunData:
    """Stats, manifest and per-row records under OUTPUT_URL (only the columns the report needs)."""
    store = Storage(output_url, storage_options)
    stats = sorted(read_stats(store), key=lambda s: s["shard"])
    manifest = read_manifest(store)
    tables = []
    for shard, name in output_files(store):
        table = store.read_parquet(name)
        text = ("generated", reference_column) if reference_column in table.column_names else ()
        wanted = [c for c in (*ROW_COLUMNS, *text) if c in table.column_names]
        table = table.select(wanted)
        tables.append(table.append_column("shard", pa.array([shard] * table.num_rows, pa.string())))
    rows = pa.concat_tables(tables, promote_options="default") if tables else pa.table({})
    has_reference = reference_column in rows.column_names
    reference = reference_column if has_reference else None
    return RunData(output_url, stats, manifest, rows, reference, is_job_complete(store))


def _ratio(value) -> str:
    """A speedup as `1.05x`, or `-` where none was measured (target-only runs)."""
    return "-" if value is None else f"{value:.2f}x"


def _share(value) -> str:
    """An acceptance rate as `0.42`, or `-` where nothing was drafted."""
    return "-" if value is None else f"{value:.2f}"


def _interval(ci95: list[float] | None) -> str:
    return f"[{ci95[0]:.2f}, {ci95[1]:.2f}]" if ci95 else "-"


def _failed_line(failed: dict) -> str:
    reason = failed.get("reason", "")[:80]
    return f"{failed['shard']:<24} {'':>5} {'':>4} FAILED after {failed.get('attempts')} attempt(s): {reason}"


def _shard_line(s: ShardStats) -> str:
    if not s.ok:
        return f"{s.shard:<24} {'':>5} {'':>4} unreadable: {(s.error or '')[:80]}"
    d, sp = s.decoded, s.speedup.measured
    return (
        f"{s.shard:<24} {s.rows_out:>5} {s.rows_error:>4} {d.new_tokens:>7} "
        f"{_share(d.alpha):>6} {d.tau:>5.2f} {d.tokens_per_second:>7.2f} "
        f"{_ratio(sp['measured']):>8}  {_interval(sp['ci95']):<13} {_ratio(s.speedup.predicted):>9} "
        f"{verdict(sp['ci95']) or ''}"
    ).rstrip()


def print_shard_table(stats: list[dict], failed: list[dict] | None = None) -> bool:
    """Print one line per shard (failed ones too, with their reason) and a totals line; False when
    there is nothing to show yet. A speedup is printed with its 95% interval and what the
    interval says: faster, slower, or no measurable difference where it holds 1.0."""
    failed = failed or []
    if not stats and not failed:
        return False
    click.echo(
        f"{'shard':<24} {'rows':>5} {'err':>4} {'tokens':>7} {'alpha':>6} {'tau':>5} {'tok/s':>7} "
        f"{'speedup':>8}  {'95% interval':<13} {'predicted':>9}"
    )
    lines = [(f["shard"], _failed_line(f)) for f in failed]
    records = [ShardStats.from_json(r) for r in stats]
    lines += [(s.shard, _shard_line(s)) for s in records]
    for _, line in sorted(lines):
        click.echo(line)
    totals = JobTotals(records)
    d, sample = totals.decoded, totals.speedup
    sp = sample.measured
    line = (
        f"{'TOTAL':<24} {sum(s.rows_out for s in records):>5} {sum(s.rows_error for s in records):>4} "
        f"{d.new_tokens:>7} {_share(d.alpha):>6} {d.tau:>5.2f} {d.tokens_per_second:>7.2f} "
        f"{_ratio(sp['measured']):>8}  {_interval(sp['ci95']):<13} {'':>9} {verdict(sp['ci95']) or ''}"
    )
    click.echo(line.rstrip())
    if d.rounds.by_drafter:
        click.echo(
            f"rounds that drafted nothing: {d.rounds.undrafted_share:.0%}; tokens per target pass "
            f"{d.tau:.2f} over all passes, {d.rounds.tau_drafted:.2f} over rounds that drafted"
        )
    elif d.rounds.undrafted:
        click.echo("no round drafted: target-only decoding throughout")
    if sample.pair_seconds:
        median = sp["median_pair_ratio"]
        click.echo(
            f"speedup sample: {sp['pairs']} pairs, median pair {_ratio(median)}; "
            f"measuring took {totals.sample_share:.0%} of the shards' time"
        )
    if totals.shards_stood_down:
        click.echo(
            f"drafting stood down in {totals.shards_stood_down} of {len(records)} shards: the actor's "
            f"pairs had measured it slower than target-only (taken up again after a rest)"
        )
    if sample.identical_rows is not None:
        click.echo(
            f"target-only check: {sample.identical_rows}/{sample.sample_rows} sampled rows identical "
            f"to target-only decoding"
        )
    for line in (_learning_head_line(stats), _where_line(stats)):
        if line:
            click.echo(line)
    return True


def _where_line(stats: list[dict]) -> str | None:
    """Where the models ran, from the shards' `models` records: each device (a GPU by its name)
    with the dtype and the pass path, once however many actors shared it."""
    seen = []
    for record in stats:
        m = record.get("models") or {}
        if not m.get("device"):
            continue
        device = f"{m['device']} ({m['gpu']})" if m.get("gpu") else m["device"]
        path = ("compiled " if m.get("compiled_passes") else "") + "static passes"
        line = ", ".join(part for part in (device, m.get("dtype"), m.get("static_passes") and path) if part)
        if line not in seen:
            seen.append(line)
    return f"models on {'; '.join(seen)}" if seen else None


def _learning_head_line(stats: list[dict]) -> str | None:
    """With `drafter.head_online`: how the head's first drafts fared on the rows it had not
    learned from yet, the first shards against the last (in the order they ran: each record
    checks the rows decoded before its shard), and what training cost."""
    records = [
        s["head_online"] for s in sorted(stats, key=lambda s: s.get("started") or 0) if s.get("head_online")
    ]
    if not records:
        return None
    accuracy = [r["first_draft"]["accuracy"] for r in records]
    k = min(5, len(accuracy) // 2) or 1
    trained = sum(r["seconds"] for r in records)
    shards = sum(s.get("decode_seconds") or 0 for s in stats)
    share = f" ({trained / shards:.0%} of the shards' decoding time)" if shards else ""
    return (
        f"learning head: first drafts accepted on rows it had not learned from, first {k} checks "
        f"{sum(accuracy[:k]) / k:.2f}, last {k} {sum(accuracy[-k:]) / k:.2f}; "
        f"{sum(r['steps'] for r in records)} training steps in {trained:.0f} s{share}"
    )
