"""The policy: which source drafts for each row, how many tokens, and when probes re-measure."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from decode_case import (
    BATCH8_DRAFT,
    BATCH8_TARGET,
    CPU_COSTS,
    GPU_COSTS,
    MAX_NEW,
    PREFILL_PER_TOKEN,
    measured_costs,
)

from pipeline.decode import search
from pipeline.decode.batched_lm import BatchedLM
from pipeline.decode.costs import (
    AcceptanceByPosition,
    CostModel,
    RunningRate,
    expected_drain_advance,
    iid_survival,
)
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.policy import (
    CopierPrices,
    DraftingGate,
    Offer,
    Policy,
    RoundOptions,
    _Candidates,
    _Copies,
    _lay_out,
)
from pipeline.decode.settings import DRAFT_MODEL, HEAD, PROMPT_LOOKUP, SUFFIX, EngineConfig
from pipeline.decode.static_lm import width_of


def test_a_pass_size_measured_once_in_a_slow_spell_is_tried_again(case):
    """From the translate benchmark: one 4-token pass took 0.23 s beside 0.14 s for 3, and
    `auto` never went that wide again. A size seen once costs no more than its neighbours say
    until a second measurement confirms it; a confirmed one is believed."""
    model = measured_costs({1: 0.15, 2: 0.14, 3: 0.14}, {})
    model.observe_target(4, 0.23)
    assert model.target_time(4) == pytest.approx(0.14)  # extrapolated from 2 and 3
    policy = _policy_with_costs(case, model, alpha=0.8)
    policy.costs.observe_draft(1, 0.02)
    policy.costs.observe_draft(1, 0.02)
    assert policy.choose(_one_row())[1] >= 3  # a 4-token verify pass is on the table
    model.observe_target(4, 0.23)  # confirmed: the size really is that dear
    assert model.target_time(4) == pytest.approx(0.23)
    assert policy.choose(_one_row())[1] < 3


def test_verify_cost_is_interpolated_piecewise_and_width_1_measured_first(tiny_models):
    """On a CPU a 1-token pass takes a faster path: the cost jumps from width 1 to 2, then grows
    gently. One line through the wider passes would put width 1 near 0.7 s instead of 0.4 s."""
    model = measured_costs(CPU_COSTS[0], {})
    assert model.target_time(1) == 0.40
    assert model.target_time(3) == pytest.approx(0.83 + (1.23 - 0.83) / 3)
    assert model.target_time(8) == pytest.approx(1.23 + 3 * (1.23 - 0.83) / 3)
    # the 1-token pass is no slope anchor: from {1, 2} alone, wider passes get the prior slope
    # (and get measured), not the 1→2 jump repeated for every token (0.40 s more per token)
    model = measured_costs({1: 0.40, 2: 0.83}, {})
    assert model.target_time(5) == pytest.approx(0.83 * (1 + 0.03 * 4) / (1 + 0.03))
    # an engine that knows only wider passes measures plain decoding before any choice
    target, draft, _ = tiny_models
    engine = SpeculativeEngine(target, draft, eos_token_ids=[1], pad_token_id=0)
    for width in (2, 5):
        engine.costs.observe_target(width, CPU_COSTS[0][width])
    assert engine.policy.choose(_one_row()) == (0, 0, [None])


def _one_row(gamma_cap: int = 8) -> RoundOptions:
    """A round of one row, no lookup match, the draft model warm, 100 tokens to go."""
    return RoundOptions([[]], True, gamma_cap, remaining=100, catch_up=0.0)


def _lookup(lengths: list[int], ngrams: list[int]) -> list[list[Offer]]:
    """Each row's prompt-lookup offer: `lengths` tokens after a match of `ngrams` tokens."""
    return [[Offer(PROMPT_LOOKUP, n, g)] if n else [] for n, g in zip(lengths, ngrams)]


def _policy_with_costs(case, costs: CostModel, alpha: float, **config) -> Policy:
    target = case[0]
    # priced as on the CPU that measured these costs, where ragged passes are packed
    policy = Policy(EngineConfig(**config), costs, BatchedLM(target, pad_token_id=0, pack=True))
    # a long history at exactly `alpha` at every position, outweighing the prior
    policy.model_rates = AcceptanceByPosition(prior=alpha, weight=1e9)
    return policy


def test_a_draining_static_batch_prices_plain_passes_as_its_runner_measured_them(case):
    """A static runner's pass computes every slot at its graph's width (`StaticLM.pass_tokens`):
    5 rows left of 8 slots cost what 8 rows do, and that is the size their passes were measured
    at. Priced as 5 tokens, plain decoding was never measured there, and every round of a
    draining batch decoded plainly whatever its copies were worth."""
    slots = 8
    costs = measured_costs({slots * w: 0.001 * (1 + 0.02 * w) for w in (1, 2, 4, 8)}, {})
    policy = _policy_with_costs(case, costs, alpha=0.5)
    policy.copy_rates[(PROMPT_LOOKUP, 4)] = AcceptanceByPosition(prior=0.95, weight=1e6)
    policy.target.pack = False
    policy.target.pass_tokens = lambda lengths: slots * width_of(max(lengths))
    rows = 5
    offers = [[Offer(PROMPT_LOOKUP, 6, 4)] for _ in range(rows)]
    choice = policy.choose(RoundOptions(offers, False, 6, rows * 40, 0.0, None))
    assert choice.cap > 0 and set(choice.sources) == {PROMPT_LOOKUP}
    assert policy._plain_bar(rows)[0] == pytest.approx(rows / 0.00102 * (1 + policy.config.min_gain))


def test_a_cold_draft_speculates_only_when_the_rounds_left_repay_its_prefill(case):
    """The batch-8 benchmark defect: the draft model ran at 0.77x target-only on 24 new tokens.
    Its decode rounds did gain (33 s of passes against 37 s), but the draft's prefill of the 8
    prompts took 22 s, which no one had charged to the choice of drafting."""
    costs = measured_costs(BATCH8_TARGET, BATCH8_DRAFT, PREFILL_PER_TOKEN)
    policy = _policy_with_costs(case, costs, alpha=0.76)
    cold = costs.prefill_time("draft", 8 * 396)
    assert cold == pytest.approx(22.3, rel=0.01)
    lookup = ([[]] * 8, True, 8)
    assert policy.choose(RoundOptions(*lookup, 8 * 23, 0.0))[1] > 0  # warm: it pays
    assert policy.choose(RoundOptions(*lookup, 8 * 23, cold))[1] == 0  # 24 new tokens: not
    assert policy.choose(RoundOptions(*lookup, 8 * 500, cold))[1] > 0  # 500: it does again
    # before the draft ever ran, its prefill is priced from the target's at the prior ratio
    unmeasured = measured_costs(BATCH8_TARGET, {}, {"target": PREFILL_PER_TOKEN["target"]})
    assert unmeasured.prefill_time("draft", 8 * 396) == pytest.approx(72.9 * 0.4, rel=0.01)
    # a warm draft a few tokens behind costs only the extra width of its catch-up pass
    assert costs.catch_up_time(8, 8 * 2) == 0.0
    assert costs.catch_up_time(8, 8 * 3) == pytest.approx(0.64 + (0.64 - 0.50) - 0.50)  # 24 tokens


def _calibration(widths: dict[int, float], draft_step: float) -> dict:
    """What `pipeline.decode.calibration.measure` records (string keys, as read back from JSON)."""
    return {
        "target_pass_seconds_by_batch": {"1": {str(w): s for w, s in widths.items()}},
        "draft_step_seconds_by_batch": {"1": {"1": draft_step}},
        "prefill_seconds_per_token": {"target": 0.01, "draft": 0.004},
    }


