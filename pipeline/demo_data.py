"""A demo corpus that exists on every machine with Python: standard-library module docstrings.

(And, for the benchmark, license texts that ship with Python and the OS: see license_sections.)

Nobody on this project wrote these texts and none of them is committed to the repository;
they are read from the running interpreter and written as Parquet shards.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys

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


def license_paths() -> list[str]:
    """License texts shipped with this Python and, on Debian-like systems, with the OS."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    python = os.path.join(sys.base_prefix, "lib", version, "LICENSE.txt")
    common = "/usr/share/common-licenses"
    os_texts = sorted(os.path.join(common, n) for n in os.listdir(common)) if os.path.isdir(common) else []
    return [p for p in [python, *os_texts] if os.path.isfile(p)]


def license_sections(paths: list[str], min_chars: int = 800, max_chars: int = 2500) -> list[dict]:
    """License texts cut at blank lines into sections of `min_chars` to `max_chars`.

    A second benchmark corpus, of legal prose whose summaries reuse its phrases: the input-
    grounded case prompt lookup is made for, where docstring summaries mostly paraphrase.
    Consecutive paragraphs are joined until a section is long enough; a section that overshoots
    is dropped. Symlinked duplicates (GPL -> GPL-3) are read once.
    """
    docs, seen = [], set()
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            continue
        seen.add(real)
        with open(real, encoding="utf-8", errors="replace") as fh:
            paragraphs = [p.strip() for p in fh.read().split("\n\n") if p.strip()]
        section: list[str] = []
        for paragraph in paragraphs:
            section.append(paragraph)
            text = "\n\n".join(section)
            if len(text) >= min_chars:
                if len(text) <= max_chars:
                    name = os.path.basename(path)
                    docs.append({"id": f"license/{name}/{len(docs)}", "title": name, "text": text})
                section = []
    return docs


CORPORA = {
    "docstrings": docstrings,
    "licenses": lambda: license_sections(license_paths()),
}


def write_demo_data(url: str, shards: int = 2, rows_per_shard: int = 6) -> list[str]:
    """Write `shards` Parquet files of `rows_per_shard` documents each under `url`."""
    docs = docstrings()
    needed = shards * rows_per_shard
    if len(docs) < needed:
        raise ValueError(f"only {len(docs)} suitable docstrings on this Python, {needed} asked for")
    # here, not at the top: `pipeline bench` reads the corpora on machines without pyarrow (a GPU's)
    import pyarrow as pa

    from pipeline.storage import Storage

    store = Storage(url)
    written = []
    for k in range(shards):
        rows = docs[k * rows_per_shard : (k + 1) * rows_per_shard]
        written.append(store.write_parquet(f"part-{k:05d}.parquet", pa.Table.from_pylist(rows)))
    return written
