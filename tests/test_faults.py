"""Nothing lost, nothing duplicated: a killed driver, killed actors, out-of-memory batches, a
flaky and a misconfigured S3, and credentials that must never leak. Real processes throughout:
a real local Ray, real SIGKILLs, a real S3 server behind a fault-injecting proxy on loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pytest
import ray
import torch
from click.testing import CliRunner
from pipeline_helpers import DOCS, check_output, expected_text, job_dict, write_corpus
from s3_fixtures import TEST_KEY_ID, TEST_SECRET

from pipeline.cli import main
from pipeline.job.executor import ACTOR_RESTARTS, run_job
from pipeline.job.layout import shard_name, shard_paths
from pipeline.job.worker import build_processor
from pipeline.spec import spec_from_dict
from pipeline.storage import Storage

REPO = Path(__file__).resolve().parent.parent


def clean_corpus(store: Storage, shards: int, rows: int) -> set[str]:
    """`shards` shards of `rows` good documents each; returns every id written."""
    ids = set()
    for s in range(shards):
        shard_ids = [f"s{s}r{r}" for r in range(rows)]
        texts = [DOCS[(s + r) % 5] for r in range(rows)]
        store.write_parquet(f"part-{s:03d}.parquet", pa.table({"id": shard_ids, "text": texts}))
        ids.update(shard_ids)
    return ids


def ids_in(out: Storage, sub: str) -> list:
    """Every id under outputs/ or errors/, duplicates kept (so the caller can count them)."""
    return [i for n in out.list(sub) for i in out.read_parquet(n).column("id").to_pylist()]


def assert_exactly_once(out: Storage, expected: set[str]) -> None:
    seen = ids_in(out, "outputs") + [i for i in ids_in(out, "errors") if i is not None]
    assert len(seen) == len(set(seen)), "a row appears twice"
    assert set(seen) == expected, f"missing rows: {sorted(expected - set(seen))}"


class ActorKiller(threading.Thread):
    """SIGKILLs model actor processes while they decode a shard (up to `kills` times).

    Ray titles an actor process `ray::ModelWorker.process` while that method runs, so the kill
    lands mid-shard, never while the actor is idle or loading.
    """

    def __init__(self, kills: int):
        super().__init__(daemon=True)
        self.kills = kills
        self.killed: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() and len(self.killed) < self.kills:
            for proc in psutil.process_iter(["pid", "cmdline"]):
                cmdline = " ".join(proc.info["cmdline"] or [])
                if "ray::ModelWorker.process" in cmdline and proc.pid not in self.killed:
                    time.sleep(0.2)  # let it get into the shard
                    try:
                        os.kill(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    self.killed.append(proc.pid)
                    break
            time.sleep(0.05)


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


def test_actor_killed_mid_shard_is_restarted_and_the_shard_retried(
    tiny_models, tiny_pair_dirs, tmp_path, ray_local
):
    rows_in = write_corpus(Storage(str(tmp_path / "in")))
    data = job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out"), max_retries=2)
    # shards long enough for the killer to find one mid-decode on a fast (AVX-512) machine
    data["generation"]["max_new_tokens"] = 48
    spec = spec_from_dict(data)
    killer = ActorKiller(kills=1)
    killer.start()
    try:
        result = run_job(spec, progress=False)
    finally:
        killer.stop.set()
    assert len(killer.killed) == 1
    assert result.ok and len(result.done) == 4
    assert max(s["attempt"] for s in result.done) == 2  # the killed shard, on its second attempt
    out = Storage(str(tmp_path / "out"))
    check_output(tiny_models, spec, out, rows_in)  # every row once, each equal to target-only


def test_an_actor_killed_more_often_than_ray_restarts_it_is_replaced(tiny_pair_dirs, tmp_path, ray_local):
    """A long night can kill one actor more often than Ray's restart budget: the job goes on."""
    # enough shards that work is still queued when the third kill comes, however fast they run
    expected = clean_corpus(Storage(str(tmp_path / "in")), shards=8, rows=12)
    data = job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out"), max_retries=4)
    data["input"]["keep_columns"] = []
    killer = ActorKiller(kills=ACTOR_RESTARTS + 1)
    killer.start()
    try:
        result = run_job(spec_from_dict(data), progress=False)
    finally:
        killer.stop.set()
    assert len(killer.killed) == ACTOR_RESTARTS + 1
    assert result.ok and len(result.done) == 8, result.failed
    assert_exactly_once(Storage(str(tmp_path / "out")), expected)