def test_a_calibration_seeds_the_costs_a_fresh_engine_decides_with(case):
    """An actor seeds its engine from a calibration (cached, or measured at start-up) so the
    first rounds run on this machine's costs, not on priors: the same fresh engine at the same
    acceptance drafts where the calibrated passes are flat in their width and not where each
    extra token in a pass is dear."""
    seeded = CostModel()
    seeded.seed(_calibration({1: 0.30, 2: 0.31, 4: 0.33, 8: 0.36}, draft_step=0.02))
    assert seeded.target_time(4) == 0.33 and seeded.target_time(8) == 0.36  # believed at once
    assert seeded.draft_time(1) == 0.02 and seeded.prefill_time("draft", 100) == pytest.approx(0.4)
    seeded.observe_target(4, 0.43)  # a job's own passes move them like any other measurement
    assert 0.33 < seeded.target_time(4) < 0.43
    options = RoundOptions([[]], True, 8, remaining=200, catch_up=0.0)
    for widths, drafts in (
        ({1: 0.3, 2: 0.31, 4: 0.33, 8: 0.36}, True),
        ({1: 0.3, 2: 0.9, 4: 2.1, 8: 4.5}, False),
    ):
        costs = CostModel()
        costs.seed(_calibration(widths, draft_step=0.02))
        policy = _policy_with_costs(case, costs, alpha=0.7)
        assert (policy.choose(options)[1] > 0) is drafts


@pytest.mark.parametrize("left, probes", [(100, False), (500, True)])
def test_a_probe_risks_a_cold_prefill_only_where_the_work_left_dwarfs_it(case, left, probes):
    """The batch-4 translation benchmark: a probe hoping for α 0.95 started a cold draft whose
    prefill took 12% of the job, and the α of 0.57 it found never repaid it. A probe may risk
    at most 5% of the plain decoding left on the draft's catch-up."""
    costs = measured_costs(BATCH8_TARGET, BATCH8_DRAFT, PREFILL_PER_TOKEN)
    policy = _policy_with_costs(case, costs, alpha=0.3, probe_every=1)  # believed poor
    cold = costs.prefill_time("draft", 8 * 396)  # 22.3 s; 100 tokens per row: 161 s plain
    options = RoundOptions([[]] * 8, True, 8, 8 * left, cold)
    assert policy.best(options, iid_survival(policy.config.probe_alpha, 8)).gamma > 0  # a hopeful α would pay
    assert (policy.choose(options)[1] > 0) is probes


@pytest.mark.parametrize("min_gain, gamma", [(0.05, 0), (0.0, 1)])
def test_a_marginal_expected_gain_does_not_start_speculation(case, min_gain, gamma):
    # alpha 0.5, free draft: gamma 1 yields 1.5 tokens per 1.456 s against 1 token per 1.0 s,
    # 3% more, and every longer gamma less: inside the margin, so target-only.
    costs = measured_costs({1: 1.0, 2: 1.456, 3: 1.912}, {1: 0.0})
    policy = _policy_with_costs(case, costs, alpha=0.5, min_gain=min_gain)
    assert policy.choose(_one_row(gamma_cap=4)) == (0, gamma, [DRAFT_MODEL if gamma else None])


def test_drafting_goes_on_while_the_chain_is_likely_and_the_step_pays(case):
    """One more draft is worth P·α tokens (P: the chance every draft so far is accepted, α: how
    often a draft after accepted ones is) at the seconds a token has lately cost, against a
    draft step plus the wider verify pass."""
    costs = measured_costs(
        {1: 0.135, 2: 0.135, 3: 0.137, 4: 0.143, 8: 0.152, 16: 0.195}, {1: 0.021, 2: 0.025}
    )
    costs.observe_round(1, 0.09)  # lately 0.09 s per token
    policy = _policy_with_costs(case, costs, alpha=0.6)
    policy.model_rates = AcceptanceByPosition(prior=0.75, weight=1e6)
    steps, keep = policy.draft_length(_one_row(gamma_cap=8), 0, 2, [DRAFT_MODEL])
    assert steps == 8  # a lone row may draft to the cap; the rule ends it sooner
    # 0.9 · 0.75 · 0.09 = 0.061 s gained against 0.021 + 0.001 s; 0.3 · 0.75 · 0.09 = 0.020 s: no
    assert keep([0.9], [1]) == [True]
    assert keep([0.3], [3]) == [False]
    # two rows while prompts wait: each goes on by its own chain, the step by their sum
    two = RoundOptions([[], []], True, 8, remaining=200, catch_up=0.0)
    steps, keep = policy.draft_length(two, 0, 2, [DRAFT_MODEL, DRAFT_MODEL])
    assert steps == 8
    assert keep([0.9, 0.01], [2, 2]) == [True, False]
    assert keep([0.2, 0.2], [2, 2]) == [False, False]  # each barely gains, together not a step
    # a draining batch keeps the gamma its drain pricing chose as the most it drafts
    draining = RoundOptions([[], []], True, 8, 80, 0.0, drain_budgets=[40, 40])
    assert policy.draft_length(draining, 0, 2, [DRAFT_MODEL, DRAFT_MODEL])[0] == 2
    # fixed gamma drafts gamma, no rule
    fixed = _policy_with_costs(case, costs, alpha=0.6, adaptive=False)
    assert fixed.draft_length(_one_row(), 0, 5, [DRAFT_MODEL]) == (5, None)


def test_a_head_draft_is_kept_while_its_chance_pays_for_its_verify_token(case):
    """The head's confidence is known before its draft goes to the target: a draft is kept
    while (chance its row's drafts are all accepted) x (seconds a token is worth) exceeds the
    verify token it adds, and the row drafts on while that also pays a head step."""
    costs = measured_costs({1: 0.10, 2: 0.14, 3: 0.18, 4: 0.22}, {})
    policy = _policy_with_costs(case, costs, alpha=0.6)
    assert policy.head_length(0.01) is None  # nothing measured of a token's worth yet: gamma
    costs.observe_round(1, 0.1)  # lately 0.1 s per token; a verify token costs 0.04 s
    rule = policy.head_length(0.01)
    assert rule([0.9], [1]) == [(True, True)]  # 0.09 - 0.04 pays the draft and a step
    assert rule([0.45], [2]) == [(True, False)]  # 0.005 over the verify token: not a step too
    assert rule([0.3], [1]) == [(False, False)]
    # two rows: each by its own chance, the step shared by the rows still drafting
    assert rule([0.9, 0.2], [3, 1]) == [(True, True), (False, False)]
    assert rule([0.0, 0.9], [0, 2]) == [(False, False), (True, True)]
    fixed = _policy_with_costs(case, costs, alpha=0.6, adaptive=False)
    assert fixed.head_length(0.01) is None


