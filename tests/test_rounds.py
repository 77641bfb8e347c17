"""Counting rounds (pipeline.decode.rounds): acceptance by position and accepted lengths."""

from __future__ import annotations

import pytest

from pipeline.decode.rounds import DrafterRounds, Rounds, row_tau


def test_rounds_by_position_lengths_and_pooling():
    rounds = Rounds()
    for drafter, drafted, accepted, produced in [
        ("draft_model", 3, 3, 4),
        ("draft_model", 3, 1, 2),
        ("draft_model", 1, 0, 1),
        ("suffix", 2, 2, 3),
        (None, 0, 0, 1),
    ]:
        rounds.observe(drafter, drafted, accepted, produced)
    model = rounds.by_drafter["draft_model"]
    assert model.by_position() == [2 / 3, 1 / 2, 1 / 2]
    assert model.accepted_lengths() == {0: 1, 1: 1, 3: 1}
    assert rounds.undrafted == 1 and rounds.undrafted_share == 1 / 5
    assert rounds.tau_drafted == pytest.approx((4 + 2 + 1 + 3) / 4)

    stats = rounds.to_dict()
    assert stats["acceptance_by_position"] == {"draft_model": [2 / 3, 1 / 2, 1 / 2], "suffix": [1.0, 1.0]}
    pooled = Rounds.from_stats(stats)
    pooled.add(Rounds.from_stats(stats))
    assert pooled.by_drafter["draft_model"] == DrafterRounds(6, 14, [6, 4, 4], [4, 2, 2])
    assert pooled.undrafted == 2 and pooled.tau_drafted == rounds.tau_drafted
    assert Rounds.from_stats({}) == Rounds()  # a stats file from before these counts


def test_row_tau():
    assert row_tau(12, 4) == 3.0 and row_tau(0, 0) == 0.0
