"""`pipeline`: run, submit and inspect speculative-decoding batch jobs.

Exit codes: 0 success, 1 the job ran but failed (some shard failed, or the cluster job
failed), 2 usage or job-spec error (nothing was started).
"""

from __future__ import annotations

import json
import os
import sys

import click

from pipeline.job.lease import DEFAULT_TIMEOUT_MINUTES, LeaseHeld, LeaseLost
from pipeline.spec import (
    JobSpec,
    SpecError,
    check_context_length,
    check_models_reachable,
    load_spec,
    parse_overrides,
    spec_from_dict,
)
from pipeline.storage import StorageError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


SPEC_ENV = "PIPELINE_SPEC_JSON"


def _load(spec_path: str, run_id: str | None, date: str | None, sets: tuple[str, ...]) -> JobSpec:
    """Load a spec file, or `env:NAME`: a rendered spec that `submit` shipped to the cluster."""
    try:
        if spec_path.startswith("env:"):
            data = json.loads(os.environ[spec_path[4:]])
            return spec_from_dict(
                data, source=spec_path, run_id=run_id, date=date, overrides=parse_overrides(sets)
            )
        return load_spec(spec_path, run_id=run_id, date=date, overrides=parse_overrides(sets))
    except SpecError as exc:
        click.echo(str(exc), err=True)
        sys.exit(EXIT_USAGE)


spec_options = [
    click.argument("spec_path", metavar="SPEC"),
    click.option("--run-id", help="Run id rendered into {run_id}; reuse one to resume a killed run."),
    click.option("--date", help="Date (YYYY-MM-DD) rendered into {date}; default today (UTC)."),
    click.option(
        "--set",
        "sets",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override a spec field, e.g. --set execution.num_actors=4.",
    ),
]


def with_spec_options(fn):
    for option in reversed(spec_options):
        fn = option(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="spec-pipeline")
def main() -> None:
    """Batch LLM generation over Parquet corpora on Ray, sped up by lossless speculative decoding.

    \b
    Quick start (offline, on this machine):
      pipeline models install qwen2.5-coder
      pipeline demo-data
      pipeline run jobs/demo.yaml

    Exit codes: 0 ok, 1 job failed, 2 usage or spec error.
    """


lease_timeout_option = click.option(
    "--lease-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_TIMEOUT_MINUTES,
    show_default=True,
    metavar="MINUTES",
    help="Take over the output's lease from a driver with no heartbeat for this long.",
)


@main.command()
@with_spec_options
@click.option("--address", help="Ray cluster address (ray://... or auto); default: an embedded local Ray.")
@click.option("--overwrite", is_flag=True, help="Redo shards that are already complete.")
@click.option(
    "--progress/--no-progress",
    default=None,
    help="A progress bar, or one line per finished shard (default: the bar on a terminal only).",
)
@lease_timeout_option
@click.option("-v", "--verbose", is_flag=True, help="Also show the model actors' own logs.")
def run(spec_path, run_id, date, sets, address, overwrite, progress, lease_timeout, verbose):
    """Run SPEC now and wait for it.

    \b
    Examples:
      pipeline run jobs/demo.yaml
      pipeline run jobs/summarize.yaml --date 2026-11-22 --address auto
      pipeline run jobs/demo.yaml --run-id 20261123T081500Z   # resume a killed run
    """
    from pipeline.job.executor import JobStopped, run_job
    from pipeline.report.results import load_stats, print_shard_table

    spec = _load(spec_path, run_id, date, sets)
    for line in check_context_length(spec):  # cheap (a config file), and it would fail every shard
        click.echo(f"{spec_path}: {line}", err=True)
        sys.exit(EXIT_USAGE)
    click.echo(f"job {spec.name}  run {spec.run_id}  ->  {spec.output.url}", err=True)
    click.echo(f"(resume or re-run with: --run-id {spec.run_id})", err=True)
    try:
        result = run_job(
            spec,
            address=address,
            overwrite=overwrite,
            progress=progress,
            lease_timeout=lease_timeout,
            verbose=verbose,
        )
    except SpecError as exc:  # found before anything ran (e.g. --overwrite over foreign files)
        click.echo(str(exc), err=True)
        sys.exit(EXIT_USAGE)
    except LeaseHeld as exc:  # another driver writes this output: nothing was started
        click.echo(f"{spec_path}: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    except JobStopped as exc:  # the storage went away mid-job
        for line in exc.summary:
            click.echo(line, err=True)
        sys.exit(EXIT_FAILED)
    except (StorageError, ValueError, OSError, LeaseLost) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_FAILED)
    print_shard_table(load_stats(result.output_url, spec.output.storage_options), result.failed)
    if result.shards_skipped:
        click.echo(f"{result.shards_skipped} shard(s) were already complete and were skipped", err=True)
    if not result.ok:
        click.echo(f"{len(result.failed)} shard(s) FAILED:", err=True)
        for failure in result.failed:
            click.echo(f"  {failure['shard']}: {failure['reason']}", err=True)
        sys.exit(EXIT_FAILED)
    click.echo(f"outputs: {result.output_url}/outputs   stats: {result.output_url}/stats", err=True)


