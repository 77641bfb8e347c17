"""Nothing lost, nothing duplicated: a killed driver, a flaky and a misconfigured S3, a driver
that loses its storage, and credentials that must never leak. Real processes throughout: a real
local Ray, real SIGKILLs, a real S3 server behind a fault-injecting proxy on loopback. (Killed
actors are tests/test_executor.py's, out-of-memory batches tests/test_shard.py's.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import ray
from click.testing import CliRunner
from pipeline_helpers import (
    assert_exactly_once,
    check_output,
    clean_corpus,
    job_dict,
    write_corpus,
)
from s3_fixtures import TEST_KEY_ID, TEST_SECRET

from pipeline.cli import main
from pipeline.job.executor import run_job
from pipeline.spec import spec_from_dict
from pipeline.storage import Storage

REPO = Path(__file__).resolve().parent.parent


def test_driver_sigkill_then_resume(tiny_pair_dirs, tmp_path, ray_local):
    """kill -9 the driver mid-job; the same command again finishes the job, every row once."""
    expected = clean_corpus(Storage(str(tmp_path / "in")), shards=8, rows=3)
    spec_path = tmp_path / "job.yaml"
    data = job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out") + "/{run_id}")
    data["input"]["keep_columns"] = []
    spec_path.write_text(json.dumps(data))
    address = ray.get_runtime_context().gcs_address
    command = [sys.executable, "-m", "pipeline.cli", "run", str(spec_path), "--run-id", "nightly-1"]
    command += ["--address", address, "--no-progress"]
    out = Storage(str(tmp_path / "out" / "nightly-1"))

    driver = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while len(out.list("stats")) < 2:
        assert driver.poll() is None, driver.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the job never got going"
        time.sleep(0.05)
    driver.send_signal(signal.SIGKILL)
    driver.wait(timeout=30)
    done_at_kill = len(out.list("stats"))
    assert done_at_kill < 8 and not out.exists("_SUCCESS")

    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already complete and were skipped" in again.stderr
    assert out.exists("_SUCCESS") and len(out.list("stats")) == 8
    assert_exactly_once(out, expected)
    manifest = out.read_json("manifest.json")
    assert manifest["shards_skipped"] >= 2 and manifest["totals"]["rows_out"] == len(expected)


def test_job_through_a_flaky_s3(tiny_models, tiny_pair_dirs, faulty_s3, ray_local):
    """5xx, throttling and connection resets on a share of requests: retried, nothing lost."""
    bucket = faulty_s3.make_bucket("flaky")
    rows_in = write_corpus(Storage(f"s3://{bucket}/docs", faulty_s3.upstream.storage_options))
    data = job_dict(tiny_pair_dirs, f"s3://{bucket}/docs/", f"s3://{bucket}/out")
    data["input"]["storage_options"] = dict(faulty_s3.storage_options)
    data["output"] = {"url": f"s3://{bucket}/out", "storage_options": dict(faulty_s3.storage_options)}
    spec = spec_from_dict(data)
    faulty_s3.set_fault_rate(0.1)
    result = run_job(spec, progress=False)
    faulty_s3.set_fault_rate(0.0)
    assert result.ok and len(result.done) == 4
    assert faulty_s3.injected >= 3, faulty_s3.injected_by_kind
    out = Storage(f"s3://{bucket}/out", faulty_s3.upstream.storage_options)
    check_output(tiny_models, spec, out, rows_in)


def test_permanent_s3_error_fails_fast_and_names_the_url_not_the_secret(tiny_pair_dirs, s3_server, tmp_path):
    bucket = s3_server.make_bucket("present")
    write_corpus(Storage(f"s3://{bucket}/docs", s3_server.storage_options))
    data = job_dict(tiny_pair_dirs, f"s3://{bucket}/docs/", "s3://no-such-bucket-here/out")
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(json.dumps(data))
    began = time.monotonic()
    result = CliRunner().invoke(main, ["run", str(spec_path), "--no-progress"])
    assert result.exit_code == 1
    assert time.monotonic() - began < 30
    assert "s3://no-such-bucket-here" in result.output
    assert "Traceback" not in result.output
    assert TEST_SECRET not in result.output and TEST_KEY_ID not in result.output


def test_credentials_never_written_or_logged(tiny_pair_dirs, s3_server, ray_local, tmp_path):
    """Run a job on S3 with credentials in the environment, then grep everything it produced."""
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == TEST_SECRET
    bucket = s3_server.make_bucket("secrets")
    write_corpus(Storage(f"s3://{bucket}/docs", s3_server.storage_options))
    data = job_dict(tiny_pair_dirs, f"s3://{bucket}/docs/", f"s3://{bucket}/out")
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(json.dumps(data))
    runner = CliRunner()
    outputs = [runner.invoke(main, ["run", str(spec_path), "--no-progress"])]
    assert outputs[0].exit_code == 0, outputs[0].output
    outputs.append(runner.invoke(main, ["stats", f"s3://{bucket}/out"]))
    outputs.append(runner.invoke(main, ["validate", str(spec_path), "--no-models"]))

    out = Storage(f"s3://{bucket}/out", s3_server.storage_options)
    written = {n: out.read_bytes(n) for n in out.list()}
    assert "manifest.json" in written and len(written) >= 12 and out.exists("_SUCCESS")
    logs = {
        str(p): p.read_bytes()
        # this session's Ray (not /tmp/ray/session_latest: under pytest-xdist, maybe another's)
        for p in Path(ray._private.worker._global_node.get_logs_dir_path()).rglob("*")
        if p.is_file() and p.stat().st_size < 50_000_000
    }
    assert logs, "no Ray logs found to check"
    for secret in (TEST_SECRET, TEST_KEY_ID):
        for result in outputs:
            assert secret not in result.output
        leaked = [n for n, b in {**written, **logs}.items() if secret.encode() in b]
        assert not leaked, f"{secret[:4]}... found in {leaked}"


def test_a_driver_that_loses_its_storage_stops_with_a_summary(tiny_pair_dirs, faulty_s3, ray_local, tmp_path):
    """Every request fails from mid-job on: exit 1, the shards done and not done, no traceback;
    once the storage is back, the same command finishes the job."""
    bucket = faulty_s3.make_bucket("lost")
    upstream = Storage(f"s3://{bucket}", faulty_s3.upstream.storage_options)
    expected = clean_corpus(upstream.child("in"), shards=6, rows=3)
    data = job_dict(tiny_pair_dirs, f"s3://{bucket}/in/", f"s3://{bucket}/out", max_retries=0)
    # botocore's own retries off (its waits start at 1 s): the pipeline's retries are the ones
    # under test, and the driver notices the outage sooner
    options = {**faulty_s3.storage_options, "config_kwargs": {"retries": {"total_max_attempts": 1}}}
    data["input"].update(keep_columns=[], storage_options=options)
    data["output"] = {"url": f"s3://{bucket}/out", "storage_options": options}
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(json.dumps(data))
    command = [sys.executable, "-m", "pipeline.cli", "run", str(spec_path), "--run-id", "lost-1"]
    command += ["--address", ray.get_runtime_context().gcs_address, "--no-progress"]
    env = dict(os.environ, PIPELINE_STORAGE_RETRIES="1", PIPELINE_STORAGE_RETRY_WAIT="0.05")
    out = upstream.child("out")

    driver = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 180
    while not out.list("stats"):
        assert driver.poll() is None, driver.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the job never got going"
        time.sleep(0.05)
    faulty_s3.set_fault_rate(1.0, kinds=("internal",))
    try:
        _, stderr = driver.communicate(timeout=240)
    finally:
        faulty_s3.set_fault_rate(0.0)
    assert driver.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr and "error: the job stopped: its storage failed: " in stderr
    assert f"s3://{bucket}/out" in stderr and "InternalError" in stderr
    done_line = next(line for line in stderr.splitlines() if "shard(s) done: " in line)
    not_done_line = next(line for line in stderr.splitlines() if " not done: " in line)
    done = done_line.split(": ", 1)[1].split(", ")
    not_done = not_done_line.split(": ", 1)[1].split(", ")
    assert done_line.strip().startswith(f"{len(done)} of 6 shard(s)") and not_done != ["none"]
    assert sorted(done + not_done) == [f"part-{s:03d}" for s in range(6)]
    assert all(out.exists(f"stats/{name}.json") for name in done)
    assert "resume with --run-id lost-1 once the storage is back" in stderr
    assert not out.exists("_SUCCESS")

    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "taking over the lease" in again.stderr  # the stopped driver could not release it
    assert out.exists("_SUCCESS")
    assert_exactly_once(out, expected)
