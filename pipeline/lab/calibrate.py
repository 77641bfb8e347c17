"""`pipeline calibrate`: pass costs measured at length, printed, cached and recorded.

The measuring itself is the runtime's (`pipeline.decode.calibration.measure`, which a model
actor also runs, briefly, at start-up); the lab adds what a person comparing machines or
settings wants: `--against`, the target on other weights timed in alternating rounds in one
process (`measure_alternating`), so that a shared machine's drifting speed hits both alike; the
measurements as a table (`format_table`); and a Markdown record for docs/benchmarks/
(`write_report`).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.decode import static_lm
from pipeline.decode.calibration import measure, summary
from pipeline.lab.record import command_line, write_record
from pipeline.models.loading import LoadedPair

_PASSES = (("target", "target_pass_seconds_by_batch"), ("draft", "draft_step_seconds_by_batch"))


def measure_alternating(pairs: list[LoadedPair], *args, runs: int = 3, **kwargs) -> list[dict[str, Any]]:
    """`measure` each of `pairs` `runs` times in turn (A B A B ...), one timed pass per shape
    each time, and give each pair the median of its rounds: two settings' pass costs compared
    in one process, where a shared machine's drifting speed hits both alike."""
    rounds: list[list[dict]] = [[] for _ in pairs]
    began = time.perf_counter()
    for _ in range(runs):
        for done, pair in zip(rounds, pairs):
            done.append(measure(pair, *args, runs=1, **kwargs))
    merged = []
    for pair, done in zip(pairs, rounds):
        first = done[0]
        passes = {
            role: {
                batch: {w: statistics.median(d[key][batch][w] for d in done) for w in by_width}
                for batch, by_width in first[key].items()
            }
            for role, key in _PASSES
            if first[key]
        }
        prefill = {
            role: statistics.median(d["prefill_seconds_per_token"][role] for d in done)
            if rate is not None
            else None
            for role, rate in first["prefill_seconds_per_token"].items()
        }
        kept = {k: first[k] for k in ("context", "draft_vocab")}
        result = summary(pair, passes, prefill, runs=runs, pair_name=first["pair"]["name"], **kept)
        result["read_bandwidth_gb_s"] = statistics.median(d["read_bandwidth_gb_s"] for d in done)
        result["seconds"] = time.perf_counter() - began
        merged.append(result)
    return merged


