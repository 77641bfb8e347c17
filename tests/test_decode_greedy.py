"""Greedy speculative decoding must reproduce the target's own greedy decoding exactly."""

from __future__ import annotations

import copy

import pytest
import torch

from pipeline.decode.batched_lm import BatchedLM
from pipeline.decode.costs import (
    AcceptanceByPosition,
    CostModel,
    RunningRate,
    expected_drain_advance,
    iid_survival,
)
from pipeline.decode.drafters import DraftModelDrafter
from pipeline.decode.engine import EngineConfig, PromptError, RoundOptions, SpeculativeEngine
from pipeline.decode.sampling import SamplingParams
from pipeline.models.draft_int8 import quantize_draft

TEXTS = [
    "The quick brown fox jumps",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one. "
    "Summaries copy phrases from their input documents, translations rarely do. Summaries copy",
    "Data",
    "Le renard brun saute par-dessus le chien paresseux. The quick brown fox jumps over the lazy dog.",
    "Parquet shards are read from object storage and written back with statistics. Parquet shards",
    "Data teams run batch jobs every night on a cluster of machines. Every night",
    "fox",
    "The lazy dog. The lazy dog. The lazy",
]
MAX_NEW = 24


def reference(model, prompt: list[int], max_new: int, eos: list[int]) -> list[int]:
    """The target decoding alone: Hugging Face greedy generate, batch 1, no padding."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def case(tiny_models):
    """Prompts, an EOS set that makes rows stop at different times, and reference outputs."""
    target, draft, tokenizer = tiny_models
    prompts = [tokenizer(t).input_ids for t in TEXTS]
    plain = [reference(target, p, MAX_NEW, [1]) for p in prompts]
    # Promote a token that several reference rows emit mid-way to an extra EOS, so rows
    # finish after different numbers of tokens, some early and some at max_new_tokens.
    counts: dict[int, int] = {}
    for row in plain:
        for t in set(row[3:-3]):
            counts[t] = counts.get(t, 0) + 1
    stopper = max(sorted(counts), key=lambda t: counts[t])
    eos = [1, stopper]
    refs = [reference(target, p, MAX_NEW, eos) for p in prompts]
    assert len({len(r) for r in refs}) > 2, "rows should stop at different times"
    return target, draft, tokenizer, prompts, eos, refs


@pytest.mark.parametrize("drafter", ["draft_model", "prompt_lookup", "auto"])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_matches_target_for_every_gamma(case, drafter, batch_size):
    target, draft, _, prompts, eos, refs = case
    totals = {"accepted": 0, "drafted": 0}
    for gamma in range(1, 9):
        engine = SpeculativeEngine(
            target,
            draft,
            eos_token_ids=eos,
            pad_token_id=0,
            config=EngineConfig(drafter=drafter, gamma_max=gamma, adaptive=False),
        )
        for start in range(0, len(prompts), batch_size):
            outputs, batch = engine.generate(prompts[start : start + batch_size], MAX_NEW)
            for k, out in enumerate(outputs):
                assert out.tokens == refs[start + k], f"row {start + k}, gamma {gamma}"
            totals["accepted"] += batch.accepted
            totals["drafted"] += batch.drafted
    # both the accept and the reject paths ran
    assert 0 < totals["accepted"] < totals["drafted"]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_prompts_sharing_a_template_decode_as_they_would_alone(tiny_models, batch_size):
    """A corpus job's prompts share their chat markup and instruction; the engine computes that
    start once (target and draft alike) and copies it into later rows."""
    target, draft, tokenizer = tiny_models
    template = "Data teams run batch jobs every night on a cluster of machines.\nSummarize:\n"
    prompts = [tokenizer(template + t).input_ids for t in TEXTS]
    refs = [reference(target, p, MAX_NEW, [1]) for p in prompts]
    engine = SpeculativeEngine(
        target, draft, eos_token_ids=[1], pad_token_id=0, config=EngineConfig(adaptive=False, gamma_max=3)
    )
    fed = []
    for start in range(0, len(prompts), batch_size):
        outputs, batch = engine.generate(prompts[start : start + batch_size], MAX_NEW, drafter="draft_model")
        assert [o.tokens for o in outputs] == refs[start : start + batch_size]
        fed.append(batch.prefill_tokens)
    shared = len(tokenizer(template).input_ids) - 1  # the template's last token may merge onward
    for lm in (engine.target, engine.draft.lm):
        assert lm.template is not None and len(lm.template.tokens) >= shared
    # the first prompt shows no template yet; every later one reuses it
    assert fed[0] >= len(prompts[0])
    assert sum(fed) <= sum(map(len, prompts)) - shared * (len(prompts) - 1)


def test_a_draft_with_a_restricted_output_layer_stays_lossless(case):
    """The draft proposes among ids below 64 plus its batch's prompt tokens and EOS only."""
    target, draft, _, prompts, eos, refs = case
    config = EngineConfig(drafter="draft_model", gamma_max=4, adaptive=False, draft_vocab=64)
    engine = SpeculativeEngine(target, draft, eos_token_ids=eos, pad_token_id=0, config=config)
    outputs, batch = engine.generate(prompts, MAX_NEW)
    assert [o.tokens for o in outputs] == refs
    assert 0 < batch.accepted < batch.drafted
    # (the draft starts after the prefill: each row's first token, the target's, is in its prompt)
    allowed = set(range(64)) | {t for p, r in zip(prompts, refs) for t in p + r[:1]} | set(eos)
    assert set(engine.draft.lm.head_rows.tolist()) == allowed
    engine.draft.start([prompts[2]])
    proposal = engine.draft.propose([prompts[2]], 3, SamplingParams(), torch.Generator())
    assert set(proposal.tokens[0]) <= allowed


