"""The driver (pipeline.job.executor): planning which shards run, and the pool of model actors
that runs them: an actor killed mid-shard is restarted and the shard retried, one killed more
often than Ray restarts it is replaced, a shard out of attempts is reported while the others
finish, and a model that cannot load fails the job instead of hanging. Real processes: a real
local Ray and real SIGKILLs.
"""

from __future__ import annotations

import json
import shutil
import time

import pyarrow as pa
import pytest
from click.testing import CliRunner
from pipeline_helpers import (
    ActorKiller,
    assert_exactly_once,
    check_output,
    clean_corpus,
    ids_in,
    job_dict,
    write_corpus,
)

from pipeline.cli import main
from pipeline.job.executor import ACTOR_RESTARTS, plan, run_job
from pipeline.spec import spec_from_dict
from pipeline.storage import Storage


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


def test_shard_name_collision_names_both_files(tiny_pair_dirs, tmp_path):
    inp = Storage(str(tmp_path / "in"))
    inp.write_parquet("a__b.parquet", pa.table({"id": ["x"], "text": ["t"]}))
    inp.write_parquet("a/b.parquet", pa.table({"id": ["y"], "text": ["t"]}))
    spec = spec_from_dict(job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out")))
    with pytest.raises(ValueError, match=r"a/b.parquet and .*a__b.parquet -> a__b"):
        plan(spec.with_absolute_paths(), overwrite=False)
