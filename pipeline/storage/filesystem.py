"""Storage: a root URL and the retried, atomic operations the pipeline needs below it.

Everything the pipeline reads or writes goes through :class:`Storage` (a root URL plus relative
paths) or the shard helpers of :mod:`pipeline.storage.shards`.
Any fsspec URL works: ``s3://bucket/prefix`` first, also ``file:///abs``, plain local paths
(made absolute) and ``memory://name`` (tests).

Errors
    Every failure surfaces as a :class:`StorageError` whose message names the URL and has gone
    through :func:`redact` (no credentials).  :class:`TransientStorageError` means the retries
    were used up on errors that may go away (5xx, throttling, resets, timeouts);
    :class:`PermanentStorageError` means retrying is pointless (403/AccessDenied, bad keys,
    NoSuchBucket, missing object, corrupt shard).  :class:`StorageNotFoundError` (permanent,
    also a ``FileNotFoundError``) is raised for a missing object, and :class:`ShardReadError`
    (permanent) for a file that is not readable Parquet.  The original exception is not chained
    (its text could hold secrets); its type name and redacted text are in the message.

Retries, in three bounded layers (defaults; storage_options may override the first two)
    1. botocore, per HTTP request: ``standard`` retry mode, 3 attempts in all, jittered
       exponential backoff, for 5xx / throttling / connection errors.  Per request matters for
       multipart uploads: one failed part is re-sent, not the whole object.  Left to botocore's
       own settings when ``AWS_MAX_ATTEMPTS`` or ``AWS_RETRY_MODE`` is set in the environment.
    2. s3fs's own retry loop is turned off (``retries = 1``): it would multiply layer 1.
    3. tenacity, per storage operation (this module), for whatever layer 1 gave up on
       (including failures while streaming a body, which botocore cannot retry): up to
       ``PIPELINE_STORAGE_RETRIES`` retries (default 5; 0 disables), exponential backoff with
       jitter starting at ``PIPELINE_STORAGE_RETRY_WAIT`` seconds (default 0.2), capped at
       ``PIPELINE_STORAGE_RETRY_MAX_WAIT`` (default 5).  Only transient errors are retried;
       permanent ones fail at once.

Caching
    s3fs instances are created with ``skip_instance_cache=True`` and
    ``use_listings_cache=False``: a re-run (or another worker) always sees the bucket as it is.
    This module reuses them within a process for identical options and ``AWS_*`` environment
    (a new client costs ~0.25 s); having no listing cache, a reused one is never stale.

Credentials
    Never taken from arguments (they would end up in logs and pickles): s3fs/botocore read them
    from the environment (``AWS_ACCESS_KEY_ID`` ...), ``~/.aws`` or a named ``profile``.
    ``storage_options`` may carry ``endpoint_url`` (also read from ``AWS_ENDPOINT_URL`` by
    botocore itself), ``profile``, ``region`` (passed as ``client_kwargs.region_name`` only when
    given: some S3 servers then refuse bucket creation), ``anon``, and other s3fs options;
    credential keys (``key``, ``secret``, ``token``, ...) are refused with a ``ValueError``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import posixpath
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import tenacity

from pipeline.storage.secrets import check_no_credentials, redact
from pipeline.storage.urls import protocol_of

log = logging.getLogger(__name__)

T = TypeVar("T")

# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class StorageError(Exception):
    """A storage operation failed.  ``str(err)`` names the URL and never holds credentials.

    Attributes: ``url`` (the URL concerned, or None) and ``cause_type`` (the type name of the
    underlying exception, or None).
    """

    def __init__(self, message: str, url: str | None = None, cause_type: str | None = None):
        super().__init__(redact(message))
        self.url = url
        self.cause_type = cause_type

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):  # keep url/cause_type across pickling (Ray moves exceptions)
        return (_rebuild_error, (type(self), str(self), self.url, self.cause_type))


def _rebuild_error(cls, message, url, cause_type):
    return cls(message, url, cause_type)


class TransientStorageError(StorageError):
    """Failed on errors that may go away (5xx, throttling, resets, timeouts) after all retries."""


class PermanentStorageError(StorageError):
    """Failed on an error that retrying cannot fix (access denied, no such bucket, bad data)."""


class StorageNotFoundError(PermanentStorageError, FileNotFoundError):
    """The object (or bucket) does not exist.  Also a ``FileNotFoundError``."""


class ShardReadError(PermanentStorageError):
    """The file exists but is not readable Parquet (corrupt, truncated, another format)."""


# --------------------------------------------------------------------------------------------
# Transient / permanent classification
# --------------------------------------------------------------------------------------------

_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "ProvisionedThroughputExceededException",
        "EC2ThrottledException",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "InternalError",
        "InternalFailure",
        "ServiceUnavailable",
        "OperationAborted",
        "IDPCommunicationError",
        "429",
        "500",
        "502",
        "503",
        "504",
    }
)
_PERMANENT_CODES = frozenset(
    {
        "AccessDenied",
        "AccountProblem",
        "AllAccessDisabled",
        "AuthorizationHeaderMalformed",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidBucketName",
        "InvalidObjectState",
        "InvalidRequest",
        "InvalidToken",
        "MethodNotAllowed",
        "NoSuchBucket",
        "NoSuchKey",
        "NotSignedUp",
        "PermanentRedirect",
        "RequestTimeTooSkewed",
        "SignatureDoesNotMatch",
        "400",
        "401",
        "403",
        "404",
        "405",
        "412",
        "416",
    }
)
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ECONNREFUSED,
        errno.ETIMEDOUT,
        errno.EPIPE,
        errno.EAGAIN,
        errno.EBUSY,  # s3fs's translation of 503 / SlowDown
        getattr(errno, "EREMOTEIO", 121),  # s3fs's translation of 500 / InternalError
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.ENETRESET,
    }
)
_CODE_IN_TEXT = re.compile(r"An error occurred \(([\w.]+)\)")
_TRANSIENT_TEXT = re.compile(
    r"SlowDown|reduce your request rate|Throttl|ServiceUnavailable|Service Unavailable"
    r"|InternalError|Internal Server Error|Bad Gateway|Gateway Time-?out|Connection reset",
    re.IGNORECASE,
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, then its causes / contexts (bounded, cycle-safe)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(seen) < 16:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ if cur.__cause__ is not None else cur.__context__


def _error_code(exc: BaseException) -> str | None:
    """The S3 error code (or HTTP status as a string) carried by a botocore ClientError."""
    response = getattr(exc, "response", None)
    if isinstance(response, Mapping):
        err = response.get("Error") or {}
        code = err.get("Code") if isinstance(err, Mapping) else None
        if code:
            return str(code)
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if status:
            return str(status)
    return None


def _first_code(exc: BaseException) -> str | None:
    for e in _chain(exc):
        code = _error_code(e)
        if code is None:
            m = _CODE_IN_TEXT.search(str(e))
            code = m.group(1) if m else None
        if code:
            return code
    return None


def _verdict_for_code(code: str | None) -> bool | None:
    if not code:
        return None
    if code in _TRANSIENT_CODES:
        return True
    if code in _PERMANENT_CODES:
        return False
    if code.isdigit():
        status = int(code)
        if status >= 500 or status == 429:
            return True
        if 400 <= status < 500:
            return False
    return None


def _verdict(exc: BaseException) -> bool | None:
    """True: transient, False: permanent, None: this link of the chain does not say."""
    if isinstance(exc, StorageError):
        return isinstance(exc, TransientStorageError)
    try:  # botocore is there whenever s3fs is; keep this module importable without it
        import botocore.exceptions as bce
    except ImportError:  # pragma: no cover
        bce = None
    if bce is not None:
        if isinstance(exc, bce.ClientError):
            verdict = _verdict_for_code(_error_code(exc))
            if verdict is None:  # unknown code: judge by the HTTP status
                status = (getattr(exc, "response", None) or {}).get("ResponseMetadata", {})
                verdict = _verdict_for_code(str(status.get("HTTPStatusCode", "")))
            return verdict
        if isinstance(exc, (bce.SSLError, bce.NoCredentialsError, bce.PartialCredentialsError)):
            return False
        if isinstance(exc, bce.ParamValidationError):
            return False
        if isinstance(exc, (bce.HTTPClientError, bce.ConnectionError)):
            # EndpointConnectionError, ConnectionClosedError, ReadTimeoutError, ...
            return True
    try:
        import aiohttp
    except ImportError:  # pragma: no cover
        aiohttp = None
    if aiohttp is not None and isinstance(exc, aiohttp.ClientError):
        if isinstance(exc, aiohttp.ClientResponseError):
            return exc.status >= 500 or exc.status == 429
        if isinstance(exc, (aiohttp.ClientSSLError, aiohttp.InvalidURL)):
            return False
        return True  # ServerDisconnectedError, ClientOSError, ClientPayloadError, ...
    if type(exc).__name__ == "FSTimeoutError":
        return True
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(exc, FileExistsError):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError):
        if exc.errno in _TRANSIENT_ERRNOS:
            return True
        verdict = _verdict_for_code(_first_code(exc))
        if verdict is not None:
            return verdict
        if _TRANSIENT_TEXT.search(str(exc)):
            return True
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the operation that raised ``exc`` may succeed."""
    for e in _chain(exc):
        verdict = _verdict(e)
        if verdict is not None:
            return verdict
    return False