@pytest.mark.parametrize("pack", [True, False])
def test_the_draft_rules_price_each_length_among_the_rows_once_as_row_by_row(case, pack):
    """The draft model's and the head's rules price the verify token a row's draft adds. A
    pass's cost depends on its rows' lengths, not on which row has which, so they price it once
    per length among the rows: a row at a time, each a list of every row, it was O(rows²) a draft
    step (docs/engine.md, "Draft length"). The verdicts are those of pricing every row alone,
    packed (a CPU) or padded to the widest row (where only the widest rows widen the pass)."""
    costs = measured_costs({t: 0.01 + 0.0004 * t for t in (200, 400, 800, 1600)}, {200: 0.004})
    costs.observe_round(1, 0.002)  # lately 2 ms per token
    policy = _policy_with_costs(case, costs, alpha=0.6)
    policy.model_rates = AcceptanceByPosition(prior=0.75, weight=1e6)
    policy.target.pack = pack
    rows, rng = 200, random.Random(5)
    drafted = [rng.randint(1, 4) for _ in range(rows)]
    chances = [rng.random() for _ in range(rows)]
    counted = []
    runner_tokens = policy.target.pass_tokens
    policy.target.pass_tokens = lambda lengths: counted.append(1) or runner_tokens(lengths)
    _, keep = policy.draft_length(
        RoundOptions([[]] * rows, True, 8, rows * 40, 0.0), 0, 4, [DRAFT_MODEL] * rows
    )
    rule = policy.head_length(0.004)
    token = costs.token_seconds()

    def alone(lengths: list[int], i: int, to: int) -> float:  # row i `to` long, priced on its own
        return costs.target_time(runner_tokens([*lengths[:i], to, *lengths[i + 1 :]]))

    counted.clear()
    kept = keep(chances, drafted)
    assert len(counted) <= 1 + len(set(drafted))  # the pass as it is, then once a length
    lengths = [1 + d for d in drafted]
    now = costs.target_time(runner_tokens(lengths))
    gains = [
        chances[i] * policy.model_rates.rate(drafted[i]) * token
        - max(alone(lengths, i, lengths[i] + 1) - now, 0.0)
        for i in range(rows)
    ]
    assert kept == [g > 0 for g in gains] and 0 < sum(kept) < rows
    counted.clear()
    verdicts = rule(chances, drafted)
    assert len(counted) <= 1 + len(set(drafted))
    gains = [chances[i] * token - max(now - alone(lengths, i, drafted[i]), 0.0) for i in range(rows)]
    assert [keep for keep, _ in verdicts] == [g > 0 for g in gains]


def test_a_head_whose_drafts_the_rule_cuts_probes_one_draft_now_and_then(case):
    """The online head's job: a 2-token pass timed while another process ran looked so dear
    that the rule cut every draft after it, so neither that pass nor the head (learning all
    the while) was ever measured again: no draft in its last five shards. After `probe_every`
    rounds cut to nothing, and in a gate's probe, the rule sends a row's first draft, but only
    one near paying (the next job's probes, sent wherever the head stood, had none of 52
    accepted); after as many rounds again without one, whatever its chance."""
    costs = measured_costs({1: 0.10, 2: 0.25, 3: 0.30}, {})  # 2 tokens: timed in a slow spell
    costs.observe_round(1, 0.15)  # a token is worth 0.15 s: a 0.8 chance gains 0.12 s, not 0.15
    policy = _policy_with_costs(case, costs, alpha=0.6, probe_every=4)
    for _ in range(4):
        assert policy.head_length(0.005)([0.8], [1]) == [(False, False)]
    probe = policy.head_length(0.005)
    assert probe([0.8, 0.0], [1, 0]) == [(True, False), (False, False)]  # one draft, no more
    assert policy.head_length(0.005)([0.8], [1]) == [(False, False)]  # counting again
    # a probe's draft must be near paying: 0.3 x 0.15 = 0.045 s gained is more than half the
    # 0.15 s verify token short; the probe waits, rounds after it probe too, and 0.6 goes out
    assert policy.head_length(0.005, probe=True)([0.3], [1]) == [(False, False)]  # the gate's
    assert policy._rounds_without_head == 2  # a probe that sent nothing is a round without
    for _ in range(2):
        assert policy.head_length(0.005)([0.3], [1]) == [(False, False)]
    assert policy.head_length(0.005)([0.3], [1]) == [(False, False)]  # 4 cut: a probe, waiting
    # of two rows (a 4-token pass priced 0.05 s above 3), the one near paying sends its first
    # draft, the other's (0.02 x 0.15 = 0.003 s) is too far short, and neither drafts on
    assert policy.head_length(0.005)([0.6, 0.02], [1, 1]) == [(True, False), (False, False)]
    assert policy._rounds_without_head == 0
    # a probe that waited `probe_every` rounds more sends the first draft whatever its chance
    for _ in range(8):
        assert policy.head_length(0.005)([0.1], [1]) == [(False, False)]
    assert policy.head_length(0.005)([0.1], [1]) == [(True, False)]
    # a round that keeps a draft is no round without the head: the count starts over
    costs.observe_target(2, 0.11)
    costs.observe_target(2, 0.11)
    costs.observe_target(2, 0.11)
    assert policy.head_length(0.005)([0.8], [1]) == [(True, True)]
    assert policy._rounds_without_head == 0


def test_plain_decoding_is_re_measured_while_speculating(case):
    costs = measured_costs(GPU_COSTS[0], {1: GPU_COSTS[1]})
    policy = _policy_with_costs(case, costs, alpha=0.9, probe_every=1)
    gammas = [policy.choose(_one_row())[1] for _ in range(10)]
    assert [g == 0 for g in gammas] == [False] * 4 + [True] + [False] * 4 + [True], gammas


def test_at_batch_8_a_row_verifies_copied_tokens_only_where_they_pay_for_themselves(case):
    """In a packed pass each row pays for its own verify tokens (3-7% of a pass each at batch
    8 on this CPU): a strong 4-gram match is worth verifying, a weak 1-gram match is not."""
    costs = measured_costs({8: 0.186, 12: 0.236, 16: 0.243, 24: 0.280, 40: 0.40}, {})
    policy = _policy_with_costs(case, costs, alpha=0.5)
    assert policy.target.pack  # a CPU
    policy.copy_rates[(PROMPT_LOOKUP, 4)] = AcceptanceByPosition(prior=0.95, weight=1e6)
    policy.copy_rates[(PROMPT_LOOKUP, 1)] = AcceptanceByPosition(prior=0.15, weight=1e6)
    offers = _lookup([6, 6] + [0] * 6, [4, 1] + [1] * 6)
    options = RoundOptions(offers, False, 8, remaining=8 * 100, catch_up=0.0)
    cap, gamma, sources = policy.choose(options)
    assert gamma == 0 and cap >= 4
    assert sources == [PROMPT_LOOKUP] + [None] * 7


def test_a_lone_row_verifies_a_whole_copy_where_copies_run(case):
    """License summaries at batch 1: a copy's first token accepted 29% of the time, each next
    one nearly always. One rate per drafted token keeps copies at up to 3 tokens; priced by
    position, the whole copy is worth its wider pass."""
    costs = measured_costs({1: 0.150, 2: 0.152, 3: 0.155, 4: 0.156, 6: 0.168, 9: 0.181}, {1: 0.024})
    policy = _policy_with_costs(case, costs, alpha=0.6)
    options = RoundOptions(_lookup([8], [2]), False, 8, remaining=100, catch_up=0.0)
    policy.copy_rates[(PROMPT_LOOKUP, 2)] = AcceptanceByPosition(prior=0.24, weight=1e6)  # i.i.d. 0.24
    assert policy.choose(options)[0] <= 3  # short: the 4th token would add 0.3%
    runs = AcceptanceByPosition(prior=0.24, weight=1.0)
    for _ in range(20):
        runs.observe([(0, 8)] * 7 + [(8, 8)] * 3)
    policy.copy_rates[(PROMPT_LOOKUP, 2)] = runs
    assert policy.choose(options) == (8, 0, [PROMPT_LOOKUP])