def test_a_shard_that_keeps_failing_is_reported_and_the_others_finish(tiny_pair_dirs, tmp_path, ray_local):
    # shards long enough for the killer to find one mid-decode: with 2 rows a shard took less
    # than its polling interval on an AVX-512 machine and the job finished unharmed
    expected = clean_corpus(Storage(str(tmp_path / "in")), shards=3, rows=10)
    data = job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out"), max_retries=0)
    data["input"]["keep_columns"] = []
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(json.dumps(data))
    killer = ActorKiller(kills=1)
    killer.start()
    try:
        result = CliRunner().invoke(main, ["run", str(spec_path), "--no-progress"])
    finally:
        killer.stop.set()
    assert len(killer.killed) == 1
    assert result.exit_code == 1, result.output
    assert "1 shard(s) FAILED" in result.output and "model actor died" in result.output
    out = Storage(str(tmp_path / "out"))
    manifest = out.read_json("manifest.json")
    (failed,) = manifest["failed"]
    assert failed["attempts"] == 1 and "model actor died" in failed["reason"]
    assert out.read_json(f"failed/{failed['shard']}.json") == failed  # written when it failed
    assert not out.exists("_SUCCESS")
    # the other two shards are complete, with all their rows
    assert len(out.list("stats")) == 2
    failed_ids = {i for i in expected if i.startswith(f"s{int(failed['shard'][-3:])}r")}
    assert sorted(ids_in(out, "outputs")) == sorted(expected - failed_ids)


def test_a_model_that_cannot_load_fails_the_job_instead_of_hanging(tiny_pair_dirs, tmp_path, ray_local):
    target, draft = tiny_pair_dirs
    broken = tmp_path / "broken-draft"
    shutil.copytree(draft, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:1000])  # a truncated download
    clean_corpus(Storage(str(tmp_path / "in")), shards=3, rows=1)
    data = job_dict((target, broken), str(tmp_path / "in"), str(tmp_path / "out"), num_actors=2)
    data["input"]["keep_columns"] = []
    # what an earlier run's actor left when it was killed between a shard's outputs and its
    # stats: the shard is not complete, and once it fails for good those files must go
    out = Storage(str(tmp_path / "out"))
    partial = pa.table({"id": ["s0r0"], "generated": ["half a job"]})
    out.write_parquet("outputs/part-000.parquet", partial)
    out.write_parquet("errors/part-000.parquet", partial)
    began = time.monotonic()
    result = run_job(spec_from_dict(data), progress=False)
    assert time.monotonic() - began < 240
    assert not result.ok and not result.done and len(result.failed) == 3
    for failed in result.failed:
        assert "SafetensorError" in failed["reason"], failed
    assert len(out.read_json("manifest.json")["failed"]) == 3 and not out.exists("_SUCCESS")
    assert out.list("outputs") == [] and out.list("errors") == []  # failed shards leave no rows


@pytest.fixture(scope="module")
def processor(tiny_pair_dirs, tmp_path_factory):
    """A shard processor for the tiny pair, as a model actor builds it, and its input dir."""
    root = tmp_path_factory.mktemp("processor")
    clean_corpus(Storage(str(root / "in")), shards=1, rows=5)
    data = job_dict(tiny_pair_dirs, str(root / "in"), str(root / "out"), batch_size=4)
    data["input"]["keep_columns"] = []
    return build_processor(spec_from_dict(data).with_absolute_paths()), root