def test_a_draft_on_int8_weights_stays_lossless(case):
    """Int8 decode steps change what the draft proposes, never what the target emits."""
    target, draft, _, prompts, eos, refs = case
    quantized = copy.deepcopy(draft)
    assert quantize_draft(quantized) > 0
    config = EngineConfig(drafter="draft_model", gamma_max=4, adaptive=False)
    for batch_size in (1, 8):  # draft steps of 1 row (int8) and of 8 (the loaded weights)
        engine = SpeculativeEngine(target, quantized, eos_token_ids=eos, pad_token_id=0, config=config)
        outputs = []
        for start in range(0, len(prompts), batch_size):
            outputs += engine.generate(prompts[start : start + batch_size], MAX_NEW)[0]
        assert [o.tokens for o in outputs] == refs
        assert 0 < sum(o.stats.accepted for o in outputs) < sum(o.stats.drafted for o in outputs)


def test_adaptive_gamma_is_lossless_and_reuses_costs(case):
    target, draft, _, prompts, eos, refs = case
    engine = SpeculativeEngine(target, draft, eos_token_ids=eos, pad_token_id=0, config=EngineConfig())
    for _ in range(2):
        outputs, batch = engine.generate(prompts, MAX_NEW)
        assert [o.tokens for o in outputs] == refs
    assert engine.costs.target, "target pass costs were measured"
    assert sum(batch.gamma_histogram.values()) == batch.target_passes - 1


# Seconds per target pass by tokens in the pass (rows × width), and per draft pass, as measured
# on the 1.5B/0.5B pair on a 2-core CPU in float32 (the benchmark machine), and as they look on
# a GPU (a wider pass nearly free).
CPU_COSTS = ({1: 0.40, 2: 0.83, 5: 1.23}, 0.22)
GPU_COSTS = ({1: 0.020, 2: 0.021, 5: 0.022}, 0.004)
# Batch 8, 400-token prompts (tools: a per-pass timing of the engine on the benchmark machine).
BATCH8_TARGET = {8: 1.61, 16: 1.82, 24: 2.05, 40: 2.32, 72: 2.90}
BATCH8_DRAFT = {8: 0.50, 16: 0.64}
PREFILL_PER_TOKEN = {"target": 72.9 / (8 * 396), "draft": 22.3 / (8 * 396)}


def _costs(target: dict, draft: dict, prefill: dict | None = None) -> CostModel:
    """A cost model that measured these tables (each size twice: confirmed, see PassCosts.time)."""
    model = CostModel()
    for _ in range(2):
        for tokens, seconds in target.items():
            model.observe_target(tokens, seconds)
        for tokens, seconds in draft.items():
            model.observe_draft(tokens, seconds)
    for name, rate in (prefill or {}).items():
        model.observe_prefill(name, 1000, rate * 1000)
    return model


def test_pass_costs_are_keyed_by_tokens_so_every_batch_size_shares_them():
    model = _costs(BATCH8_TARGET, BATCH8_DRAFT)
    assert model.target_time(8) == 1.61  # 8 rows × 1 token, 4 × 2, or 1 × 8
    assert model.target_time(7) == pytest.approx(1.61 - (1.82 - 1.61) / 8)  # a shrinking batch
    assert model.target_time(32) == pytest.approx(2.05 + (2.32 - 2.05) / 2)  # 8 × 4
    assert model.draft_time(8) == 0.50 and model.draft_time(16) == 0.64


def test_a_pass_size_measured_once_in_a_slow_spell_is_tried_again(case):
    """From the translate benchmark: one 4-token pass took 0.23 s beside 0.14 s for 3, and
    `auto` never went that wide again. A size seen once costs no more than its neighbours say
    until a second measurement confirms it; a confirmed one is believed."""
    model = _costs({1: 0.15, 2: 0.14, 3: 0.14}, {})
    model.observe_target(4, 0.23)
    assert model.target_time(4) == pytest.approx(0.14)  # extrapolated from 2 and 3
    engine = _engine_with_costs(case, model, alpha=0.8)
    engine.costs.observe_draft(1, 0.02)
    engine.costs.observe_draft(1, 0.02)
    assert engine._choose_gammas(_one_row())[1] >= 3  # a 4-token verify pass is on the table
    model.observe_target(4, 0.23)  # confirmed: the size really is that dear
    assert model.target_time(4) == pytest.approx(0.23)
    assert engine._choose_gammas(_one_row())[1] < 3


