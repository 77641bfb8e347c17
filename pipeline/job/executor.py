"""The driver: list shards, skip finished ones, feed the rest to a pool of model actors.

Plain Ray Core rather than Ray Data: one task per shard keeps "one input shard -> one output,
one errors and one stats file" exact, makes a shard the unit of retry, and streams (the driver
only ever holds shard names and small stats dicts, never rows).

Ray dashboard metrics (`pipeline.job.metrics`) are recorded here, from each shard's stats as it
comes back: the driver lives for the whole job, so the last shard's counts are still exported
after the actors are gone, and a retried shard is counted once.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial

import pyarrow as pa
import ray
from ray.exceptions import RayActorError, RayTaskError

import pipeline
from pipeline.job import metrics, nodes
from pipeline.job.fingerprint import check_resume, check_resume_outputs, fingerprint
from pipeline.job.ids import clear_duplicates, map_ids, partitions, read_duplicates, reduce_ids
from pipeline.job.layout import (
    HEAD_DIR,
    clear_failed,
    clear_job_output,
    failed_path,
    foreign_files,
    head_dir,
    is_complete,
    name_shards,
    read_manifest,
    read_stats,
    remove_partial,
    save_manifest,
    shard_paths,
)
from pipeline.job.lease import DEFAULT_TIMEOUT_MINUTES, Lease
from pipeline.job.nodes import Drains
from pipeline.job.pool import CannotStart, Finished, ModelActorPool
from pipeline.job.progress import ShardProgress
from pipeline.job.stats import job_totals
from pipeline.job.worker import ModelWorker
from pipeline.spec import JobSpec, SpecError
from pipeline.storage import ShardReadError, Storage, StorageError, list_shards, open_shard

LOOPBACK_ENV = {
    # Keep an embedded Ray on 127.0.0.1 and quiet (see docs/operations.md).
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}


# what the driver keeps of each finished shard's stats (the rest stays in stats/<shard>.json)
DONE_KEYS = ("shard", "status", "attempt", "rows_in", "rows_out", "rows_error", "tokens_out")


@dataclass
class JobResult:
    output_url: str
    shards_total: int
    shards_skipped: int
    # a line per finished shard (`DONE_KEYS` of its stats, ~0.6 KB in memory), not its whole
    # stats (~9 KB): 10⁵ shards keep ~60 MB, not ~1 GB (the stats are in stats/)
    done: list[dict] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)
    # attempts that failed and went back on the queue (shard, attempt, reason, the actor's node)
    retried: list[dict] = field(default_factory=list)
    # Ray nodes alive when the shards started and dead at the end (Ray declares a node dead
    # after missing heartbeats, ~15 s: a job that recovers sooner may end before it does)
    nodes_lost: list[dict] = field(default_factory=list)
    # nodes that drained during the job (`pipeline.job.nodes.Drains`), and the shards their
    # actors handed back (requeued without counting an attempt)
    nodes_drained: list[dict] = field(default_factory=list)
    handed_back: list[dict] = field(default_factory=list)
    # with drafter.head_online: the heads the actors learned, written under head/ at the end
    heads: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed


def ensure_ray(address: str | None, num_cpus: int | None = None, verbose: bool = False) -> bool:
    """Connect to `address` (or RAY_ADDRESS), or start an embedded local Ray. True if we started it.

    Actors' own output reaches this terminal only when `verbose`: their failures come back as
    exceptions with their cause, and their logs stay in the Ray dashboard and session logs.
    """
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=verbose)
        return False
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
    # "local": a new embedded Ray even where `ray start` left a cluster's address in
    # /tmp/ray/ray_current_cluster, which a bare ray.init() would join (and refuse num_cpus)
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=verbose,
        configure_logging=False,
    )
    return True


def plan(spec: JobSpec, overwrite: bool) -> tuple[list[tuple[str, str]], list[tuple[str, str]], Storage]:
    """The (url, name) shards to run (those not complete in the output) and all of them, sorted."""
    out = Storage(spec.output.url, spec.output.storage_options)
    shards = name_shards(list_shards(spec.input.url, spec.input.storage_options), spec.input.url)
    manifest = None if overwrite else read_manifest(out)
    if manifest is not None:
        check_resume(spec, manifest)
        check_resume_outputs(spec, out, manifest)
    if overwrite:
        foreign = foreign_files(out)
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise SpecError(
                f"output.url: --overwrite refused: {out.url} holds {len(foreign)} file(s) that no job "
                f"of this pipeline wrote ({shown}); choose an output prefix of its own",
                spec.source,
            )
        clear_job_output(out)
    todo = [(url, name) for url, name in shards if overwrite or not is_complete(out, name)]
    clear_failed(out)  # failures of an earlier run: those shards are retried now
    return todo, shards, out


def run_job(
    spec: JobSpec,
    *,
    address: str | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    lease_timeout: float = DEFAULT_TIMEOUT_MINUTES,
    verbose: bool = False,
) -> JobResult:
    """Run a job to completion; failed shards are reported, never silently dropped.

    Everything happens under the output's lease (pipeline.job.lease), taken before the prefix is
    read or cleared: LeaseHeld if another driver holds it, LeaseLost if it is taken over.
    Storage that fails the driver once shards have started is JobStopped, with a summary.
    """
    began = time.time()
    spec = spec.with_absolute_paths()
    with Lease(Storage(spec.output.url, spec.output.storage_options), spec.run_id, lease_timeout) as lease:
        todo, shards, out = plan(spec, overwrite or spec.output.overwrite)
        result = JobResult(out.url, len(shards), len(shards) - len(todo))  # out.url: no trailing '/'

        write_manifest(spec, out, result, began, final=False)  # the fingerprint, before any shard runs
        try:
            if todo:
                ex = spec.execution
                cpus = max(os.cpu_count() or 1, int(ex.num_actors * ex.num_cpus))
                started_ray = ensure_ray(address, num_cpus=cpus, verbose=verbose)
                try:
                    schema = job_input_schema(spec, [url for url, _ in shards])
                    duplicates = find_duplicates(spec, shards, out)
                    _run_shards(spec, todo, result, progress, out, schema, duplicates, lease)
                finally:
                    if started_ray:
                        ray.shutdown()
            result.seconds = time.time() - began
            lease.check()
            write_manifest(spec, out, result, began)
        except StorageError as exc:
            raise _stopped(spec, out, result, began, todo, shards, exc) from None
    return result


class JobStopped(Exception):
    """The driver lost its output storage mid-job; `summary` is what it can still tell."""

    def __init__(self, summary: list[str]):
        super().__init__(summary)
        self.summary = summary


def _names(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
    return shown or "none"


def _stopped(
    spec: JobSpec,
    out: Storage,
    result: JobResult,
    began: float,
    todo: list[tuple[str, str]],
    shards: list[tuple[str, str]],
    exc: StorageError,
) -> JobStopped:
    """Write what can still be written (the manifest, with the failures so far) and say which
    shards are done and which are not, so that an operator knows what a resume will redo."""
    cause = exc.cause if isinstance(exc, RayTaskError) else exc  # a Ray task's StorageError
    result.seconds = time.time() - began
    try:
        write_manifest(spec, out, result, began)
        manifest = "manifest.json updated"
    except StorageError:
        manifest = "manifest.json not updated (storage still failing)"
    ran = {s["shard"] for s in result.done}
    failed = [f["shard"] for f in result.failed]
    queued = {name for _, name in todo}
    done = [name for _, name in shards if name in ran or name not in queued]
    not_done = [name for _, name in shards if name in queued and name not in ran]
    summary = [
        f"error: the job stopped: its storage failed: {cause}",
        f"  {len(done)} of {len(shards)} shard(s) done: {_names(done)}",
        f"  {len(not_done)} not done: {_names(not_done)}",
    ]
    if failed:
        summary.append(f"  of which failed: {_names(failed)}")
    summary.append(f"  {manifest}; resume with --run-id {spec.run_id} once the storage is back")
    return JobStopped(summary)


# Ray restarts a crashed model actor this many times before it is dead for good; the pool
# then starts a new one. A crash (OOM kill, lost node) is survived this way, a model that can
# never load (corrupt weights, too big for the device) is not retried forever: see
# pipeline.job.pool.CannotStart.
ACTOR_RESTARTS = 2
# how long an actor may take to write its learned head at the end (the 1.5B's is 0.2 GB)
HEAD_SAVE_SECONDS = 600
# A learning head is also saved while the job runs, at most this often per actor, so that a
# killed job's next run goes on from it; rarely enough that the saves (the head's weights) stay
# a small share of the job (docs/reliability.md).
HEAD_CHECKPOINT_SECONDS = 600


# How many shards `job_input_schema` opens looking for one that has the job's columns.
SCHEMA_PROBES = 8


def job_input_schema(spec: JobSpec, urls: list[str]) -> pa.Schema | None:
    """The input schema that types the id and kept columns of every outputs file of the job.

    It is the first shard's (in the sorted listing) that has those columns, so it does not
    depend on which shard an actor happens to finish first. A shard whose columns do not convert
    to it is an unreadable shard, named as such, rather than an outputs file with another schema
    (`pyarrow.parquet.read_table(outputs_dir)` would then drop columns silently). None when
    none of the first SCHEMA_PROBES shards has them (each shard then uses its own types).
    """
    wanted = [spec.input.id_column, *spec.input.keep_columns]
    for url in urls[:SCHEMA_PROBES]:
        try:
            schema = open_shard(url, spec.input.storage_options).schema_arrow
        except ShardReadError:
            continue
        if all(c in schema.names for c in wanted):
            return schema
    return None


def find_duplicates(spec: JobSpec, shards: list[tuple[str, str]], out: Storage) -> dict[str, dict[str, str]]:
    """{shard: {id: shard holding it}} for rows whose id an earlier shard holds (see pipeline.job.ids)."""
    columns = [spec.input.id_column, spec.input.text_column, *spec.input.keep_columns]
    mapper = ray.remote(map_ids)
    opts = spec.input.storage_options
    counts = ray.get([mapper.remote(url, name, out, opts, columns) for url, name in shards])
    parts = partitions(sum(counts))
    clear_duplicates(out)
    names = [name for _, name in shards]
    ray.get([ray.remote(reduce_ids).remote(p, parts, names, out) for p in range(parts)])
    return read_duplicates(out)


@dataclass(frozen=True)
class ShardAttempt:
    """One try at one shard: what the queue holds and what the pool hands back with its outcome."""

    url: str
    name: str
    attempt: int


def _run_shards(
    spec: JobSpec,
    todo: list[tuple[str, str]],
    result: JobResult,
    progress: bool | None,
    out: Storage,
    input_schema: pa.Schema | None,
    duplicates: dict[str, dict[str, str]],
    lease: Lease,
) -> None:
    """Dispatch the planned shards to the model actors and record each outcome as it comes back
    (done, retried or failed for good), until none is queued or running."""
    queue = deque(ShardAttempt(url, name, 1) for url, name in todo)
    shown = ShardProgress(len(todo), show_bar=_show_progress(progress))
    record = _Recorder(spec, out, result, shown, queue)
    actor_spec = _with_learned_head(spec, out, shown)
    start_actor = partial(_model_actor_class(actor_spec).remote, actor_spec)
    checkpoints = _HeadCheckpoints(out, shown) if spec.drafter.head_online else None
    alive, drains = nodes.alive(), Drains()
    with ModelActorPool(start_actor, min(spec.execution.num_actors, len(todo))) as pool:
        while queue or pool.running:  # not waiting for actors coming back once no shard is left
            _dispatch(pool, queue, input_schema, duplicates)
            outcome = pool.next(timeout=drains.poll_seconds)
            lease.check()
            for drain in drains.check(pool):
                record.draining(drain)
            if isinstance(outcome, Finished) and outcome.retired and isinstance(outcome.error, RayActorError):
                record.hand_back(outcome.task, drains.hand_back(outcome.actor, outcome.task.name))
            elif isinstance(outcome, Finished):
                record.finished(outcome.task, outcome.value, outcome.error, outcome.actor)
                if checkpoints is not None:
                    checkpoints.after_shard(pool, outcome.actor)
            elif isinstance(outcome, CannotStart) and queue:
                record.give_up(f"model actors cannot start: {_reason(outcome.error)}")
        if checkpoints is not None:
            checkpoints.wait()
            result.heads = _save_heads(pool, out, shown)
    result.nodes_drained = [d.to_dict() for d in drains.seen.values()]
    result.nodes_lost = [{"node": n, "reason": why} for n, why in nodes.dead().items() if n in alive]
    for lost in result.nodes_lost:
        metrics.record_node_event(spec.name, "lost")
        shown.note(f"Ray node {lost['node']} was lost during the job: {lost['reason']}")
    shown.close()


def _save_heads(pool: ModelActorPool, out: Storage, shown: ShardProgress) -> list[dict]:
    """Each live actor's learned head, written under head/actor-<k>/ (`ModelWorker.save_head`)
    for a later job's `drafter.head` to start from, so that a nightly job's head goes on
    learning night after night. A by-product: an actor that cannot save it costs a note, not
    the job."""
    heads = []
    for k, actor in enumerate(pool.actors):
        url = out.url_for(head_dir(k))
        try:
            saved = ray.get(actor.save_head.remote(url), timeout=HEAD_SAVE_SECONDS)
        except Exception as exc:  # a lost actor, a storage error: the outputs are whole anyway
            shown.note(f"the head of model actor {k} was not saved: {_reason(exc)}")
            continue
        if saved:
            heads.append(saved)
            shown.note(f"head learned over {saved['steps']} steps saved to {url}")
    return heads


class _HeadCheckpoints:
    """Each actor's learning head, saved under head/actor-<k>/ while the job runs, at most every
    HEAD_CHECKPOINT_SECONDS, so that a killed job's next run starts from what it had learned
    (`_with_learned_head`). A save is asked for as a shard comes back, before the actor's next:
    the call queues on the actor, and the driver does not wait for it."""

    def __init__(self, out: Storage, shown: ShardProgress):
        self.out, self.shown = out, shown
        self.began = time.monotonic()
        self.saved: dict[int, float] = {}  # actor -> when its last save was asked for
        self.calls: list[tuple[int, ray.ObjectRef]] = []

    def after_shard(self, pool: ModelActorPool, actor) -> None:
        k = next((k for k, a in enumerate(pool.actors) if a is actor), None)
        now = time.monotonic()
        if k is None or now - self.saved.get(k, self.began) < HEAD_CHECKPOINT_SECONDS:
            return
        self.saved[k] = now
        self.calls.append((k, actor.save_head.remote(self.out.url_for(head_dir(k)))))

    def wait(self) -> None:
        """The saves asked for have ended (before the job's last, which must come after them)."""
        for k, call in self.calls:
            try:
                ray.get(call, timeout=HEAD_SAVE_SECONDS)
            except Exception as exc:  # a lost actor, a storage error: the final save may still come
                self.shown.note(f"a checkpoint of model actor {k}'s head was not saved: {_reason(exc)}")


def _with_learned_head(spec: JobSpec, out: Storage, shown: ShardProgress) -> JobSpec:
    """The spec the model actors start from. Where a learning job's output already holds heads
    (a killed run's checkpoints, or an ended run's heads before shards were added), the actors
    start from the most trained one rather than from `drafter.head`: a re-run goes on learning
    where the last one stopped. Any other spec as it is."""
    from pipeline.decode.head import HEAD_CONFIG

    if not spec.drafter.head_online:
        return spec
    best = None
    for name in out.list(HEAD_DIR, suffix=HEAD_CONFIG):
        try:
            steps = out.read_json(name).get("steps", 0)
        except (StorageError, ValueError, AttributeError):
            continue  # unreadable: not a head to go on from
        if best is None or steps > best[0]:
            best = (steps, out.url_for(name.rsplit("/", 1)[0]))
    if best is None:
        return spec
    shown.note(f"the model actors go on from the head saved after {best[0]} steps at {best[1]}")
    return spec.model_copy(update={"drafter": spec.drafter.model_copy(update={"head": best[1]})})


def _model_actor_class(spec: JobSpec):
    """The Ray actor class of the job's model actors, with its resources and restart budget."""
    ex = spec.execution
    return ray.remote(ModelWorker).options(
        num_cpus=ex.num_cpus,
        num_gpus=ex.num_gpus,
        scheduling_strategy="SPREAD" if ex.placement == "spread" else "DEFAULT",
        max_restarts=ACTOR_RESTARTS,
        max_task_retries=0,  # the driver retries shards itself, counting attempts per shard
    )


def _dispatch(
    pool: ModelActorPool,
    queue: deque[ShardAttempt],
    input_schema: pa.Schema | None,
    duplicates: dict[str, dict[str, str]],
) -> None:
    """Hand queued shards, in order, to the pool's free actors."""
    while queue and pool.has_free():
        shard = queue.popleft()
        args = (shard.url, shard.name, shard.attempt, input_schema, duplicates.get(shard.name))
        pool.submit(shard, lambda actor, args=args: actor.process.remote(*args))


class _Recorder:
    """What each shard's outcome leaves behind: the job result, failed/ records, the Ray metrics
    and the progress lines; a failed attempt with attempts left goes back on the queue."""

    def __init__(
        self, spec: JobSpec, out: Storage, result: JobResult, shown: ShardProgress, queue: deque[ShardAttempt]
    ):
        self.spec, self.out, self.result, self.shown, self.queue = spec, out, result, shown, queue
        self.nodes: dict = {}  # actor -> the Ray node its shards' stats named

    def finished(self, shard: ShardAttempt, stats: dict | None, error: Exception | None, actor=None) -> None:
        if error is None:
            self.nodes[actor] = (stats.get("worker") or {}).get("node")
            self.done(stats)
            return
        reason = _reason(error)
        node = self.nodes.get(actor)
        if is_complete(self.out, shard.name):  # died after writing its completion marker: done
            self.done(self.out.read_json(shard_paths(shard.name)["stats"]))
        elif shard.attempt <= self.spec.execution.max_retries:
            metrics.record_failure(self.spec.name, shard.name, reason, final=False)
            retry = {"shard": shard.name, "attempt": shard.attempt, "reason": reason, "node": node}
            self.result.retried.append(retry)
            self.queue.append(ShardAttempt(shard.url, shard.name, shard.attempt + 1))
            where = f" on node {node}" if node else ""
            self.shown.note(f"shard {shard.name}: attempt {shard.attempt}{where} failed ({reason}); retrying")
        else:
            self.fail(shard, shard.attempt, reason)
            self.shown.shard_failed(f"shard {shard.name}: FAILED after {shard.attempt} attempts: {reason}")

    def draining(self, drain) -> None:
        metrics.record_node_event(self.spec.name, "draining")
        deadline = f"in {drain.deadline - drain.noticed:.0f} s" if drain.deadline else "none"
        self.shown.note(
            f"Ray node {drain.node} is draining (deadline {deadline}): its actors take no new "
            "shard and are replaced on other nodes"
        )

    def hand_back(self, shard: ShardAttempt, node: str | None) -> None:
        """A retired actor's shard that did not finish: first in line again, same attempt
        (killed after writing its completion marker, it is done, as in `finished`)."""
        if is_complete(self.out, shard.name):
            self.done(self.out.read_json(shard_paths(shard.name)["stats"]))
            return
        metrics.record_handed_back(self.spec.name)
        self.result.handed_back.append({"shard": shard.name, "attempt": shard.attempt, "node": node})
        self.queue.appendleft(shard)
        self.shown.note(f"shard {shard.name}: handed back from draining node {node}; requeued")

    def done(self, stats: dict) -> None:
        self.result.done.append(
            {k: stats.get(k) for k in DONE_KEYS} | {"node": (stats.get("worker") or {}).get("node")}
        )
        metrics.record_shard(stats, self.spec.name)
        self.shown.shard_done(stats)

    def give_up(self, reason: str) -> None:
        """No actor can start: every queued shard fails now, with the attempts it has had."""
        self.shown.note(f"giving up on {len(self.queue)} shard(s): {reason}")
        while self.queue:
            shard = self.queue.popleft()
            self.fail(shard, shard.attempt - 1, reason)
            self.shown.shard_failed(f"shard {shard.name}: FAILED: {reason}")

    def fail(self, shard: ShardAttempt, attempts: int, reason: str) -> None:
        """A shard out of attempts: recorded now (failed/, read by `pipeline status`), not at the end.

        An actor killed between writing the shard's outputs and its stats (the completion
        marker) leaves files behind; they go, so that outputs/ holds finished shards only and a
        failed shard's rows are in no output until a re-run redoes it.
        """
        remove_partial(self.out, shard.name)
        failure = {"shard": shard.name, "input_url": shard.url, "attempts": attempts, "reason": reason}
        self.result.failed.append(failure)
        self.out.write_json(failed_path(shard.name), failure)
        metrics.record_failure(self.spec.name, shard.name, reason, final=True)


_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception)\b[^:]*:")


