"""One writer per output (issue 22, item 6): the lease under the output prefix, on local files
and on the loopback S3 servers. Real drivers (the CLI in a subprocess on the session's local
Ray), real files and objects, real process ids.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
import ray
from click.testing import CliRunner
from pipeline_helpers import DOCS, job_dict

from pipeline.cli import main
from pipeline.job.lease import LEASE_NAME, Lease, LeaseHeld, LeaseLost
from pipeline.storage import Storage

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(params=["local", "s3"])
def prefix(request, tmp_path):
    """(storage options, URL maker) for a place on local disk or on the loopback moto server."""
    if request.param == "local":
        return {}, lambda name: str(tmp_path / name)
    s3 = request.getfixturevalue("s3_server")
    bucket = s3.make_bucket("lease")
    return s3.storage_options, lambda name: f"s3://{bucket}/{name}"


def lease_record(run_id: str, host: str, pid: int, heartbeat_age: float) -> dict:
    now = time.time()
    return {
        "run_id": run_id,
        "host": host,
        "pid": pid,
        "pid_start": "",
        "started": now - heartbeat_age - 60,
        "heartbeat": now - heartbeat_age,
        "token": "someone-else",
    }


def dead_pid() -> int:
    """The pid of a process of this host that has ended and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("storage", ["local", "s3", "weed"])
def test_lease_is_exclusive_heartbeats_and_takes_over_stale_holders(storage, tmp_path, request, capfd):
    if storage == "local":
        out = Storage(str(tmp_path / "out"))
    else:
        server = request.getfixturevalue("s3_server" if storage == "s3" else "weed_s3")
        out = Storage(f"s3://{server.make_bucket('lease')}/out", server.storage_options)

    first = Lease(out, "first", timeout_minutes=0.05)  # 3 s; a heartbeat every 0.6 s
    first.acquire()
    written = json.loads(out.read_bytes(LEASE_NAME))
    assert (written["run_id"], written["pid"], written["host"]) == (
        "first",
        os.getpid(),
        socket.gethostname(),
    )
    with pytest.raises(
        LeaseHeld, match=r"in use by run 'first' \(host .+, pid \d+, last heartbeat \d+ s ago\)"
    ):
        Lease(out, "second").acquire()
    time.sleep(1.5)
    assert json.loads(out.read_bytes(LEASE_NAME))["heartbeat"] > written["heartbeat"]
    assert out.conditional_writes == "atomic", "this server should support conditional PUTs"
    assert out.write_if(LEASE_NAME, b"{}", None) is None  # If-None-Match: * is enforced
    assert out.write_if(LEASE_NAME, b"{}", '"0123"') is None  # and If-Match

    # a driver that took the lease over (first's heartbeat stalled): first finds out and stops
    current = out.read_versioned(LEASE_NAME)
    taken = lease_record("usurper", "other-host", 1, 0)
    assert out.write_if(LEASE_NAME, json.dumps(taken).encode(), current.version) is not None
    time.sleep(1.5)
    with pytest.raises(LeaseLost, match="taken over by run 'usurper' \\(host other-host"):
        first.check()
    first.release()  # gives back nothing: it is not ours any more
    assert json.loads(out.read_bytes(LEASE_NAME))["run_id"] == "usurper"
    capfd.readouterr()

    # stale: a heartbeat older than the timeout, or a holder on this host whose process is gone
    for holder, why in [
        (lease_record("old", "other-host", 1, 3600), "no heartbeat for 60 min"),
        (lease_record("killed", socket.gethostname(), dead_pid(), 1), "on this host is gone"),
    ]:
        out.write_bytes(LEASE_NAME, json.dumps(holder).encode())
        with Lease(out, "taker") as taker:
            assert json.loads(out.read_bytes(LEASE_NAME))["token"] == taker.token
        warning = capfd.readouterr().err
        assert f"warning: taking over the lease of {out.url} from run {holder['run_id']!r}" in warning
        assert why in warning
        assert not out.exists(LEASE_NAME)  # released


def spec_file(tmp_path: Path, tiny_pair_dirs, input_url: str, output_url: str, options: dict) -> Path:
    data = job_dict(tiny_pair_dirs, input_url, output_url)
    data["input"] = {"url": input_url, "keep_columns": [], "storage_options": options}
    data["output"] = {"url": output_url, "storage_options": options}
    data["generation"]["max_new_tokens"] = 24  # long enough for the second driver to meet the first
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(data))
    return path


def write_input(inp: Storage, shards: int) -> None:
    for s in range(shards):
        inp.write_parquet(
            f"part-{s:03d}.parquet", pa.table({"id": [f"s{s}r{r}" for r in range(3)], "text": DOCS[:3]})
        )


def test_a_second_driver_is_refused_and_the_first_finishes(prefix, tiny_pair_dirs, tmp_path, ray_local):
    options, url = prefix
    write_input(Storage(url("in"), options), shards=4)
    path = spec_file(tmp_path, tiny_pair_dirs, url("in"), url("out"), options)
    out = Storage(url("out"), options)
    command = [sys.executable, "-m", "pipeline.cli", "run", str(path), "--no-progress"]
    command += ["--address", ray.get_runtime_context().gcs_address]
    first = subprocess.Popen(
        [*command, "--run-id", "first-run"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 120
    while not out.exists(LEASE_NAME):
        assert first.poll() is None, first.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the first driver never took the lease"
        time.sleep(0.05)

    runner = CliRunner()
    for extra in ([], ["--overwrite"]):  # --overwrite never runs under another's lease either
        second = runner.invoke(main, ["run", str(path), "--no-progress", "--run-id", "second-run", *extra])
        assert second.exit_code == 2, second.output
        assert (
            f"output.url: {out.url} is in use by run 'first-run' (host {socket.gethostname()}, "
            in second.output
        )
        assert f"pid {first.pid}, last heartbeat" in second.output and "Traceback" not in second.output
    assert first.poll() is None, "the first driver ended before the second one was refused"

    assert first.wait(timeout=300) == 0, first.stdout.read().decode()[-3000:]
    assert out.exists("_SUCCESS") and len(out.list("stats")) == 4
    assert out.read_json("manifest.json")["run_id"] == "first-run"
    assert not out.exists(LEASE_NAME)


def test_a_stale_lease_is_taken_over_by_the_cli(prefix, tiny_pair_dirs, tmp_path, ray_local):
    options, url = prefix
    write_input(Storage(url("in"), options), shards=1)
    path = spec_file(tmp_path, tiny_pair_dirs, url("in"), url("out"), options)
    out = Storage(url("out"), options)
    out.write_bytes(LEASE_NAME, json.dumps(lease_record("crashed", "other-host", 4242, 120)).encode())
    runner = CliRunner()
    refused = runner.invoke(main, ["run", str(path), "--no-progress", "--overwrite"])
    assert refused.exit_code == 2 and "in use by run 'crashed' (host other-host, pid 4242" in refused.output
    assert "last heartbeat 2 min ago" in refused.output

    ran = runner.invoke(main, ["run", str(path), "--no-progress", "--overwrite", "--lease-timeout", "1"])
    assert ran.exit_code == 0, ran.output
    assert "warning: taking over the lease" in ran.output and "no heartbeat for 2 min" in ran.output
    assert out.exists("_SUCCESS") and not out.exists(LEASE_NAME)