@main.command()
@with_spec_options
@click.option("--address", help="Ray dashboard address, e.g. http://HEAD:8265. Without it: run locally.")
@click.option("--wait", is_flag=True, help="Follow the job's logs until it ends; exit with its status.")
@click.option("--overwrite", is_flag=True, help="Redo shards that are already complete.")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: only on a terminal).")
@lease_timeout_option
def submit(spec_path, run_id, date, sets, address, wait, overwrite, progress, lease_timeout):
    """Submit SPEC to a Ray cluster through the Ray Jobs API (or run it locally).

    The current directory (the project: package, jobs/, configs/) travels as the job's
    working_dir, so the cluster runs exactly this code and this spec.

    \b
    Examples:
      pipeline submit jobs/translate.yaml --address http://ray-head:8265 --wait
      pipeline submit jobs/demo.yaml            # no address: same as `pipeline run`
    """
    spec = _load(spec_path, run_id, date, sets)
    if not address:
        ctx = click.get_current_context()
        ctx.invoke(
            run,
            spec_path=spec_path,
            run_id=spec.run_id,
            date=spec.date,
            sets=sets,
            address=None,
            overwrite=overwrite,
            progress=progress,
            lease_timeout=lease_timeout,
        )
        return
    from pipeline.cluster.jobs_api import follow, submit_job

    job_id = submit_job(address, spec, SPEC_ENV, overwrite, lease_timeout)
    click.echo(job_id)
    click.echo(
        f"run {spec.run_id} -> {spec.output.url}; follow with: pipeline status {job_id} --address {address}",
        err=True,
    )
    if wait:
        status = follow(address, job_id, progress=sys.stderr.isatty() if progress is None else progress)
        sys.exit(EXIT_OK if status == "SUCCEEDED" else EXIT_FAILED)


@main.command()
@click.argument("job_id")
@click.option(
    "--address",
    required=True,
    envvar="RAY_API_SERVER_ADDRESS",
    help="Ray dashboard address, e.g. http://HEAD:8265.",
)
def status(job_id, address):
    """Show a submitted job's state and its shards' progress."""
    from pipeline.cluster.jobs_api import job_status

    info = job_status(address, job_id)
    for key, value in info.items():
        click.echo(f"{key:>18}: {value}")
    if info.get("state") in ("FAILED", "STOPPED"):
        sys.exit(EXIT_FAILED)


@main.command()
@click.argument("job_id")
@click.option("--address", required=True, envvar="RAY_API_SERVER_ADDRESS", help="Ray dashboard address.")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: only on a terminal).")
def logs(job_id, address, progress):
    """Follow a submitted job's logs until it ends."""
    from pipeline.cluster.jobs_api import follow

    status = follow(address, job_id, progress=sys.stderr.isatty() if progress is None else progress)
    sys.exit(EXIT_OK if status == "SUCCEEDED" else EXIT_FAILED)


