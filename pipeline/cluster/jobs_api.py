"""Submitting to and watching a Ray cluster through the Ray Jobs API."""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path

import click
from tenacity import retry, retry_if_exception, stop_after_delay, wait_exponential

from pipeline.spec import JobSpec
from pipeline.storage.secrets import redact_options

# What does not travel in the job's working_dir: environments, caches, local data and outputs.
WORKING_DIR_EXCLUDES = [".venv/", "out/", "data/", ".pipeline/", "**/__pycache__/", ".whl/", "*.gguf"]


def _auth_token() -> str | None:
    """The cluster token, from where Ray itself looks: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, then
    ~/.ray/auth_token. Heads started by `ray start` (Ray >= 2.5x) require it on the Jobs API."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    return path.read_text().strip() if path.is_file() else None


def _client(address: str):
    from ray.job_submission import JobSubmissionClient

    token = _auth_token()
    headers = {"authorization": f"Bearer {token}"} if token else None
    return JobSubmissionClient(address, headers=headers)


def _agent_not_ready(exc: BaseException) -> bool:
    # A head that has just started answers 500 "No available agent to submit job" until its
    # dashboard agent registers (seconds); a nightly schedule that starts the cluster and then
    # submits hits exactly that window.
    return isinstance(exc, RuntimeError) and "No available agent" in str(exc)


_retry_until_agent_ready = retry(
    retry=retry_if_exception(_agent_not_ready),
    wait=wait_exponential(multiplier=1, max=10),
    stop=stop_after_delay(120),
    reraise=True,
)


def submit_job(
    address: str, spec: JobSpec, spec_env: str, overwrite: bool, lease_timeout: float | None = None
) -> str:
    """Submit `pipeline run` for this (rendered) spec; return the job id.

    The spec travels in an environment variable, already validated, with its URLs rendered and
    local paths made absolute, so the cluster runs exactly what was validated here, whatever
    directory the spec file lives in. The project directory travels as the working_dir.
    """
    spec = spec.with_absolute_paths()
    entrypoint = [
        "python",
        "-m",
        "pipeline.cli",
        "run",
        f"env:{spec_env}",
        "--run-id",
        spec.run_id,
        "--date",
        spec.date,
    ]
    if overwrite:
        entrypoint.append("--overwrite")
    if lease_timeout is not None:
        entrypoint += ["--lease-timeout", repr(float(lease_timeout))]
    client = _client(address)
    return _retry_until_agent_ready(client.submit_job)(
        entrypoint=" ".join(shlex.quote(p) for p in entrypoint),
        runtime_env={
            "working_dir": ".",
            "excludes": WORKING_DIR_EXCLUDES,
            "env_vars": {spec_env: json.dumps(spec.to_dict())},
        },
        metadata={
            "pipeline_job": spec.name,
            "run_id": spec.run_id,
            "input_url": spec.input.url,
            "output_url": spec.output.url,
            # what `job_status` reads the outputs with (credential keys are refused by the spec)
            "storage_options": json.dumps(
                redact_options({"input": spec.input.storage_options, "output": spec.output.storage_options})
            ),
        },
    )


# A progress refresh reads every stats file and lists the input: not on every log poll.
PROGRESS_REFRESH_S = 30.0


def follow(address: str, job_id: str, poll_seconds: float = 2.0, progress: bool = False) -> str:
    """Print the job's logs as they grow until it reaches a terminal state; return that state.

    With ``progress``, a bar of shards finished (done or failed) out of the input's shards is
    kept under the logs, with failed shards, tokens/s, α and tqdm's ETA, from the job's stats.
    """
    from tqdm import tqdm

    client = _client(address)
    bar = tqdm(unit="shard", disable=not progress, dynamic_ncols=True)
    shown, last_poll = 0, 0.0
    try:
        while True:
            status = str(client.get_job_status(job_id).value)
            logs = client.get_job_logs(job_id)
            if len(logs) > shown:
                bar.write(logs[shown:].rstrip("\n"))
                shown = len(logs)
            done = status in ("SUCCEEDED", "FAILED", "STOPPED")
            if progress and (done or time.monotonic() - last_poll > PROGRESS_REFRESH_S):
                last_poll = time.monotonic()
                _update_bar(bar, job_status(address, job_id))
            if done:
                break
            time.sleep(poll_seconds)
    finally:
        bar.close()
    click.echo(f"job {job_id}: {status}", err=True)
    return status


def _update_bar(bar, info: dict) -> None:
    finished = info.get("shards_done", 0) + info.get("shards_failed", 0)
    if "shards_remaining" in info:
        bar.total = finished + info["shards_remaining"]
    bar.n = finished
    bar.set_postfix(
        failed=info.get("shards_failed", 0),
        tok_s=info.get("tokens_per_second", 0),
        alpha="-" if info.get("alpha") is None else info["alpha"],
        refresh=False,
    )
    bar.refresh()


def job_status(address: str, job_id: str, storage_options: dict | None = None) -> dict:
    """State of a submitted job plus progress read from its output's stats files, with the
    storage options the job was submitted with, updated by `storage_options` (for both URLs)."""
    from pipeline.job.layout import read_failed
    from pipeline.job.stats import JobTotals
    from pipeline.report.results import load_stats
    from pipeline.storage import Storage

    client = _client(address)
    info = client.get_job_info(job_id)
    meta = info.metadata or {}
    result = {"job_id": job_id, "state": str(info.status.value), "message": info.message or ""}
    output_url = meta.get("output_url")
    if not output_url:
        return result
    result["output_url"] = output_url
    submitted = json.loads(meta.get("storage_options") or "{}")
    options = {url: {**submitted.get(url, {}), **(storage_options or {})} for url in ("input", "output")}
    stats = load_stats(output_url, options["output"])
    totals = JobTotals.of(stats)
    decoded = totals.decoded
    done = len(stats)
    failed = len(read_failed(Storage(output_url, options["output"])))
    result["shards_done"] = done
    result["shards_failed"] = failed
    input_url = meta.get("input_url")
    if input_url:
        from pipeline.storage import list_shards

        total = len(list_shards(input_url, options["input"]))
        result["shards_remaining"] = max(total - done - failed, 0)
    elapsed = (time.time() - info.start_time / 1000) if info.start_time else None
    end = info.end_time / 1000 if info.end_time else None
    if end and info.start_time:
        elapsed = end - info.start_time / 1000
    if elapsed:
        result["rows_per_second"] = round(decoded.rows / elapsed, 3)
        result["tokens_per_second"] = round(decoded.new_tokens / elapsed, 2)
        remaining = result.get("shards_remaining")
        if remaining and done:
            result["eta_seconds"] = round(elapsed / done * remaining)
    result["alpha"] = None if decoded.alpha is None else round(decoded.alpha, 3)
    result["tau"] = round(decoded.tau, 3)
    result["rows_error"] = sum(s.rows_error for s in totals.shards)
    return result