def test_verify_cost_is_interpolated_piecewise_and_width_1_measured_first(tiny_models):
    """On a CPU a 1-token pass takes a faster path: the cost jumps from width 1 to 2, then grows
    gently. One line through the wider passes would put width 1 near 0.7 s instead of 0.4 s."""
    model = _costs(CPU_COSTS[0], {})
    assert model.target_time(1) == 0.40
    assert model.target_time(3) == pytest.approx(0.83 + (1.23 - 0.83) / 3)
    assert model.target_time(8) == pytest.approx(1.23 + 3 * (1.23 - 0.83) / 3)
    # the 1-token pass is no slope anchor: from {1, 2} alone, wider passes get the prior slope
    # (and get measured), not the 1→2 jump repeated for every token (0.40 s more per token)
    model = _costs({1: 0.40, 2: 0.83}, {})
    assert model.target_time(5) == pytest.approx(0.83 * (1 + 0.03 * 4) / (1 + 0.03))
    # an engine that knows only wider passes measures plain decoding before any choice
    target, draft, _ = tiny_models
    engine = SpeculativeEngine(target, draft, eos_token_ids=[1], pad_token_id=0)
    for width in (2, 5):
        engine.costs.observe_target(width, CPU_COSTS[0][width])
    assert engine._choose_gammas(_one_row()) == (0, 0, [None])


def _one_row(gamma_cap: int = 8) -> RoundOptions:
    """A round of one row, no lookup match, the draft model warm, 100 tokens to go."""
    return RoundOptions([0], ["prompt_lookup:1"], True, gamma_cap, remaining=100, catch_up=0.0)


def _engine_with_costs(case, costs: CostModel, alpha: float, **config):
    target, draft, _, _, eos, _ = case
    config = EngineConfig(**config)
    engine = SpeculativeEngine(target, draft, eos_token_ids=eos, pad_token_id=0, config=config)
    engine.costs = costs
    rate = engine.alpha["draft_model"]
    rate.drafted = 1e6  # a long history at exactly `alpha`, outweighing the prior
    rate.accepted = alpha * (rate.drafted + rate.weight) - rate.prior * rate.weight
    return engine


def test_a_cold_draft_speculates_only_when_the_rounds_left_repay_its_prefill(case):
    """The batch-8 benchmark defect: the draft model ran at 0.77x target-only on 24 new tokens.
    Its decode rounds did gain (33 s of passes against 37 s), but the draft's prefill of the 8
    prompts took 22 s, which no one had charged to the choice of drafting."""
    costs = _costs(BATCH8_TARGET, BATCH8_DRAFT, PREFILL_PER_TOKEN)
    engine = _engine_with_costs(case, costs, alpha=0.76)
    cold = costs.prefill_time("draft", 8 * 396)
    assert cold == pytest.approx(22.3, rel=0.01)
    lookup = ([0] * 8, ["prompt_lookup:1"] * 8, True, 8)
    assert engine._choose_gammas(RoundOptions(*lookup, 8 * 23, 0.0))[1] > 0  # warm: it pays
    assert engine._choose_gammas(RoundOptions(*lookup, 8 * 23, cold))[1] == 0  # 24 new tokens: not
    assert engine._choose_gammas(RoundOptions(*lookup, 8 * 500, cold))[1] > 0  # 500: it does again
    # before the draft ever ran, its prefill is priced from the target's at the prior ratio
    unmeasured = _costs(BATCH8_TARGET, {}, {"target": PREFILL_PER_TOKEN["target"]})
    assert unmeasured.prefill_time("draft", 8 * 396) == pytest.approx(72.9 * 0.4, rel=0.01)
    # a warm draft a few tokens behind costs only the extra width of its catch-up pass
    assert costs.catch_up_time(8, 8 * 2) == 0.0
    assert costs.catch_up_time(8, 8 * 3) == pytest.approx(0.64 + (0.64 - 0.50) - 0.50)  # 24 tokens


def _calibration(widths: dict[int, float], draft_step: float) -> dict:
    """What `pipeline.calibrate.measure` records (string keys, as read back from JSON)."""
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
    options = RoundOptions([0], ["prompt_lookup:1"], True, 8, remaining=200, catch_up=0.0)
    for widths, drafts in (
        ({1: 0.3, 2: 0.31, 4: 0.33, 8: 0.36}, True),
        ({1: 0.3, 2: 0.9, 4: 2.1, 8: 4.5}, False),
    ):
        costs = CostModel()
        costs.seed(_calibration(widths, draft_step=0.02))
        engine = _engine_with_costs(case, costs, alpha=0.7)
        assert (engine._choose_gammas(options)[1] > 0) is drafts


