"""The output layout, its one owner: where a shard's outputs, errors and stats go, when a shard
and a job are complete, what a job owns under its output prefix (and deleting only that), its
records read back (stats, failures, manifest.json, _SUCCESS); the totals over the stats are
`pipeline.job.stats`'s.

    OUTPUT/outputs/<shard>.parquet   errors/<shard>.parquet   stats/<shard>.json
           failed/<shard>.json       manifest.json            _SUCCESS    _LEASE.json
           report/                   _ids/map/<shard>.parquet   _ids/dups/p-<n>.parquet
                                     (duplicate ids across shards, pipeline.job.ids)
           head/actor-<k>/           (with drafter.head_online: each actor's head at the end)

Every path under the prefix is built here (and read back from here: stats listed, a warm
start's outputs found), so that the layout above is the whole of it.

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
OUTPUTS_DIR = "outputs"
ERRORS_DIR = "errors"
STATS_DIR = "stats"
FAILED_DIR = "failed"
REPORT_DIR = "report"
IDS_DIR = "_ids"
DUPLICATES_DIR = f"{IDS_DIR}/dups"
HEAD_DIR = "head"
# Directories and files a job writes directly under its output prefix (see docs/reliability.md).
JOB_DIRS = (OUTPUTS_DIR, ERRORS_DIR, STATS_DIR, FAILED_DIR, REPORT_DIR, IDS_DIR, HEAD_DIR)
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
        "outputs": f"{OUTPUTS_DIR}/{name}.parquet",
        "errors": f"{ERRORS_DIR}/{name}.parquet",
        "stats": f"{STATS_DIR}/{name}.json",
    }


def _shard_of(path: str, suffix: str) -> str:
    """The shard a per-shard file is named after (`shard_paths`, in reverse)."""
    return path.rsplit("/", 1)[-1].removesuffix(suffix)


def id_map_path(name: str) -> str:
    """A shard's ids and their hashes: the map pass of pipeline.job.ids (kept for a resume)."""
    return f"{IDS_DIR}/map/{name}.parquet"


def head_dir(actor: int) -> str:
    """Where the job's `actor`-th model actor leaves the head it learned (`drafter.head_online`)."""
    return f"{HEAD_DIR}/actor-{actor}"


def duplicates_path(partition: int) -> str:
    """One hash partition's duplicate ids: the reduce pass of pipeline.job.ids."""
    return f"{DUPLICATES_DIR}/p-{partition:05d}.parquet"


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
    for sub in (STATS_DIR, ERRORS_DIR, OUTPUTS_DIR, FAILED_DIR, REPORT_DIR, IDS_DIR):
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
    return f"{FAILED_DIR}/{name}.json"


def clear_failed(out: Storage) -> None:
    """Delete the failure records of an earlier run (its failed shards are retried now)."""
    out.delete_prefix(FAILED_DIR)


def remove_partial(out: Storage, name: str) -> None:
    """Delete what a shard wrote before its stats (its commit record): outputs and errors."""
    for sub in ("outputs", "errors"):
        partial = shard_paths(name)[sub]
        if out.exists(partial):
            out.delete(partial)


# -- the job's own records: stats read back, failures, the manifest and _SUCCESS ---------------


def stats_files(out: Storage) -> list[str]:
    """The path of every shard's stats file (its commit record) under a job's output."""
    return out.list(STATS_DIR, suffix=".json")


def shards_with_stats(out: Storage) -> list[str]:
    """The shards that have a stats file, in the order of `stats_files`."""
    return [_shard_of(path, ".json") for path in stats_files(out)]


def read_stats(out: Storage) -> list[dict]:
    """Every shard's stats file under a job's output."""
    return [out.read_json(path) for path in stats_files(out)]


def read_failed(out: Storage) -> list[dict]:
    """The failure records of shards that ran out of attempts (failed/<shard>.json)."""
    return [out.read_json(name) for name in out.list(FAILED_DIR, suffix=".json")]


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
    return [(_shard_of(path, ".parquet"), path) for path in out.list(OUTPUTS_DIR, suffix=".parquet")]


def warm_start_outputs(storage: Storage) -> Storage:
    """Where the outputs files of a warm start's earlier run are: OUTPUT/outputs/ when `storage`
    is a run's output prefix, else `storage` itself (any directory of Parquet files)."""
    return storage.child(OUTPUTS_DIR) if storage.exists(OUTPUTS_DIR) else storage