def _reason(exc: Exception) -> str:
    if isinstance(exc, RayActorError):
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or ["(no message)"]
        # an actor whose constructor raised carries that traceback; its last line is the cause
        cause = next((line for line in reversed(lines) if _EXCEPTION_LINE.match(line)), None)
        return f"model actor died: {(cause if exc.actor_init_failed and cause else lines[0])[:300]}"
    cause = getattr(exc, "cause", None)
    text = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc).splitlines()[-1]
    return text[:500]


def _show_progress(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress


def write_manifest(spec: JobSpec, out: Storage, result: JobResult, began: float, final: bool = True) -> None:
    """manifest.json always (what ran and how it ended); _SUCCESS only when every shard is done.

    Also written when a run starts (`final` False: `finished` is null), so that a run killed
    before its end still records the spec fingerprint a resume is checked against.
    """
    stats = read_stats(out)
    totals = job_totals(stats)
    models = next((s["models"] for s in stats if s.get("models")), {})
    manifest = {
        "job": spec.name,
        "run_id": spec.run_id,
        "date": spec.date,
        "package_version": pipeline.__version__,
        "spec": spec.to_dict(),
        "fingerprint": fingerprint(spec),
        "models": models,
        "started": began,
        "finished": time.time() if final else None,
        "shards_total": result.shards_total,
        "shards_skipped": result.shards_skipped,
        "failed": result.failed,
        "retried": result.retried,
        "nodes_lost": result.nodes_lost,
        "nodes_drained": result.nodes_drained,
        "handed_back": result.handed_back,
        "heads": result.heads,
        "totals": totals,
    }
    save_manifest(out, manifest, complete=final and result.ok and totals["shards"] == result.shards_total)
