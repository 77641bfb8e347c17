"""Several nodes (issue 38): a head and two worker nodes on this machine, each a raylet of its
own (`ray.cluster_utils.Cluster`), a job whose model actors spread over the workers, a worker
node killed mid-job (its raylet, actors and object store at once) and a new one joining."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline_helpers import assert_exactly_once, clean_corpus, ids_in, job_dict

from pipeline.storage import Storage

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def cluster():
    """A head with no CPUs (as a user's head would be) and two 1-CPU worker nodes."""
    from ray.cluster_utils import Cluster

    # a lost node declared dead after ~2 s of missed health checks rather than Ray's ~15 s: only
    # then does Ray restart its actors elsewhere, and the test need not outlast that
    checks = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}
    head = {"num_cpus": 0, "include_dashboard": False, "_system_config": checks}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def _start_job(cluster, tiny_pair_dirs, tmp_path, shards: int) -> tuple[subprocess.Popen, Storage, set[str]]:
    expected = clean_corpus(Storage(str(tmp_path / "in")), shards=shards, rows=1)
    data = job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out" / "{run_id}"), num_actors=2)
    data["input"]["keep_columns"] = []
    data["generation"]["max_new_tokens"] = 24  # shards long enough that a kill finds one in flight
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps(data))
    command = [sys.executable, "-m", "pipeline.cli", "run", str(spec), "--run-id", "nodes", "--no-progress"]
    command += ["--address", cluster.address]
    driver = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return driver, Storage(str(tmp_path / "out" / "nodes")), expected


def _nodes(out: Storage) -> list[str]:
    return [out.read_json(n)["worker"]["node"] for n in out.list("stats")]


def test_actors_spread_and_a_lost_node_costs_no_row(cluster, tiny_pair_dirs, tmp_path):
    # work enough left after the kill for the restarted actor to load its models and take some
    driver, out, expected = _start_job(cluster, tiny_pair_dirs, tmp_path, shards=80)
    workers = [n for n in cluster.list_all_nodes() if n is not cluster.head_node]
    began = time.monotonic()
    # until both actors (one per worker node: spread) have finished shards, 4 at least
    while driver.poll() is None and time.monotonic() - began < 240:
        done = _nodes(out)
        if len(done) >= 4 and len(set(done)) == 2:
            break
        time.sleep(0.1)
    assert driver.poll() is None, driver.communicate()[0].decode()[-3000:]
    assert set(_nodes(out)) == {w.node_id for w in workers}  # spread: both workers decoded
    cluster.remove_node(workers[0], allow_graceful=False)  # SIGKILL: raylet, actors, object store
    joined = cluster.add_node(num_cpus=1)  # where Ray may restart the lost actor
    log = driver.communicate(timeout=400)[0].decode()
    assert driver.returncode == 0, log[-3000:]
    assert out.exists("_SUCCESS")
    assert_exactly_once(out, expected)
    manifest = out.read_json("manifest.json")
    assert manifest["failed"] == [] and manifest["totals"]["rows_out"] == len(ids_in(out, "outputs"))
    # the shard in flight on the lost node went back on the queue, named with its node
    retried_on = {r["node"] for r in manifest["retried"]}
    assert manifest["retried"] and retried_on == {workers[0].node_id}, log[-3000:]
    assert all(r["reason"].startswith("model actor died") for r in manifest["retried"])
    assert [lost["node"] for lost in manifest["nodes_lost"]] == [workers[0].node_id]
    # both workers decoded; the joined node takes work only once Ray has restarted the lost actor
    # there (its models loaded), which a loaded CI machine may not reach before the job ends
    nodes = set(_nodes(out))
    assert {w.node_id for w in workers} <= nodes <= {*(w.node_id for w in workers), joined.node_id}
