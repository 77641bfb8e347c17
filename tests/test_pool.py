"""The model actor pool (pipeline.job.pool) on a real local Ray, with a toy actor for a model:
outcomes come back with their task, an actor whose call raised stays, a crashed actor that Ray
restarts is pinged back, one dead for good is replaced, and actors that never start are
CannotStart. The executor's own tests (tests/test_executor.py) run it with real model actors."""

from __future__ import annotations

import os
import time

import ray
from ray.exceptions import RayActorError, RayTaskError

from pipeline.job.pool import CannotStart, Finished, ModelActorPool


def _toy_actor_class(restarts: int, broken: bool = False):
    """A Ray actor class standing in for ModelWorker (defined here, so that Ray ships it by value)."""

    class Toy:
        def __init__(self):
            if broken:
                raise ValueError("weights truncated")

        def info(self) -> int:
            return os.getpid()

        def double(self, x: int) -> int:
            if x < 0:
                raise ValueError("negative")
            return 2 * x

        def crash(self) -> None:
            os._exit(1)

        def sleep(self, seconds: float) -> None:
            time.sleep(seconds)

    return ray.remote(Toy).options(num_cpus=0, max_restarts=restarts, max_task_retries=0)


class Started:
    """start_actor for the pool, keeping every actor it started."""

    def __init__(self, actor_class):
        self.actor_class = actor_class
        self.actors: list = []

    def __call__(self):
        self.actors.append(self.actor_class.remote())
        return self.actors[-1]


def _dies(actor, seconds: float = 30) -> bool:
    """The actor dies within `seconds`. ray.kill is asynchronous (it goes through Ray's control
    store while calls go straight to the actor), so a call just after it may still be answered."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            ray.get(actor.info.remote(), timeout=seconds)
        except RayActorError:
            return True
        time.sleep(0.1)
    return False


def _double(x: int):
    return lambda actor: actor.double.remote(x)


def _crash(actor):
    return actor.crash.remote()


def test_each_outcome_comes_back_with_its_task_and_shutdown_kills_the_actors(ray_local):
    started = Started(_toy_actor_class(restarts=0))
    with ModelActorPool(started, size=2) as pool:
        assert pool.has_free() and not pool.busy
        pool.submit("a", _double(1))
        pool.submit("b", _double(-1))
        assert not pool.has_free() and pool.busy
        outcomes = {o.task: o for o in (pool.next(), pool.next())}
        assert outcomes["a"] == Finished("a", 2)
        assert isinstance(outcomes["b"].error, RayTaskError)  # the call raised: the actor stays
        assert pool.has_free() and not pool.busy
        pool.submit("c", _double(5))
        pool.submit("d", _double(6))
        assert sorted(o.value for o in (pool.next(), pool.next())) == [10, 12]
    assert len(started.actors) == 2
    assert all(_dies(actor) for actor in started.actors)


def test_a_crashed_actor_that_ray_restarts_is_pinged_back_not_replaced(ray_local):
    started = Started(_toy_actor_class(restarts=1))
    with ModelActorPool(started, size=1) as pool:
        pool.submit("x", _crash)
        outcome = pool.next()
        assert outcome.task == "x" and isinstance(outcome.error, RayActorError)
        assert not pool.has_free() and pool.busy  # waiting for the restarted actor's ping
        assert pool.next() is None and pool.has_free()
        pool.submit("y", _double(4))
        assert pool.next() == Finished("y", 8)
    assert len(started.actors) == 1


def test_an_actor_dead_for_good_is_replaced_by_a_fresh_one(ray_local):
    started = Started(_toy_actor_class(restarts=0))
    with ModelActorPool(started, size=1) as pool:
        pool.submit("warm", _double(1))  # it answered once: its death is not a failed start
        assert pool.next().value == 2
        pool.submit("x", _crash)
        assert isinstance(pool.next().error, RayActorError)
        assert pool.next() is None and len(started.actors) == 2  # the ping failed: replaced
        assert pool.next() is None and pool.has_free()  # the fresh actor answered its ping
        pool.submit("y", _double(3))
        assert pool.next() == Finished("y", 6)


def test_actors_that_never_start_are_cannot_start_once_the_pool_has_lost_as_many(ray_local):
    started = Started(_toy_actor_class(restarts=0, broken=True))
    with ModelActorPool(started, size=2) as pool:
        pool.submit("a", _double(1))
        pool.submit("b", _double(2))
        outcomes = []
        while pool.busy:  # calls and pings end in whatever order Ray gets to them
            outcomes.append(pool.next())
        assert not pool.has_free()
    finished = [o for o in outcomes if isinstance(o, Finished)]
    assert sorted(o.task for o in finished) == ["a", "b"]
    assert all(isinstance(o.error, RayActorError) for o in finished)
    # the first death is replaced; the second makes two in a row, as many as the pool holds;
    # the replacement dies as well, and the pool starts no more
    assert outcomes.count(None) == 1 and len(started.actors) == 3
    cannot = [o for o in outcomes if isinstance(o, CannotStart)]
    assert len(cannot) == 2 and all("weights truncated" in str(o.error) for o in cannot)


def test_retired_actors_are_replaced_idle_at_once_busy_after_their_call_or_now(ray_local):
    started = Started(_toy_actor_class(restarts=1))
    with ModelActorPool(started, size=2) as pool:
        idle, busy = started.actors
        pool.submit("a", _double(1))  # the last one freed takes it: `busy`
        pool.retire(idle)  # idle: gone at once, a fresh actor warming in its place
        assert len(started.actors) == 3 and idle not in pool.actors and _dies(idle)
        pool.retire(busy)  # busy: its call ends as usual, then it goes
        outcomes = [pool.next(), pool.next()]  # the call, the fresh actor's ping (in either order)
        done = next(o for o in outcomes if isinstance(o, Finished))
        assert done == Finished("a", 2) and done.retired and _dies(busy)
        assert len(started.actors) == 4 and pool.actors == started.actors[2:]
        while pool.busy:  # the second fresh actor answers its ping
            assert pool.next() is None
        pool.submit("c", lambda actor: actor.sleep.remote(30))
        assert pool.next(timeout=0.05) is None  # nothing ended yet
        (sleeper,) = [a for a in pool.actors if pool.is_busy(a)]
        pool.retire(sleeper, now=True)  # killed: its call ends as a retired error
        killed = pool.next(timeout=20)
        assert killed.task == "c" and isinstance(killed.error, RayActorError) and killed.retired
        assert len(started.actors) == 5  # replaced, not restarted (restarts=1 would allow it)