def test_a_draining_batch_speculates_only_where_it_brings_the_end_closer(case):
    """The batch-8 benchmark with 8 documents in 8 places: every row ran to the 64-token limit
    and the batch made 63-64 passes whatever the drafter, so verifying copied tokens only made
    passes wider (0.94-0.96x target-only). Priced by how far a round brings in the row with
    most tokens left, even rows decode plainly; a row left behind alone still speculates."""
    costs = measured_costs({8: 0.186, 12: 0.236, 16: 0.243, 24: 0.280, 40: 0.40}, {})
    policy = _policy_with_costs(case, costs, alpha=0.5)
    policy.copy_rates[(PROMPT_LOOKUP, 4)] = AcceptanceByPosition(prior=0.8, weight=1e6)
    policy.runs_to_limit = RunningRate(prior=0.99, weight=1e6)  # rows have run to the limit
    offers = _lookup([4] * 8, [4] * 8)
    waiting = RoundOptions(offers, False, 8, remaining=8 * 40, catch_up=0.0)
    assert policy.choose(waiting)[2] == [PROMPT_LOOKUP] * 8  # prompts wait: every token counts
    draining = RoundOptions(offers, False, 8, 8 * 40, 0.0, drain_budgets=[40] * 8)
    assert policy.choose(draining) == (0, 0, [None] * 8)
    behind = RoundOptions(offers, False, 8, 7 * 16 + 40, 0.0, drain_budgets=[16] * 7 + [40])
    cap, _, sources = policy.choose(behind)
    assert cap == 4 and sources == [None] * 7 + [PROMPT_LOOKUP]
    # rows that end at EOS make the row with most tokens left a guess: throughput decides again
    policy.runs_to_limit = RunningRate(prior=0.01, weight=1e6)
    assert policy.choose(draining)[2] == [PROMPT_LOOKUP] * 8


def test_each_row_takes_the_copy_its_source_and_depth_have_earned(case):
    """`auto` routes each row among the draft model, prompt lookup and suffix by what each has
    measured: a deep suffix match that proved right outweighs a 1-gram lookup copy, a shallow
    one that proved wrong does not, and fixed gamma takes the first copy offered."""
    costs = measured_costs({1: 0.150, 2: 0.152, 3: 0.155, 4: 0.156, 6: 0.168, 9: 0.181}, {1: 0.1})
    policy = _policy_with_costs(case, costs, alpha=0.3)
    policy.copy_rates[(PROMPT_LOOKUP, 1)] = AcceptanceByPosition(prior=0.3, weight=1e6)
    policy.copy_rates[(SUFFIX, 8)] = AcceptanceByPosition(prior=0.9, weight=1e6)
    policy.copy_rates[(SUFFIX, 2)] = AcceptanceByPosition(prior=0.05, weight=1e6)
    deep = [[Offer(PROMPT_LOOKUP, 6, 1), Offer(SUFFIX, 6, 8)]]
    assert policy.choose(RoundOptions(deep, True, 8, remaining=100, catch_up=0.0)) == (6, 0, [SUFFIX])
    shallow = [[Offer(PROMPT_LOOKUP, 6, 1), Offer(SUFFIX, 6, 2)]]
    assert policy.choose(RoundOptions(shallow, True, 8, remaining=100, catch_up=0.0))[2] == [PROMPT_LOOKUP]
    fixed = _policy_with_costs(case, costs, alpha=0.3, adaptive=False)
    offers = [[Offer(PROMPT_LOOKUP, 6, 1), Offer(SUFFIX, 6, 8)], [Offer(SUFFIX, 3, 2)], []]
    assert fixed.choose(RoundOptions(offers, True, 8, remaining=100, catch_up=0.0)) == (
        8,
        8,
        [PROMPT_LOOKUP, SUFFIX, DRAFT_MODEL],
    )


def test_a_head_offer_is_weighed_by_its_own_chances(case):
    """In `auto` the draft head's drafts come with the chance that drafts 1..k are all accepted
    (its calibrated confidences), which the policy takes over any measured rate: a sure head
    chain beats a weak copy, an unsure one does not, and a row takes only the head drafts that
    pay (the cap)."""
    costs = measured_costs({1: 0.150, 2: 0.152, 3: 0.155, 4: 0.156, 6: 0.168, 9: 0.181}, {1: 0.1})
    policy = _policy_with_costs(case, costs, alpha=0.3)
    policy.copy_rates[(PROMPT_LOOKUP, 1)] = AcceptanceByPosition(prior=0.3, weight=1e6)
    sure = Offer(HEAD, 4, 0, (0.95, 0.9, 0.85, 0.8))
    unsure = Offer(HEAD, 4, 0, (0.1, 0.01, 0.001, 0.0001))
    copy = Offer(PROMPT_LOOKUP, 6, 1)
    choice = policy.choose(RoundOptions([[copy, sure]], False, 8, remaining=100, catch_up=0.0))
    assert choice.sources == [HEAD] and choice.cap == 4
    choice = policy.choose(RoundOptions([[copy, unsure]], False, 8, remaining=100, catch_up=0.0))
    assert choice.sources == [PROMPT_LOOKUP]


def test_the_draft_model_and_copies_are_priced_by_the_drafts_the_target_tested(case):
    """From the translate benchmark: the draft model's drafts were accepted 0.75 of the time
    where the target tested them, but counted per drafted token (the drafts after a row's first
    miss, never tested, as misses) only 0.55, while copies were priced by the drafts tested.
    That made a 40% copy look better than the draft model, and `auto` ran behind the draft
    model alone. Both are now measured alike."""
    costs = measured_costs({w: 0.30 + 0.015 * (w - 1) for w in (1, 2, 3, 5, 9)}, {1: 0.05, 2: 0.05})
    policy = _policy_with_costs(case, costs, alpha=0.6)
    policy.model_rates = AcceptanceByPosition(prior=0.6)
    # chains of 6 drafts, each accepted with chance 0.7 after accepted ones: 64 rows as drawn
    chains = [(a, 6) for a in range(6) for _ in range(round(64 * 0.3 * 0.7**a))]
    chains += [(6, 6)] * (64 - len(chains))
    for _ in range(20):
        policy.observe({(DRAFT_MODEL, 0): chains})
    per_drafted = sum(a for a, _ in chains) / sum(d for _, d in chains)
    assert per_drafted < 0.45
    assert policy.model_rates.rate(0) == pytest.approx(0.7, abs=0.05)
    policy.copy_rates[(SUFFIX, 2)] = AcceptanceByPosition(prior=0.4, weight=1e6)
    offers = [[Offer(SUFFIX, 6, 2)]]
    choice = policy.choose(RoundOptions(offers, True, 8, remaining=100, catch_up=0.0))
    assert choice.sources == [DRAFT_MODEL] and choice.gamma >= 2
    # priced per drafted token, the same draft model would have lost the round to the copy
    as_before = policy.best(RoundOptions(offers, True, 8, 100, 0.0), iid_survival(per_drafted, 8))
    assert as_before.sources == [SUFFIX]


def _run_gate(
    gate: DraftingGate, rows: int, rounds: int, drafting_rate: float, plain_rate: float, plain_passes: int = 1
) -> list:
    """`rounds` rounds through the gate, each making `rows` tokens a pass at the rate of its
    kind; a plain round makes `plain_passes` passes back to back."""
    asked = []
    for _ in range(rounds):
        ask = gate.asks(rows)
        asked.append(ask)
        passes = 1 if ask else plain_passes
        tokens = rows * passes
        seconds = tokens / (drafting_rate if ask else plain_rate)
        gate.observe(rows, ask, tokens, seconds, drafted=int(ask), passes=passes)
    return asked