def test_out_of_memory_halves_the_batch(tiny_models, processor, monkeypatch):
    """A batch that does not fit is split in halves; outputs stay those of target-only."""
    processor, root = processor
    generate = processor.engine.generate
    sizes: list[int] = []

    def generate_within_memory(prompts, *args, batch_size, **kwargs):
        # The allocator's own exception type, raised where a real device would run out.
        sizes.append(batch_size)
        if batch_size > 1 and batch_size * max(map(len, prompts)) > 120:
            raise torch.OutOfMemoryError("CUDA out of memory (injected: batch too large)")
        return generate(prompts, *args, batch_size=batch_size, **kwargs)

    monkeypatch.setattr(processor.engine, "generate", generate_within_memory)
    stats = processor.process(str(root / "in" / "part-000.parquet"), "part-000")
    assert stats["oom_splits"] >= 1 and stats["rows_out"] == 5
    assert sizes[:2] == [4, 2] and sizes[-1] < 4  # halved until it fit, then the speedup sample
    table = Storage(str(root / "out")).read_parquet("outputs/part-000.parquet")
    for row_id, text in zip(table.column("id").to_pylist(), table.column("generated").to_pylist()):
        doc = DOCS[int(row_id[-1]) % 5]
        assert text == expected_text(tiny_models, processor.spec, doc)

    def never_fits(prompts, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(processor.engine, "generate", never_fits)
    with pytest.raises(torch.OutOfMemoryError):  # one row that does not fit fails the attempt
        processor.process(str(root / "in" / "part-000.parquet"), "part-000")


def test_missing_column_is_a_shard_error_naming_the_columns(processor):
    processor, root = processor
    Storage(str(root / "in")).write_parquet("renamed.parquet", pa.table({"id": ["x"], "body": ["text"]}))
    stats = processor.process(str(root / "in" / "renamed.parquet"), "renamed")
    assert stats["status"] == "unreadable"
    assert "missing column(s) ['text']" in stats["error"] and "['id', 'body']" in stats["error"]
    errors = Storage(str(root / "out")).read_parquet("errors/renamed.parquet").to_pylist()
    assert [e["reason"] for e in errors] == ["unreadable_shard"] and "body" in errors[0]["detail"]


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
        for p in Path("/tmp/ray/session_latest/logs").rglob("*")
        if p.is_file() and p.stat().st_size < 50_000_000
    }
    assert logs, "no Ray logs found to check"
    for secret in (TEST_SECRET, TEST_KEY_ID):
        for result in outputs:
            assert secret not in result.output
        leaked = [n for n, b in {**written, **logs}.items() if secret.encode() in b]
        assert not leaked, f"{secret[:4]}... found in {leaked}"


@pytest.mark.parametrize(
    "shard_url",
    ["/in/../../etc/passwd.parquet", "/in/..parquet", "/in/a/../../../b.parquet", "/in/nested/x.parquet"],
)
def test_shard_names_cannot_leave_the_output_prefix(shard_url, tmp_path):
    """Output names come from input names; whatever those are, every write stays under OUTPUT/."""
    out = Storage(str(tmp_path / "out"))
    name = shard_name(shard_url, "/in")
    for rel in shard_paths(name).values():
        target = Path(out.url_for(rel).removeprefix("file://")).resolve()
        assert target.is_relative_to((tmp_path / "out").resolve()), (shard_url, rel)
        assert "/" not in name


def test_a_driver_that_loses_its_storage_stops_with_a_summary(tiny_pair_dirs, faulty_s3, ray_local, tmp_path):
    """Every request fails from mid-job on: exit 1, the shards done and not done, no traceback;
    once the storage is back, the same command finishes the job."""
    bucket = faulty_s3.make_bucket("lost")
    upstream = Storage(f"s3://{bucket}", faulty_s3.upstream.storage_options)
    expected = clean_corpus(upstream.child("in"), shards=6, rows=3)
    data = job_dict(tiny_pair_dirs, f"s3://{bucket}/in/", f"s3://{bucket}/out", max_retries=0)
    data["input"].update(keep_columns=[], storage_options=dict(faulty_s3.storage_options))
    data["output"] = {"url": f"s3://{bucket}/out", "storage_options": dict(faulty_s3.storage_options)}
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
