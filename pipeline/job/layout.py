"""The output layout, its one owner: where a shard's outputs, errors and stats go, when a shard
and a job are complete, what a job owns under its output prefix (and deleting only that), its
records read back (stats, failures, manifest.json, _SUCCESS); the totals over the stats are
`pipeline.job.stats`'s.

    OUTPUT/outputs/<shard>.parquet   errors/<shard>.parquet   stats/<shard>.json
           failed/<shard>.json       manifest.json            _SUCCESS    _LEASE.json
           report/                   _ids/ (duplicate ids across shards, pipeline.job.ids)

A shard is committed in order: its outputs, its errors, then its stats file as the commit
record, so a shard is complete when its stats and outputs are both there (`is_complete`).

`--overwrite` deletes a job's earlier results before running again. An output prefix set by
mistake to a directory that holds other data (a corpus, another tool's results, a parent of
many runs) must not be wiped: overwrite deletes only the names a job of this pipeline writes,
and refuses to start when the prefix holds anything else, because a half-deleted foreign
directory is worse than a refusal.
"""

from __future__ import annotations

import re

from pipeline.job.lease import LEASE_NAME
from pipeline.storage import Storage
from pipeline.storage.urls import glob_root, has_glob

MANIFEST = "manifest.json"
SUCCESS = "_SUCCESS"
REPORT_DIR = "report"
# Directories and files a job writes directly under its output prefix (see docs/reliability.md).
JOB_DIRS = ("outputs", "errors", "stats", "failed", REPORT_DIR, "_ids")
# The lease is the running driver's own: overwrite leaves it in place.
JOB_FILES = (MANIFEST, SUCCESS, LEASE_NAME)
# an atomic write's temporary name next to its target (pipeline.storage.filesystem._write_local_atomic)
_TEMP = re.compile(r"^\.(.+)\.[0-9a-f]{32}\.tmp$")


def shard_name(shard_url: str, input_root: str) -> str:
    """A stable, flat name for a shard: its path under the input root without `.parquet`."""
    rel = shard_url[len(input_root) :].lstrip("/") if shard_url.startswith(input_root) else shard_url
    rel = rel.rsplit("/", 1)[-1] if "://" in rel else rel
    return rel.removesuffix(".parquet").replace("/", "__")


def shard_paths(name: str) -> dict[str, str]:
    return {
        "outputs": f"outputs/{name}.parquet",
        "errors": f"errors/{name}.parquet",
        "stats": f"stats/{name}.json",
    }


def is_complete(out: Storage, name: str) -> bool:
    paths = shard_paths(name)
    return out.exists(paths["stats"]) and out.exists(paths["outputs"])


def _ours(name: str) -> bool:
    top, _, rest = name.partition("/")
    if rest:
        return top in JOB_DIRS
    temp = _TEMP.match(name)
    return (temp.group(1) if temp else name) in JOB_FILES


def foreign_files(out: Storage) -> list[str]:
    """Names under the prefix that no job of this pipeline writes (hidden names included)."""
    return [name for name in out.list(hidden=True) if not _ours(name)]


def clear_job_output(out: Storage) -> None:
    """Delete what a job wrote: the completion marker and commit records (stats) first, so that a
    delete interrupted half-way never leaves a shard that looks complete without its rows."""
    out.delete(SUCCESS)
    for sub in ("stats", "errors", "outputs", "failed", REPORT_DIR, "_ids"):
        out.delete_prefix(sub)
    out.delete(MANIFEST)


def name_shards(urls: list[str], input_url: str) -> list[tuple[str, str]]:
    """(url, name) for every input shard, named under the input's root (the folder before a glob);
    ValueError naming both files when two shards map to one output name."""
    root = glob_root(input_url) if has_glob(input_url) else Storage(input_url).url
    shards = [(url, shard_name(url, root)) for url in urls]
    by_name: dict[str, list[str]] = {}
    for url, name in shards:
        by_name.setdefault(name, []).append(url)
    clashes = [f"{' and '.join(urls)} -> {name}" for name, urls in by_name.items() if len(urls) > 1]
    if clashes:
        raise ValueError(f"input shards map to the same output name, rename them: {'; '.join(clashes)}")
    return shards


def failed_path(name: str) -> str:
    """A shard that ran out of attempts: its failure record (read by `pipeline status`)."""
    return f"failed/{name}.json"


def clear_failed(out: Storage) -> None:
    """Delete the failure records of an earlier run (its failed shards are retried now)."""
    out.delete_prefix("failed")


def remove_partial(out: Storage, name: str) -> None:
    """Delete what a shard wrote before its stats (its commit record): outputs and errors."""
    for sub in ("outputs", "errors"):
        partial = shard_paths(name)[sub]
        if out.exists(partial):
            out.delete(partial)


# -- the job's own records: stats read back, failures, the manifest and _SUCCESS ---------------


def read_stats(out: Storage) -> list[dict]:
    """Every shard's stats file under a job's output."""
    return [out.read_json(name) for name in out.list("stats", suffix=".json")]


def read_failed(out: Storage) -> list[dict]:
    """The failure records of shards that ran out of attempts (failed/<shard>.json)."""
    return [out.read_json(name) for name in out.list("failed", suffix=".json")]


def read_manifest(out: Storage) -> dict | None:
    """manifest.json, or None before the first run of the job has written one."""
    return out.read_json(MANIFEST) if out.exists(MANIFEST) else None


def is_job_complete(out: Storage) -> bool:
    """_SUCCESS is there: every shard of the job is complete."""
    return out.exists(SUCCESS)


def save_manifest(out: Storage, manifest: dict, complete: bool) -> None:
    """manifest.json always; _SUCCESS, after it, only when the job is `complete`."""
    out.write_json(MANIFEST, manifest)
    if complete:
        out.write_bytes(SUCCESS, b"")


def output_files(out: Storage) -> list[tuple[str, str]]:
    """(shard name, path) of every shard's outputs file."""
    return [
        (path.rsplit("/", 1)[-1].removesuffix(".parquet"), path)
        for path in out.list("outputs", suffix=".parquet")
    ]