@pytest.mark.parametrize("left, probes", [(100, False), (500, True)])
def test_a_probe_risks_a_cold_prefill_only_where_the_work_left_dwarfs_it(case, left, probes):
    """The batch-4 translation benchmark: a probe hoping for α 0.95 started a cold draft whose
    prefill took 12% of the job, and the α of 0.57 it found never repaid it. A probe may risk
    at most 5% of the plain decoding left on the draft's catch-up."""
    costs = _costs(BATCH8_TARGET, BATCH8_DRAFT, PREFILL_PER_TOKEN)
    engine = _engine_with_costs(case, costs, alpha=0.3, probe_every=1)  # believed poor
    cold = costs.prefill_time("draft", 8 * 396)  # 22.3 s; 100 tokens per row: 161 s plain
    options = RoundOptions([0] * 8, ["prompt_lookup:1"] * 8, True, 8, 8 * left, cold)
    assert engine._best(options, engine.config.probe_alpha)[1] > 0  # a hopeful α would pay
    assert (engine._choose_gammas(options)[1] > 0) is probes


@pytest.mark.parametrize("costs, probes", [(CPU_COSTS, False), (GPU_COSTS, True)])
def test_no_acceptance_probes_where_no_draft_could_pay(case, costs, probes):
    """Going target-only, the engine re-tries the draft now and then to re-measure α, unless
    the measured costs say that no acceptance would make the draft pay."""
    target, draft, _, prompts, eos, refs = case
    engine = SpeculativeEngine(
        target, draft, eos_token_ids=eos, pad_token_id=0, config=EngineConfig(probe_every=1)
    )
    widths, draft_seconds = costs
    # every pass size the batch can produce, each as dear as its tokens say (CPU) or not (GPU)
    w1, w2 = widths[1], widths[2]
    for tokens in range(1, len(prompts) * 9 + 1):
        engine.costs.observe_target(tokens, w1 + (w2 - w1) * (tokens - 1) if probes else w1 * tokens)
        engine.costs.observe_draft(tokens, draft_seconds)
    # keep these costs: the tiny model's own passes take milliseconds, and mixing them in would
    # make (say) 3 rows × 2 tokens look as cheap as the measured 6 rows × 1 token
    engine.costs.target.smoothing = engine.costs.draft.smoothing = 0.0
    engine.alpha["draft_model"].drafted = 1e6  # a draft that is never accepted: target-only
    outputs, batch = engine.generate(prompts, MAX_NEW, drafter="draft_model")
    assert [o.tokens for o in outputs] == refs
    assert (batch.draft_passes > 0) is probes


@pytest.mark.parametrize("probe_every, probes", [(10_000, False), (2, True)])
def test_prompt_lookup_is_probed_where_an_unmeasured_cost_looks_too_dear(case, probe_every, probes):
    """The batch-4 benchmark defect: alone, prompt lookup never drafted at batch 4, because a
    2-token verify pass there was priced from other shapes, never measured, and too dear."""
    target, draft, _, prompts, eos, refs = case
    config = EngineConfig(probe_every=probe_every)
    engine = SpeculativeEngine(target, draft, eos_token_ids=eos, pad_token_id=0, config=config)
    # a plain pass 1 s and a 3-token pass 30 s (each seen twice: confirmed): 2 tokens, never
    # measured, interpolate to 15.5 s
    for _ in range(2):
        engine.costs.observe_target(1, 1.0)
        engine.costs.observe_target(3, 30.0)
    drafted = 0
    for k in (1, 7):  # prompts that repeat themselves, so lookup finds matches
        outputs, batch = engine.generate([prompts[k]], MAX_NEW, drafter="prompt_lookup")
        assert outputs[0].tokens == refs[k]
        drafted += batch.drafted
    assert (drafted > 0) is probes
    # probing measured the 2-token pass (the tiny model's milliseconds), not extrapolated any more
    assert engine.costs.target.has(2) is probes


@pytest.mark.parametrize("min_gain, gamma", [(0.05, 0), (0.0, 1)])
def test_a_marginal_expected_gain_does_not_start_speculation(case, min_gain, gamma):
    # alpha 0.5, free draft: gamma 1 yields 1.5 tokens per 1.456 s against 1 token per 1.0 s,
    # 3% more, and every longer gamma less: inside the margin, so target-only.
    costs = _costs({1: 1.0, 2: 1.456, 3: 1.912}, {1: 0.0})
    engine = _engine_with_costs(case, costs, alpha=0.5, min_gain=min_gain)
    assert engine._choose_gammas(_one_row(gamma_cap=4)) == (0, gamma, ["model" if gamma else None])


