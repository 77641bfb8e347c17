"""A finished job's figures shard by shard, as a record under docs/benchmarks/.

    python scripts/job_record.py OUTPUT_URL --report docs/benchmarks/NAME.md [--title TEXT]

Writes NAME.md (the job's settings, the per-shard table `pipeline stats` prints, and, with
`drafter.head_online`, the learning head's figures in the order the shards ran) and NAME.json
(the manifest and every shard's stats) beside it. The machine named is the one this runs on:
run it where the job ran (the stats name the actor's host, `worker.host`, to check).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path


def _head_drafts(shard: dict) -> tuple[int, int]:
    """A shard's head drafts: (accepted, drafted)."""
    return (shard.get("accepted_by") or {}).get("head", 0), (shard.get("drafted_by") or {}).get("head", 0)


def _head_rows(stats: list[dict]) -> list[str]:
    """One Markdown row per shard, in the order they ran: the head's drafts in the shard, and the
    refinement before it (its check of the rows decoded before it, and its training)."""
    rows = []
    for s in sorted(stats, key=lambda s: s.get("started") or 0):
        h = s.get("head_online") or {}
        accepted, drafted = _head_drafts(s)
        alpha = f"{accepted / drafted:.2f}" if drafted else "-"
        check = h.get("first_draft") or {}
        accuracy = f"{check['accuracy']:.3f}" if check else "-"
        # recorded from commit d1eac55 on: how sure the head was of those first drafts
        sure = f"{check['confidence']:.3f}" if "confidence" in check else "-"
        trained = f"{h['steps']} steps, {h['seconds']:.1f} s" if h else "-"
        speedup = (s.get("speedup") or {}).get("measured")
        rows.append(
            f"| {s['shard']} | {accuracy} | {sure} | {trained} | {accepted} / {drafted} | {alpha} | "
            f"{s.get('decode_seconds', 0):.1f} | {f'{speedup:.2f}x' if speedup else '-'} |"
        )
    return rows


def _ends(stats: list[dict], n: int = 5) -> list[str]:
    """The first and last `n` shards in the order they ran, side by side: the head's check, its
    drafts accepted pooled over the shards, and the mean of the shards' α (issue 39 asks the
    last five's to be the first five's + 0.1), over the shards that drafted (a shard whose
    drafts the policy cut to none has no α)."""
    ran = sorted(stats, key=lambda s: s.get("started") or 0)
    if len(ran) < 2 * n:
        return []
    head = "| shards | checked (mean) | head accepted / drafted | α pooled | shards' α, mean (with drafts) |"
    lines = [head, "|---|---|---|---|---|"]
    for name, part in ((f"first {n}", ran[:n]), (f"last {n}", ran[-n:])):
        checks = [((s.get("head_online") or {}).get("first_draft") or {}).get("accuracy") for s in part]
        checks = [c for c in checks if c is not None]
        drafts = [_head_drafts(s) for s in part]
        accepted, drafted = [a for a, _ in drafts], [d for _, d in drafts]
        alphas = [a / d for a, d in zip(accepted, drafted) if d]
        check = f"{sum(checks) / len(checks):.3f}" if checks else "-"
        pooled = f"{sum(accepted) / sum(drafted):.2f}" if sum(drafted) else "-"
        mean = f"{sum(alphas) / len(alphas):.2f} ({len(alphas)})" if alphas else "- (0)"
        lines.append(f"| {name} | {check} | {sum(accepted)} / {sum(drafted)} | {pooled} | {mean} |")
    return lines


def main() -> None:
    from pipeline.job.layout import read_manifest, read_stats
    from pipeline.machine import cpu_info, git_state
    from pipeline.report.results import print_shard_table
    from pipeline.storage import Storage

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_url")
    parser.add_argument("--report", required=True, help="the Markdown file to write (JSON beside it)")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()

    out = Storage(args.output_url)
    stats, manifest = read_stats(out), read_manifest(out) or {}
    table = io.StringIO()
    with contextlib.redirect_stdout(table):
        print_shard_table(stats)
    model, flags = cpu_info()
    commit, dirty = git_state()
    features = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)
    fields = (manifest.get("fingerprint") or {}).get("fields", {})
    sections = ("task", "generation", "models", "drafter", "execution")
    settings = {k: v for k, v in fields.items() if k.split(".")[0] in sections and v not in (None, [], "")}
    title = args.title or f"Job {manifest.get('job')} {manifest.get('run_id')}"
    lines = [
        f"# {title}",
        "",
        f"`python scripts/job_record.py {args.output_url}`, commit {(commit or '?')[:7]}"
        f"{' (dirty)' if dirty else ''}; {model}, {features or 'no AVX2'}, the job's run "
        f"{manifest.get('run_id')} with package {manifest.get('package_version')}.",
        "",
        "Settings: " + ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in settings.items()),
        "",
        "```",
        table.getvalue().rstrip(),
        "```",
    ]
    if any(s.get("head_online") for s in stats):
        lines += [
            "",
            "The learning head, shard by shard in the order they ran. *Checked*: the share of the "
            "rows decoded before the shard whose output tokens the head (as it drafted them) drafts "
            "first, before learning from them; *sure*: its mean confidence in those first drafts "
            "(checked ÷ sure: the head's calibration over all its first drafts; the shard's head "
            "starts from the same ratio band by band of confidence); *trained*: the refinement "
            "before the shard; the head's own drafts in the shard (which the policy cuts to those "
            "that pay).",
            "",
            "| shard | checked | sure | trained | head accepted / drafted | α head | decode s | speedup |",
            "|---|---|---|---|---|---|---|---|",
            *_head_rows(stats),
        ]
        ends = _ends(stats)
        if ends:
            lines += ["", "The first and last five shards:", "", *ends]
    md = Path(args.report)
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(lines) + "\n")
    record = {"machine": {"cpu_model": model, "flags": features, "commit": commit, "dirty": dirty}}
    everything = {**record, "manifest": manifest, "stats": stats}
    md.with_suffix(".json").write_text(json.dumps(everything, indent=1) + "\n")
    print(f"wrote {md} and {md.with_suffix('.json')}")


if __name__ == "__main__":
    main()