def test_the_gate_stops_asking_where_drafting_rounds_are_slower_and_probes_now_and_then():
    gate = DraftingGate(probe_every=8, probe_share=1.0)  # probes as cheap as wanted: the rounds' clock alone
    asked = _run_gate(gate, 3, 400, drafting_rate=70.0, plain_rate=100.0)
    # drafting first, then plain rounds to judge it by, then off with one probe in 8
    assert asked[: gate.min_rounds] == [True] * gate.min_rounds
    assert asked[gate.min_rounds : gate.min_rounds + 2] == [False, False]
    assert 3 in gate.off and gate.record()["off_at_rows"] == [3]
    probes = [i for i, a in enumerate(asked) if a and i > gate.min_rounds + 2]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == gate.min_rounds + 1 + 8  # the first probe_every rounds after turning off
    assert gaps == sorted(gaps) and gaps[0] == 16 and max(gaps) == 32  # backing off, up to 4 × 8
    # a probe that finds nothing to draft goes on asking, up to PROBE_ROUNDS rounds
    while not gate.asks(3):
        gate.observe(3, False, 3, 0.03)
    gate.observe(3, True, 3, 3 / 70.0, drafted=0)
    more = [gate.asks(3) for _ in range(gate.PROBE_ROUNDS)]
    assert more == [True] * (gate.PROBE_ROUNDS - 1) + [False]
    # the text starts to copy well: a probe finds drafting faster and turns it back on
    _run_gate(gate, 3, 40, drafting_rate=200.0, plain_rate=100.0)
    assert 3 not in gate.off
    assert sum(_run_gate(gate, 3, 32, drafting_rate=200.0, plain_rate=100.0)) >= 31  # one plain re-timing


@pytest.mark.parametrize("drafting_rate", [70.0, 95.0])
def test_probes_lose_at_most_their_share_of_the_time_between_them(drafting_rate):
    """The tiny pair on an AVX2 CPU: an asking round 5.1 ms, a plain one 1.9 ms at one row, and a
    job that never drafted lost about 4% to probes every 32 to 128 rounds. A probe now comes
    only after enough plain rounds that its rounds' loss (each asking round's, measured against
    plain ones) is within `probe_share` of their time: where asking loses much, rarely; where it
    loses little, as often as the rounds' clock allows."""
    gate = DraftingGate(probe_every=8)
    asked = _run_gate(gate, 3, 4000, drafting_rate=drafting_rate, plain_rate=100.0)
    assert gate.off == {3}
    loss = 3 / drafting_rate - 3 / 100.0  # an asking round's seconds beyond a plain one's
    gap = gate.priced_gap(3)
    assert gap == math.ceil(gate.PROBE_ROUNDS * loss / (gate.probe_share * 0.03))
    assert gate.record()["probe_gap_rounds"] == {3: gap}
    start = gate.min_rounds + 2  # judged: off from here
    probes = [i for i, a in enumerate(asked) if a and i >= start]
    assert probes[0] - start >= max(gap, 8) - 1
    plain = asked[start:].count(False) * 0.03
    assert len(probes) * loss <= 1.1 * gate.probe_share * plain
    if drafting_rate == 95.0:  # a small loss: the clock's backing off (up to 4 x 8) decides
        assert max(gap, 32) == 32 and len(probes) >= (4000 - start) // 33


def test_plain_rounds_of_several_passes_move_the_probes_clock_by_their_passes():
    """Drafting off, a probe comes after as many target passes whether the plain rounds make
    one pass or four back to back (`EngineConfig.plain_steps`)."""
    first_probe = {}
    for passes in (1, 4):
        gate = DraftingGate(probe_every=8)
        asked = _run_gate(gate, 3, 200, drafting_rate=70.0, plain_rate=100.0, plain_passes=passes)
        rounds = [i for i, a in enumerate(asked) if a and i > gate.min_rounds + 2]
        first_probe[passes] = sum(1 if asked[i] else passes for i in range(gate.min_rounds + 2, rounds[0]))
    assert first_probe[4] - first_probe[1] <= 3  # the same clock, give or take a round's passes


def test_the_gate_keeps_asking_where_drafting_pays_and_times_plain_rounds_rarely():
    gate = DraftingGate(probe_every=8)
    asked = _run_gate(gate, 1, 300, drafting_rate=150.0, plain_rate=100.0)
    assert not gate.off
    plain = asked.count(False)
    assert 2 <= plain <= 2 + 300 // (4 * 8) + 1  # the first judgement, then one in 4 × probe_every
    # each batch size is judged on its own
    _run_gate(gate, 4, 40, drafting_rate=50.0, plain_rate=100.0)
    assert gate.off == {4}


def test_a_plain_round_timed_in_a_slow_spell_does_not_keep_drafting_on():
    """Plain rounds are re-timed one in 4 x probe_every while drafting is on, so a plain rate
    that took in a round the cores spent elsewhere kept drafting on long after: the tiny pair's
    job drafted where it lost through 9 of 20 shards after one plain round timed at about 5
    times its usual seconds, and the online head's job for five shards after a package install
    shared the cores. A plain round does the same work whatever the text: its rate is the
    fastest of the last few, which one such round does not move, and a spell that lasts moves
    only while it lasts: the first plain round after it restores the rate (as the median of the
    last 5, three re-timings did, while drafting lost for 5 to 7 shards of the tiny job)."""
    gate = DraftingGate(probe_every=8)
    _run_gate(gate, 1, 100, drafting_rate=150.0, plain_rate=100.0)
    assert not gate.off
    while gate.asks(1):  # the next plain re-timing falls in a moment of other work: 10 x as long
        gate.observe(1, True, 1, 1 / 150.0, drafted=1)
    gate.observe(1, False, 1, 10 / 100.0)
    assert gate.rate(False, 1) == pytest.approx(100.0)
    # a spell that lasts: every round ten times as long, both kinds
    _run_gate(gate, 1, 4 * 4 * 8, drafting_rate=15.0, plain_rate=10.0)
    assert gate.rate(False, 1) == pytest.approx(10.0) and not gate.off
    rounds = 0
    while not gate.off and rounds < 2000:  # after the spell drafting loses
        rounds += 1
        ask = gate.asks(1)
        gate.observe(1, ask, 1, 1 / (90.0 if ask else 100.0), drafted=int(ask))
    assert gate.off == {1} and rounds <= 4 * 8 + 1, rounds  # one plain re-timing


def test_each_batch_size_re_times_its_plain_rounds_while_another_is_probed():
    """A shard's rows drain 3, 2, 1: the gate turned drafting off at 2 rows, and its probes
    there kept resetting the clock that re-timed plain rounds at 1 row, where drafting stayed
    on against a plain rate timed once, low, for 13 of a job's 20 shards. Each batch size now
    re-times its own plain rounds, one in 4 x probe_every of its asking rounds."""
    gate = DraftingGate(probe_every=8)
    _run_gate(gate, 1, 40, drafting_rate=150.0, plain_rate=100.0)
    _run_gate(gate, 2, 40, drafting_rate=70.0, plain_rate=100.0)
    assert gate.off == {2} and gate.judged == {1, 2}
    plain_at_one = 0
    for _ in range(40):  # rounds alternate: 3 at 2 rows (off, probed now and then), 1 at 1 row
        _run_gate(gate, 2, 3, drafting_rate=70.0, plain_rate=100.0)
        plain_at_one += _run_gate(gate, 1, 1, drafting_rate=150.0, plain_rate=100.0).count(False)
    assert plain_at_one == 40 // (4 * 8)  # one in 32 of the 1-row rounds