def test_drafting_goes_on_while_the_chain_is_likely_and_the_step_pays(case):
    """One more draft is worth P·α tokens (P: the chance every draft so far is accepted, α: how
    often a draft after accepted ones is) at the seconds a token has lately cost, against a
    draft step plus the wider verify pass."""
    costs = _costs({1: 0.135, 2: 0.135, 3: 0.137, 4: 0.143, 8: 0.152, 16: 0.195}, {1: 0.021, 2: 0.025})
    costs.observe_round(1, 0.09)  # lately 0.09 s per token
    engine = _engine_with_costs(case, costs, alpha=0.6)
    engine.draft_next = RunningRate(prior=0.75, weight=1e6)
    steps, keep = engine._draft_length(_one_row(gamma_cap=8), 0, 2, ["model"])
    assert steps == 8  # a lone row may draft to the cap; the rule ends it sooner
    # 0.9 · 0.75 · 0.09 = 0.061 s gained against 0.021 + 0.001 s; 0.3 · 0.75 · 0.09 = 0.020 s: no
    assert keep([0.9], [1]) == [True]
    assert keep([0.3], [3]) == [False]
    # two rows while prompts wait: each goes on by its own chain, the step by their sum
    two = RoundOptions([0, 0], ["prompt_lookup:1"] * 2, True, 8, remaining=200, catch_up=0.0)
    steps, keep = engine._draft_length(two, 0, 2, ["model", "model"])
    assert steps == 8
    assert keep([0.9, 0.01], [2, 2]) == [True, False]
    assert keep([0.2, 0.2], [2, 2]) == [False, False]  # each barely gains, together not a step
    # a draining batch keeps the gamma its drain pricing chose as the most it drafts
    draining = RoundOptions([0, 0], ["prompt_lookup:1"] * 2, True, 8, 80, 0.0, drain_budgets=[40, 40])
    assert engine._draft_length(draining, 0, 2, ["model", "model"])[0] == 2
    # fixed gamma drafts gamma, no rule
    fixed = _engine_with_costs(case, costs, alpha=0.6, adaptive=False)
    assert fixed._draft_length(_one_row(), 0, 5, ["model"]) == (5, None)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_drafts_that_stop_row_by_row_stay_lossless(case, batch_size):
    """Rows stop drafting at different passes; a stopped row is still fed through the passes
    that follow (one rectangle), so its draft cache runs ahead of its drafts and is rolled back
    at the next round."""
    target, draft, _, prompts, eos, refs = case
    config = EngineConfig(drafter="draft_model", gamma_max=6, adaptive=False)
    engine = SpeculativeEngine(target, draft, eos_token_ids=eos, pad_token_id=0, config=config)
    rounds: list[list[tuple[list[float], list[int]]]] = []  # each round's calls of the rule

    def rule(options, cap, gamma, sources):
        rounds.append([])

        def keep(chances: list[float], drafted: list[int]) -> list[bool]:
            rounds[-1].append((chances, drafted))
            calls = sum(map(len, rounds))
            return [c > 0 and (i + calls) % 3 != 0 for i, c in enumerate(chances)]

        return gamma, keep

    engine._draft_length = rule
    outputs = []
    for start in range(0, len(prompts), batch_size):
        outputs += engine.generate(prompts[start : start + batch_size], MAX_NEW)[0]
    assert [o.tokens for o in outputs] == refs
    for calls in rounds:
        for (chances, drafted), (later, more) in zip(calls, calls[1:]):
            # a chance is a product of confidences: it never grows, and a stopped row's is 0
            assert all(0.0 <= b <= a <= 1.0 for a, b in zip(chances, later))
            assert all(m - d in (0, 1) for d, m in zip(drafted, more))
    if batch_size > 1:
        assert any(len(set(drafted)) > 1 for calls in rounds for _, drafted in calls)
    assert len({len(o.tokens) for o in outputs}) > 1


def test_a_guess_at_the_drafts_chain_saves_passes_and_changes_no_draft(case):
    """A lone row's draft checks guessed tokens (a prompt-lookup copy) in one pass: right
    guesses skip passes, a wrong one costs none, the drafts are the plain steps' own, and the
    guessed tokens left in the cache are rolled back before the next proposal."""
    _, draft, _, prompts, _, _ = case
    greedy, generator = SamplingParams(), torch.Generator()

    def drafter():
        d = DraftModelDrafter(draft, 0)
        d.start([prompts[1]])
        d.propose([prompts[1]], 1, greedy, generator)  # the prefill: a cold cache takes no guess
        return d

    plain, guessed = drafter(), drafter()
    seq = prompts[1] + plain.propose([prompts[1]], 1, greedy, generator).tokens[0]
    guessed.propose([prompts[1]], 1, greedy, generator)
    chain = plain.propose([seq], 6, greedy, generator)
    assert chain.model_passes == 6
    right = guessed.propose([seq], 6, greedy, generator, guess=chain.tokens[0][:3])
    assert right.tokens == chain.tokens and right.model_passes == 3  # 4 drafts in the first pass
    wrong_token = (chain.tokens[0][1] + 1) % draft.config.vocab_size
    wrong = guessed.propose([seq], 6, greedy, generator, guess=[chain.tokens[0][0], wrong_token])
    assert wrong.tokens == chain.tokens and wrong.model_passes == 5
    # a row whose rule stops it inside a guessed run stops where plain steps would
    stop_after_two = lambda chances, drafted: [drafted[0] < 2]  # noqa: E731
    short = guessed.propose([seq], 6, greedy, generator, stop_after_two, guess=chain.tokens[0][:3])
    assert short.tokens == [chain.tokens[0][:2]] and short.model_passes == 1
    # the caches agree afterwards: the next proposals are the same
    later = seq + chain.tokens[0][:4]
    expected = plain.propose([later], 4, greedy, generator).tokens
    assert guessed.propose([later], 4, greedy, generator).tokens == expected


