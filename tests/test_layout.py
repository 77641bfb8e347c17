"""The output layout (pipeline.job.layout): where a shard's files go, that every path a job
writes is one of the job's own (so that --overwrite deletes it), and paths read back."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.job.layout import (
    clear_job_output,
    duplicates_path,
    failed_path,
    foreign_files,
    id_map_path,
    read_stats,
    shard_name,
    shard_paths,
    shards_with_stats,
    warm_start_outputs,
)
from pipeline.storage import Storage


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


def test_every_path_a_job_writes_is_its_own_and_overwrite_deletes_it(tmp_path):
    out = Storage(str(tmp_path / "out"))
    name = "part-1"
    paths = [*shard_paths(name).values(), failed_path(name), id_map_path(name), duplicates_path(3)]
    for path in paths:
        out.write_bytes(path, b"{}")
    out.write_bytes("notes.txt", b"someone else's")
    assert sorted(out.list(hidden=True)) == sorted([*paths, "notes.txt"])
    assert foreign_files(out) == ["notes.txt"]
    clear_job_output(out)
    assert out.list(hidden=True) == ["notes.txt"]


def test_the_stats_listing_names_its_shards(tmp_path):
    out = Storage(str(tmp_path / "out"))
    for name in ("part-2", "a__b"):
        out.write_json(shard_paths(name)["stats"], {"shard": name})
    assert shards_with_stats(out) == ["a__b", "part-2"]
    assert [s["shard"] for s in read_stats(out)] == ["a__b", "part-2"]


def test_a_warm_start_reads_a_runs_outputs_or_a_plain_directory(tmp_path):
    run, plain = Storage(str(tmp_path / "run")), Storage(str(tmp_path / "plain"))
    run.write_bytes(shard_paths("part-0")["outputs"], b"")
    run.write_bytes(shard_paths("part-0")["stats"], b"{}")
    plain.write_bytes("night.parquet", b"")
    assert warm_start_outputs(run).list() == ["part-0.parquet"]
    assert warm_start_outputs(plain).url == plain.url