def _is_missing_bucket(exc: BaseException) -> bool:
    for e in _chain(exc):
        if _error_code(e) == "NoSuchBucket" or "bucket does not exist" in str(e).lower():
            return True
    return False


def _is_not_found(exc: BaseException) -> bool:
    for e in _chain(exc):
        if isinstance(e, FileNotFoundError):
            return True
        if _error_code(e) in ("NoSuchKey", "NoSuchBucket", "404"):
            return True
    return False


# --------------------------------------------------------------------------------------------
# Retry machinery
# --------------------------------------------------------------------------------------------


def _env_number(name: str, default: float, cast: Callable[[str], float]) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = cast(raw)
    except ValueError:
        log.warning("ignoring %s=%r: not a number; using %s", name, raw, default)
        return default
    if value < 0:
        log.warning("ignoring %s=%r: negative; using %s", name, raw, default)
        return default
    return value


def _retry_settings() -> tuple[int, float, float]:
    """(retries after the first attempt, first wait in s, max wait in s), read from the env."""
    retries = int(_env_number("PIPELINE_STORAGE_RETRIES", 5, int))
    first = float(_env_number("PIPELINE_STORAGE_RETRY_WAIT", 0.2, float))
    max_wait = float(_env_number("PIPELINE_STORAGE_RETRY_MAX_WAIT", 5.0, float))
    return retries, first, max(first, max_wait)