def _parse_storage_options(items: tuple[str, ...]) -> dict:
    """--storage-option KEY=VALUE pairs; values parsed as YAML scalars (true, 3, text)."""
    import yaml

    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            click.echo(f"--storage-option: expected KEY=VALUE, got {item!r}", err=True)
            sys.exit(EXIT_USAGE)
        options[key.strip()] = yaml.safe_load(value) if value else ""
    return options


storage_option = click.option(
    "--storage-option",
    "storage_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="fsspec/s3fs option for OUTPUT_URL, e.g. endpoint_url=http://host:9000 (repeatable; "
    "no credentials).",
)


@main.command()
@click.argument("output_url")
@click.option("--json", "as_json", is_flag=True, help="Print the totals as JSON.")
@storage_option
def stats(output_url, as_json, storage_options):
    """Per-shard table and totals from the stats files under OUTPUT_URL.

    Exits 1 when the run failed (shards out of attempts, listed) or is not complete (no
    _SUCCESS: still running, or killed), so scripts can trust exit 0.
    """
    from pipeline.job.layout import is_job_complete, read_failed, read_stats
    from pipeline.job.stats import job_totals
    from pipeline.report.results import print_shard_table
    from pipeline.storage import Storage

    try:
        store = Storage(output_url, _parse_storage_options(storage_options))
        shard_stats, failed, complete = read_stats(store), read_failed(store), is_job_complete(store)
    except (StorageError, ValueError) as exc:
        click.echo(f"pipeline stats: {exc}", err=True)
        sys.exit(EXIT_FAILED)
    if not shard_stats and not failed:
        click.echo(f"pipeline stats: no stats under {store.url}", err=True)
        sys.exit(EXIT_FAILED)
    if as_json:
        summary = {**job_totals(shard_stats), "complete": complete, "failed": failed}
        click.echo(json.dumps(summary, indent=2))
    else:
        print_shard_table(shard_stats, failed)
    if failed:
        click.echo(f"{len(failed)} shard(s) FAILED; rerun with the same --run-id to retry them", err=True)
        sys.exit(EXIT_FAILED)
    if not complete:
        click.echo(f"incomplete: no _SUCCESS under {store.url} (still running, or stopped)", err=True)
        sys.exit(EXIT_FAILED)


@main.command()
@click.argument("output_url")
@click.option("--out", "report_url", help="Where to write the report (default: OUTPUT_URL/report/).")
@click.option(
    "--reference-column",
    default="reference",
    show_default=True,
    help="Output column holding reference texts (kept from the input with input.keep_columns).",
)
@storage_option
def report(output_url, report_url, reference_column, storage_options):
    """Write an HTML report with figures (α, τ, speedup, γ, throughput, errors, quality)."""
    from pipeline.report.html import write_report

    options = _parse_storage_options(storage_options)
    try:
        page, figures = write_report(
            output_url, report_url, storage_options=options, reference_column=reference_column
        )
    except (ValueError, StorageError) as exc:
        click.echo(f"pipeline report: {exc}", err=True)
        sys.exit(EXIT_FAILED)
    click.echo(f"wrote {page} ({len(figures)} figures: {', '.join(f.name for f in figures)})")


@main.command()
@with_spec_options
@click.option("--no-models", is_flag=True, help="Skip loading tokenizers to compare target and draft.")
def validate(spec_path, run_id, date, sets, no_models):
    """Check SPEC without running it; exit 2 with field-level errors if it is invalid."""
    spec = _load(spec_path, run_id, date, sets)
    problems = check_context_length(spec) + ([] if no_models else check_models_reachable(spec))
    if spec.output.overwrite:
        problems += _overwrite_problems(spec)
    if problems:
        for line in problems:
            click.echo(f"{spec_path}: {line}", err=True)
        sys.exit(EXIT_USAGE)
    click.echo(f"{spec_path}: OK (job {spec.name}: {spec.input.url} -> {spec.output.url})")


