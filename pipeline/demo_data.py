"""A demo corpus that exists on every machine with Python: standard-library module docstrings.

Nobody on this project wrote these texts and none of them is committed to the repository;
they are read from the running interpreter and written as Parquet shards.
"""

from __future__ import annotations

import importlib
import inspect

import pyarrow as pa

from pipeline.storage import Storage

# Modules whose docstrings are real prose of a useful length for summarization.
CANDIDATES = (
    "argparse",
    "calendar",
    "csv",
    "difflib",
    "doctest",
    "heapq",
    "inspect",
    "json",
    "optparse",
    "pickle",
    "pydoc",
    "random",
    "shlex",
    "smtplib",
    "socketserver",
    "string",
    "subprocess",
    "tarfile",
    "timeit",
    "uuid",
    "imaplib",
    "gettext",
    "ftplib",
    "mailbox",
)


def docstrings(min_chars: int = 300, max_chars: int = 2500) -> list[dict]:
    """Module docstrings of a useful length, in a stable order."""
    docs = []
    for name in CANDIDATES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        text = inspect.cleandoc(module.__doc__ or "")
        if min_chars <= len(text) <= max_chars:
            docs.append({"id": f"stdlib/{name}", "title": name, "text": text})
    return docs


def write_demo_data(url: str, shards: int = 2, rows_per_shard: int = 4) -> list[str]:
    """Write `shards` Parquet files of `rows_per_shard` documents each under `url`."""
    docs = docstrings()
    needed = shards * rows_per_shard
    if len(docs) < needed:
        raise ValueError(f"only {len(docs)} suitable docstrings on this Python, {needed} asked for")
    store = Storage(url)
    written = []
    for k in range(shards):
        rows = docs[k * rows_per_shard : (k + 1) * rows_per_shard]
        written.append(store.write_parquet(f"part-{k:05d}.parquet", pa.Table.from_pylist(rows)))
    return written
