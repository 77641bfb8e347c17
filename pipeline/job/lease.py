"""One writer per output prefix: a lease file that a running driver holds and heartbeats.

Two drivers on one output (a nightly job started twice, a resume while the first run still
runs) would decode the same shards twice and overwrite each other's files, and one's
`--overwrite` would delete what the other is writing. So a driver takes `_LEASE.json` under the
output prefix before it reads or deletes anything there, refreshes its heartbeat from a
background thread while it runs, and deletes it at the end. A second driver finds the lease
held and is refused, naming the holder.

A driver that dies without releasing (kill -9, a lost node) leaves the lease behind. It is
taken over, with a warning, once its heartbeat is older than the lease timeout, or at once when
the holder ran on this host and its process is gone (a driver killed and resumed on one
machine does not wait for the timeout). Ages compare the holder's clock with ours: hosts are
assumed to agree on the time to well within the timeout.

Every change to the lease is a conditional write (`Storage.write_if`: an exclusive flock on
local files, If-None-Match / If-Match on S3), so two drivers racing for a free or stale lease
cannot both win, and a heartbeat never overwrites a lease that another driver has taken over:
the heartbeat finds it gone and the job stops (LeaseLost).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

from pipeline.storage import Storage, StorageError

LEASE_NAME = "_LEASE.json"
DEFAULT_TIMEOUT_MINUTES = 10.0
# The heartbeat comes this many times per timeout (at least once a minute), so that a slow
# storage request or two never lets a live driver's lease look stale.
BEATS_PER_TIMEOUT = 5
# How many times `acquire` reads the lease again after losing a race for it.
ACQUIRE_ATTEMPTS = 5


class LeaseHeld(Exception):
    """Another live driver holds the output: nothing was started (exit 2)."""


class LeaseLost(Exception):
    """Another driver took the lease over while this one ran (exit 1)."""


def _process_state(pid: int) -> tuple[str, str] | None:
    """(state, start time) of a process of this host from /proc, or None where it is gone.

    The start time tells a reused pid from the holder's own (a restarted container's driver
    is often pid 1 again); a zombie (state Z) is a killed driver not yet reaped.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc: only existence can be checked
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ("?", "")
    return fields[0], fields[19]


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def describe(holder: dict[str, Any], now: float | None = None) -> str:
    """'run 'r1' (host h, pid 12, last heartbeat 4 s ago)': who holds a lease, for messages."""
    age = (now or time.time()) - float(holder.get("heartbeat", 0))
    return (
        f"run {holder.get('run_id')!r} (host {holder.get('host')}, pid {holder.get('pid')}, "
        f"last heartbeat {_age(max(age, 0))} ago)"
    )


class Lease:
    """The lease of one output prefix, taken by `acquire` and given back by `release`.

    Use it as a context manager around everything a driver does under the prefix.
    """

    def __init__(self, out: Storage, run_id: str, timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES):
        if timeout_minutes <= 0:
            raise ValueError(f"lease timeout must be positive, got {timeout_minutes} min")
        self.out = out
        self.run_id = run_id
        self.timeout = timeout_minutes * 60
        self.interval = min(60.0, self.timeout / BEATS_PER_TIMEOUT)
        self.token = uuid.uuid4().hex
        self.host = socket.gethostname()
        self.started = time.time()
        self.version: str | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        state = _process_state(os.getpid())
        record = {
            "run_id": self.run_id,
            "host": self.host,
            "pid": os.getpid(),
            "pid_start": state[1] if state else "",
            "started": self.started,
            "heartbeat": time.time(),
            "token": self.token,
        }
        return json.dumps(record, indent=2).encode() + b"\n"

    def _stale(self, holder: dict[str, Any] | None) -> str | None:
        """Why `holder`'s lease may be taken over, or None while it is live."""
        if holder is None:
            return "the lease file is unreadable"
        age = time.time() - float(holder.get("heartbeat", 0))
        if age > self.timeout:
            return f"no heartbeat for {_age(age)} (lease timeout {_age(self.timeout)})"
        if holder.get("host") == self.host and isinstance(holder.get("pid"), int):
            state = _process_state(holder["pid"])
            if state is None or state[0] == "Z" or (state[1] and state[1] != holder.get("pid_start")):
                return f"its process {holder['pid']} on this host is gone"
        return None

    def acquire(self) -> None:
        """Take the lease (free, stale or already ours), or raise LeaseHeld naming its holder."""
        for _ in range(ACQUIRE_ATTEMPTS):
            current = self.out.read_versioned(LEASE_NAME)
            if current is None:
                version = self.out.write_if(LEASE_NAME, self._record(), None)
            else:
                holder = _parse(current.data)
                if holder is not None and holder.get("token") == self.token:
                    version = current.version  # our own write, whose reply was lost and retried
                else:
                    stale = self._stale(holder)
                    if stale is None:
                        raise LeaseHeld(
                            f"output.url: {self.out.url} is in use by {describe(holder)}; a lease "
                            f"with no heartbeat for {_age(self.timeout)} is taken over (--lease-timeout)"
                        )
                    who = describe(holder) if holder else "an unreadable lease"
                    _warn(f"taking over the lease of {self.out.url} from {who}: {stale}")
                    version = self.out.write_if(LEASE_NAME, self._record(), current.version)
            if version is not None and self._holds():
                self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
                self._thread.start()
                return
        raise LeaseHeld(f"output.url: {self.out.url}: another driver keeps taking the lease; try again")

    def _holds(self) -> bool:
        """Read the lease back: where writes are only 'verified', a racing writer shows here."""
        current = self.out.read_versioned(LEASE_NAME)
        holder = _parse(current.data) if current else None
        if holder is None or holder.get("token") != self.token:
            return False
        self.version = current.version
        return True

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                version = self.out.write_if(LEASE_NAME, self._record(), self.version)
                if version is not None:
                    self.version = version
                elif not self._holds():
                    current = self.out.read_versioned(LEASE_NAME)
                    holder = _parse(current.data) if current else None
                    self.lost = (
                        f"the lease of {self.out.url} was taken over by {describe(holder)}"
                        if holder
                        else f"the lease of {self.out.url} was deleted"
                    )
                    _warn(f"{self.lost}; stopping")
                    return
            except StorageError as exc:  # storage down: the next beat tries again
                _warn(f"lease heartbeat failed: {exc}")

    def check(self) -> None:
        """Raise LeaseLost once another driver has taken the lease over."""
        if self.lost:
            raise LeaseLost(self.lost)

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost or self.version is None:
            return
        try:
            if self._holds():
                self.out.delete_if(LEASE_NAME, self.version)
        except StorageError as exc:
            _warn(
                f"could not release the lease {self.out.url_for(LEASE_NAME)} ({exc}); a resume on "
                f"this host takes it over at once, elsewhere after {_age(self.timeout)}"
            )

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


def _parse(data: bytes) -> dict[str, Any] | None:
    try:
        holder = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return holder if isinstance(holder, dict) else None


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)
