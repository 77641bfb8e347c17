"""The job's model actors: a pool that hands a shard to a free actor, gives back each outcome
with the shard it belongs to, brings crashed actors back before they get work again, and
replaces those that die for good.

Why not `ray.util.ActorPool`: it fits the happy path (an idle list, the calls in flight) but
not the three things a night of shards needs.

* Its results come back alone, and a call that fails raises without naming its value; the
  driver must know which shard failed, on which attempt, to retry or fail that shard.
* A crashed actor that Ray is restarting (`max_restarts`) goes straight back to its idle list,
  so the next shard sent to it fails at once and burns an attempt. Here it is pinged first (a
  call that Ray retries until the actor answers) and gets work once the ping comes back.
* It drops an actor that died for good and never starts another, so a long job that loses
  actors (OOM kills, lost nodes) shrinks to nothing. Here a fresh actor takes its place, unless
  actors keep dying before they ever answered: then none can start (`CannotStart`).

What is left to reuse is a list and a dict, so the pool is a small class of its own. It also
retires actors on request (a draining node's: see `pipeline.job.nodes.Drains`), replacing each
with a fresh one that Ray places elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError


@dataclass(frozen=True)
class Finished:
    """A submitted call came back: `task` as submitted, with the value the call returned, or
    the error it ended with (RayActorError: its actor died mid-call; RayTaskError: it raised)."""

    task: Any
    value: Any = None
    error: RayActorError | RayTaskError | None = None
    actor: Any = field(default=None, compare=False)  # the actor the call ran on
    # its actor was retired (`ModelActorPool.retire`) and is gone: an error then is the
    # retirement's, not the task's
    retired: bool = field(default=False, compare=False)


@dataclass(frozen=True)
class CannotStart:
    """As many actors as the pool holds died for good in a row without ever answering: no actor
    can start (corrupt weights, a model too big for the device). `error` is the last death's.
    The pool starts no more; actors still running or coming back keep working."""

    error: RayActorError | RayTaskError


class ModelActorPool:
    """`size` actors from `start_actor()`; `ping` names a cheap method of theirs that answers
    once an actor is up (it waits for a restarting actor, see the module docstring)."""

    def __init__(self, start_actor: Callable[[], Any], size: int, ping: str = "info"):
        self.size = size
        self._start_actor = start_actor
        self._ping_method = ping
        self._idle = [start_actor() for _ in range(size)]
        self._alive = list(self._idle)  # every actor not known dead for good, for shutdown
        self._running: dict[ray.ObjectRef, tuple[Any, Any]] = {}  # call -> (actor, task)
        self._warming: dict[ray.ObjectRef, Any] = {}  # ping -> actor coming back from a crash
        # Actors that answered at least once (a ping or a call). One that dies for good after
        # answering (killed more often than Ray restarts it, over a long job) is replaced;
        # `_dead_in_a_row` counts those that died without ever answering (see CannotStart).
        self._answered: set = set()
        self._dead_in_a_row = 0
        self._retiring: set = set()  # actors to replace once their call ends (`retire`)

    def __enter__(self) -> ModelActorPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def has_free(self) -> bool:
        return bool(self._idle)

    @property
    def busy(self) -> bool:
        """Calls in flight or actors coming back: `next` has something to wait for."""
        return bool(self._running or self._warming)

    @property
    def running(self) -> bool:
        """Calls in flight. Actors coming back are no work of their own: an actor restarting
        where no node has room for it (its node lost, the survivors full) may never answer."""
        return bool(self._running)

    @property
    def actors(self) -> list:
        """Every actor of the pool not known dead for good (idle, busy or coming back)."""
        return list(self._alive)

    def is_busy(self, actor: Any) -> bool:
        return any(a is actor for a, _ in self._running.values())

    def retire(self, actor: Any, now: bool = False) -> None:
        """Take `actor` out of the pool for good and start a fresh one in its place (Ray places
        it away from a draining node). An idle or warming actor goes at once; a busy one once
        its call ends, or with `now` at once, its call then ending as an error. Either way that
        call comes back with `retired=True`."""
        if actor not in self._alive:
            return
        self._retiring.add(actor)
        if actor in self._idle:
            self._idle.remove(actor)
            self._replace(actor)
        elif actor in self._warming.values():
            ping = next(p for p, a in self._warming.items() if a is actor)
            del self._warming[ping]
            self._replace(actor)
        elif now:
            ray.kill(actor, no_restart=True)  # its call fails; `next` replaces it

    def submit(self, task: Any, call: Callable[[Any], ray.ObjectRef]) -> None:
        """Start `call(actor)` on a free actor (the last one freed); `task` comes back with it."""
        actor = self._idle.pop()
        self._running[call(actor)] = (actor, task)

    def next(self, timeout: float | None = None) -> Finished | CannotStart | None:
        """Wait for the next call or ping to end, at most `timeout` seconds. None when that was
        an actor coming back (now free), one replaced after dying for good, or nothing within
        `timeout`: nothing for the caller but perhaps more free room."""
        ready, _ = ray.wait([*self._running, *self._warming], num_returns=1, timeout=timeout)
        if not ready:
            return None
        ref = ready[0]
        if ref in self._warming:
            return self._came_back(ref)
        actor, task = self._running.pop(ref)
        try:
            value = ray.get(ref)
        except RayActorError as exc:  # Ray restarts it (or it is dead for good): ping it
            return Finished(task, error=exc, actor=actor, retired=self._after_call(actor, crashed=True))
        except RayTaskError as exc:  # the call raised; its actor is fine
            return Finished(task, error=exc, actor=actor, retired=self._after_call(actor))
        retired = self._after_call(actor)
        self._dead_in_a_row = 0
        return Finished(task, value, actor=actor, retired=retired)

    def shutdown(self) -> None:
        """Kill every actor of the pool (Ray would once their handles go; now, and for good)."""
        for actor in self._alive:
            ray.kill(actor, no_restart=True)
        self._alive.clear()
        self._retiring.clear()
        self._idle.clear()
        self._running.clear()
        self._warming.clear()

    def _after_call(self, actor: Any, crashed: bool = False) -> bool:
        """Put an actor whose call ended back to work (pinged first if it crashed), or replace
        it if it is retiring; True in that case."""
        if actor in self._retiring:
            self._replace(actor)
            return True
        if crashed:
            self._warm(actor)
        else:
            self._free(actor)
        return False

    def _replace(self, actor: Any) -> None:
        """Kill a retiring actor for good and warm a fresh one in its place."""
        self._retiring.discard(actor)
        self._alive.remove(actor)
        ray.kill(actor, no_restart=True)
        fresh = self._start_actor()
        self._alive.append(fresh)
        self._warm(fresh)

    def _free(self, actor: Any) -> None:
        self._idle.append(actor)
        self._answered.add(actor)

    def _warm(self, actor: Any) -> None:
        ping = getattr(actor, self._ping_method).options(max_task_retries=-1).remote()
        self._warming[ping] = actor

    def _came_back(self, ping: ray.ObjectRef) -> CannotStart | None:
        actor = self._warming.pop(ping)
        try:
            ray.get(ping)
        except (RayActorError, RayTaskError) as exc:  # dead for good
            self._alive.remove(actor)
            self._dead_in_a_row += actor not in self._answered
            if self._dead_in_a_row >= self.size:
                return CannotStart(exc)
            fresh = self._start_actor()
            self._alive.append(fresh)
            self._warm(fresh)
            return None
        self._free(actor)
        self._dead_in_a_row = 0
        return None
