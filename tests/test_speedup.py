"""The speedup's arithmetic (pipeline.job.speedup): Student's t, the ratio of means, verdicts."""

from __future__ import annotations

import pytest

from pipeline.job.speedup import NO_DIFFERENCE, pair_seconds, paired_speedup, t975, verdict


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