def test_a_lone_row_drafts_with_copies_as_guesses_and_stays_lossless(case):
    target, draft, _, prompts, eos, refs = case
    counts = {}
    for guess_tokens in (0, 3):
        config = EngineConfig(drafter="draft_model", gamma_max=6, adaptive=False, guess_tokens=guess_tokens)
        engine = SpeculativeEngine(target, draft, eos_token_ids=eos, pad_token_id=0, config=config)
        passes = drafted = 0
        for prompt, ref in zip(prompts, refs):
            outputs, batch = engine.generate([prompt], MAX_NEW)
            assert outputs[0].tokens == ref
            passes, drafted = passes + batch.draft_passes, drafted + batch.drafted
        counts[guess_tokens] = (passes, drafted)
    assert counts[0][0] == counts[0][1]  # one pass per draft
    assert counts[3][0] < counts[3][1]  # guesses that held saved passes


def test_plain_decoding_is_re_measured_while_speculating(case):
    costs = _costs(GPU_COSTS[0], {1: GPU_COSTS[1]})
    engine = _engine_with_costs(case, costs, alpha=0.9, probe_every=1)
    gammas = [engine._choose_gammas(_one_row())[1] for _ in range(10)]
    assert [g == 0 for g in gammas] == [False] * 4 + [True] + [False] * 4 + [True], gammas


def test_target_only_mode_equals_reference(case):
    target, draft, _, prompts, eos, refs = case
    engine = SpeculativeEngine(target, draft, eos_token_ids=eos, pad_token_id=0)
    outputs, batch = engine.generate(prompts, MAX_NEW, drafter="none")
    assert [o.tokens for o in outputs] == refs
    assert batch.drafted == 0 and batch.draft_passes == 0
    assert all(o.stats.tau == 1.0 for o in outputs)
    # gamma 0 through the config is the same thing
    engine0 = SpeculativeEngine(
        target, draft, eos_token_ids=eos, pad_token_id=0, config=EngineConfig(gamma_max=0)
    )
    assert [o.tokens for o in engine0.generate(prompts, MAX_NEW)[0]] == refs


def test_counters_are_consistent(case):
    target, draft, _, prompts, eos, _ = case
    engine = SpeculativeEngine(
        target, draft, eos_token_ids=eos, pad_token_id=0, config=EngineConfig(gamma_max=4, adaptive=False)
    )
    outputs, batch = engine.generate(prompts, MAX_NEW)
    for out in outputs:
        s = out.stats
        assert s.accepted <= s.drafted
        assert s.new_tokens == len(out.tokens) == s.accepted + s.target_tokens
        assert s.tau * s.target_passes == pytest.approx(s.new_tokens)
        assert 0.0 <= s.alpha <= 1.0 and 0.0 <= s.alpha_leviathan <= 1.0
        assert sum(s.drafted_by.values()) == s.drafted
    assert batch.new_tokens == sum(len(o.tokens) for o in outputs)
    assert batch.accepted <= batch.drafted
    assert batch.target_seconds > 0 and batch.draft_seconds > 0
    # the prefills are timed apart (the benchmark's whole-job prediction adds them back)
    assert 0 < batch.prefill_seconds < batch.target_seconds
    assert 0 < batch.draft_prefill_seconds < batch.draft_seconds
    assert {o.finish_reason for o in outputs} <= {"eos", "length"}


def test_stop_strings_cut_where_target_only_would(case):
    target, draft, tokenizer, prompts, _, _ = case
    engine = SpeculativeEngine(
        target,
        draft,
        eos_token_ids=[1],
        pad_token_id=0,
        decode_text=tokenizer.decode,
        config=EngineConfig(gamma_max=5, adaptive=False),
    )
    baseline, _ = engine.generate(prompts, MAX_NEW, drafter="none")
    text = tokenizer.decode(baseline[1].tokens)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    spec, _ = engine.generate(prompts, MAX_NEW, stop_strings=[stop])
    plain, _ = engine.generate(prompts, MAX_NEW, stop_strings=[stop], drafter="none")
    assert [o.tokens for o in spec] == [o.tokens for o in plain]
    assert spec[1].finish_reason == "stop" and stop in tokenizer.decode(spec[1].tokens)
    assert len(spec[1].tokens) < len(baseline[1].tokens)


