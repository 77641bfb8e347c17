"""The shard's stats record (`pipeline.job.stats`): written and read back with the same keys and
values, and added up into the job's totals from the counters, not from shards' rates."""

import json

import pytest

from pipeline.decode.rounds import Rounds
from pipeline.decode.stats import BatchStats
from pipeline.job.stats import JobTotals, ShardStats, SpeedupSample, job_totals


def _decoded(tokens, drafted, accepted, row_passes, seconds, rows=2):
    rounds = Rounds()
    rounds.undrafted = 3
    return BatchStats(
        rows=rows,
        new_tokens=tokens,
        drafted=drafted,
        accepted=accepted,
        target_passes=row_passes // rows,
        row_passes=row_passes,
        wall_seconds=seconds,
        target_seconds=seconds * 0.8,
        drafted_by={"suffix": drafted},
        accepted_by={"suffix": accepted},
        rounds=rounds,
    )


def _shard(name, decoded, pairs=()):
    return ShardStats(
        shard=name,
        input_url=f"s3://bucket/in/{name}.parquet",
        rows_in=decoded.rows + 1,
        rows_out=decoded.rows,
        rows_error=1,
        errors_by_reason={"duplicate_id": 1},
        tokens_in=300,
        decoded=decoded,
        gamma_max=8,
        drafter="auto",
        batch_size=4,
        speedup=SpeedupSample(pair_seconds=[list(p) for p in pairs], sample_rows=2, identical_rows=2),
        context={"attempt": 1, "worker": {"host": "h", "pid": 1}},
    )


def test_a_record_reads_back_as_it_was_written():
    shard = _shard("part-00000", _decoded(64, 40, 30, 20, 8.0), pairs=[[4.0, 5.0], [4.0, 4.4]])
    written = json.loads(json.dumps(shard.to_json()))
    assert written["alpha"] == 0.75 and written["tau"] == 64 / 20 and written["duplicates"] == 1
    assert written["mean_gamma"] == 40 / (20 - 2)
    assert written["speedup"]["measured"] == pytest.approx(9.4 / 8.0)
    again = ShardStats.from_json(written)
    assert json.loads(json.dumps(again.to_json())) == written
    assert again.decoded.alpha == 0.75 and again.context["worker"] == {"host": "h", "pid": 1}


def test_an_unreadable_shard_keeps_its_reason_and_no_decoding_figures():
    shard = ShardStats(shard="bad", input_url="x", status="unreadable", error="not Parquet", rows_in=5)
    written = shard.to_json()
    assert written["error"] == "not Parquet" and "alpha" not in written
    assert ShardStats.from_json(written).to_json() == written


def test_totals_add_counters_and_take_rates_of_the_sums():
    a = _shard("a", _decoded(100, 50, 45, 40, 10.0), pairs=[[1.0, 2.0], [1.0, 2.0]])
    b = _shard("b", _decoded(300, 10, 1, 150, 10.0), pairs=[[3.0, 3.0]])
    unreadable = ShardStats(shard="c", input_url="x", status="unreadable", error="e", rows_in=7)
    t = job_totals([a.to_json(), b.to_json(), unreadable.to_json()])
    assert t["alpha"] == 46 / 60  # not the mean of 0.9 and 0.1
    assert t["tau"] == 400 / 190
    assert t["tokens_per_second"] == 400 / 20
    assert t["speedup"] == pytest.approx(7 / 5) and t["speedup_pairs"] == 3
    assert t["speedup_median_pair_ratio"] == 2.0
    assert (t["rows_in"], t["rows_in_unreadable"], t["shards_unreadable"]) == (13, 7, 1)
    assert t["sample_identical_rows"] == 4 and t["undrafted_rounds"] == 6


def test_a_file_written_before_row_passes_gets_them_from_tau():
    written = _shard("a", _decoded(90, 20, 10, 30, 3.0)).to_json()
    del written["row_passes"]
    assert ShardStats.from_json(written).decoded.row_passes == 30
    assert JobTotals.of([written]).decoded.tau == 3.0


def test_a_file_from_before_the_pairs_were_kept_keeps_its_recorded_speedup():
    written = _shard("a", _decoded(90, 20, 10, 30, 3.0)).to_json()
    written["speedup"] = {"measured": 1.5, "ci95": [1.2, 1.8], "pairs": 3, "sample_rows": 3}
    again = ShardStats.from_json(written)
    assert again.speedup.measured["measured"] == 1.5 and again.speedup.measured["ci95"] == [1.2, 1.8]
    assert "drafted_by" not in again.context and again.decoded.drafted_by == {"suffix": 20}