def _overwrite_problems(spec: JobSpec) -> list[str]:
    """What `run` would refuse to delete under output.overwrite: files no job of ours wrote."""
    from pipeline.job.layout import foreign_files
    from pipeline.storage import Storage

    out = Storage(spec.output.url, spec.output.storage_options)
    try:
        foreign = foreign_files(out)
    except StorageError as exc:
        return [f"output.url: cannot list the output prefix to check output.overwrite: {exc}"]
    if not foreign:
        return []
    return [
        f"output.url: output.overwrite would be refused: {out.url} holds {len(foreign)} file(s) that "
        f"no job of this pipeline wrote (e.g. {foreign[0]})"
    ]


@main.command("demo-data")
@click.option("--out", default="./data/demo", show_default=True, help="Where to write the shards.")
@click.option("--shards", default=2, show_default=True, help="Number of Parquet shards.")
@click.option("--rows", default=2, show_default=True, help="Documents per shard.")
def demo_data(out, shards, rows):
    """Write a demo corpus (standard-library module docstrings) as Parquet shards."""
    from pipeline.demo_data import write_demo_data

    for path in write_demo_data(out, shards, rows):
        click.echo(path)


@main.command()
@click.option(
    "--pair", default="qwen2.5-coder", show_default=True, help="Named model pair (configs/models.yaml)."
)
@click.option("--tasks", default="summarize,translate", show_default=True)
@click.option("--docs", default=4, show_default=True, help="Documents per task.")
@click.option(
    "--corpus",
    type=click.Choice(["docstrings", "licenses"]),
    default="docstrings",
    show_default=True,
    help="Standard-library docstrings (the demo corpus), or sections of the license texts shipped "
    "with Python and the OS (legal prose whose summaries copy more of their input).",
)
@click.option("--batches", default="1,4", show_default=True, help="Batch sizes for our engine.")
@click.option("--max-new-tokens", default=48, show_default=True)
@click.option("--runs", default=3, show_default=True, help="Runs per configuration (median reported).")
@click.option("--dtype", default="auto", show_default=True)
@click.option("--threads", type=int, default=None, help="torch threads (default: all cores).")
@click.option(
    "--batch-invariant/--stock-kernels",
    default=None,
    help="Target numerics (default: as a job would load it; see models.batch_invariant). HF runs "
    "on the same loaded models.",
)
@click.option(
    "--static-passes/--dynamic-passes",
    default=None,
    help="Passes through fixed slots and shapes, CUDA graphs on a GPU (default: as a job would "
    "load it; see models.static_passes).",
)
@click.option(
    "--draft-int8/--draft-as-loaded",
    default=None,
    help="Draft decode steps on int8 weights (default: as a job would load it; see "
    "models.draft_int8). HF's assisted generation runs with the draft as loaded and, when this "
    "is on, with the int8 steps too.",
)
@click.option(
    "--hf-assistant-tokens", default="3,5", show_default=True, help="HF num_assistant_tokens to try."
)
@click.option(
    "--hf-lookup-tokens", default="3,10", show_default=True, help="HF prompt_lookup_num_tokens to try."
)
@click.option(
    "--hf/--no-hf",
    default=True,
    show_default=True,
    help="Run HF's rows (batch 1); without them ours target-only is the reference for outputs.",
)
@click.option(
    "--drafters",
    default="draft_model,prompt_lookup,auto",
    show_default=True,
    help="Our drafters to run at every batch size (target-only always runs); `auto:A+B` is auto "
    "choosing among A and B only (drafter.auto_sources), e.g. auto:draft_model+prompt_lookup.",
)
@click.option(
    "--draft-vocab",
    default=32768,
    show_default=True,
    help="Our draft model proposes among ids below this plus prompt tokens (0: all; drafter.draft_vocab).",
)
@click.option(
    "--warm-docs",
    default=0,
    show_default=True,
    help="Also run suffix and auto warm: their corpus holds our outputs of this many other documents "
    "of the task (drafter.suffix_warm_start).",
)
@click.option(
    "--weights",
    type=click.Choice(["auto", "gguf-blocks", "dense"]),
    default="auto",
    show_default=True,
    help="The target's weights (as models.weights in a job spec).",
)
@click.option(
    "--llama-cpp",
    "llama_cpp",
    is_flag=True,
    help="Also run llama.cpp (llama-cpp-python, pip install -e '.[llama]') on the target's GGUF file: "
    "greedy and its prompt lookup, batch 1, with every row's tokens/s against its target-only.",
)
@click.option(
    "--llama-cpp-gguf",
    type=click.Path(exists=True, dir_okay=False),
    help="The GGUF file llama.cpp runs (default: the one `pipeline models install --keep-gguf` kept "
    "beside the pair's target).",
)
@click.option(
    "--out",
    "out_path",
    help="Where to write the JSON (default: beside --report as NAME.json, else bench.json).",
)
@click.option(
    "--report",
    "report_path",
    metavar="PATH.md",
    help="Also write a Markdown record of the run (command, commit, machine, pair, settings, tables), "
    "e.g. docs/benchmarks/NAME.md.",
)
def bench(
    pair,
    tasks,
    docs,
    corpus,
    batches,
    max_new_tokens,
    runs,
    dtype,
    threads,
    batch_invariant,
    static_passes,
    draft_int8,
    hf_assistant_tokens,
    hf_lookup_tokens,
    hf,
    drafters,
    draft_vocab,
    warm_docs,
    weights,
    llama_cpp,
    llama_cpp_gguf,
    out_path,
    report_path,
):
    """Benchmark target-only vs our speculative engine vs HF assisted generation, one run.

    \b
    Example:
      pipeline bench --docs 4 --batches 1,4,8 --runs 3
    """
    import shlex
    from datetime import datetime, timezone
    from pathlib import Path

    import torch

    from pipeline.bench import HEADER, LlamaCpp, describe_costs, run_benchmark, write_json, write_report
    from pipeline.machine import describe_machine
    from pipeline.models.loading import load_model, load_pair, resolve_pair

    # argv[0] is whichever entry point ran the CLI (the script, or -m pipeline.cli)
    command = shlex.join(["pipeline", *sys.argv[1:]])
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out_path = out_path or (str(Path(report_path).with_suffix(".json")) if report_path else "bench.json")

    if threads:
        torch.set_num_threads(threads)
    target, draft = resolve_pair(pair)
    gguf = None
    if llama_cpp:  # before minutes of model loading
        gguf = llama_cpp_gguf or str(Path(target.path).parent / "target.gguf")
        if not Path(gguf).is_file():
            raise click.UsageError(
                f"--llama-cpp: no GGUF file at {gguf}; give --llama-cpp-gguf, or install the pair "
                f"again keeping it: pipeline models install {pair} --force --keep-gguf"
            )
    loaded = load_pair(
        target,
        draft,
        dtype=dtype,
        device="auto",
        batch_invariant=batch_invariant,
        draft_int8=draft_int8,
        weights=weights,
        static_passes=static_passes,
    )
    click.echo(
        f"{pair}: {loaded.target_id} + {loaded.draft_id}, {loaded.dtype}, {loaded.device}, "
        f"{torch.get_num_threads()} threads, "
        + ("batch-invariant target" if loaded.batch_invariant else "stock kernels")
        + (", int8 draft steps" if loaded.draft_int8 else "")
        + (", streamed linears" if loaded.streamed else "")
        + (", target on its GGUF blocks" if loaded.weights == "gguf-blocks" else "")
        + (", static passes" if loaded.static_passes else "")
    )
    runner = LlamaCpp(gguf, torch.get_num_threads(), context=2048) if gguf else None
    # HF's rows run the models as `transformers` loads them, not on our kernels
    hf_models = None
    if loaded.streamed:
        hf_models = tuple(
            load_model(r, dtype=loaded.dtype, device=loaded.device) if r else None for r in (target, draft)
        )
    machine = describe_machine(loaded)  # now: the commit that runs, whatever the tree becomes during the run
    click.echo(HEADER)
    result = run_benchmark(
        loaded,
        tasks=tuple(tasks.split(",")),
        docs=docs,
        corpus=corpus,
        batches=tuple(int(b) for b in batches.split(",")),
        max_new_tokens=max_new_tokens,
        runs=runs,
        hf_assistant_tokens=_ints(hf_assistant_tokens),
        hf_lookup_tokens=_ints(hf_lookup_tokens),
        drafters=tuple(d for d in drafters.split(",") if d),
        draft_vocab=draft_vocab,
        warm_docs=warm_docs,
        hf_models=hf_models,
        llama_cpp=runner,
        hf=hf,
        log=click.echo,
    )
    meta = {
        "pair": pair,
        "models": loaded.manifest(),
        "machine": machine,
        "command": command,
        "date": date,
        "tasks": tasks.split(","),
        "corpus": corpus,
        "docs": docs,
        "batches": list(_ints(batches)),
        "max_new_tokens": max_new_tokens,
        "runs": runs,
        "drafters": [d for d in drafters.split(",") if d],
        "draft_vocab": draft_vocab,
        "warm_docs": warm_docs,
        "hf_assistant_tokens": list(_ints(hf_assistant_tokens)),
        "hf_lookup_tokens": list(_ints(hf_lookup_tokens)),
        "weights": loaded.weights,
        "llama_cpp": f"llama-cpp-python {runner.version}, {Path(gguf).name}" if runner else "no",
    }
    click.echo("measured by the auto engine, seconds: " + describe_costs(result.costs["auto"]))
    for path in (out_path, report_path or out_path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_json(result, out_path, meta)
    click.echo(f"wrote {out_path}")
    if report_path:
        write_report(report_path, result, meta, out_path)
        click.echo(f"wrote {report_path}")


@main.command()
@click.option(
    "--pair", default="qwen2.5-coder", show_default=True, help="Named model pair (configs/models.yaml)."
)
@click.option("--batch", "batches", default="1,4,8", show_default=True, help="Batch sizes (rows per pass).")
@click.option(
    "--widths", default="1,2,4,8,16", show_default=True, help="New tokens per row in a pass (must include 1)."
)
@click.option("--context", default=400, show_default=True, help="Cached tokens per row under every pass.")
@click.option("--dtype", default="auto", show_default=True)
@click.option("--threads", type=int, default=None, help="torch threads (default: all cores).")
@click.option(
    "--weights",
    type=click.Choice(["auto", "gguf-blocks", "dense"]),
    default="auto",
    show_default=True,
    help="The target's weights (as models.weights in a job spec).",
)
@click.option(
    "--against",
    type=click.Choice(["gguf-blocks", "dense"]),
    help="Also time the target on these weights in the same process, in alternating rounds (one pass "
    "per shape each), and print the ratio of the passes: two settings compared on one drifting machine.",
)
@click.option(
    "--batch-invariant/--stock-kernels",
    default=None,
    help="Target numerics (default: as a job would load it; see models.batch_invariant).",
)
@click.option(
    "--static-passes/--dynamic-passes",
    default=None,
    help="Passes through fixed slots and shapes, CUDA graphs on a GPU (default: as a job would "
    "load it; see models.static_passes).",
)
@click.option("--runs", default=3, show_default=True, help="Timed passes per shape (median reported).")
@click.option("--json", "as_json", is_flag=True, help="Print the measurements as JSON instead of a table.")
@click.option("--out", "out_path", help="Also write the JSON to this file.")
@click.option(
    "--report",
    "report_path",
    type=click.Path(dir_okay=False),
    metavar="PATH.md",
    help="Also write a Markdown record (command, machine, table), e.g. docs/benchmarks/NAME.md, "
    "with the JSON beside it unless --out says where.",
)
def calibrate(
    pair,
    batches,
    widths,
    context,
    dtype,
    threads,
    weights,
    against,
    batch_invariant,
    static_passes,
    runs,
    as_json,
    out_path,
    report_path,
):
    """Measure what target passes and draft steps cost here, as a job would run them.

    Loads the pair as a job's actor does and times, with the engine's own runner, a target
    pass of every width at every batch size over --context cached tokens, the draft's steps,
    and both prefills; prints them with the speedup Leviathan et al.'s formula predicts at
    α 0.6 and 0.8 for the best γ. The result is also cached for actors on this machine.

    \b
    Example:
      pipeline calibrate --batch 1,8 --widths 1,2,4,8 --runs 3
    """
    import shlex
    from pathlib import Path

    import torch

    from pipeline.calibrate import (
        against_record,
        calibration_key,
        check_settings,
        format_table,
        measure,
        measure_alternating,
        save_cached,
        write_report,
    )
    from pipeline.models.loading import ModelError, load_pair, resolve_pair

    command = shlex.join(["pipeline", *sys.argv[1:]])
    out_path = out_path or (str(Path(report_path).with_suffix(".json")) if report_path else None)
    if threads:
        torch.set_num_threads(threads)
    batches, widths = _ints(batches), _ints(widths)
    try:
        check_settings(batches, widths, context, runs)
        target, draft = resolve_pair(pair)
        # as a job's actor loads it (pipeline/job/worker.py with a spec's default models fields)
        kernels = {"batch_invariant": batch_invariant, "static_passes": static_passes}
        loaded = load_pair(target, draft, dtype=dtype, device="auto", weights=weights, **kernels)
        if against:
            other = load_pair(target, None, dtype=dtype, device="auto", weights=against, **kernels)
            result, theirs = measure_alternating(
                [loaded, other], batches, widths, context, runs=runs, pair_name=pair
            )
            result["against"] = against_record(result, theirs)
        else:
            result = measure(loaded, batches, widths, context, runs, pair_name=pair)
    except (ModelError, ValueError) as exc:
        click.echo(f"pipeline calibrate: {exc}", err=True)
        sys.exit(EXIT_USAGE)
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
    if as_json:
        click.echo(text)
    else:
        machine = result["machine"]
        click.echo(
            f"{pair}: {loaded.target_id} + {loaded.draft_id}, {machine['dtype']}, {machine['device']}, "
            f"{machine['threads']} threads, {machine['cpu_model']}"
        )
        click.echo(format_table(result))
    wrote = "".join(f"; wrote {path}" for path in (out_path, report_path) if path)
    click.echo(f"cached as {cached}{wrote}", err=True)


@main.command()
@click.argument("run_output_url")
@click.option(
    "--pair",
    default="qwen2.5-coder",
    show_default=True,
    help="The pair whose draft to fine-tune; its target must be the one the run decoded with.",
)
@click.option("--out", "out_name", required=True, help="Name of the new local pair (models.pair, --pair).")
@click.option(
    "--holdout",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=0.1,
    show_default=True,
    help="Share of documents held out (by a hash of their id, at least one) for the evaluation.",
)
@click.option("--steps", type=click.IntRange(min=1), help="Optimizer steps (instead of --epochs).")
@click.option(
    "--epochs",
    type=click.FloatRange(min=0, min_open=True),
    help="Passes over the training documents (default 1 when --steps is not given).",
)
@click.option("--lora-rank", default=16, show_default=True, type=click.IntRange(min=1), help="LoRA rank.")
@click.option("--full", is_flag=True, help="Fine-tune every weight instead of LoRA adapters.")
@click.option(
    "--lr", type=click.FloatRange(min=0, min_open=True), help="AdamW learning rate [2e-4 LoRA, 2e-5 full]."
)
@click.option(
    "--batch-size", default=4, show_default=True, type=click.IntRange(min=1), help="Documents per step."
)
@click.option(
    "--max-seconds",
    type=click.FloatRange(min=0, min_open=True),
    help="Stop training after this long (the evaluation comes after).",
)
@click.option("--seed", default=0, show_default=True, help="Seed of the adapters' start and the shuffling.")
@click.option(
    "--runs", default=1, show_default=True, type=click.IntRange(min=1), help="Evaluation runs (median time)."
)
@click.option(
    "--eval-max-new-tokens",
    type=click.IntRange(min=1),
    help="Tokens per held-out document in the evaluation (default: the run's max_new_tokens). "
    "The draft's prefill is paid once per document: on a CPU, short completions hide what a "
    "better draft saves.",
)
@click.option("--force", is_flag=True, help="Replace a local pair of the same name.")
@click.option("--json", "as_json", is_flag=True, help="Print the provenance and evaluation as JSON.")
@click.option(
    "--report",
    "report_path",
    type=click.Path(dir_okay=False),
    metavar="PATH.md",
    help="Also write a Markdown record (command, machine, loss curve, evaluation), e.g. "
    "docs/benchmarks/distill-DATE.md, with distill.json's copy beside it (PATH.json).",
)
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: only on a terminal).")
@storage_option
def distill(
    run_output_url,
    pair,
    out_name,
    holdout,
    steps,
    epochs,
    lora_rank,
    full,
    lr,
    batch_size,
    max_seconds,
    seed,
    runs,
    eval_max_new_tokens,
    force,
    as_json,
    report_path,
    progress,
    storage_options,
):
    """Fine-tune PAIR's draft on the run at RUN_OUTPUT_URL and install it as the local pair OUT.

    Prompts are rebuilt with the run's own task and template; the completions are the target's
    outputs. LoRA adapters (merged at the end) or all weights learn them; then the old and the
    new draft are compared on the held-out documents under the run's `draft_model` and `auto`
    settings at batch 1: α, acceptance by position, predicted and measured speedup, and every
    output checked equal to target-only. `distill.json` beside the new pair records it all.

    \b
    Example:
      pipeline distill ./out/licenses/RUN --pair qwen2.5-coder --out coder-licenses \\
          --max-seconds 2400 --report docs/benchmarks/distill-2026-11-26.md
    """
    import shlex

    from pipeline.distill import Settings, write_report
    from pipeline.distill import distill as run_distill
    from pipeline.models.loading import ModelError

    settings = Settings(
        holdout=holdout,
        steps=steps,
        epochs=epochs,
        lora_rank=lora_rank,
        full=full,
        lr=lr,
        batch_size=batch_size,
        max_seconds=max_seconds,
        seed=seed,
        runs=runs,
        eval_max_new_tokens=eval_max_new_tokens,
        force=force,
        progress=sys.stderr.isatty() if progress is None else progress,
    )
    try:
        result = run_distill(
            run_output_url,
            pair,
            out_name,
            settings,
            storage_options=_parse_storage_options(storage_options),
            command=shlex.join(["pipeline", *sys.argv[1:]]),
            log=lambda line: click.echo(line, err=as_json),
        )
    except (ModelError, StorageError) as exc:
        click.echo(f"pipeline distill: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    if report_path:
        json_path = write_report(report_path, result)
        click.echo(f"wrote {report_path} and {json_path}", err=True)
    if as_json:
        click.echo(json.dumps(result, indent=2))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _register_models() -> None:
    from pipeline.models.install import models

    main.add_command(models)


_register_models()


if __name__ == "__main__":  # `python -m pipeline.cli` (used as a Ray job entrypoint)
    main()
