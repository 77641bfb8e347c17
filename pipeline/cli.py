"""`pipeline`: run, submit and inspect speculative-decoding batch jobs.

Exit codes: 0 success, 1 the job ran but failed (some shard failed, or the cluster job
failed), 2 usage or job-spec error (nothing was started).
"""

from __future__ import annotations

import json
import os
import sys

import click

from pipeline.cli_common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, parse_storage_options, storage_option
from pipeline.job.lease import DEFAULT_TIMEOUT_MINUTES, LeaseHeld, LeaseLost
from pipeline.lab.cli import bench, calibrate, distill
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
    from pipeline.job.layout import OUTPUTS_DIR, STATS_DIR

    where = result.output_url
    click.echo(f"outputs: {where}/{OUTPUTS_DIR}   stats: {where}/{STATS_DIR}", err=True)


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
@storage_option
def status(job_id, address, storage_options):
    """Show a submitted job's state and its shards' progress, read from its input and output
    with the storage options it was submitted with (and any given here)."""
    from pipeline.cluster.jobs_api import job_status

    try:
        info = job_status(address, job_id, parse_storage_options(storage_options))
    except (StorageError, ValueError) as exc:
        click.echo(f"pipeline status: {exc}", err=True)
        sys.exit(EXIT_FAILED)
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
        store = Storage(output_url, parse_storage_options(storage_options))
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

    options = parse_storage_options(storage_options)
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
@click.option("--rows", default=6, show_default=True, help="Documents per shard.")
def demo_data(out, shards, rows):
    """Write a demo corpus (standard-library module docstrings) as Parquet shards."""
    from pipeline.demo_data import write_demo_data

    for path in write_demo_data(out, shards, rows):
        click.echo(path)


def _register_models() -> None:
    from pipeline.models.install import models

    main.add_command(models)


_register_models()
for command in (bench, calibrate, distill):  # the lab's commands (pipeline/lab/cli.py)
    main.add_command(command)


if __name__ == "__main__":  # `python -m pipeline.cli` (used as a Ray job entrypoint)
    main()