def against_record(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """What `pipeline calibrate --against` adds to a record: the other weights' target passes,
    prefill and bandwidth, and our passes over theirs by batch and width."""
    mine, other = ours["target_pass_seconds_by_batch"], theirs["target_pass_seconds_by_batch"]
    return {
        "weights": theirs["weights"],
        "target_pass_seconds_by_batch": other,
        "prefill_seconds_per_token": theirs["prefill_seconds_per_token"]["target"],
        "weight_bytes": theirs["weight_bytes"]["target"],
        "bandwidth_gb_s": theirs["bandwidth_gb_s"]["target"],
        "target_pass_ratio_by_batch": {
            batch: {w: mine[batch][w] / other[batch][w] for w in by_width}
            for batch, by_width in other.items()
        },
        "prefill_ratio": ours["prefill_seconds_per_token"]["target"]
        / theirs["prefill_seconds_per_token"]["target"],
    }


def format_table(result: dict[str, Any]) -> str:
    """The measurements as text: passes in milliseconds, batch sizes as rows and widths (new
    tokens per row) as columns; then prefill rates and the predicted speedups."""
    widths = [str(w) for w in result["widths"]]
    lines = [
        f"context {result['context']} cached tokens per row, median of {result['runs']} run(s), milliseconds"
    ]

    def grid(title: str, by_batch: dict[str, dict[str, float]]) -> None:
        lines.append("")
        lines.append(f"{title:<22}" + "".join(f"{'w=' + w:>9}" for w in widths))
        for batch, by_width in by_batch.items():
            cells = "".join(f"{1000 * by_width[w]:>9.2f}" for w in widths)
            lines.append(f"{'batch ' + batch:<22}{cells}")

    grid("target pass", result["target_pass_seconds_by_batch"])
    against = result.get("against")
    if against:  # the same passes on other weights, measured in alternation with these
        grid(f"target ({against['weights']})", against["target_pass_seconds_by_batch"])
        lines.append("")
        lines.append(f"{'ours / ' + against['weights']:<22}" + "".join(f"{'w=' + w:>9}" for w in widths))
        for batch, by_width in against["target_pass_ratio_by_batch"].items():
            lines.append(f"{'batch ' + batch:<22}" + "".join(f"{by_width[w]:>8.2f}x" for w in widths))
    if result["draft_step_seconds_by_batch"]:
        grid("draft pass", result["draft_step_seconds_by_batch"])
    rates = result["prefill_seconds_per_token"]
    if result.get("weight_bytes"):
        lines.append("")
        lines.append(
            f"weights read per pass ({result.get('weights', 'dense')}"
            + (f", {result['block_activations']} activations" if result.get("block_activations") else "")
            + "), "
            "bandwidth achieved at width 1, batch 1: "
            + ", ".join(
                f"{role} {size / 1e9:.2f} GB at {result['bandwidth_gb_s'][role]:.1f} GB/s"
                for role, size in result["weight_bytes"].items()
            )
            + (
                f"; target on {against['weights']} {against['weight_bytes'] / 1e9:.2f} GB at "
                f"{against['bandwidth_gb_s']:.1f} GB/s"
                if against
                else ""
            )
        )
        roof = result.get("read_bandwidth_gb_s")
        if roof:  # how far from the limit: the machine's own reading of a large tensor
            share = result["bandwidth_gb_s"]["target"] / roof
            lines.append(
                f"the memory's pace, reading far more than the caches hold: {roof:.1f} GB/s; the "
                f"target's width-1 pass reads its weights at {share:.0%} of it"
            )
    head = result.get("head")
    if head:
        lines.append(
            f"draft head step (one layer of the target's shape, output layer over {head['vocab_rows']} "
            f"tokens, {head['parameters'] / 1e6:.1f}M trained parameters): "
            f"{1000 * head['step_seconds']:.2f} ms, {100 * head['share_of_target_pass']:.1f}% of a "
            "width-1 target pass at batch 1"
        )
    for role, graphs in (result.get("static_passes") or {}).items():
        lines.append(
            f"static passes ({role}{', compiled' if graphs.get('compiled') else ''}"
            f"{', fixed-order attention' if graphs.get('fixed_attention') else ''}"
            f"{', fixed-order products' if graphs.get('fixed_linears') else ''}): "
            f"{graphs['slots']} slots of {graphs['slot_length']} positions, "
            + (
                f"graphs of widths {','.join(map(str, graphs['graphs']))}"
                + (f" and a {static_lm.CHUNK}-token prefill piece" if graphs.get("prefill_graph") else "")
                + (f" (prefill eager: {why})" if (why := graphs.get("prefill_eager_because")) else "")
                + " captured in "
                f"{graphs['capture_seconds']:.2f} s, {graphs['graph_bytes'] / 1e6:.0f} MB"
                if graphs["graphs"]
                else f"eager ({graphs['eager_because']})"
            )
        )
    lines.append("")
    lines.append(
        "prefill per token: "
        + ", ".join(f"{role} {1000 * rate:.3f}" for role, rate in rates.items() if rate is not None)
        + (
            f"; target on {against['weights']} {1000 * against['prefill_seconds_per_token']:.3f} "
            f"({against['prefill_ratio']:.2f}x)"
            if against
            else ""
        )
    )
    by_batch = result["predicted_speedup_by_batch"]
    if by_batch:
        lines.append("")
        lines.append("predicted speedup (Leviathan et al., measured pass widths), best gamma:")
        lines.append(f"{'':<22}" + "".join(f"{'alpha ' + a:>16}" for a in by_batch["1"]))
        for batch, by_alpha in by_batch.items():
            cells = "".join(f"{p['speedup']:>10.2f}x g={p['gamma']:<2}" for p in by_alpha.values())
            lines.append(f"{'batch ' + batch:<22}{cells}")
    return "\n".join(lines)


def write_report(path: str, result: dict[str, Any], command: str, json_path: str) -> None:
    """A Markdown record of one calibration for docs/benchmarks/: the command and the machine
    beside the table, since pass costs hold for the machine, dtype and threads they came from."""
    pair = result["pair"]
    write_record(
        path,
        f"Calibration: {pair['name']} ({pair['target']} + {pair['draft']})",
        date=result["measured_at"],
        command=command,
        machine=result["machine"],
        json_path=json_path,
        body=["## Pass costs", "", "```", format_table(result), "```"],
    )


@dataclass(frozen=True)
class CalibrateOptions:
    """`pipeline calibrate`'s options, parsed (batch sizes and widths as tuples)."""

    pair: str
    batches: tuple[int, ...]
    widths: tuple[int, ...]
    context: int
    dtype: str
    threads: int | None
    weights: str
    block_activations: str
    against: str | None
    batch_invariant: bool | None
    static_passes: bool | None
    compiled_passes: bool | None
    fused_projections: bool
    float64_attention: bool
    block_linears: bool
    runs: int
    head: bool
    head_vocab: int | None
    as_json: bool
    out_path: str | None
    report_path: str | None


def measure_pair(options: CalibrateOptions) -> tuple[LoadedPair, dict[str, Any]]:
    """Load the pair as a job's actor does (pipeline/job/worker.py with a spec's default models
    fields) and measure it, alternating with the target on `--against` weights where asked.
    ModelError or ValueError for a pair or settings that cannot be measured."""
    import torch

    from pipeline.decode.calibration import check_settings
    from pipeline.models.loading import load_pair, resolve_pair

    o = options
    if o.threads:
        torch.set_num_threads(o.threads)
    check_settings(o.batches, o.widths, o.context, o.runs)
    target, draft = resolve_pair(o.pair)
    kernels = {
        "batch_invariant": o.batch_invariant,
        "static_passes": o.static_passes,
        "compiled_passes": o.compiled_passes,
        "fused_projections": o.fused_projections,
        "float64_attention": o.float64_attention,
        "block_linears": o.block_linears,
        "block_activations": o.block_activations,
    }
    loaded = load_pair(target, draft, dtype=o.dtype, device="auto", weights=o.weights, **kernels)
    if not o.against:
        return loaded, measure(
            loaded,
            o.batches,
            o.widths,
            o.context,
            o.runs,
            pair_name=o.pair,
            head=o.head,
            head_vocab=o.head_vocab,
        )
    other = load_pair(target, None, dtype=o.dtype, device="auto", weights=o.against, **kernels)
    result, theirs = measure_alternating(
        [loaded, other], o.batches, o.widths, o.context, runs=o.runs, pair_name=o.pair
    )
    result["against"] = against_record(result, theirs)
    return loaded, result


def record(options: CalibrateOptions, loaded: LoadedPair, result: dict[str, Any], echo) -> None:
    """What the command does with a measurement: cache it for actors on this machine, write the
    JSON and the Markdown record where asked, and print it (`echo` as click.echo)."""
    import torch

    from pipeline.decode.calibration import calibration_key, save_cached

    command = command_line()
    report_path = options.report_path
    out_path = options.out_path or (str(Path(report_path).with_suffix(".json")) if report_path else None)
    key = calibration_key(loaded, torch.get_num_threads())
    result["key"] = key
    cached = save_cached(key, result)
    text = json.dumps(result, indent=2)
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        with open(out_path, "w") as fh:
            fh.write(text + "\n")
    if report_path:
        write_report(report_path, result, command, out_path)
    if options.as_json:
        echo(text)
    else:
        machine = result["machine"]
        echo(
            f"{options.pair}: {loaded.target_id} + {loaded.draft_id}, {machine['dtype']}, "
            f"{machine['device']}, {machine['threads']} threads, {machine['cpu_model']}"
        )
        echo(format_table(result))
    wrote = "".join(f"; wrote {path}" for path in (out_path, report_path) if path)
    echo(f"cached as {cached}{wrote}", err=True)
