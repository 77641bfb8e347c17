"""The shard's statistics record, its one owner: built from the engine's counters, written as
stats/<shard>.json (the shard's commit record), read back, and added up into the job's totals.

Every figure of the file (α, τ, mean γ, tokens/s) is a property of the counters it holds
(`pipeline.decode.stats.BatchStats`), so a shard's figures and the job's are computed by the
same code: the totals add shards' counters and take the rates of the sums (token-weighted),
never means of shards' rates. The speedup sample (`SpeedupSample`) pools its pairs the same
way. Progress lines, metrics, `pipeline stats`, the report and the Jobs API read these
classes; the JSON keys are written and read here alone (docs/stats.md explains each).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.decode.rounds import Rounds
from pipeline.decode.stats import BatchStats
from pipeline.job.speedup import pair_seconds, paired_speedup, verdict

OK, UNREADABLE = "ok", "unreadable"


@dataclass
class SpeedupSample:
    """A shard's speedup sample (`ShardProcessor._decode_measured`): its pairs of [speculative,
    target-only] seconds, what they say, and what measuring cost. Empty where nothing was
    sampled (target-only jobs)."""

    pair_seconds: list[list[float]] = field(default_factory=list)
    predicted: float | None = None
    rows_per_pair: int = 0
    sample_rows: int = 0  # rows decoded both ways, a row decoded again counted again
    sample_tokens: int = 0  # the speculative halves' tokens
    target_only_tokens: int = 0
    speculative_seconds: float = 0.0
    target_only_seconds: float = 0.0
    identical_rows: int | None = None  # greedy only: rows whose two halves were identical
    seconds: float = 0.0  # what measuring cost the shard: decoding done for the sample alone
    # pairs of rows decoded again: their speculative half drafts from each row's own text only,
    # where the shard's own decoding also drafts from the actor's corpus (the suffix drafter)
    repeated_pairs: int = 0

    def add_pair(self, speculative: BatchStats, target_only: BatchStats, identical: int | None) -> None:
        """One pair's halves, each the counters of one chunk decoded one way."""
        self.pair_seconds.append(
            pair_seconds(
                (speculative.new_tokens, speculative.wall_seconds),
                (target_only.new_tokens, target_only.wall_seconds),
            )
        )
        self.rows_per_pair = max(self.rows_per_pair, speculative.rows)
        self.sample_rows += speculative.rows
        self.sample_tokens += speculative.new_tokens
        self.target_only_tokens += target_only.new_tokens
        self.speculative_seconds += speculative.wall_seconds
        self.target_only_seconds += target_only.wall_seconds
        if identical is not None:
            self.identical_rows = (self.identical_rows or 0) + identical

    # a file written before the pairs were kept: its figures as recorded
    recorded: dict | None = None

    @property
    def measured(self) -> dict:
        """{"measured", "ci95", "pairs", "median_pair_ratio"} over the pairs."""
        if not self.pair_seconds and self.recorded:
            return {**paired_speedup([]), **self.recorded}
        return paired_speedup(self.pair_seconds)

    def to_json(self) -> dict:
        if not self.pair_seconds:
            return {}
        measured = self.measured
        return {
            **measured,
            "verdict": verdict(measured["ci95"]),
            "predicted": self.predicted,
            "rows_per_pair": self.rows_per_pair,
            "sample_rows": self.sample_rows,
            "sample_tokens": self.sample_tokens,
            "pair_seconds": self.pair_seconds,
            "speculative_seconds": self.speculative_seconds,
            "speculative_tokens_per_second": _rate(self.sample_tokens, self.speculative_seconds),
            "target_only_tokens": self.target_only_tokens,
            "target_only_seconds": self.target_only_seconds,
            "target_only_tokens_per_second": _rate(self.target_only_tokens, self.target_only_seconds),
            "identical_rows": self.identical_rows,
            "seconds": self.seconds,
            "repeated_pairs": self.repeated_pairs,
        }

    @classmethod
    def from_json(cls, record: dict | None) -> SpeedupSample:
        record = record or {}
        return cls(
            pair_seconds=[list(p) for p in record.get("pair_seconds", [])],
            predicted=record.get("predicted"),
            rows_per_pair=record.get("rows_per_pair", 0),
            sample_rows=record.get("sample_rows", 0),
            sample_tokens=record.get("sample_tokens", 0),
            target_only_tokens=record.get("target_only_tokens", 0),
            speculative_seconds=record.get("speculative_seconds", 0.0),
            target_only_seconds=record.get("target_only_seconds", 0.0),
            identical_rows=record.get("identical_rows"),
            recorded={k: record[k] for k in ("measured", "ci95", "pairs") if k in record} or None,
            repeated_pairs=record.get("repeated_pairs", 0),
            # files from before 2026-11-28 decoded every pair's halves for the sample alone
            seconds=record.get(
                "seconds", record.get("speculative_seconds", 0.0) + record.get("target_only_seconds", 0.0)
            ),
        )


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds else 0.0


