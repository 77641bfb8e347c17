"""`pipeline submit --address` against a real `ray start --head` on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner
from s3_fixtures import free_ports

from pipeline.cli import main
from pipeline.storage import Storage

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def ray_head():
    """A real Ray head with the dashboard (Jobs API) on loopback; stopped afterwards."""
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ray_bin = str(Path(sys.executable).parent / "ray")
    # every port chosen here: Ray's defaults (e.g. the agent's 52365) may still be held by a
    # Ray that an earlier test shut down a moment ago
    gcs, dashboard, agent, metrics = free_ports(4)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    started = subprocess.run(
        [
            ray_bin,
            "start",
            "--head",
            f"--port={gcs}",
            "--num-cpus=2",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            f"--dashboard-agent-listen-port={agent}",
            f"--metrics-export-port={metrics}",
            "--disable-usage-stats",
            f"--temp-dir={temp_dir}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 0, started.stderr[-3000:]
    try:
        yield f"http://127.0.0.1:{dashboard}"
    finally:
        stop_processes_under(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def stop_processes_under(temp_dir: str) -> None:
    """Stop this head's processes only. `ray stop` stops every Ray on the machine, the test
    session's own included; the head's processes name its temp dir on their command lines."""
    procs = {p for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])}
    for p in list(procs):
        try:
            procs.update(p.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=15)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=15)


def test_submit_to_a_ray_head_and_wait(tiny_pair_dirs, tmp_path, ray_head, monkeypatch):
    import pyarrow as pa

    Storage(str(tmp_path / "in")).write_parquet(
        "part-0.parquet", pa.table({"id": ["x", "y"], "text": ["The quick brown fox.", "Data teams."]})
    )
    target, draft = tiny_pair_dirs
    spec = {
        "name": "submitted",
        "input": {"url": str(tmp_path / "in")},
        "task": {"kind": "summarize"},
        "generation": {"max_new_tokens": 6},
        "models": {"target": str(target), "draft": str(draft), "dtype": "float32", "device": "cpu"},
        "execution": {"num_actors": 1, "num_cpus": 1},
        "output": {"url": str(tmp_path / "out" / "{run_id}")},
    }
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(json.dumps(spec))
    monkeypatch.chdir(REPO)  # the project directory travels as the job's working_dir
    result = CliRunner().invoke(
        main,
        ["submit", str(spec_path), "--address", ray_head, "--run-id", "sub1", "--wait", "--progress"]
        + ["--lease-timeout", "7.5"],
    )
    assert result.exit_code == 0, result.output
    job_id = re.search(r"^(raysubmit_\w+)$", result.stdout, re.M).group(1)
    from pipeline.cluster.jobs_api import _client

    assert "--lease-timeout 7.5" in _client(ray_head).get_job_info(job_id).entrypoint
    out = Storage(str(tmp_path / "out" / "sub1"))
    assert out.exists("_SUCCESS")
    assert out.read_json("stats/part-0.json")["rows_out"] == 2

    status = CliRunner().invoke(main, ["status", job_id, "--address", ray_head])
    assert status.exit_code == 0, status.output
    assert "SUCCEEDED" in status.output and "shards_done" in status.output
    assert "shards_failed: 0" in status.output
    assert re.search(r"1/1 \[[^]]*shard", result.stderr)  # the final state of the progress bar


def test_status_reads_s3_with_the_storage_options_the_job_was_submitted_with(s3_server, monkeypatch):
    """A MinIO-style endpoint given only in the spec's storage_options: `pipeline status` reads
    the job's stats and lists its input there (before, it read with none and failed)."""
    import types

    import pyarrow as pa

    from pipeline.cluster import jobs_api

    bucket = s3_server.make_bucket("status")
    options = s3_server.storage_options
    Storage(f"s3://{bucket}/in", options).write_parquet(
        "part-0.parquet", pa.table({"id": ["a"], "text": ["x"]})
    )
    Storage(f"s3://{bucket}/in", options).write_parquet(
        "part-1.parquet", pa.table({"id": ["b"], "text": ["y"]})
    )
    out = Storage(f"s3://{bucket}/out", options)
    out.write_bytes(
        "stats/part-0.json", (Path(__file__).parent / "data/demo-run/stats/part-00000.json").read_bytes()
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_ports(1)[0]}")  # nothing listens there
    metadata = {"input_url": f"s3://{bucket}/in", "output_url": f"s3://{bucket}/out"}
    info = types.SimpleNamespace(
        metadata=metadata,
        status=types.SimpleNamespace(value="RUNNING"),
        message="",
        start_time=None,
        end_time=None,
    )
    client = types.SimpleNamespace(get_job_info=lambda job_id: info)
    monkeypatch.setattr(jobs_api, "_client", lambda address: client)
    monkeypatch.setattr(jobs_api.time, "time", lambda: 0.0)

    metadata["storage_options"] = json.dumps({"input": options, "output": options})  # as `submit` writes it
    result = CliRunner().invoke(main, ["status", "raysubmit_x", "--address", "http://127.0.0.1:1"])
    assert result.exit_code == 0, result.output
    assert "shards_done: 1" in result.output and "shards_remaining: 1" in result.output

    del metadata["storage_options"]  # a job submitted without them: given on the command line
    args = ["status", "raysubmit_x", "--address", "http://127.0.0.1:1"]
    result = CliRunner().invoke(main, [*args, "--storage-option", f"endpoint_url={s3_server.endpoint}"])
    assert result.exit_code == 0 and "shards_done: 1" in result.output, result.output


def test_no_address_starts_an_embedded_ray_even_where_a_cluster_address_is_recorded():
    """`ray start` records its address in <tmp>/ray/ray_current_cluster, and a bare ray.init()
    joins whatever is recorded there (here a dead one). The embedded default must not."""
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    try:
        os.makedirs(f"{temp_dir}/ray")
        Path(f"{temp_dir}/ray/ray_current_cluster").write_text("127.0.0.1:9")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(RAY_TMPDIR=temp_dir, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
        code = (
            "import ray\nfrom pipeline.job.executor import ensure_ray\n"
            "print('started', ensure_ray(None, num_cpus=1), ray.cluster_resources()['CPU'])\nray.shutdown()"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
        )
        assert "started True 1.0" in done.stdout, done.stderr[-3000:]
    finally:
        stop_processes_under(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
