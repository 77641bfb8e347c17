"""Reading a job's per-shard stats back: the terminal table and the totals."""

from __future__ import annotations

import click

from pipeline.storage import Storage


def load_stats(output_url: str, storage_options: dict | None = None) -> list[dict]:
    store = Storage(output_url, storage_options)
    return [store.read_json(name) for name in store.list("stats", suffix=".json")]


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
    """Tokens/s over all speedup samples of one kind (speculative or target_only)."""
    seconds = sum(x[f"{kind}_seconds"] for x in samples)
    return sum(x[f"{kind}_tokens"] for x in samples) / seconds if seconds else 0.0


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_shard_table(output_url: str, storage_options: dict | None = None) -> bool:
    """Print one line per shard and a totals line; False when there are no stats yet."""
    stats = load_stats(output_url, storage_options)
    if not stats:
        return False
    click.echo(
        f"{'shard':<24} {'rows':>5} {'err':>4} {'tokens':>7} {'alpha':>6} {'tau':>5} {'tok/s':>7} "
        f"{'speedup':>8} {'predicted':>9}"
    )
    for s in sorted(stats, key=lambda s: s["shard"]):
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
