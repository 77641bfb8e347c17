"""Ray custom metrics for pipeline jobs, exported on every node's metrics port (Prometheus).

Ray exports a metric named ``pipeline_x`` as ``ray_pipeline_x`` (with Ray's own labels added:
``SessionName``, ``NodeAddress``, ``Version``, ...). ``infra/monitoring/`` scrapes and graphs them.

Calling convention (one place per event, so nothing is counted twice):

* ``record_shard(stats, job)`` once per shard that finished (the dict written to
  ``stats/<shard>.json``, ``status`` ``ok`` or ``unreadable``);
* ``record_failure(job, shard, reason, final=...)`` once per failed attempt of a shard, with
  ``final=True`` when the shard is given up and ``final=False`` when it will be retried;
* ``record_node_event(job, event)`` once per node lost or noticed draining, and
  ``record_handed_back(job)`` once per shard a draining node's actor handed back.

Labels (tag keys), chosen for bounded cardinality:

* ``pipeline_job``: the job name (``spec.name``). Not ``job``: Prometheus attaches its own
  ``job`` label (the scrape job) to every target, which would rename ours to ``exported_job``.
* ``shard``: only on the per-shard gauges (last value per shard: α, τ, tokens/s, speedup and its
  interval) and on ``pipeline_shard_failures_total``; never on the counters or the histogram.
* ``status`` (``ok`` | ``unreadable``) on ``pipeline_shards_done_total``.
* ``drafter`` (``draft_model`` | ``prompt_lookup`` | ``suffix``, and ``none`` on
  ``pipeline_rounds_total``) and ``position`` (1..γmax, at most 64) on the round counters:
  acceptance at position k is rate(accepted_by_position) / rate(drafted_by_position).
* ``event`` (``lost`` | ``draining``) on ``pipeline_node_events_total``.
* ``reason`` (a category from ``FAILURE_REASONS``, never the error text) and ``outcome``
  (``retried`` | ``failed``) on ``pipeline_shard_failures_total``.

Metrics are created lazily, once per process, the first time something is recorded while Ray is
initialized in that process. Without Ray (not imported, or not initialized) every call is a
no-op, and importing this module never imports Ray. Recording never raises: a metrics problem
must not fail a shard.
"""

from __future__ import annotations

import logging
import math
import re
import sys
import threading
from typing import Any

from pipeline.decode.rounds import Rounds
from pipeline.job.stats import ShardStats

log = logging.getLogger(__name__)

PREFIX = "pipeline_"
EXPORTED_PREFIX = "ray_"  # what Ray prepends on its Prometheus endpoint

COUNTERS: dict[str, str] = {
    "pipeline_rows_total": "Rows decoded into outputs/ (rows_out).",
    "pipeline_rows_error_total": "Rows sent to errors/ (rows_error).",
    "pipeline_tokens_total": "New tokens generated (tokens_out).",
    "pipeline_drafted_tokens_total": "Tokens proposed by the drafters.",
    "pipeline_accepted_tokens_total": "Drafted tokens accepted by the target.",
    "pipeline_target_passes_total": "Target model forward passes (batched passes).",
    "pipeline_rounds_total": "Rounds (a row's share of a verify pass), by drafter (none: drafted nothing).",
    "pipeline_drafted_by_position_total": "Rounds that drafted at least `position` tokens, by drafter.",
    "pipeline_accepted_by_position_total": "Rounds whose draft at `position` was accepted, by drafter.",
    "pipeline_shards_done_total": "Shards completed (stats written), by status (ok | unreadable).",
    "pipeline_shard_failures_total": "Failed shard attempts, by reason category and outcome.",
    "pipeline_node_events_total": "Ray nodes lost or draining during the job, by event (lost | draining).",
    "pipeline_shards_handed_back_total": "Shards a draining node's actors handed back (no attempt counted).",
}
GAUGES: dict[str, str] = {
    "pipeline_alpha": "Draft acceptance rate alpha of the shard (accepted / drafted).",
    "pipeline_tau": "Mean tokens per target pass per row (tau) of the shard.",
    "pipeline_tokens_per_second": "Decoding throughput of the shard (new tokens / decode second).",
    "pipeline_tau_drafted_rounds": "Tokens per target pass over the shard's rounds that drafted.",
    "pipeline_speedup": "Measured speedup of the shard over target-only decoding.",
    "pipeline_speedup_ci95_low": "Lower bound of the 95% interval of the shard's measured speedup.",
    "pipeline_speedup_ci95_high": "Upper bound of the 95% interval of the shard's measured speedup.",
}
HISTOGRAMS: dict[str, str] = {
    "pipeline_shard_decode_seconds": "Wall seconds spent decoding one shard.",
}