# The counters a stats file holds under its own names: (key in the file, BatchStats attribute).
_COUNTERS = (
    ("tokens_out", "new_tokens"),
    ("drafted", "drafted"),
    ("accepted", "accepted"),
    ("target_passes", "target_passes"),
    ("row_passes", "row_passes"),
    ("draft_passes", "draft_passes"),
    ("target_seconds", "target_seconds"),
    ("draft_seconds", "draft_seconds"),
    ("prefill_seconds", "prefill_seconds"),
    ("prefill_tokens", "prefill_tokens"),
    ("draft_prefill_seconds", "draft_prefill_seconds"),
    ("asking_seconds", "asking_seconds"),
    ("asked_rounds", "asked_rounds"),
    ("decode_seconds", "wall_seconds"),
)


@dataclass
class ShardStats:
    """One shard's record. `decoded` holds the engine's counters; the rest is the shard's own:
    its rows, errors, settings, the speedup sample and where and when it ran (`context`: models,
    worker, the drafting gate and the static passes' records, attempt, started, finished)."""

    shard: str
    input_url: str
    status: str = OK
    error: str | None = None  # why an unreadable shard could not be read
    rows_in: int = 0
    rows_out: int = 0
    rows_error: int = 0
    errors_by_reason: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    oom_splits: int = 0
    tokens_in: int = 0
    decoded: BatchStats = field(default_factory=BatchStats)
    gamma_max: int | None = None
    drafter: str | None = None
    batch_size: int | None = None
    speedup: SpeedupSample = field(default_factory=SpeedupSample)
    context: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_json(self) -> dict:
        """The stats file: the keys of docs/stats.md, in its order."""
        if not self.ok:
            head = {
                "shard": self.shard,
                "input_url": self.input_url,
                "status": self.status,
                "error": self.error,
            }
            return {**head, **self._rows(), **self.context}
        d = self.decoded
        return {
            "shard": self.shard,
            "input_url": self.input_url,
            "status": self.status,
            **self._rows(),
            "duplicates": self.errors_by_reason.get("duplicate_id", 0),
            "truncated": self.truncated,
            "oom_splits": self.oom_splits,
            "tokens_in": self.tokens_in,
            "alpha": d.alpha,  # null, not 0, when nothing was drafted: nothing was rejected either
            "alpha_leviathan": d.alpha_leviathan,
            "tau": d.tau,
            **d.rounds.to_dict(),
            "gamma_max": self.gamma_max,
            "mean_gamma": d.mean_gamma,
            "drafter": self.drafter,
            "drafted_by": d.drafted_by,  # by draft source: draft_model, prompt_lookup, suffix
            "accepted_by": d.accepted_by,
            **{key: getattr(d, name) for key, name in _COUNTERS},
            "tokens_per_second": d.tokens_per_second,
            "speedup": self.speedup.to_json(),
            "batch_size": self.batch_size,
            **self.context,
        }

    def _rows(self) -> dict:
        return {
            "rows_in": self.rows_in,
            "rows_out": self.rows_out,
            "rows_error": self.rows_error,
            "errors_by_reason": self.errors_by_reason,
        }

    @classmethod
    def from_json(cls, record: dict) -> ShardStats:
        """A stats file read back; files written before a key existed get its empty value."""
        decoded = BatchStats(rows=record.get("rows_out", 0))
        for key, name in _COUNTERS:
            setattr(decoded, name, record.get(key, 0) or 0)
        if "row_passes" not in record and record.get("tau"):  # files from before 2026-11-28
            decoded.row_passes = round(decoded.new_tokens / record["tau"])
        decoded.drafted_by = dict(record.get("drafted_by") or {})
        decoded.accepted_by = dict(record.get("accepted_by") or {})
        decoded.rounds = Rounds.from_stats(record)
        known = set(cls.__dataclass_fields__) | {key for key, _ in _COUNTERS} | set(_DERIVED)
        known |= {"drafted_by", "accepted_by"}  # the counters by source, in `decoded`
        return cls(
            shard=record["shard"],
            input_url=record.get("input_url", ""),
            status=record.get("status", OK),
            error=record.get("error"),
            rows_in=record.get("rows_in", 0),
            rows_out=record.get("rows_out", 0),
            rows_error=record.get("rows_error", 0),
            errors_by_reason=dict(record.get("errors_by_reason") or {}),
            truncated=record.get("truncated", 0),
            oom_splits=record.get("oom_splits", 0),
            tokens_in=record.get("tokens_in", 0),
            decoded=decoded,
            gamma_max=record.get("gamma_max"),
            drafter=record.get("drafter"),
            batch_size=record.get("batch_size"),
            speedup=SpeedupSample.from_json(record.get("speedup")),
            context={k: v for k, v in record.items() if k not in known},
        )