def _describe(exc: BaseException) -> str:
    """'Type: text [code=X]' for an exception, redacted."""
    text = str(exc).strip() or repr(exc)
    detail = f"{type(exc).__name__}: {text}"
    code = _first_code(exc)
    if code and code not in detail:
        detail += f" [code={code}]"
    return redact(detail)


def _wrap(op: str, url: str, exc: BaseException, attempts: int) -> StorageError:
    if isinstance(exc, StorageError):
        return exc
    detail = _describe(exc)
    cause = type(exc).__name__
    if is_transient(exc):
        return TransientStorageError(
            f"{op} {url} failed after {attempts} attempt(s) on transient errors: {detail}",
            url,
            cause,
        )
    if _is_not_found(exc):
        what = "bucket does not exist" if _is_missing_bucket(exc) else "not found"
        return StorageNotFoundError(f"{op} {url} failed: {what}: {detail}", url, cause)
    return PermanentStorageError(f"{op} {url} failed: {detail}", url, cause)


def _call(op: str, url: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` with retries on transient errors; map every failure to a StorageError."""
    retries, first_wait, max_wait = _retry_settings()
    attempts = 0

    def attempt() -> T:
        nonlocal attempts
        attempts += 1
        return fn()

    def before_sleep(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        wait = state.next_action.sleep if state.next_action else 0.0
        log.warning(
            "%s",
            redact(
                f"storage {op} {url}: transient error ({_describe(exc) if exc else '?'}); "
                f"retry {state.attempt_number}/{retries} in {wait:.2f}s"
            ),
        )

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(retries + 1),
        # exponential backoff (first_wait, 2x, 4x, ... capped) plus up to first_wait of jitter
        wait=tenacity.wait_exponential(multiplier=first_wait, max=max_wait)
        + tenacity.wait_random(0, first_wait),
        retry=tenacity.retry_if_exception(is_transient),
        before_sleep=before_sleep,
        reraise=True,
    )
    try:
        return retrying(attempt)
    except StorageError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure becomes a StorageError
        raise _wrap(op, url, exc, attempts) from None


# --------------------------------------------------------------------------------------------
# Filesystems and URLs
# --------------------------------------------------------------------------------------------

# Object stores where a single PUT (or a completed multipart upload) is atomic: readers see the
# old object or the whole new one, never a prefix of it.
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "memory"})


_FS_CACHE: collections.OrderedDict[tuple[int, str], fsspec.AbstractFileSystem] = collections.OrderedDict()
_FS_CACHE_LOCK = threading.Lock()
_FS_CACHE_SIZE = 16


def _make_fs(protocol: str, storage_options: Mapping[str, Any] | None) -> fsspec.AbstractFileSystem:
    """A filesystem for ``protocol``, shared within the process for identical settings.

    Creating an S3 client costs ~0.25 s, too much per shard, so instances are reused; the key
    covers the process id, the options and every ``AWS_*`` environment variable (hashed), so a
    changed endpoint or credential gets a new client.  Reuse never serves stale listings: the
    instances keep no listing cache.
    """
    opts = dict(storage_options or {})
    check_no_credentials(opts)
    if protocol in ("file", "memory"):
        return _new_fs(protocol, opts)
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))
    material = json.dumps([protocol, opts, env], sort_keys=True, default=repr)
    key = (os.getpid(), hashlib.sha256(material.encode()).hexdigest())
    with _FS_CACHE_LOCK:
        fs = _FS_CACHE.get(key)
        if fs is not None:
            _FS_CACHE.move_to_end(key)
            return fs
    fs = _new_fs(protocol, opts)
    with _FS_CACHE_LOCK:
        fs = _FS_CACHE.setdefault(key, fs)
        while len(_FS_CACHE) > _FS_CACHE_SIZE:
            _FS_CACHE.popitem(last=False)
    return fs


def _new_fs(protocol: str, opts: dict[str, Any]) -> fsspec.AbstractFileSystem:
    if protocol == "file":
        return fsspec.filesystem("file")
    if protocol == "memory":
        return fsspec.filesystem("memory")
    if protocol == "s3":
        import s3fs

        kwargs: dict[str, Any] = {}
        endpoint = opts.pop("endpoint_url", None)
        endpoint = opts.pop("endpoint", None) or endpoint
        if endpoint:
            kwargs["endpoint_url"] = endpoint
        client_kwargs = dict(opts.pop("client_kwargs", None) or {})
        region = opts.pop("region_name", None)
        region = opts.pop("region", None) or region
        if region:  # only when asked: a region breaks bucket creation on some servers
            client_kwargs["region_name"] = region
        if client_kwargs:
            kwargs["client_kwargs"] = client_kwargs
        if "anon" in opts:
            kwargs["anon"] = bool(opts.pop("anon"))
        if opts.get("profile") is None:
            opts.pop("profile", None)
        config_kwargs = dict(opts.pop("config_kwargs", None) or {})
        if (
            "retries" not in config_kwargs
            and "AWS_MAX_ATTEMPTS" not in os.environ
            and "AWS_RETRY_MODE" not in os.environ
        ):
            config_kwargs["retries"] = {"mode": "standard", "total_max_attempts": 3}
        kwargs["config_kwargs"] = config_kwargs
        s3fs_retries = int(opts.pop("s3fs_retries", 1))
        kwargs.update(opts)  # profile, requester_pays, s3_additional_kwargs, ...
        kwargs["skip_instance_cache"] = True
        kwargs["use_listings_cache"] = False
        fs = s3fs.S3FileSystem(**kwargs)
        fs.retries = max(1, s3fs_retries)  # see the module docstring: layer 2 off by default
        return fs
    return fsspec.filesystem(protocol, skip_instance_cache=True, **opts)


def _is_absolute(rel: str) -> bool:
    return "://" in rel or os.path.isabs(rel)


def _normalize_rel(rel: str) -> str:
    rel = str(rel).replace("\\", "/") if os.sep == "\\" else str(rel)
    rel = rel.strip("/")
    if rel in ("", "."):
        return ""
    norm = posixpath.normpath(rel)
    if norm == ".." or norm.startswith("../"):
        raise ValueError(f"relative path {rel!r} escapes the storage root")
    return "" if norm == "." else norm


def _hidden(rel_name: str) -> bool:
    """Whether any component of a relative name starts with '_' or '.' (temp files, markers)."""
    return any(part.startswith(("_", ".")) for part in rel_name.split("/") if part)


class Storage:
    """A root URL and the operations the pipeline needs below it.

    Paths given to methods are relative to the root (``"out/part-0.parquet"``); an absolute
    URL (``"s3://b/k"``) or absolute local path is used as is.  Names returned by :meth:`list`
    are relative to the root, so they can be passed back to any method.

    Writes are atomic (a reader never sees a partial object):

    * local files: written to ``.<name>.<uuid>.tmp`` in the target's directory, fsync'ed, then
      ``os.replace``'d onto the target (atomic rename on POSIX); the temp file is removed on
      failure and, starting with ``.``, is never listed.
    * S3 and other object stores (and ``memory://``): one direct write of the whole object
      (``pipe_file``: a single PUT, or a multipart upload above s3fs's part size).  S3 makes an
      object visible only when its PUT, or CompleteMultipartUpload, succeeds, so this is already
      atomic; a temp key + server-side copy would double the requests and the bytes moved
      (copies above 5 GB need multipart copy), could leave temp garbage behind on a crash, and
      would not be more atomic.  A failed or retried PUT leaves the old object in place.
    * other fsspec filesystems: temp name next to the target, then ``mv``.

    ``Storage`` objects pickle without their filesystem (rebuilt lazily), so they can be sent to
    Ray workers; they hold no credentials.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None):
        if not isinstance(url, str) or not url.strip():
            raise ValueError(f"storage URL must be a non-empty string, got {url!r}")
        self._options: dict[str, Any] = dict(storage_options or {})
        check_no_credentials(self._options)
        url = url.strip()
        self._protocol = protocol_of(url)
        if self._protocol == "file":
            if url.lower().startswith("file://"):
                path = url[len("file://") :]
                self._url_prefix = "file://"
            else:
                path = url
                self._url_prefix = ""
            path = os.path.abspath(os.path.expanduser(path))
            self._root_path = path
            self._url = self._url_prefix + path
        else:
            scheme = url.split("://", 1)[0].lower()
            rest = url.split("://", 1)[1].strip("/")
            self._url_prefix = f"{scheme}://"
            self._url = f"{scheme}://{rest}"
            self._root_path = rest  # fsspec path, resolved via _strip_protocol when needed
        self._fs: fsspec.AbstractFileSystem | None = None
        self._other_fs: dict[str, fsspec.AbstractFileSystem] = {}
        self._no_conditional = False  # set when an S3 server refuses conditional PUTs

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The root URL (local paths made absolute)."""
        return self._url

    @property
    def protocol(self) -> str:
        return self._protocol

    @property
    def storage_options(self) -> dict[str, Any]:
        return dict(self._options)

    @property
    def is_local(self) -> bool:
        return self._protocol == "file"

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem (created on first use)."""
        if self._fs is None:
            self._fs = _make_fs(self._protocol, self._options)
        return self._fs

    def __repr__(self) -> str:
        return f"Storage({self._url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Storage) and self._url == other._url and self._options == other._options

    def __hash__(self) -> int:
        return hash(self._url)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fs"] = None
        state["_other_fs"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _fs_path(self, url: str) -> str:
        """The fsspec path of a full URL of this storage's protocol."""
        if self._protocol == "file":
            return url[len("file://") :] if url.lower().startswith("file://") else url
        return self.fs._strip_protocol(url)

    def _target(self, rel: str) -> tuple[fsspec.AbstractFileSystem, str, str]:
        """(filesystem, fsspec path, URL) of ``rel``."""
        if _is_absolute(rel):
            proto = protocol_of(rel)
            if proto == "file":
                url = rel
                path = rel[len("file://") :] if rel.lower().startswith("file://") else rel
                path = os.path.abspath(path)
                fs = self.fs if self._protocol == "file" else fsspec.filesystem("file")
                return fs, path, url
            if proto == self._protocol:
                fs = self.fs
            else:
                if proto not in self._other_fs:  # this root's options are for its own protocol
                    self._other_fs[proto] = _make_fs(proto, None)
                fs = self._other_fs[proto]
            return fs, fs._strip_protocol(rel), rel
        url = self.url_for(rel)
        return self.fs, self._fs_path(url), url

    def _rel_name(self, fs_path: str, base_path: str) -> str:
        base = base_path.rstrip("/")
        if fs_path == base:
            return ""
        if base and fs_path.startswith(base + "/"):
            return fs_path[len(base) + 1 :]
        if not base:
            return fs_path.lstrip("/")
        return fs_path

    # -- paths ------------------------------------------------------------------------------

    def url_for(self, rel: str) -> str:
        """Full URL of ``rel`` (returned unchanged if already absolute)."""
        if _is_absolute(rel):
            return rel
        norm = _normalize_rel(rel)
        if not norm:
            return self._url
        if self._protocol == "file":
            return self._url_prefix + os.path.join(self._root_path, *norm.split("/"))
        return f"{self._url}/{norm}"

    def child(self, rel: str) -> Storage:
        """A Storage rooted at ``rel`` below this one (sharing the filesystem client)."""
        sub = Storage(self.url_for(rel), self._options)
        sub._fs = self._fs
        sub._other_fs = self._other_fs
        return sub

    # -- queries ----------------------------------------------------------------------------

    def exists(self, rel: str = "") -> bool:
        """Whether ``rel`` exists (file, or directory / non-empty prefix).

        A missing bucket raises StorageNotFoundError rather than answering False: that is a
        configuration error, not an absent output.
        """
        fs, path, url = self._target(rel)

        def run() -> bool:
            try:
                fs.info(path)
                return True
            except FileNotFoundError as exc:
                if _is_missing_bucket(exc):
                    raise
                return False

        return _call("exists", url, run)

    def list(self, rel: str = "", suffix: str | None = None, hidden: bool = False) -> list[str]:
        """Files below ``rel`` (recursive), as sorted names relative to the root.

        Names with a component starting with ``_`` or ``.`` (temp files, ``_SUCCESS``
        markers, ``_tmp/``) are skipped unless ``hidden`` (used to see everything a prefix
        holds before deleting any of it).  A missing directory / prefix gives ``[]``; a missing
        bucket raises StorageNotFoundError.  If ``rel`` is an absolute URL the names are full
        URLs.
        """
        fs, path, url = self._target(rel)
        absolute = _is_absolute(rel)
        base = path if absolute else self._fs_path(self._url)
        # Hidden components are judged below the listed path only.
        listed_prefix = self._rel_name(path, base) if not absolute else ""

        def run() -> list[str]:
            try:
                found = fs.find(path, withdirs=False)
            except FileNotFoundError as exc:
                if _is_missing_bucket(exc):
                    raise
                return []
            return found

        names = []
        for p in _call("list", url, run):
            name = self._rel_name(p, base)
            below = name[len(listed_prefix) :].lstrip("/") if listed_prefix else name
            if not name or (_hidden(below) and not hidden):
                continue
            if suffix is not None and not name.endswith(suffix):
                continue
            names.append(f"{url.rstrip('/')}/{name}" if absolute and name else name)
        return sorted(names)

    # -- reads ------------------------------------------------------------------------------

    def read_bytes(self, rel: str) -> bytes:
        fs, path, url = self._target(rel)
        return _call("read", url, lambda: fs.cat_file(path))

    def read_json(self, rel: str) -> Any:
        data = self.read_bytes(rel)
        url = self._target(rel)[2]
        try:
            return json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PermanentStorageError(
                f"read_json {url} failed: not valid JSON: {exc}", url, type(exc).__name__
            ) from None

    def read_parquet(self, rel: str, columns: list[str] | None = None) -> pa.Table:
        """Read a whole Parquet file (one GET, retried as a unit) into a Table.

        Raises ShardReadError (naming the URL and the reason) if it is not readable Parquet.
        """
        url = self._target(rel)[2]
        return _parse_parquet(url, self.read_bytes(rel), columns)

    # -- writes -----------------------------------------------------------------------------

    def write_bytes(self, rel: str, data: bytes | bytearray | memoryview) -> str:
        """Atomically write ``data`` to ``rel`` (see the class docstring); returns its URL."""
        fs, path, url = self._target(rel)
        payload = bytes(data)
        proto = protocol_of(url)
        if proto == "file":
            _call("write", url, lambda: _write_local_atomic(path, payload))
        elif proto in _OBJECT_STORES:
            _call("write", url, lambda: fs.pipe_file(path, payload))
        else:
            _call("write", url, lambda: _write_via_temp(fs, path, payload))
        return url

    def write_json(self, rel: str, obj: Any) -> str:
        """Atomically write ``obj`` as UTF-8 JSON (indented).  TypeError if not serialisable."""
        data = json.dumps(obj, indent=2, ensure_ascii=False).encode("utf-8") + b"\n"
        return self.write_bytes(rel, data)

    def write_parquet(self, rel: str, table: pa.Table, **write_options: Any) -> str:
        """Atomically write ``table`` as Parquet (zstd unless ``compression=`` says otherwise)."""
        write_options.setdefault("compression", "zstd")
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, **write_options)
        return self.write_bytes(rel, sink.getvalue().to_pybytes())

    # -- deletes ----------------------------------------------------------------------------

    def delete(self, rel: str) -> None:
        """Delete one file; a missing file is not an error (a missing bucket is)."""
        fs, path, url = self._target(rel)

        def run() -> None:
            try:
                fs.rm_file(path)
            except FileNotFoundError as exc:
                if _is_missing_bucket(exc):
                    raise

        _call("delete", url, run)

    def delete_prefix(self, rel: str) -> None:
        """Delete every file below ``rel`` (taken as a directory: ``rel/...``), hidden included.

        On object stores only objects are deleted, never the bucket itself; locally the
        directory is removed.  Missing is not an error (a missing bucket is).
        """
        fs, path, url = self._target(rel)
        proto = protocol_of(url)

        def run() -> None:
            try:
                if proto == "file":
                    if os.path.isdir(path):
                        fs.rm(path, recursive=True)
                    return
                files = fs.find(path, withdirs=False)
            except FileNotFoundError as exc:
                if _is_missing_bucket(exc):
                    raise
                return
            base = path.rstrip("/") + "/"
            files = [f for f in files if f.startswith(base)]
            if files:
                fs.rm(files)

        _call("delete_prefix", url, run)

    # -- conditional writes (the output lease, pipeline.job.lease) ------------------------------

    @property
    def conditional_writes(self) -> str:
        """How :meth:`write_if` decides between writers racing for one object.

        ``"atomic"``: the storage itself compares and writes in one step (local files under an
        exclusive ``flock``; S3's ``If-None-Match: *`` / ``If-Match: <etag>`` on PutObject).
        ``"verified"``: read, compare, write, then read back; two writers racing within one
        round trip can both believe they won (other fsspec stores, and S3 servers that answer
        conditional PUTs with NotImplemented).
        """
        if self._protocol == "file" or (self._protocol in ("s3", "s3a") and not self._no_conditional):
            return "atomic"
        return "verified"

    def read_versioned(self, rel: str) -> Versioned | None:
        """``rel``'s bytes and a version to pass to :meth:`write_if`, or None if it is absent."""
        fs, path, url = self._target(rel)
        return _call("read", url, lambda: self._read_versioned(fs, path))

    def _read_versioned(self, fs: fsspec.AbstractFileSystem, path: str) -> Versioned | None:
        if self._protocol == "file":
            return _read_locked(path)
        try:
            if self.conditional_writes == "atomic":  # S3: the ETag, read before the body (see write_if)
                etag = fs.info(path)["ETag"]
                return Versioned(fs.cat_file(path), etag)
            data = fs.cat_file(path)
        except FileNotFoundError as exc:
            if _is_missing_bucket(exc):
                raise
            return None
        return Versioned(data, _digest(data))

    def write_if(self, rel: str, data: bytes, version: str | None) -> str | None:
        """Write ``rel`` only if it is still at ``version`` (None: only if it does not exist).

        Returns the new version, or None when the condition did not hold (another writer got
        there first). On S3 the version is the ETag, and a version read before the body can
        only be older than the body: a write based on a stale read fails rather than wins.
        """
        fs, path, url = self._target(rel)

        def run() -> str | None:
            if self._protocol == "file":
                return _write_locked(path, data, version)
            if self.conditional_writes == "atomic":
                bucket, key, _ = fs.split_path(path)
                condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": version}
                try:
                    return fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)["ETag"]
                except OSError as exc:
                    code = _first_code(exc)
                    if code in _CONDITION_FAILED or isinstance(exc, FileExistsError):
                        return None
                    if code not in _CONDITION_UNSUPPORTED:
                        raise
                    log.warning("%s does not support conditional writes; verifying by reading back", url)
                    self._no_conditional = True  # an ETag `version` now fails: the caller reads again
            return self._write_verified(fs, path, data, version)

        return _call("write_if", url, run)

    def _write_verified(
        self, fs: fsspec.AbstractFileSystem, path: str, data: bytes, version: str | None
    ) -> str | None:
        current = self._read_versioned(fs, path)
        if (current.version if current else None) != version:
            return None
        fs.pipe_file(path, data)
        written = self._read_versioned(fs, path)
        return written.version if written and written.data == data else None

    def delete_if(self, rel: str, version: str) -> bool:
        """Delete ``rel`` if it is still at ``version``; whether it was. Atomic for local files
        only: on object stores the check and the delete are two requests."""
        fs, path, url = self._target(rel)
        if self._protocol == "file":
            return _call("delete", url, lambda: _delete_locked(path, version))
        current = self.read_versioned(rel)
        if current is None or current.version != version:
            return False
        self.delete(rel)
        return True


# --------------------------------------------------------------------------------------------
# Atomic write helpers
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Versioned:
    """An object's bytes and the version :meth:`Storage.write_if` compares against."""

    data: bytes
    version: str


# S3 answers for a failed condition (a concurrent conditional write may get 409)
_CONDITION_FAILED = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict", "409"})
# servers that do not implement conditional PUTs
_CONDITION_UNSUPPORTED = frozenset({"NotImplemented", "501"})


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@contextlib.contextmanager
def _locked(path: str, create: bool) -> Iterator[int | None]:
    """An fd of ``path`` under an exclusive ``flock`` (None if absent and not ``create``).

    The lock is on the file itself, so it is written in place, never replaced; a file deleted
    or replaced while we waited for its lock is opened again.
    """
    if create:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
        except FileNotFoundError:
            yield None
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield fd
    finally:
        os.close(fd)


def _read_fd(fd: int) -> Versioned | None:
    """An empty file is an absent one: a writer that died between creating and writing it."""
    size = os.fstat(fd).st_size
    data = os.pread(fd, size, 0) if size else b""
    return Versioned(data, _digest(data)) if data else None


def _read_locked(path: str) -> Versioned | None:
    with _locked(path, create=False) as fd:
        return None if fd is None else _read_fd(fd)


def _write_locked(path: str, data: bytes, version: str | None) -> str | None:
    with _locked(path, create=True) as fd:
        current = _read_fd(fd)
        if (current.version if current else None) != version:
            return None
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
        return _digest(data)


def _delete_locked(path: str, version: str) -> bool:
    with _locked(path, create=False) as fd:
        current = None if fd is None else _read_fd(fd)
        if current is None or current.version != version:
            return False
        os.unlink(path)
        return True


def _write_local_atomic(path: str, data: bytes) -> None:
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _write_via_temp(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    directory, name = posixpath.split(path)
    tmp = posixpath.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
    try:
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)
    except BaseException:
        try:
            fs.rm_file(tmp)
        except Exception:  # noqa: BLE001 - best-effort cleanup
            pass
        raise


# --------------------------------------------------------------------------------------------
# Shards
# --------------------------------------------------------------------------------------------


def _parse_parquet(url: str, data: bytes, columns: list[str] | None) -> pa.Table:
    try:
        return pq.read_table(pa.BufferReader(data), columns=columns)
    except (pa.ArrowException, OSError, ValueError, KeyError) as exc:
        raise ShardReadError(
            f"cannot read Parquet shard {url}: {type(exc).__name__}: {exc}", url, type(exc).__name__
        ) from None
