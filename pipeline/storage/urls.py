"""URLs: scheme splitting, the protocol behind a URL, and glob handling.

Any fsspec URL names a location: ``s3://bucket/prefix``, ``file:///abs``, a plain local path
(made absolute by :class:`~pipeline.storage.filesystem.Storage`) or ``memory://name`` (tests).
"""

from __future__ import annotations

import re

SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
GLOB_CHARS = "*?["
_GLOB_RE = re.compile(r"[*?\[]")


def split_scheme(url: str) -> tuple[str | None, str]:
    """``("s3", "bucket/key")`` for URLs, ``(None, path)`` for plain local paths."""
    m = SCHEME_RE.match(url)
    if not m:
        return None, url
    return m.group(1), url[m.end() :]


def protocol_of(url: str) -> str:
    """The fsspec protocol of a URL (``s3a`` is ``s3``; a plain path is ``file``)."""
    if "://" in url:
        proto = url.split("://", 1)[0].lower()
        return "s3" if proto == "s3a" else proto
    return "file"


def has_glob(text: str) -> bool:
    return bool(_GLOB_RE.search(text))


def glob_root(url: str) -> str:
    """The part of a glob URL before its first component holding a glob character."""
    scheme = ""
    rest = url
    if "://" in url:
        scheme, rest = url.split("://", 1)
        scheme += "://"
    parts = rest.split("/")
    fixed = []
    for part in parts:
        if has_glob(part):
            break
        fixed.append(part)
    root = "/".join(fixed)
    if not root and rest.startswith("/"):
        root = "/"
    return scheme + root
