"""The cost model and the acceptance estimators the policy prices its choices with."""

from __future__ import annotations

import random

import pytest
from decode_case import BATCH8_DRAFT, BATCH8_TARGET, measured_costs

from pipeline.decode.costs import AcceptanceByPosition, PassCosts, expected_drain_advance, iid_survival


def test_pass_costs_are_keyed_by_tokens_so_every_batch_size_shares_them():
    model = measured_costs(BATCH8_TARGET, BATCH8_DRAFT)
    assert model.target_time(8) == 1.61  # 8 rows × 1 token, 4 × 2, or 1 × 8
    assert model.target_time(7) == pytest.approx(1.61 - (1.82 - 1.61) / 8)  # a shrinking batch
    assert model.target_time(32) == pytest.approx(2.05 + (2.32 - 2.05) / 2)  # 8 × 4
    assert model.draft_time(8) == 0.50 and model.draft_time(16) == 0.64


def test_a_first_pass_that_paid_for_warming_up_is_replaced_by_a_faster_second():
    """Seen on an H200: a 2-token pass first took 0.24 s, then 0.05 s like its neighbours."""
    costs = PassCosts()
    for tokens, seconds in ((1, 0.05), (1, 0.05), (2, 0.24), (2, 0.05), (3, 0.05)):
        costs.observe(tokens, seconds)
    assert costs.time(2, 0.0) == 0.05
    costs.observe(3, 0.08)  # a slower second pass is a measurement like any other
    assert costs.time(3, 0.0) == pytest.approx(0.05 + 0.3 * 0.03)


def _estimate_as_written_first(points: dict, counts: dict, tokens: int, prior_slope: float) -> float | None:
    """`PassCosts.time` as it was before it kept its sizes sorted: every size sorted again."""
    measured = points.get(tokens)
    if measured is not None and counts[tokens] >= 2:
        return measured
    row = {n: s for n, s in points.items() if n != tokens}
    estimate = None
    if row:
        sizes = sorted(row)
        below, above = [n for n in sizes if n < tokens], [n for n in sizes if n > tokens]
        if below and above:
            n0, n1 = below[-1], above[0]
        else:
            anchors = [n for n in (below or above) if n > 1] or (below or above)
            if len(anchors) == 1:
                n0 = anchors[0]
                estimate = row[n0] / (1 + prior_slope * (n0 - 1)) * (1 + prior_slope * (tokens - 1))
            else:
                n0, n1 = (anchors[-2], anchors[-1]) if below else (anchors[0], anchors[1])
        if estimate is None:
            slope = max((row[n1] - row[n0]) / (n1 - n0), 0.0)
            estimate = max(row[n0] + slope * (tokens - n0), 1e-6)
    if measured is None:
        return estimate
    return measured if estimate is None else min(measured, estimate)


def test_an_estimate_is_what_sorting_every_size_again_gives():
    """`PassCosts` keeps its sizes sorted between additions (the policy estimates a handful of
    sizes a round); every estimate is the one sorting them afresh gives, exactly, as sizes are
    measured once, twice, or seeded straight into `points` (a calibration's)."""
    rng = random.Random(0)
    for trial in range(200):
        costs = PassCosts()
        for _ in range(rng.randint(1, 30)):
            if rng.random() < 0.2:
                tokens = rng.randint(1, 600)
                costs.points[tokens], costs.counts[tokens] = rng.random(), 2
            else:
                costs.observe(rng.choice([1, 2, 3, rng.randint(1, 600)]), rng.random())
            for tokens in (rng.randint(1, 700) for _ in range(5)):
                prior = rng.choice([0.0, 0.03])
                got = costs.time(tokens, prior)
                assert got == _estimate_as_written_first(costs.points, costs.counts, tokens, prior), trial


def test_copies_are_priced_by_how_their_acceptance_runs():
    """Prompt lookup's copies are accepted in runs: rarely the first copied token, nearly always
    the next ones once it matched. Counted per position, a copy of 8 is worth what it yields."""
    runs = AcceptanceByPosition(prior=0.3, weight=1.0, decay=1.0)
    assert runs.survival(3) == pytest.approx([1.0, 0.3, 0.09, 0.027])  # nothing seen: i.i.d. prior
    # 10 copies of 8: 7 rejected at once, 3 accepted whole
    runs.observe([(0, 8)] * 7 + [(8, 8)] * 3)
    first = (3 + 0.3) / (10 + 1)
    assert runs.survival(1) == pytest.approx([1.0, first])
    later = (3 + first) / (3 + 1)  # each position's prior is the rate before it
    assert runs.survival(2)[2] == pytest.approx(first * later)
    assert sum(runs.survival(8)) > 2.0  # one rate per drafted token (24/80) would say 1.4
    # only the drafts up to the first miss were tested: a miss at 2 says nothing of 3..8
    runs = AcceptanceByPosition(prior=0.5, weight=1.0, decay=1.0)
    runs.observe([(1, 8)])
    assert runs.tried[:3] == [1, 1, 0] and runs.accepted[:3] == [1, 0, 0]
    # forgetting: each round weighs the rounds before it less
    runs = AcceptanceByPosition(prior=0.5, weight=1.0, decay=0.5)
    runs.observe([(0, 1)])
    runs.observe([(1, 1)])
    assert runs.tried == [1.5] and runs.accepted == [1.0]


def test_a_survival_is_asked_once_until_its_counts_change():
    """`survival` keeps its answers (the policy asks for every source and depth every round)
    only while they hold: a round observed, or counts set anew, gives what a fresh one gives."""

    def fresh(runs):
        return AcceptanceByPosition(
            runs.prior, runs.weight, runs.decay, list(runs.tried), list(runs.accepted)
        )

    runs = AcceptanceByPosition(prior=0.4, weight=1.0, decay=0.9)
    before = runs.survival(4)
    assert runs.survival(4) is before and runs.survival(2) == fresh(runs).survival(2)
    runs.observe([(4, 4), (1, 3)])
    assert runs.survival(4) != before and runs.survival(4) == fresh(runs).survival(4)
    runs.observe([])  # nothing drafted: nothing learnt, the same answers
    assert runs.survival(4) == fresh(runs).survival(4)
    runs.tried, runs.accepted = [10.0, 10.0], [0.0, 0.0]  # counts set anew (as tests do)
    assert runs.survival(4) == fresh(runs).survival(4) and runs.survival(4)[1] < 0.1


def test_a_draining_round_is_worth_how_far_it_brings_the_last_row_in():
    """With no prompt waiting, the batch ends when its row with most tokens left does."""

    def row(lead: int, drafts: int, alpha: float) -> tuple[int, list[float]]:
        return lead, iid_survival(alpha, drafts)

    assert expected_drain_advance([row(0, 4, 0.6)]) == pytest.approx(sum(0.6**k for k in range(5)))
    # 8 even rows: one that drafts nothing holds the advance at 1, however well the rest copy
    assert expected_drain_advance([row(0, 0, 0.0)] + [row(0, 4, 0.95)] * 7) == 1.0
    assert expected_drain_advance([row(0, 1, 0.6)] * 8) == pytest.approx(1 + 0.6**8)
    # a row 5 tokens ahead cannot hold back an advance of at most 4; one 1 token ahead can
    assert expected_drain_advance([row(0, 3, 0.9), row(5, 0, 0.0)]) == pytest.approx(1 + 0.9 + 0.81 + 0.729)
    assert expected_drain_advance([row(0, 3, 0.9), row(1, 0, 0.0)]) == pytest.approx(1.9)