#: Every metric name, as passed to Ray (Prometheus shows them with the ``ray_`` prefix).
METRIC_NAMES: tuple[str, ...] = (*COUNTERS, *GAUGES, *HISTOGRAMS)

#: Histogram buckets for shard decode time: seconds to half a day.
DECODE_SECONDS_BOUNDARIES: tuple[float, ...] = (
    1, 5, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 28800, 43200,
)  # fmt: skip

#: Failure categories used as the ``reason`` label (checked in this order, first match wins).
FAILURE_REASONS: tuple[str, ...] = (
    "oom",
    "actor_died",
    "timeout",
    "model",
    "storage",
    "unreadable",
    "cancelled",
    "other",
)
_REASON_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern, re.IGNORECASE))
    for name, pattern in (
        ("oom", r"out ?of ?memory|\bOOM\b|OutOfMemoryError|MemoryError|oom[- ]?kill"),
        ("actor_died", r"actor died|RayActorError|ActorDiedError|ActorUnavailable|node died|worker died"),
        ("timeout", r"timed? ?out|deadline exceeded"),
        ("model", r"tokenizer|safetensors|checkpoint|from_pretrained|vocab|CUDA error"),
        (
            "storage",
            r"NoCredentials|AccessDenied|Forbidden|NoSuchKey|NoSuchBucket|ClientError|EndpointConnection"
            r"|botocore|s3fs|FileNotFound|PermissionError|ConnectionError|SlowDown|Throttl",
        ),
        ("unreadable", r"unreadable|ArrowInvalid|parquet|corrupt"),
        ("cancelled", r"cancel|KeyboardInterrupt|SIGTERM|preempt"),
    )
)

_lock = threading.Lock()
_metrics: dict[str, Any] | None = None  # name -> Ray metric object, once created in this process
_disabled = False  # set when creating the metrics failed; stop trying


def failure_category(reason: str | None) -> str:
    """Map a free-text failure reason to one of ``FAILURE_REASONS`` (a bounded label value)."""
    text = str(reason or "")
    for name, pattern in _REASON_PATTERNS:
        if pattern.search(text):
            return name
    return "other"


def _ray_initialized() -> bool:
    """True when Ray is initialized in this process; never imports Ray itself."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        return bool(ray.is_initialized())
    except Exception:  # a half-imported or stubbed ray module
        return False


def _create() -> dict[str, Any]:
    from ray.util.metrics import Counter, Gauge, Histogram

    job = ("pipeline_job",)
    made: dict[str, Any] = {}
    for name, doc in COUNTERS.items():
        if name == "pipeline_shards_done_total":
            keys = (*job, "status")
        elif name == "pipeline_shard_failures_total":
            keys = (*job, "shard", "reason", "outcome")
        elif name == "pipeline_node_events_total":
            keys = (*job, "event")
        elif name == "pipeline_rounds_total":
            keys = (*job, "drafter")
        elif name.endswith("_by_position_total"):
            keys = (*job, "drafter", "position")
        else:
            keys = job
        made[name] = Counter(name, description=doc, tag_keys=keys)
    for name, doc in GAUGES.items():
        made[name] = Gauge(name, description=doc, tag_keys=(*job, "shard"))
    for name, doc in HISTOGRAMS.items():
        made[name] = Histogram(
            name, description=doc, boundaries=list(DECODE_SECONDS_BOUNDARIES), tag_keys=job
        )
    return made


def _get() -> dict[str, Any] | None:
    """The metric objects, created on first use; None when Ray is not initialized here."""
    global _metrics, _disabled
    if _metrics is not None:
        return _metrics
    if _disabled or not _ray_initialized():
        return None
    with _lock:
        if _metrics is None and not _disabled:
            try:
                _metrics = _create()
            except Exception as exc:  # never let metrics break a job
                _disabled = True
                log.warning("pipeline metrics disabled: %s", exc)
    return _metrics


def _number(value: Any) -> float | None:
    """A finite float, or None for missing / non-numeric / NaN / inf values."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _inc(metric: Any, value: Any, tags: dict[str, str]) -> None:
    number = _number(value)
    if number is not None and number > 0:  # Ray counters reject increments <= 0
        metric.inc(number, tags=tags)


def _set(metric: Any, value: Any, tags: dict[str, str]) -> None:
    number = _number(value)
    if number is not None:
        metric.set(number, tags=tags)