def test_the_gate_keeps_asking_where_asking_costs_next_to_nothing():
    """A CPU pass of the 1.5B costs about 70 ms and asking the copying drafters about 0.5 ms
    (Zen 4 EPYC, license summaries): rounds that drafted in a stretch that did not copy ran
    slower than plain ones, and the gate turned drafting off through the next stretch that
    did. Where asking costs under `margin` of a plain round, the gate never stops asking;
    where asking itself is dear (the tiny pair, a GPU), it stops as before."""

    def run(asking: float) -> DraftingGate:
        gate = DraftingGate(probe_every=8)
        for i in range(400):
            ask = gate.asks(1)
            drafted = int(ask and i % 2 == 0)  # half the asking rounds find nothing to draft
            seconds = 0.1 if not ask else 0.1 + asking if not drafted else 0.15  # drafts lose
            gate.observe(1, ask, 1, seconds, drafted=drafted, asking=asking if ask else None)
        return gate

    cheap = run(asking=0.0005)
    assert cheap.asking_is_cheap(1) and not cheap.off and 1 in cheap.judged
    assert cheap.rate(True, 1) < cheap.rate(False, 1)  # slower, yet asked: the policy's call
    assert cheap.record()["asking_seconds"] == {1: pytest.approx(0.0005)}
    dear = run(asking=0.02)  # a fifth of a plain round in the drafters alone
    assert not dear.asking_is_cheap(1) and dear.off == {1}


def test_a_draining_batch_follows_the_batch_size_it_drained_from():
    """Rows that end with no document left to admit leave a round or two at each smaller count:
    too few to judge there. They follow the nearest judged size above, until judged themselves."""
    gate = DraftingGate(probe_every=1000)  # no probe in this test's rounds
    _run_gate(gate, 64, 20, drafting_rate=70.0, plain_rate=100.0)
    assert gate.off == {64}
    draining = [a for rows in range(63, 0, -1) for a in _run_gate(gate, rows, 2, 70.0, 100.0)]
    assert not any(draining) and gate.off == {64}
    # where drafting paid at the full batch, the draining rounds ask as it did
    paying = DraftingGate(probe_every=1000)
    _run_gate(paying, 64, 20, drafting_rate=150.0, plain_rate=100.0)
    assert all(a for rows in range(63, 0, -1) for a in _run_gate(paying, rows, 2, 150.0, 100.0))
    # a size judged on its own keeps its own judgement
    both = DraftingGate(probe_every=1000)
    _run_gate(both, 8, 20, drafting_rate=150.0, plain_rate=100.0)
    _run_gate(both, 64, 20, drafting_rate=70.0, plain_rate=100.0)
    assert both.judged == {8, 64} and not both.is_off(8) and both.is_off(40) and not both.is_off(4)


def test_a_resting_gate_asks_in_no_round_and_probes_in_none_then_goes_on_as_it_was():
    """The actor stood down (`StandDown`, its pairs slower): no round asks, not even where
    drafting pays or a probe is due; taken up again, the gate judges as before it rested."""
    gate = DraftingGate(probe_every=8, probe_share=1.0)
    _run_gate(gate, 3, 40, drafting_rate=70.0, plain_rate=100.0)  # off at 3 rows, probes due
    _run_gate(gate, 5, 10, drafting_rate=200.0, plain_rate=100.0)  # drafting pays at 5 rows
    gate.resting = True
    assert not any(_run_gate(gate, 3, 100, drafting_rate=70.0, plain_rate=100.0))
    assert not any(_run_gate(gate, 5, 100, drafting_rate=200.0, plain_rate=100.0))
    assert not gate.probing and 3 in gate.off and 5 not in gate.off
    gate.resting = False
    assert all(_run_gate(gate, 5, 8, drafting_rate=200.0, plain_rate=100.0))
    assert any(_run_gate(gate, 3, 64, drafting_rate=70.0, plain_rate=100.0))  # its probes again


@pytest.mark.parametrize("resting", [False, True])
def test_a_gated_engine_stays_lossless(case, resting):
    """With drafting slower than plain decoding the gate stops asking mid-batch; the outputs are
    the target's own whichever rounds asked."""
    target, draft, tokenizer, prompts, eos, refs = case
    engine = SpeculativeEngine(
        target, draft, eos_token_ids=eos, pad_token_id=0, config=EngineConfig(drafter="auto", probe_every=4)
    )
    engine.gate.off.update(range(1, 9))  # as if every batch size had been judged slower drafting
    engine.gate.resting = resting  # or the actor stood down: no round asks, none probes
    outputs, stats = engine.generate(prompts, MAX_NEW, batch_size=3)
    assert [o.tokens for o in outputs] == refs
    assert engine.gate.rounds.get((False, 3), 0) > 0  # rounds that asked nothing ran
    assert (stats.asked_rounds == 0) == resting


def _copier_rounds(
    prices: CopierPrices,
    rounds: int,
    worth: dict[str, float],
    seconds: dict[str, float],
    plain_seconds: float = 0.004,
):
    """`rounds` rounds of both copiers on offer: which each asked, each observed as asked."""
    asked = []
    for _ in range(rounds):
        names = prices.asked([PROMPT_LOOKUP, SUFFIX])
        asked.append(names)
        prices.observe({n: seconds[n] for n in names}, {n: worth[n] for n in names}, plain_seconds)
    return asked


def test_a_round_with_nothing_to_offer_is_plain_without_weighing(case):
    """Prompt lookup alone, a round whose rows match nothing: the choice is plain decoding, as
    the search would find, without its arrays (a third of a millisecond at one row on a CPU)."""
    policy = _policy_with_costs(case, measured_costs(CPU_COSTS[0], {}), alpha=0.5)
    options = RoundOptions([[], []], False, 8, remaining=100, catch_up=0.0)
    assert policy.best(options, [1.0] * 9) == (0, 0, [None, None])
    policy.best = None  # not called
    assert policy.choose(options) == (0, 0, [None, None]) and policy._rounds_since_plain == 0


def test_a_copier_that_adds_less_than_it_costs_rests_and_is_probed_now_and_then():
    """At 64 rows on a CPU the suffix drafter took 3.0 ms a round and prompt lookup 0.8 ms:
    where one's copies add next to nothing over the other's, it stops being asked, and probes
    ask it again, backing off, up to 4 x probe_every rounds apart."""
    prices = CopierPrices(probe_every=8)
    seconds = {PROMPT_LOOKUP: 0.0008, SUFFIX: 0.003}
    asked = _copier_rounds(prices, 200, {PROMPT_LOOKUP: 0.01, SUFFIX: 0.0001}, seconds)
    assert asked[: prices.min_rounds] == [[PROMPT_LOOKUP, SUFFIX]] * prices.min_rounds
    assert prices.resting == SUFFIX and asked[prices.min_rounds] == [PROMPT_LOOKUP]
    probes = [i for i, names in enumerate(asked) if SUFFIX in names and i >= prices.min_rounds]
    starts = [i for i in probes if i - 1 not in probes]
    assert all(i + k in probes for i in starts for k in range(prices.PROBE_ROUNDS))  # a probe: 3 rounds
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert starts[0] == prices.min_rounds + 8 - 1  # the 8th round after it rested
    assert gaps[0] == 16 + prices.PROBE_ROUNDS - 1
    assert max(gaps) == 32 + prices.PROBE_ROUNDS - 1  # backing off up to 4 x probe_every
    record = prices.record()
    assert record["resting"] == SUFFIX and record["rested_rounds"][SUFFIX] == len(asked) - len(probes) - 8
    # the text turns to what only the suffix drafter finds: a probe wakes it
    asked = _copier_rounds(prices, 40, {PROMPT_LOOKUP: 0.01, SUFFIX: 0.02}, seconds)
    assert prices.resting is None and asked[-1] == [PROMPT_LOOKUP, SUFFIX]


