"""Reading a job's results back: per-shard stats, per-row records, the terminal table, totals."""

from __future__ import annotations

from dataclasses import dataclass

import click
import pyarrow as pa

from pipeline.storage import Storage

# the per-row columns the report plots; `generated` and the reference only when scoring quality.
# Not the id: the report never shows it, and its type follows the input's (outputs of older
# versions mixed string and integer ids across shards, which no table can hold at once).
ROW_COLUMNS = ("new_tokens", "alpha", "drafted", "accepted", "rounds", "latency_s")


def read_stats(store: Storage) -> list[dict]:
    """Every shard's stats file under a job's output."""
    return [store.read_json(name) for name in store.list("stats", suffix=".json")]


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

    @property
    def task_kind(self) -> str | None:
        return ((self.manifest or {}).get("spec") or {}).get("task", {}).get("kind")


def load_run(
    output_url: str, storage_options: dict | None = None, reference_column: str = "reference"
) -> RunData:
    """Stats, manifest and per-row records under OUTPUT_URL (only the columns the report needs)."""
    store = Storage(output_url, storage_options)
    stats = sorted(read_stats(store), key=lambda s: s["shard"])
    manifest = store.read_json("manifest.json") if store.exists("manifest.json") else None
    tables = []
    for name in store.list("outputs", suffix=".parquet"):
        table = store.read_parquet(name)
        text = ("generated", reference_column) if reference_column in table.column_names else ()
        wanted = [c for c in (*ROW_COLUMNS, *text) if c in table.column_names]
        shard = name.rsplit("/", 1)[-1].removesuffix(".parquet")
        table = table.select(wanted)
        tables.append(table.append_column("shard", pa.array([shard] * table.num_rows, pa.string())))
    rows = pa.concat_tables(tables, promote_options="default") if tables else pa.table({})
    has_reference = reference_column in rows.column_names
    reference = reference_column if has_reference else None
    return RunData(output_url, stats, manifest, rows, reference, store.exists("_SUCCESS"))


def totals(stats: list[dict]) -> dict:
    """Job-wide figures. Rates are ratios of sums (token-weighted), not means of shard rates."""
    ok = [s for s in stats if s.get("status") == "ok"]
    tokens = sum(s["tokens_out"] for s in ok)
    seconds = sum(s["decode_seconds"] for s in ok)
    drafted = sum(s["drafted"] for s in ok)
    passes_rows = sum(s["tokens_out"] / s["tau"] for s in ok if s["tau"])
    sampled = [s["speedup"] for s in ok if s.get("speedup")]
    base_tps = _rate(sampled, "target_only")
    spec_tps = _rate(sampled, "speculative")
    identical = [x["identical_rows"] for x in sampled if x.get("identical_rows") is not None]
    return {
        "shards": len(stats),
        "shards_unreadable": len(stats) - len(ok),
        "rows_in": sum(s.get("rows_in", 0) for s in stats),
        "rows_out": sum(s.get("rows_out", 0) for s in stats),
        "rows_error": sum(s.get("rows_error", 0) for s in stats),
        "tokens_out": tokens,
        "alpha": sum(s["accepted"] for s in ok) / drafted if drafted else 0.0,
        "tau": tokens / passes_rows if passes_rows else 0.0,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "sample_tokens_per_second": spec_tps,
        "target_only_tokens_per_second": base_tps,
        "speedup": spec_tps / base_tps if base_tps else None,
        "sample_rows": sum(x["sample_rows"] for x in sampled),
        "sample_identical_rows": sum(identical) if identical else None,
    }


def _rate(samples: list[dict], kind: str) -> float:
    """Tokens/s over all speedup samples of one kind (speculative or target_only).

    Samples without the counts (stats written by versions before 0.1.0's final layout) are
    left out rather than failing the whole table or report.
    """
    samples = [x for x in samples if f"{kind}_seconds" in x]
    seconds = sum(x[f"{kind}_seconds"] for x in samples)
    return sum(x[f"{kind}_tokens"] for x in samples) / seconds if seconds else 0.0


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def read_failed(store: Storage) -> list[dict]:
    """The failure records of shards that ran out of attempts (failed/<shard>.json)."""
    return [store.read_json(name) for name in store.list("failed", suffix=".json")]


def print_shard_table(stats: list[dict], failed: list[dict] | None = None) -> bool:
    """Print one line per shard (failed ones too, with their reason) and a totals line; False when
    there is nothing to show yet."""
    failed = failed or []
    if not stats and not failed:
        return False
    click.echo(
        f"{'shard':<24} {'rows':>5} {'err':>4} {'tokens':>7} {'alpha':>6} {'tau':>5} {'tok/s':>7} "
        f"{'speedup':>8} {'predicted':>9}"
    )
    for s in sorted([*stats, *({**f, "status": "failed"} for f in failed)], key=lambda s: s["shard"]):
        if s.get("status") == "failed":
            reason = s.get("reason", "")[:80]
            attempts = s.get("attempts")
            click.echo(f"{s['shard']:<24} {'':>5} {'':>4} FAILED after {attempts} attempt(s): {reason}")
            continue
        if s.get("status") != "ok":
            click.echo(f"{s['shard']:<24} {'':>5} {'':>4} unreadable: {s.get('error', '')[:80]}")
            continue
        sp = s.get("speedup") or {}
        click.echo(
            f"{s['shard']:<24} {s['rows_out']:>5} {s['rows_error']:>4} {s['tokens_out']:>7} "
            f"{s['alpha']:>6.2f} {s['tau']:>5.2f} {s['tokens_per_second']:>7.2f} "
            f"{_fmt(sp.get('measured')):>7}x {_fmt(sp.get('predicted')):>8}x"
        )
    t = totals(stats)
    click.echo(
        f"{'TOTAL':<24} {t['rows_out']:>5} {t['rows_error']:>4} {t['tokens_out']:>7} "
        f"{t['alpha']:>6.2f} {t['tau']:>5.2f} {t['tokens_per_second']:>7.2f} {_fmt(t['speedup']):>7}x"
    )
    if t["sample_identical_rows"] is not None:
        click.echo(
            f"target-only check: {t['sample_identical_rows']}/{t['sample_rows']} sampled rows identical "
            f"to target-only decoding"
        )
    return True
