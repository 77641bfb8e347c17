"""What the driver knows of the Ray cluster's nodes, read from Ray's control store: which are
alive, which Ray declared dead and why, which are draining and by when, and on which node each
of the job's actors runs; and what the job does about a draining node (`Drains`).

A node drains when Ray is told it will go: a spot node's preemption notice, an autoscaler's
scale-down, `ray drain-node`. Ray then places nothing new on it, but the actors already there
run on until the node is killed, at the deadline if one was given. Left alone, the shards they
hold when it dies are lost work, and each costs an attempt. So the driver polls for drains (one
call to the control store a second, under a millisecond) and answers each as `Drains` says.

Drains and the actor table are read through `ray._private.state`, the store behind
`ray.nodes()`: Ray has no public API for either (its `ray drain-node` command is hidden as
well). A Ray without them reads as "nothing draining": a job never fails for want of a notice,
it only loses what a node loss loses.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0
# A shard still running this close to its node's deadline is handed back at once rather than
# left to die with the node: its retry then starts now, not after Ray declares the node dead.
HAND_BACK_MARGIN_S = 2.0


def alive() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def dead() -> dict[str, str]:
    """The nodes Ray has declared dead, with Ray's reason (a drained node's: its drain message)."""
    return {n["NodeID"]: n.get("DeathReasonMessage") or "" for n in ray.nodes() if not n["Alive"]}


def draining() -> dict[str, float | None]:
    """Draining nodes, each with its deadline (Unix seconds; None: no deadline)."""
    try:
        from ray._private.state import state

        deadlines = state.get_draining_nodes()
    except Exception as exc:  # a Ray without the call: nothing drains, as far as the job knows
        log.debug("cannot read draining nodes: %s", exc)
        return {}
    return {node: (ms / 1000 if ms else None) for node, ms in deadlines.items()}


def actor_nodes() -> dict[str, str]:
    """The node of every live actor of the cluster, by actor id (hex)."""
    try:
        from ray._private.state import actors

        table = actors()
    except Exception as exc:
        log.debug("cannot read the actor table: %s", exc)
        return {}
    return {actor_id: info["Address"]["NodeID"] for actor_id, info in table.items() if info.get("Address")}


def actor_id(actor: Any) -> str:
    return actor._actor_id.hex()


@dataclass
class Drain:
    """One draining node as the job saw it: for the manifest, the metrics and the log."""

    node: str
    deadline: float | None  # Unix seconds; None: no deadline
    noticed: float  # Unix seconds
    retired: set = field(default_factory=set)  # ids of the actors of ours that were on it
    handed_back: list[str] = field(default_factory=list)  # shards given back to the queue

    def to_dict(self) -> dict:
        return {
            "node": self.node,
            "deadline": self.deadline,
            "noticed": self.noticed,
            "actors_retired": len(self.retired),
            "shards_handed_back": self.handed_back,
        }


class Drains:
    """The job's answer to draining nodes. An actor on one gets no new shard: an idle actor is
    retired at once, a busy one when its shard ends, and each is replaced by a fresh actor that
    Ray places on another node (or, when none has room, as soon as one joins). A shard still
    running `HAND_BACK_MARGIN_S` before the node's deadline is handed back: its actor is killed
    and the shard goes back on the queue without counting an attempt, for it failed through
    no fault of its own."""

    def __init__(self, poll_seconds: float = POLL_SECONDS):
        self.poll_seconds = poll_seconds
        self.seen: dict[str, Drain] = {}  # node -> its drain, in the order they were noticed
        self._killed: set[str] = set()
        self._next_poll = 0.0

    def check(self, pool) -> list[Drain]:
        """Poll (at most once per `poll_seconds`) and retire the pool's actors on draining
        nodes; return the drains noticed for the first time."""
        now = time.time()
        if now < self._next_poll:
            return []
        self._next_poll = now + self.poll_seconds
        notices = draining()
        fresh = [Drain(node, deadline, now) for node, deadline in notices.items() if node not in self.seen]
        self.seen.update((d.node, d) for d in fresh)
        if notices:
            self._retire(pool, notices, now)
        return fresh

    def node_of(self, actor: Any) -> str | None:
        """The draining node an actor of ours was on, if it was retired from one."""
        found = actor_id(actor)
        return next((d.node for d in self.seen.values() if found in d.retired), None)

    def hand_back(self, actor: Any, shard: str) -> str | None:
        """Note that `shard`, held by a retired actor, went back to the queue; its node."""
        node = self.node_of(actor)
        if node is not None:
            self.seen[node].handed_back.append(shard)
        return node

    def _retire(self, pool, notices: dict[str, float | None], now: float) -> None:
        where = actor_nodes()
        for actor in pool.actors:
            node = where.get(actor_id(actor))
            if node not in notices:
                continue
            drain, ident = self.seen[node], actor_id(actor)
            late = notices[node] is not None and now >= notices[node] - HAND_BACK_MARGIN_S
            if ident in self._killed or (ident in drain.retired and not late):
                continue
            drain.retired.add(ident)
            if late and pool.is_busy(actor):
                self._killed.add(ident)
            pool.retire(actor, now=late)