def test_a_probe_is_judged_when_it_ends_though_its_last_rounds_took_no_copy():
    """Only rounds that take a copy are weighed: a probe whose later rounds copied nothing is
    judged on what its first found, when it ends."""
    prices = CopierPrices(probe_every=4)
    seconds = {PROMPT_LOOKUP: 0.0008, SUFFIX: 0.003}
    _copier_rounds(prices, 12, {PROMPT_LOOKUP: 0.01, SUFFIX: 0.0}, seconds)
    assert prices.resting == SUFFIX
    for _ in range(20):
        names = prices.asked([PROMPT_LOOKUP, SUFFIX])
        if SUFFIX in names and prices.resting and prices._probe_left == prices.PROBE_ROUNDS - 1:
            prices.observe(
                seconds, {PROMPT_LOOKUP: 0.01, SUFFIX: 0.05}, 0.004
            )  # the probe's first round only
    assert prices.resting is None


def test_copiers_that_both_pay_are_both_asked_and_a_lone_one_is_the_gates():
    prices = CopierPrices(probe_every=8)
    asked = _copier_rounds(
        prices, 100, {PROMPT_LOOKUP: 0.002, SUFFIX: 0.004}, {PROMPT_LOOKUP: 0.001, SUFFIX: 0.003}
    )
    assert prices.resting is None and all(len(names) == 2 for names in asked)
    # two that add nothing over each other: only the dearer rests, the other is the gate's to judge
    asked = _copier_rounds(
        prices, 100, {PROMPT_LOOKUP: 0.0, SUFFIX: 0.0}, {PROMPT_LOOKUP: 0.001, SUFFIX: 0.003}
    )
    assert prices.resting == SUFFIX and all(PROMPT_LOOKUP in names for names in asked)
    alone = CopierPrices(probe_every=8)
    for _ in range(50):
        assert alone.asked([SUFFIX]) == [SUFFIX]
        alone.observe({SUFFIX: 0.003}, {SUFFIX: 0.0}, 0.004)
    assert alone.resting is None
    # beside a CPU pass of tens of milliseconds neither costs enough to rest
    slow = CopierPrices(probe_every=8)
    asked = _copier_rounds(
        slow, 100, {PROMPT_LOOKUP: 0.0, SUFFIX: 0.0}, {PROMPT_LOOKUP: 0.0002, SUFFIX: 0.001}, 0.05
    )
    assert slow.resting is None and all(len(names) == 2 for names in asked)


def test_a_copy_is_worth_what_it_adds_over_the_rows_best_other_offer(case):
    """The worth `CopierPrices` weighs: per row that took a source's copy, its expected tokens
    at the round's cap less the best other offer's (one token where none)."""
    policy = _policy_with_costs(case, measured_costs(CPU_COSTS[0], {}), alpha=0.5)
    offers = [
        [Offer(PROMPT_LOOKUP, 4, 2), Offer(SUFFIX, 6, 4)],  # suffix taken: it adds over lookup's copy
        [Offer(PROMPT_LOOKUP, 3, 2)],  # lookup alone: all it adds over one token
        [Offer(SUFFIX, 2, 4)],  # not taken
        [],
    ]
    copies = _Copies(offers, 8, policy._survival)
    cap = 5
    gains = policy._copy_gains(copies, cap, [SUFFIX, PROMPT_LOOKUP, None, None])

    def expected(offer: Offer) -> float:
        return sum(policy._survival(offer, 8)[: min(offer.tokens, cap) + 1])

    assert gains[SUFFIX] == pytest.approx(expected(offers[0][1]) - expected(offers[0][0]))
    assert gains[PROMPT_LOOKUP] == pytest.approx(expected(offers[1][0]) - 1.0)


def test_a_resting_copier_is_not_asked_and_outputs_stay_the_targets(case):
    target, draft, tokenizer, prompts, eos, refs = case
    engine = SpeculativeEngine(
        target,
        draft,
        eos_token_ids=eos,
        pad_token_id=0,
        config=EngineConfig(drafter="auto", probe_every=1000),
    )
    engine.gate.asks = lambda rows: True  # every round asks the drafters
    engine.policy.copiers.resting = SUFFIX
    calls = []
    propose = engine.suffix.propose
    engine.suffix.propose = lambda *a, **k: calls.append(1) or propose(*a, **k)
    outputs, stats = engine.generate(prompts, MAX_NEW, batch_size=3)
    assert [o.tokens for o in outputs] == refs
    assert not calls and engine.policy.copiers.rested_rounds[SUFFIX] == stats.asked_rounds > 0


def _best_row_by_row(policy: Policy, options: RoundOptions, from_model: list[float]) -> tuple:
    """`Policy.best` as it was written before it weighed every row at once: a plain reference."""
    offers, gamma_cap, rows = options.offers, options.gamma_cap, len(options.offers)
    draft_time = policy.costs.draft_time(rows) or 0.0
    plain_seconds = policy.costs.target_time(policy.target.pass_tokens([1] * rows))
    per_token = 0.0
    if policy.target.pack and rows > 1:
        per_token = max((policy.costs.target_time(3 * rows) - plain_seconds) / (2 * rows), 0.0)
    budgets = options.drain_budgets if rows > 1 else None
    to_limit = policy.runs_to_limit.value if budgets else 0.0
    leads = [max(budgets) - b for b in budgets] if budgets else [0] * rows
    best, best_rate = (0, 0, [None] * rows), rows / plain_seconds * (1 + policy.config.min_gain)
    copies = [[(o, policy._survival(o, gamma_cap)) for o in row] for row in offers]
    longest = max((min(o.tokens, gamma_cap) for row in offers for o in row), default=0)
    for cap in range((gamma_cap if budgets else longest) + 1) if any(offers) else range(1):
        for gamma in range(gamma_cap + 1) if options.use_model else [0]:
            model_survival = from_model[: gamma + 1]
            model_tokens = sum(model_survival)
            reach = max(cap, gamma)
            near = sum(lead < reach for lead in leads)
            tokens, lengths, sources, drains = 0.0, [], [], []
            price = best_rate * per_token
            for row, lead in zip(copies, leads):
                weight = 1.0 - to_limit + (to_limit * rows / near if lead < reach else 0.0)
                chosen, value = (1.0, 0, None, [1.0]), weight
                if gamma and weight * model_tokens - price * gamma > value:
                    chosen, value = (
                        (model_tokens, gamma, DRAFT_MODEL, model_survival),
                        weight * model_tokens - price * gamma,
                    )
                for o, survival in row if cap else ():
                    d = min(o.tokens, cap)
                    copy = (sum(survival[: d + 1]), d, o.source, survival[: d + 1])
                    if weight * copy[0] - price * copy[1] > value:
                        chosen, value = copy, weight * copy[0] - price * copy[1]
                tokens += chosen[0]
                lengths.append(chosen[1] + 1)
                sources.append(chosen[2])
                drains.append((lead, chosen[3]))
            if gamma and DRAFT_MODEL not in sources:
                continue
            seconds = gamma * draft_time + policy.costs.target_time(policy.target.pass_tokens(lengths))
            if gamma:
                seconds += options.catch_up * min(tokens / max(options.remaining, 1), 1.0)
            worth = tokens
            if budgets:
                worth = (1.0 - to_limit) * tokens + to_limit * rows * expected_drain_advance(drains)
            if worth / seconds > best_rate * 1.0001:
                best, best_rate = (cap, gamma, sources), worth / seconds
    return best


