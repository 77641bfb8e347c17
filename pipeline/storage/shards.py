"""The input side: which Parquet shards a URL names, and opening one of them.

``list_shards`` takes a glob, a single ``.parquet`` file or a directory / prefix; reading a
shard's rows is ``Storage.read_parquet`` (one retried GET, decoded in memory).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.storage.filesystem import (
    ShardReadError,
    Storage,
    StorageNotFoundError,
    _call,
    _hidden,
    _is_missing_bucket,
)
from pipeline.storage.urls import glob_root, has_glob


def list_shards(url: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Full, sorted URLs of the Parquet shards named by ``url``.

    * a glob (``s3://b/x/*.parquet``, ``/data/**/part-*.parquet``): the files it matches;
    * a single ``.parquet`` file: just that file;
    * a directory / prefix: every ``*.parquet`` below it, recursively.

    Names with a component (below the fixed part of the URL) starting with ``_`` or ``.`` are
    left out (temp files, ``_tmp/``, ``_SUCCESS``).  The URLs keep the input's form (``s3://``,
    ``file://``, absolute local path, ``memory://``) and can be passed to
    any ``Storage`` method.  Raises StorageNotFoundError if nothing matches.
    """
    if has_glob(url):
        root = Storage(glob_root(url), storage_options)
        fs = root.fs
        pattern = url
        if root.is_local:
            pattern = os.path.abspath(url[len("file://") :] if url.lower().startswith("file://") else url)
        base = root._fs_path(root.url)

        def run() -> list[str]:
            found = fs.glob(pattern if root.is_local else fs._strip_protocol(url), detail=True)
            return [p for p, info in found.items() if info.get("type") == "file"]

        names = []
        for p in _call("list_shards", url, run):
            name = root._rel_name(p, base)
            if name and not _hidden(name):
                names.append(root.url_for(name))
        if not names:
            raise StorageNotFoundError(f"no files match the glob {url}", url)
        return sorted(names)

    store = Storage(url, storage_options)
    fs = store.fs
    root_path = store._fs_path(store.url)

    def info() -> dict | None:
        try:
            return fs.info(root_path)
        except FileNotFoundError as exc:
            if _is_missing_bucket(exc):
                raise
            return None

    if url.rstrip("/").endswith(".parquet"):
        found = _call("list_shards", store.url, info)
        if found is not None and found.get("type") == "file":
            return [store.url]
    names = store.list("", suffix=".parquet")
    if not names:
        raise StorageNotFoundError(
            f"no Parquet shards under {store.url} (looked for *.parquet recursively, "
            "skipping names that start with '_' or '.')",
            store.url,
        )
    return [store.url_for(n) for n in names]


def open_shard(url: str, storage_options: Mapping[str, Any] | None = None) -> pq.ParquetFile:
    """Fetch one shard (whole, retried) and return a ``pyarrow.parquet.ParquetFile`` over it.

    For metadata (``num_rows``, ``schema_arrow``) or batch-wise reading (``iter_batches``).
    Only the footer is checked here (ShardReadError if it is not Parquet); damage further in
    surfaces later from pyarrow itself, so prefer ``Storage(url).read_parquet("")`` when reading everything.
    """
    data = Storage(url, storage_options).read_bytes("")
    try:
        return pq.ParquetFile(pa.BufferReader(data))
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ShardReadError(
            f"cannot read Parquet shard {url}: {type(exc).__name__}: {exc}", url, type(exc).__name__
        ) from None