def record_shard(record: dict, job: str) -> None:
    """Record one finished shard from its stats file (``stats/<shard>.json``, read through
    `pipeline.job.stats.ShardStats`). Never raises."""
    metrics = _get()
    if metrics is None:
        return
    try:
        # the shard is counted from the file itself, before anything of it could fail to parse
        job_tags = {"pipeline_job": str(job)}
        ok = record.get("status", "ok") == "ok"
        metrics["pipeline_shards_done_total"].inc(
            1, tags={**job_tags, "status": "ok" if ok else "unreadable"}
        )
        _inc(metrics["pipeline_rows_total"], record.get("rows_out"), job_tags)
        _inc(metrics["pipeline_rows_error_total"], record.get("rows_error"), job_tags)
        if ok:  # an unreadable shard has no decoding statistics
            _record_decoding(metrics, ShardStats.from_json(record), job_tags)
    except Exception as exc:
        log.warning("could not record metrics for shard %s: %s", record.get("shard"), exc)


def _record_decoding(metrics: dict[str, Any], stats: ShardStats, job_tags: dict[str, str]) -> None:
    """The shard's decoding counters, rounds, and its figures as gauges tagged with the shard."""
    d = stats.decoded
    _inc(metrics["pipeline_tokens_total"], d.new_tokens, job_tags)
    _inc(metrics["pipeline_drafted_tokens_total"], d.drafted, job_tags)
    _inc(metrics["pipeline_accepted_tokens_total"], d.accepted, job_tags)
    _inc(metrics["pipeline_target_passes_total"], d.target_passes, job_tags)
    _record_rounds(metrics, d.rounds, job_tags)
    if d.wall_seconds > 0:
        metrics["pipeline_shard_decode_seconds"].observe(d.wall_seconds, tags=job_tags)
    shard_tags = {**job_tags, "shard": stats.shard}
    _set(metrics["pipeline_alpha"], d.alpha, shard_tags)
    if d.row_passes:
        _set(metrics["pipeline_tau"], d.tau, shard_tags)
    if d.rounds.drafted:
        _set(metrics["pipeline_tau_drafted_rounds"], d.rounds.tau_drafted, shard_tags)
    if d.wall_seconds:
        _set(metrics["pipeline_tokens_per_second"], d.tokens_per_second, shard_tags)
    speedup = stats.speedup.measured
    _set(metrics["pipeline_speedup"], speedup["measured"], shard_tags)
    low, high = speedup["ci95"] or (None, None)
    _set(metrics["pipeline_speedup_ci95_low"], low, shard_tags)
    _set(metrics["pipeline_speedup_ci95_high"], high, shard_tags)


def _record_rounds(metrics: dict[str, Any], rounds: Rounds, job_tags: dict[str, str]) -> None:
    """The shard's rounds per drafter, and per drafter and position (`pipeline.decode.rounds`)."""
    _inc(metrics["pipeline_rounds_total"], rounds.undrafted, {**job_tags, "drafter": "none"})
    for drafter, counts in sorted(rounds.by_drafter.items()):
        tags = {**job_tags, "drafter": str(drafter)}
        _inc(metrics["pipeline_rounds_total"], counts.rounds, tags)
        for name, per_position in (
            ("pipeline_drafted_by_position_total", counts.drafted),
            ("pipeline_accepted_by_position_total", counts.accepted),
        ):
            for position, count in enumerate(per_position, start=1):
                _inc(metrics[name], count, {**tags, "position": str(position)})


def record_failure(job: str, shard: str, reason: str, *, final: bool = True) -> None:
    """Count one failed shard attempt. ``reason`` is reduced to a category (``FAILURE_REASONS``);
    ``final=False`` when the shard will be retried (label ``outcome="retried"``), else
    ``outcome="failed"``. Never raises."""
    metrics = _get()
    if metrics is None:
        return
    try:
        metrics["pipeline_shard_failures_total"].inc(
            1,
            tags={
                "pipeline_job": str(job),
                "shard": str(shard),
                "reason": failure_category(reason),
                "outcome": "failed" if final else "retried",
            },
        )
    except Exception as exc:
        log.warning("could not record a failure metric for shard %s: %s", shard, exc)


def record_node_event(job: str, event: str) -> None:
    """Count one Ray node lost or draining during the job (``event``). Never raises."""
    _count("pipeline_node_events_total", {"pipeline_job": str(job), "event": event})


def record_handed_back(job: str) -> None:
    """Count one shard handed back by a draining node's actor. Never raises."""
    _count("pipeline_shards_handed_back_total", {"pipeline_job": str(job)})


def _count(name: str, tags: dict[str, str]) -> None:
    metrics = _get()
    if metrics is None:
        return
    try:
        metrics[name].inc(1, tags=tags)
    except Exception as exc:
        log.warning("could not record %s: %s", name, exc)


def _reset_for_tests() -> None:
    """Forget the created metrics (tests swap in fakes)."""
    global _metrics, _disabled
    with _lock:
        _metrics = None
        _disabled = False
