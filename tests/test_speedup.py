"""The speedup's arithmetic (pipeline.job.speedup): Student's t, the ratio of means, verdicts,
and the actor standing down from drafting on its pairs."""

from __future__ import annotations

import pytest

from pipeline.job.speedup import NO_DIFFERENCE, StandDown, pair_seconds, paired_speedup, t975, verdict


@pytest.mark.parametrize("df, table", [(1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042)])
def test_t975_matches_the_printed_tables(df, table):
    assert t975(df) == pytest.approx(table, abs=1e-3)


def test_pairs_that_agree_give_a_point_and_one_pair_no_interval():
    assert paired_speedup([[1.0, 1.5], [2.0, 3.0]]) == {
        "measured": 1.5,
        "ci95": [1.5, 1.5],
        "pairs": 2,
        "median_pair_ratio": 1.5,
    }
    assert paired_speedup([[1.0, 1.5]])["ci95"] is None
    assert paired_speedup([]) == {"measured": None, "ci95": None, "pairs": 0, "median_pair_ratio": None}


def test_median_of_pair_ratios_stands_beside_the_ratio_of_sums():
    # one pair slowed 5x on its target-only half moves the ratio of sums, not the median
    pairs = [[10.0, 12.0], [10.0, 13.0], [10.0, 60.0]]
    result = paired_speedup(pairs)
    assert result["measured"] == pytest.approx(85 / 30)
    assert result["median_pair_ratio"] == pytest.approx(1.3)


def test_a_sampled_pair_compares_seconds_for_the_same_tokens():
    assert pair_seconds((30, 2.0), (20, 1.0)) == [2.0, 1.5]  # target-only: 1 s for 20 -> 1.5 s for 30


def test_verdicts():
    assert verdict([1.05, 1.3]) == "faster" and verdict([0.7, 0.95]) == "slower"
    assert verdict([0.9, 1.2]) == NO_DIFFERENCE and verdict(None) is None


SLOWER_PAIRS = [[1.0, 0.80], [1.0, 0.82], [1.0, 0.78]]  # 0.80x, interval well below 1
FASTER_PAIRS = [[1.0, 1.50], [1.0, 1.52], [1.0, 1.48]]
UNSURE_PAIRS = [[1.0, 0.70], [1.0, 1.25]]  # 0.975x, an interval holding 1


def _shards(stand_down: StandDown, shards: list[list[list[float]]]) -> list[bool]:
    """Whether each shard decoded stood down, feeding each its pairs in turn."""
    rested = []
    for pairs in shards:
        rested.append(stand_down.resting)
        stand_down.after_shard(pairs)
    return rested


def test_an_actor_whose_pairs_pool_below_1_stands_down_then_drafts_again_backing_off():
    stand_down = StandDown()
    # one pair a shard: no interval from the first; the second's pools two (t at 1 df), below 1
    rested = _shards(stand_down, [[p] for p in SLOWER_PAIRS[:2]] + [SLOWER_PAIRS] * 2)
    assert rested == [False, False, True, True]  # stood down after the 2nd shard, for 2 shards
    assert stand_down.stand_downs == 1 and stand_down.rested_shards == 2
    assert stand_down.pooled["measured"] == pytest.approx(0.81) and stand_down.pooled["ci95"][1] < 1
    # drafting again: its new pairs judge afresh, and each stand-down after rests twice as long
    rested = _shards(stand_down, [SLOWER_PAIRS] * 16)
    assert rested == [False] + [True] * 4 + [False] + [True] * 8 + [False, True]
    assert stand_down.next_rest == stand_down.longest_rest == 16  # 2, 4, 8, 16, then at most 16
    assert stand_down.record(rested=True)["stand_downs"] == 4


def test_pairs_that_hold_1_leave_drafting_on_and_faster_pairs_reset_the_rest():
    stand_down = StandDown()
    assert _shards(stand_down, [UNSURE_PAIRS] * 6) == [False] * 6  # not measurably slower: the gate's call
    assert stand_down.pooled["ci95"][0] < 1 < stand_down.pooled["ci95"][1]
    stand_down = StandDown()
    rested = _shards(stand_down, [SLOWER_PAIRS] * 4)  # stood down twice: next rest 8
    assert rested == [False, True, True, False] and stand_down.next_rest == 8 and stand_down.resting
    while stand_down.resting:
        stand_down.after_shard(SLOWER_PAIRS)  # a rest's pairs time the stood-down path: not judged
    assert stand_down.pairs == []
    stand_down.after_shard(FASTER_PAIRS)
    assert not stand_down.resting and stand_down.next_rest == stand_down.first_rest


def test_the_pairs_judged_are_the_last_window_since_drafting_resumed():
    stand_down = StandDown(window=4)
    # a slow start, then a stretch at 1.5x: the window forgets the start
    _shards(stand_down, [[[1.0, 0.5]], [[1.0, 1.6]]] + [FASTER_PAIRS] * 2)
    assert len(stand_down.pairs) == 4 and [1.0, 0.5] not in stand_down.pairs
    assert not stand_down.resting and stand_down.pooled["ci95"][0] > 1