def test_empty_prompt_is_rejected(tiny_models):
    target, draft, _ = tiny_models
    engine = SpeculativeEngine(target, draft, eos_token_ids=[1], pad_token_id=0)
    with pytest.raises(PromptError, match="prompt 1 is empty"):
        engine.generate([[5, 6], []], 4)


def test_overlong_prompt_refused_or_truncated(case):
    target, draft, _, prompts, eos, _ = case
    context = target.config.max_position_embeddings
    long_prompt = (prompts[1] * 100)[: context - 4]
    engine = SpeculativeEngine(target, draft, eos_token_ids=eos, pad_token_id=0)
    with pytest.raises(PromptError, match="exceeds the model context"):
        engine.generate([long_prompt], 8)
    outputs, _ = engine.generate([long_prompt], 8, overlong="truncate")
    assert outputs[0].truncated_tokens == 4 and outputs[0].prompt_tokens == context - 8
    assert outputs[0].tokens == reference(target, long_prompt[4:], 8, eos)


def test_at_batch_8_a_row_verifies_copied_tokens_only_where_they_pay_for_themselves(case):
    """In a packed pass each row pays for its own verify tokens (3-7% of a pass each at batch
    8 on this CPU): a strong 4-gram match is worth verifying, a weak 1-gram match is not."""
    costs = _costs({8: 0.186, 12: 0.236, 16: 0.243, 24: 0.280, 40: 0.40}, {})
    engine = _engine_with_costs(case, costs, alpha=0.5)
    assert engine.target.pack  # a CPU
    engine.alpha["prompt_lookup:4"] = AcceptanceByPosition(prior=0.95, weight=1e6)
    engine.alpha["prompt_lookup:1"] = AcceptanceByPosition(prior=0.15, weight=1e6)
    keys = ["prompt_lookup:4", "prompt_lookup:1"] + ["prompt_lookup:1"] * 6
    options = RoundOptions([6, 6] + [0] * 6, keys, False, 8, remaining=8 * 100, catch_up=0.0)
    cap, gamma, sources = engine._choose_gammas(options)
    assert gamma == 0 and cap >= 4
    assert sources == ["lookup"] + [None] * 7


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


def test_a_lone_row_verifies_a_whole_copy_where_copies_run(case):
    """License summaries at batch 1: a copy's first token accepted 29% of the time, each next
    one nearly always. One rate per drafted token keeps copies at up to 3 tokens; priced by
    position, the whole copy is worth its wider pass."""
    costs = _costs({1: 0.150, 2: 0.152, 3: 0.155, 4: 0.156, 6: 0.168, 9: 0.181}, {1: 0.024})
    engine = _engine_with_costs(case, costs, alpha=0.6)
    options = RoundOptions([8], ["prompt_lookup:2"], False, 8, remaining=100, catch_up=0.0)
    engine.alpha["prompt_lookup:2"] = AcceptanceByPosition(prior=0.24, weight=1e6)  # i.i.d. 0.24
    assert engine._choose_gammas(options)[0] <= 3  # short: the 4th token would add 0.3%
    runs = AcceptanceByPosition(prior=0.24, weight=1.0)
    for _ in range(20):
        runs.observe([(0, 8)] * 7 + [(8, 8)] * 3)
    engine.alpha["prompt_lookup:2"] = runs
    assert engine._choose_gammas(options) == (8, 0, ["lookup"])


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


def test_a_draining_batch_speculates_only_where_it_brings_the_end_closer(case):
    """The batch-8 benchmark with 8 documents in 8 places: every row ran to the 64-token limit
    and the batch made 63-64 passes whatever the drafter, so verifying copied tokens only made
    passes wider (0.94-0.96x target-only). Priced by how far a round brings in the row with
    most tokens left, even rows decode plainly; a row left behind alone still speculates."""
    costs = _costs({8: 0.186, 12: 0.236, 16: 0.243, 24: 0.280, 40: 0.40}, {})
    engine = _engine_with_costs(case, costs, alpha=0.5)
    engine.alpha["prompt_lookup:4"] = AcceptanceByPosition(prior=0.8, weight=1e6)
    engine.runs_to_limit = RunningRate(prior=0.99, weight=1e6)  # rows have run to the limit
    keys = ["prompt_lookup:4"] * 8
    waiting = RoundOptions([4] * 8, keys, False, 8, remaining=8 * 40, catch_up=0.0)
    assert engine._choose_gammas(waiting)[2] == ["lookup"] * 8  # prompts wait: every token counts
    draining = RoundOptions([4] * 8, keys, False, 8, 8 * 40, 0.0, drain_budgets=[40] * 8)
    assert engine._choose_gammas(draining) == (0, 0, [None] * 8)
    behind = RoundOptions([4] * 8, keys, False, 8, 7 * 16 + 40, 0.0, drain_budgets=[16] * 7 + [40])
    cap, _, sources = engine._choose_gammas(behind)
    assert cap == 4 and sources == [None] * 7 + ["lookup"]
    # rows that end at EOS make the row with most tokens left a guess: throughput decides again
    engine.runs_to_limit = RunningRate(prior=0.01, weight=1e6)
    assert engine._choose_gammas(draining)[2] == ["lookup"] * 8


