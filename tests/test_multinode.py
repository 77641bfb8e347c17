"""Several nodes (issue 38): a head and two worker nodes on this machine, each a raylet of its
own (`ray.cluster_utils.Cluster`), a job whose model actors spread over the workers; then a
worker node killed mid-job (its raylet, actors and object store at once) and a new one joining,
or a worker node drained as a spot node's preemption notice would drain it.

The input sits behind the loopback S3 proxy, whose `hold()` stops every reader mid-shard for as
long as a test needs: so what each actor holds when a node goes is known, not raced for, and a
node that joins takes a shard before the others can finish the job without it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline_helpers import assert_exactly_once, clean_corpus, ids_in, job_dict
from s3_fixtures import free_ports

from pipeline.storage import Storage

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def cluster(s3_server):  # after s3_server: the nodes' processes inherit its test credentials
    """A head with no CPUs (as a user's head would be) and the Jobs API, and two 1-CPU workers."""
    from ray.cluster_utils import Cluster

    # a lost node declared dead after ~2 s of missed health checks rather than Ray's ~15 s: only
    # then does Ray restart its actors elsewhere, and the test need not outlast that
    checks = {"health_check_period_ms": 500, "health_check_failure_threshold": 4}
    # ports of its own for the Jobs API and the head's dashboard agent: the agent's default
    # (52365) may be held by another test's Ray, and a head without its agent takes no job
    dashboard, agent = free_ports(2)
    head = {
        "num_cpus": 0,
        "include_dashboard": True,
        "dashboard_host": "127.0.0.1",
        "dashboard_port": dashboard,
        "dashboard_agent_listen_port": agent,
        "_system_config": checks,
    }
    cluster = Cluster(initialize_head=True, head_node_args=head)
    cluster.dashboard = f"http://127.0.0.1:{dashboard}"
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


def _job(tiny_pair_dirs, tmp_path, s3, shards: int) -> tuple[Path, Storage, set[str]]:
    """A job of `shards` one-row shards read from S3 through the proxy `s3`, two actors."""
    bucket = s3.make_bucket("nodes")
    expected = clean_corpus(Storage(f"s3://{bucket}/in", s3.storage_options), shards=shards, rows=1)
    data = job_dict(tiny_pair_dirs, f"s3://{bucket}/in", str(tmp_path / "out" / "{run_id}"), num_actors=2)
    data["input"].update(keep_columns=[], storage_options=s3.storage_options)
    data["generation"]["max_new_tokens"] = 24
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps(data))
    return spec, Storage(str(tmp_path / "out" / "nodes")), expected


def _pipeline(*args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "pipeline.cli", *args, "--run-id", "nodes", "--no-progress"]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _nodes(out: Storage) -> list[str]:
    return [out.read_json(n)["worker"]["node"] for n in out.list("stats")]


def _until(condition, driver: subprocess.Popen, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if driver.poll() is not None:
            pytest.fail(f"the job ended while waiting for {what}: {driver.communicate()[0].decode()[-3000:]}")
        if time.monotonic() > deadline:
            driver.kill()
            pytest.fail(f"no {what} in {seconds} s: {driver.communicate()[0].decode()[-3000:]}")
        time.sleep(0.1)


def _both_workers_decoded(out: Storage, workers) -> bool:
    done = _nodes(out)
    return all(done.count(w.node_id) >= 2 for w in workers)  # spread: one actor on each


def _finished(driver: subprocess.Popen, out: Storage, expected: set[str]) -> tuple[dict, str]:
    log = driver.communicate(timeout=400)[0].decode()
    assert driver.returncode == 0, log[-3000:]
    assert out.exists("_SUCCESS")
    assert_exactly_once(out, expected)
    manifest = out.read_json("manifest.json")
    assert manifest["failed"] == [] and manifest["totals"]["rows_out"] == len(ids_in(out, "outputs"))
    return manifest, log


def test_a_lost_node_costs_no_row_and_a_joined_node_takes_work(cluster, faulty_s3, tiny_pair_dirs, tmp_path):
    spec, out, expected = _job(tiny_pair_dirs, tmp_path, faulty_s3, shards=20)
    # submitted through the head's Jobs API, as a user's cluster runs it
    driver = _pipeline("submit", str(spec), "--address", cluster.dashboard, "--wait")
    workers = [n for n in cluster.list_all_nodes() if n is not cluster.head_node]
    _until(lambda: _both_workers_decoded(out, workers), driver, 300, "shards from both workers")
    faulty_s3.hold()  # each actor now stops in its next shard's first read
    _until(lambda: len(faulty_s3.held_paths) >= 2, driver, 60, "both actors in a shard")
    cluster.remove_node(workers[0], allow_graceful=False)  # SIGKILL: raylet, actors, object store
    joined = cluster.add_node(num_cpus=1)  # the only room left: Ray restarts the lost actor there
    # a third shard read: the restarted actor, on the joined node, took a shard (the survivor is
    # still held in its own, and the lost actor's went back on the queue)
    _until(lambda: len(faulty_s3.held_paths) >= 3, driver, 240, "a shard on the joined node")
    faulty_s3.release()
    manifest, log = _finished(driver, out, expected)
    # the shard in flight on the lost node went back on the queue, named with its node
    assert [r["node"] for r in manifest["retried"]] == [workers[0].node_id], log[-3000:]
    assert manifest["retried"][0]["reason"].startswith("model actor died")
    assert [lost["node"] for lost in manifest["nodes_lost"]] == [workers[0].node_id]
    assert set(_nodes(out)) == {*(w.node_id for w in workers), joined.node_id}


def test_a_draining_node_hands_its_shard_back_and_costs_no_attempt(
    cluster, faulty_s3, tiny_pair_dirs, tmp_path
):
    spec, out, expected = _job(tiny_pair_dirs, tmp_path, faulty_s3, shards=20)
    driver = _pipeline("run", str(spec), "--address", cluster.address)
    workers = [n for n in cluster.list_all_nodes() if n is not cluster.head_node]
    drained = workers[0]
    _until(lambda: _both_workers_decoded(out, workers), driver, 300, "shards from both workers")
    faulty_s3.hold()
    _until(lambda: len(faulty_s3.held_paths) >= 2, driver, 60, "both actors in a shard")
    decoded_there = _nodes(out).count(drained.node_id)
    # the preemption notice: Ray's drain, with the deadline a spot node gets (here 5 s)
    ray_bin = str(Path(sys.executable).parent / "ray")
    notice = [ray_bin, "drain-node", "--address", cluster.address, "--node-id", drained.node_id]
    notice += ["--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot preemption notice"]
    subprocess.run(
        [*notice, "--deadline-remaining-seconds", "5"], check=True, capture_output=True, timeout=60
    )
    time.sleep(6)  # past the deadline: its actor's shard, held all along, must be back on the queue
    cluster.remove_node(drained, allow_graceful=False)  # the preemption itself
    faulty_s3.release()
    manifest, log = _finished(driver, out, expected)
    assert manifest["retried"] == [], log[-3000:]  # no attempt spent on the node's going
    (back,) = manifest["handed_back"]
    assert back["node"] == drained.node_id and back["attempt"] == 1
    (drain,) = manifest["nodes_drained"]
    assert drain["node"] == drained.node_id and drain["shards_handed_back"] == [back["shard"]]
    assert drain["actors_retired"] == 1 and drain["deadline"] - drain["noticed"] <= 5
    assert _nodes(out).count(drained.node_id) == decoded_there  # no shard started there after
    assert back["shard"] in {Path(n).stem for n in out.list("stats")}
    assert "handed back from draining node" in log
