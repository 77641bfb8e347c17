"""pipeline.job.metrics without a Ray cluster: no-op without Ray, and what it records (with fakes)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from pipeline.job import metrics

STATS = {
    "shard": "part-00001",
    "status": "ok",
    "rows_out": 7,
    "rows_error": 1,
    "tokens_out": 420,
    "drafted": 300,
    "accepted": 240,
    "target_passes": 90,
    "row_passes": 140,
    "alpha": 0.8,
    "tau": 3.0,
    "tokens_per_second": 420 / 7.5,
    "decode_seconds": 7.5,
    "tau_drafted_rounds": 270 / 80,
    "speedup": {"pair_seconds": [[1.0, 1.8], [1.0, 2.0]], "predicted": 2.1},
    "undrafted_rounds": 9,
    "rounds_by_drafter": {
        "draft_model": {"rounds": 80, "tokens": 270, "drafted": [80, 70], "accepted": [60, 0]}
    },
}


class Fake:
    def __init__(self, name, description="", tag_keys=None, boundaries=None):
        self.name, self.tag_keys, self.boundaries = name, tuple(tag_keys or ()), boundaries
        self.calls = []

    def _record(self, kind, value, tags):
        assert set(tags) == set(self.tag_keys), (self.name, tags)
        assert all(isinstance(v, str) for v in tags.values())
        self.calls.append((kind, value, dict(tags)))

    def inc(self, value=1.0, tags=None):
        assert value > 0
        self._record("inc", value, tags)

    def set(self, value, tags=None):
        self._record("set", value, tags)

    def observe(self, value, tags=None):
        self._record("observe", value, tags)


@pytest.fixture
def fake_metrics(monkeypatch):
    """Ray "initialized", with fake metric classes standing in for ray.util.metrics."""
    created = {}

    def factory(name, description="", tag_keys=None, boundaries=None):
        created[name] = Fake(name, description, tag_keys, boundaries)
        return created[name]

    fake_module = types.SimpleNamespace(Counter=factory, Gauge=factory, Histogram=factory)
    monkeypatch.setitem(sys.modules, "ray.util.metrics", fake_module)
    monkeypatch.setattr(metrics, "_ray_initialized", lambda: True)
    metrics._reset_for_tests()
    yield created
    metrics._reset_for_tests()


def _calls(fakes, name):
    return fakes[name].calls


def test_import_is_cheap_and_calls_are_noops_without_ray():
    code = (
        "import sys; from pipeline.job import metrics; "
        "metrics.record_shard({'shard': 'a', 'status': 'ok', 'rows_out': 3}, 'job'); "
        "metrics.record_failure('job', 'a', 'boom'); "
        "assert 'ray' not in sys.modules, 'ray was imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_record_shard(fake_metrics):
    metrics.record_shard(STATS, "translate")
    job = {"pipeline_job": "translate"}
    shard = {**job, "shard": "part-00001"}
    assert _calls(fake_metrics, "pipeline_shards_done_total") == [("inc", 1, {**job, "status": "ok"})]
    expected_counters = {
        "pipeline_rows_total": 7,
        "pipeline_rows_error_total": 1,
        "pipeline_tokens_total": 420,
        "pipeline_drafted_tokens_total": 300,
        "pipeline_accepted_tokens_total": 240,
        "pipeline_target_passes_total": 90,
    }
    for name, value in expected_counters.items():
        assert _calls(fake_metrics, name) == [("inc", value, job)], name
    model = {**job, "drafter": "draft_model"}
    assert _calls(fake_metrics, "pipeline_rounds_total") == [
        ("inc", 9, {**job, "drafter": "none"}),
        ("inc", 80, model),
    ]
    assert _calls(fake_metrics, "pipeline_drafted_by_position_total") == [
        ("inc", 80, {**model, "position": "1"}),
        ("inc", 70, {**model, "position": "2"}),
    ]
    # a count of 0 is left out (Ray counters reject it): the series starts at its first increment
    assert _calls(fake_metrics, "pipeline_accepted_by_position_total") == [
        ("inc", 60, {**model, "position": "1"})
    ]
    expected_gauges = {
        "pipeline_alpha": 0.8,
        "pipeline_tau": 3.0,
        "pipeline_tau_drafted_rounds": 270 / 80,
        "pipeline_tokens_per_second": 56.0,
        "pipeline_speedup": 1.9,  # from the pairs, as the stats file's figure is
        "pipeline_speedup_ci95_low": 1.9 - 12.706 * 0.1 / 1.0,
        "pipeline_speedup_ci95_high": 1.9 + 12.706 * 0.1 / 1.0,
    }
    for name, value in expected_gauges.items():
        [(verb, got, tags)] = _calls(fake_metrics, name)
        assert (verb, tags) == ("set", shard) and got == pytest.approx(value, abs=1e-3), name
    assert _calls(fake_metrics, "pipeline_shard_decode_seconds") == [("observe", 7.5, job)]
    assert fake_metrics["pipeline_shard_decode_seconds"].boundaries == list(metrics.DECODE_SECONDS_BOUNDARIES)
    assert _calls(fake_metrics, "pipeline_shard_failures_total") == []


def test_zero_missing_and_unreadable_values(fake_metrics):
    stats = {**STATS, "rows_error": 0, "drafted": 0, "accepted": 0, "alpha": float("nan"), "speedup": {}}
    stats.pop("tau")
    stats.pop("row_passes")
    metrics.record_shard(stats, "j")
    assert _calls(fake_metrics, "pipeline_rows_error_total") == []  # Ray counters reject 0
    assert _calls(fake_metrics, "pipeline_drafted_tokens_total") == []
    assert _calls(fake_metrics, "pipeline_alpha") == []
    assert _calls(fake_metrics, "pipeline_tau") == []
    assert _calls(fake_metrics, "pipeline_speedup") == []
    assert _calls(fake_metrics, "pipeline_speedup_ci95_low") == []

    unreadable = {"shard": "bad", "status": "unreadable", "error": "x", "rows_in": 0, "rows_out": 0}
    metrics.record_shard(unreadable, "j")
    assert _calls(fake_metrics, "pipeline_shards_done_total")[-1] == (
        "inc",
        1,
        {"pipeline_job": "j", "status": "unreadable"},
    )
    assert len(_calls(fake_metrics, "pipeline_shard_decode_seconds")) == 1  # only the ok shard


def test_record_failure(fake_metrics):
    metrics.record_failure("j", "part-3", "model actor died: The actor died unexpectedly", final=False)
    metrics.record_failure("j", "part-3", "OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB")
    assert _calls(fake_metrics, "pipeline_shard_failures_total") == [
        ("inc", 1, {"pipeline_job": "j", "shard": "part-3", "reason": "actor_died", "outcome": "retried"}),
        ("inc", 1, {"pipeline_job": "j", "shard": "part-3", "reason": "oom", "outcome": "failed"}),
    ]


def test_recording_never_raises(fake_metrics, caplog):
    metrics.record_shard({"shard": "x"}, "j")  # creates the fakes
    fake_metrics["pipeline_rows_total"].inc = None  # break one metric
    metrics.record_shard(STATS, "j")
    assert "could not record metrics" in caplog.text


@pytest.mark.parametrize(
    "reason, category",
    [
        ("model actor died: The actor died because its node was killed", "actor_died"),
        ("RayActorError: ...", "actor_died"),
        ("OutOfMemoryError: CUDA out of memory", "oom"),
        ("GetTimeoutError: Get timed out after 600 s", "timeout"),
        ("OSError: Can't load tokenizer for 'x'", "model"),
        ("ClientError: An error occurred (AccessDenied) when calling PutObject", "storage"),
        ("NoCredentialsError: Unable to locate credentials", "storage"),
        ("ArrowInvalid: Parquet magic bytes not found", "unreadable"),
        ("TaskCancelledError: cancelled", "cancelled"),
        ("ValueError: something else", "other"),
        ("", "other"),
        (None, "other"),
    ],
)
def test_failure_category(reason, category):
    assert metrics.failure_category(reason) == category
    assert category in metrics.FAILURE_REASONS


def test_real_ray_metric_classes_accept_the_definitions():
    """The real ray.util.metrics constructors accept our names, tag keys and boundaries (no cluster
    needed to construct them)."""
    pytest.importorskip("ray.util.metrics")
    made = metrics._create()
    assert set(made) == set(metrics.METRIC_NAMES)