def test_the_engine_learns_whether_rows_run_to_the_limit(case):
    target, draft, _, prompts, eos, _ = case
    engine = SpeculativeEngine(target, draft, eos_token_ids=eos, pad_token_id=0)
    outputs, _ = engine.generate(prompts, 2)
    assert all(o.finish_reason == "length" for o in outputs)
    long_rows = engine.runs_to_limit.value
    assert long_rows > 0.7
    outputs, _ = engine.generate(prompts, MAX_NEW, batch_size=3)
    assert any(o.finish_reason == "eos" for o in outputs)
    assert engine.runs_to_limit.value < long_rows


def test_logits_that_are_more_than_the_output_layer_come_from_the_models_own_forward(tiny_models):
    """Only the wanted positions go through the output layer, where that is all a model's
    logits are (Llama); Granite divides them by `logits_scaling`, so its own forward runs."""
    from transformers import GraniteConfig, GraniteForCausalLM

    target, _, _ = tiny_models
    torch.manual_seed(0)
    config = GraniteConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        logits_scaling=8.0,
    )
    granite = GraniteForCausalLM(config).eval()
    seqs = [list(range(3, 40)), list(range(50, 70))]
    for model, plain in ((target, True), (granite, False)):
        lm = BatchedLM(model, pad_token_id=0)
        lm.reset(2)
        lm.forward([seqs[0][:30], seqs[1][:19]], [1, 1])
        got = lm.forward([seqs[0][30:], seqs[1][19:]], [7, 1])  # a ragged 2 × 7 pass
        assert model._plain_head is plain
        with torch.no_grad():
            for row, seq in enumerate(seqs):
                want = model(input_ids=torch.tensor([seq])).logits[0, -len(got[row]) :].float()
                torch.testing.assert_close(got[row], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("drafter", ["none", "draft_model", "prompt_lookup", "auto"])
@pytest.mark.parametrize("gamma_max, adaptive", [(3, False), (8, True)])
def test_continuous_batching_admits_waiting_rows_as_others_finish(case, drafter, gamma_max, adaptive):
    """Eight prompts through three places: rows stop at different times (EOS), and each
    place a finished row frees is taken by a waiting prompt, prefilled beside running rows.
    Every output stays the target's own, in input order."""
    target, draft, _, prompts, eos, refs = case
    config = EngineConfig(drafter=drafter, gamma_max=gamma_max, adaptive=adaptive)
    engine = SpeculativeEngine(target, draft, eos_token_ids=eos, pad_token_id=0, config=config)
    rows_per_pass: list[int] = []
    hook = target.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: rows_per_pass.append(args[0].shape[0])
    )
    running: list[int] = []  # rows decoding when each admission's prefill ran
    admit = engine.target.admit

    def admit_and_count(blocks, logits_per_row):
        running.append(len(engine.target.tokens))
        return admit(blocks, logits_per_row)

    engine.target.admit = admit_and_count
    try:
        outputs, batch = engine.generate(prompts, MAX_NEW, batch_size=3)
    finally:
        hook.remove()
    assert running[0] == 0 and max(running) == 2  # joined a running batch, not an empty one
    assert [o.tokens for o in outputs] == refs
    assert batch.rows == len(prompts) and batch.new_tokens == sum(map(len, refs))
    # prefills one row at a time (a CPU) and decode passes over at most three rows
    assert max(rows_per_pass) <= 3
    decode_rows = [n for n in rows_per_pass[3:] if n > 1]
    assert 3 in decode_rows  # places were refilled: three rows ran again after the first finished
    assert batch.prefill_tokens == sum(map(len, prompts))
    if drafter != "none" and not adaptive:  # adaptive: tiny models' costs may say "don't"
        assert batch.drafted > 0


def test_rows_admitted_into_a_running_batch_keep_no_autograd_graph(tiny_models):
    """Admission prefills beside running rows; without no_grad there, every admitted row's
    activations stayed alive through its cache (a batch-8 benchmark grew to 17 GB)."""
    target, _, _ = tiny_models
    lm = BatchedLM(target, pad_token_id=0)
    lm.reset(1)
    lm.forward([list(range(3, 30))], [1])
    logits = lm.admit([list(range(5, 20)), list(range(7, 12))], [1, 1])
    assert len(lm.tokens) == 3 and not any(t.requires_grad for t in logits)
    assert not any(layer.keys.requires_grad or layer.values.requires_grad for layer in lm.cache.layers)