# Keys of a stats file computed from the counters, never read back as such.
_DERIVED = (
    "duplicates",
    "alpha",
    "alpha_leviathan",
    "tau",
    "mean_gamma",
    "tokens_per_second",
    *Rounds().to_dict(),
)


@dataclass
class JobTotals:
    """The job's figures over its shards' records (manifest.json, `pipeline stats`, the report,
    the Jobs API): counters added, rates taken of the sums, every shard's speedup pairs pooled.
    `rows_in` counts the rows of unreadable shards too (one error record each stands for them);
    `rows_in_unreadable` says how many."""

    shards: list[ShardStats]

    @classmethod
    def of(cls, records: list[dict]) -> JobTotals:
        return cls([ShardStats.from_json(r) for r in records])

    @property
    def decoded(self) -> BatchStats:
        total = BatchStats()
        for s in self.shards:
            if s.ok:
                total.add(s.decoded)
        return total

    @property
    def speedup(self) -> SpeedupSample:
        pooled = SpeedupSample()
        identical = [s.speedup.identical_rows for s in self.shards if s.speedup.identical_rows is not None]
        for s in self.shards:
            pooled.pair_seconds += s.speedup.pair_seconds
            pooled.sample_rows += s.speedup.sample_rows
            pooled.sample_tokens += s.speedup.sample_tokens
            pooled.seconds += s.speedup.seconds
        pooled.identical_rows = sum(identical) if identical else None
        return pooled

    @property
    def sample_share(self) -> float:
        """What measuring cost, as a share of the shards' time (decoding and measuring)."""
        seconds = sum(s.speedup.seconds for s in self.shards)
        return _rate(seconds, self.decoded.wall_seconds + seconds)

    @property
    def shards_stood_down(self) -> int:
        """Shards an actor decoded without asking the drafters, its pairs having measured
        drafting slower (`pipeline.job.speedup.StandDown`)."""
        return sum(bool(s.context.get("stand_down", {}).get("rested")) for s in self.shards)

    def to_json(self) -> dict:
        decoded, sample = self.decoded, self.speedup
        measured = sample.measured
        unreadable = [s for s in self.shards if not s.ok]
        return {
            "shards": len(self.shards),
            "shards_unreadable": len(unreadable),
            "rows_in": sum(s.rows_in for s in self.shards),
            "rows_in_unreadable": sum(s.rows_in for s in unreadable),
            "rows_out": sum(s.rows_out for s in self.shards),
            "rows_error": sum(s.rows_error for s in self.shards),
            "tokens_out": decoded.new_tokens,
            "alpha": decoded.alpha,
            "tau": decoded.tau,
            **decoded.rounds.to_dict(),
            "tokens_per_second": decoded.tokens_per_second,
            "speedup": measured["measured"],
            "speedup_ci95": measured["ci95"],
            "speedup_median_pair_ratio": measured["median_pair_ratio"],
            "speedup_verdict": verdict(measured["ci95"]),
            "speedup_pairs": measured["pairs"],
            "sample_tokens": sample.sample_tokens,
            "sample_rows": sample.sample_rows,
            "sample_identical_rows": sample.identical_rows,
            "sample_share": self.sample_share,
            "shards_stood_down": self.shards_stood_down,
        }


def job_totals(records: list[dict]) -> dict:
    """The job's totals as manifest.json and `pipeline stats` write them, from stats files."""
    return JobTotals.of(records).to_json()
