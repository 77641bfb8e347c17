"""The output layout: where a shard's outputs, errors and stats go, when a shard is complete,
and what a job owns under its output prefix (and deleting only that).

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

from pipeline.lease import LEASE_NAME
from pipeline.storage import Storage

# Directories and files a job writes directly under its output prefix (see docs/reliability.md).
JOB_DIRS = ("outputs", "errors", "stats", "failed", "report", "_ids")
# The lease is the running driver's own: overwrite leaves it in place.
JOB_FILES = ("manifest.json", "_SUCCESS", LEASE_NAME)
# an atomic write's temporary name next to its target (pipeline.storage._write_local_atomic)
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
    out.delete("_SUCCESS")
    for sub in ("stats", "errors", "outputs", "failed", "report", "_ids"):
        out.delete_prefix(sub)
    out.delete("manifest.json")