def _random_rounds(case, coarse: bool, trials: int):
    """(trial, policy, options, from_model) for `trials` random rounds: 1 to 64 rows, lookup,
    suffix and head offers, the draft model or not, draining or not, packed passes, padded
    ones, or a static runner's (every slot, some empty, at the graph width holding the widest).
    `coarse`: chances of 0, 1/2 and 1 only, so that offers, the draft model and plain tie."""
    rng = random.Random(0)

    def chance() -> float:
        return rng.choice([0.0, 0.5, 1.0]) if coarse else rng.random()

    costs = measured_costs(
        {1: 0.15, 2: 0.152, 4: 0.156, 8: 0.186, 64: 0.3, 192: 0.5, 600: 1.2}, {1: 0.02, 64: 0.06}
    )
    for trial in range(trials):
        policy = _policy_with_costs(case, costs, alpha=chance(), min_gain=rng.choice([0.0, 0.02]))
        policy.target.pack = rng.random() < 0.5
        slots = rng.choice([0, 0, 1, 5])  # where not 0, priced as `StaticLM` counts a pass
        if slots and not policy.target.pack:
            policy.target.pass_tokens = lambda lengths, more=slots: (
                (len(lengths) + more - 1) * (width_of(max(lengths)) or max(lengths))
            )
        for source, depth in [(PROMPT_LOOKUP, d) for d in (1, 2, 3, 4)] + [
            (SUFFIX, d) for d in (1, 2, 4, 8, 16)
        ]:
            policy.copy_rates[(source, depth)] = AcceptanceByPosition(prior=chance(), weight=1e6)
        policy.runs_to_limit = RunningRate(prior=chance(), weight=1e6)
        rows, gamma_cap = rng.choice([1, 2, 3, 8, 64]), rng.randint(1, 8)

        def offer() -> Offer:
            kind = rng.choice([PROMPT_LOOKUP, SUFFIX, HEAD])
            tokens = rng.randint(1, 10)
            if kind == HEAD:
                chances, held = [], 1.0
                for _ in range(rng.randint(0, tokens)):
                    held *= chance()
                    chances.append(held)
                return Offer(HEAD, tokens, 0, tuple(chances))
            return Offer(kind, tokens, rng.choice([1, 2, 4]) if kind == SUFFIX else rng.randint(1, 4))

        offers = [[offer() for _ in range(rng.choice([0, 1, 1, 2, 3]))] for _ in range(rows)]
        budgets = [rng.randint(1, 40) for _ in range(rows)] if rng.random() < 0.3 else None
        options = RoundOptions(
            offers, rng.random() < 0.5, gamma_cap, rows * 30, rng.choice([0.0, 0.5]), budgets
        )
        yield trial, policy, options, iid_survival(chance(), gamma_cap)


@pytest.mark.parametrize("coarse", [False, True])
def test_the_policy_weighs_all_rows_at_once_as_it_would_row_by_row(case, coarse, search_path):
    """`Policy.best` weighs every row's offers, for every cap and gamma, as arrays (a row at a
    time, at batch 64, cost more than a captured GPU pass; a candidate at a time, at 3 rows on
    a CPU, more than the round's pass); it chooses as the row-by-row, candidate-by-candidate
    reference does, on random rounds (`_random_rounds`). (A verify token's price held at its
    first value, or a drain's bound set too low, fails it.) With `coarse` chances offers, the
    draft model and plain often tie, and the first of equals must win as in the reference (a
    lone row's search taking the last one fails it). Both searches: numpy's and
    `search.cpp`'s (`search_path`)."""
    for trial, policy, options, from_model in _random_rounds(case, coarse, 400):
        assert tuple(policy.best(options, from_model)) == _best_row_by_row(policy, options, from_model), trial


@pytest.mark.parametrize("coarse", [False, True])
def test_the_native_search_weighs_every_candidate_as_numpy_does_bit_for_bit(case, coarse):
    """`search.cpp` settles on the candidate numpy's `_Candidates` settles on, with the very
    same rate (==, not close): every product, sum and quotient in the same order, nothing
    fused. A choice alone would hide a rate off in its last bits (a drain's advance off by
    one part in 10^9 still chose alike in every round)."""
    lib = search.library()
    if lib is None:
        pytest.skip("search.cpp cannot be built here")
    compared = 0
    for trial, policy, options, from_model in _random_rounds(case, coarse, 1500):
        rows = len(options.offers)
        if rows == 1 or options.gamma_cap <= 0:
            continue
        copies = _lay_out(options.offers, options.gamma_cap, policy._survival)
        best_rate, per_token = policy._plain_bar(rows)
        native = _Candidates(policy, options, from_model, copies).best(best_rate, per_token, lib)
        arrays = _Candidates(policy, options, from_model, copies).best(best_rate, per_token, None)
        assert native == arrays, trial
        compared += native[0].cap > 0 or native[0].gamma > 0
    assert compared > 200, "too few rounds chose to draft to compare their rates"


@pytest.mark.parametrize("coarse", [False, True])
def test_the_native_lay_out_writes_the_copies_arrays_numpy_writes(case, coarse):
    """`search.cpp`'s `lay_out` fills `_Copies`' arrays (from uninitialized memory) with the very
    numbers numpy's lays out: the drafts, every expected sum (in order, ==), the survivals, how
    many chances each offer has, which columns hold one. A sum off in its last bit, a cell left
    unwritten or a chance read past an offer's drafts fails it."""
    lib = search.library()
    if lib is None:
        pytest.skip("search.cpp cannot be built here")
    compared = 0
    for trial, policy, options, _ in _random_rounds(case, coarse, 600):
        if len(options.offers) == 1 or options.gamma_cap <= 0:
            continue
        native = _Copies(options.offers, options.gamma_cap, policy._survival, lib)
        arrays = _Copies(options.offers, options.gamma_cap, policy._survival)
        for name in ("tokens", "expected", "survivals", "survival_lengths", "held"):
            mine, reference = getattr(native, name), getattr(arrays, name)
            assert mine.dtype == reference.dtype and np.array_equal(mine, reference), (trial, name)
        assert native.longest == arrays.longest, trial
        compared += native.held.any()
    assert compared > 200, "too few rounds with copies to compare"


def test_the_environment_can_keep_the_search_in_numpy(monkeypatch, case):
    """PIPELINE_NATIVE_SEARCH=0 keeps the policy's search in numpy (a machine whose build
    misbehaves): no library, and `best` chooses through `_Candidates`' arrays."""
    if search.library() is None:
        pytest.skip("search.cpp cannot be built here")
    monkeypatch.setenv("PIPELINE_NATIVE_SEARCH", "0")
    search.library.cache_clear()
    weighed = []
    weigh = _Candidates._weigh
    monkeypatch.setattr(_Candidates, "_weigh", lambda self, *a: weighed.append(1) or weigh(self, *a))
    try:
        assert search.library() is None
        trial, policy, options, from_model = next(
            round_ for round_ in _random_rounds(case, False, 200) if len(round_[2].offers) > 1
        )
        assert tuple(policy.best(options, from_model)) == _best_row_by_row(policy, options, from_model)
        assert weighed
    finally:
        monkeypatch.delenv("PIPELINE_NATIVE_SEARCH")
        search.library.cache_clear()
    assert search.library() is not None
