"""The engine: greedy speculative decoding reproduces the target's own greedy decoding exactly."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from decode_case import (
    CPU_COSTS,
    DEVICE,
    GPU_COSTS,
    GPU_PREFILL_PER_TOKEN,
    MAX_NEW,
    PREFILL_PER_TOKEN,
    TEXTS,
    reference,
)

from pipeline.decode.drafters import Proposal
from pipeline.decode.engine import PromptError, SpeculativeEngine
from pipeline.decode.sampling import SamplingParams
from pipeline.decode.settings import PROMPT_LOOKUP, EngineConfig
from pipeline.models.draft_int8 import quantize_draft


@pytest.mark.parametrize("drafter", ["draft_model", "prompt_lookup", "suffix", "auto"])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_matches_target_for_every_gamma(case, drafter, batch_size):
    target, draft, tokenizer, prompts, eos, refs = case
    totals = {"accepted": 0, "drafted": 0}
    for gamma in range(1, 9):
        engine = SpeculativeEngine(
            target,
            draft,
            eos_token_ids=eos,
            pad_token_id=0,
            config=EngineConfig(drafter=drafter, gamma_max=gamma, adaptive=False),
            # as jobs run it: the suffix drafter also matches each prompt reflowed
            decode_text=tokenizer.decode,
            encode_text=functools.partial(tokenizer.encode, add_special_tokens=False),
        )
        assert engine.reflow is not None
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
    # the first prompt shows no template yet; every later one reuses it (on a GPU, where the
    # first batch is prefilled in one pass, every row after the first batch)
    first = 1 if engine.target.per_row_prefill else batch_size
    assert fed[0] >= len(prompts[0])
    assert sum(fed) <= sum(map(len, prompts)) - shared * (len(prompts) - first)


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


@pytest.mark.skipif(DEVICE != "cpu", reason="int8 draft steps are a CPU path")
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


@pytest.mark.parametrize(
    "costs, prefill, probes",
    [(CPU_COSTS, PREFILL_PER_TOKEN, False), (GPU_COSTS, GPU_PREFILL_PER_TOKEN, True)],
)
def test_no_acceptance_probes_where_no_draft_could_pay(case, costs, prefill, probes):
    """Going target-only, the engine re-tries the draft now and then to re-measure α, unless
    the measured costs say that no acceptance would make the draft pay."""
    target, draft, _, prompts, eos, refs = case
    engine = SpeculativeEngine(
        target, draft, eos_token_ids=eos, pad_token_id=0, config=EngineConfig(probe_every=1)
    )
    widths, draft_seconds = costs
    # every pass size the batch can produce, each as dear as its tokens say (CPU) or not (GPU)
    # twice each: a size's second measurement confirms it, and with smoothing 0 no later pass
    # moves it (a size seen once is replaced by a faster pass: the tiny model's real one)
    w1, w2 = widths[1], widths[2]
    seeded = {t: w1 + (w2 - w1) * (t - 1) if probes else w1 * t for t in range(1, len(prompts) * 9 + 1)}
    for tokens, seconds in [*seeded.items()] * 2:
        engine.costs.observe_target(tokens, seconds)
        engine.costs.observe_draft(tokens, draft_seconds)
    # and prefill rates to match: a probe must afford the cold draft's prefill, which a slow
    # or busy machine's timing of the tiny model (mixed with these costs) can make look dear
    engine.costs.prefill.update(prefill)
    # keep these costs: the tiny model's own passes take milliseconds, and mixing them in would
    # make (say) 3 rows × 2 tokens look as cheap as the measured 6 rows × 1 token
    engine.costs.target.smoothing = engine.costs.draft.smoothing = engine.costs.smoothing = 0.0
    engine.policy.model_rates.tried = [1e6] * 8  # a draft that is never accepted: target-only
    engine.policy.model_rates.accepted = [0.0] * 8
    outputs, batch = engine.generate(prompts, MAX_NEW, drafter="draft_model")
    assert [o.tokens for o in outputs] == refs
    assert engine.costs.target.points == seeded, "the test's costs held, whatever this machine's"
    assert (batch.draft_passes > 0) is probes


@pytest.mark.parametrize("probe_every, probes", [(10_000, False), (2, True)])
def test_prompt_lookup_is_probed_where_an_unmeasured_cost_looks_too_dear(case, probe_every, probes):
    """The batch-4 benchmark defect: alone, prompt lookup never drafted at batch 4, because a
    2-token verify pass there was priced from other shapes, never measured, and too dear."""
    target, draft, _, prompts, eos, refs = case
    config = EngineConfig(probe_every=probe_every)
    engine = SpeculativeEngine(target, draft, eos_token_ids=eos, pad_token_id=0, config=config)
    # the policy's probe is the subject: the gate's probes come every `probe_every` rounds, not
    # priced (where drafting loses, as it may on this tiny model, they would wait longer)
    engine.gate.probe_share = 1.0
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

    engine.policy.draft_length = rule
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
            # fixed gamma: every round after the prefill asks (the gate is not consulted)
            assert batch.asked_rounds == batch.target_passes - 1 and batch.asking_seconds > 0
        counts[guess_tokens] = (passes, drafted)
    assert counts[0][0] == counts[0][1]  # one pass per draft
    assert counts[3][0] < counts[3][1]  # guesses that held saved passes


def test_target_only_mode_equals_reference(case):
    target, draft, _, prompts, eos, refs = case
    engine = SpeculativeEngine(target, draft, eos_token_ids=eos, pad_token_id=0)
    outputs, batch = engine.generate(prompts, MAX_NEW, drafter="none")
    assert [o.tokens for o in outputs] == refs
    assert batch.drafted == 0 and batch.draft_passes == 0
    assert batch.asking_seconds == 0.0 and batch.asked_rounds == 0  # nobody to ask, not even the policy
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
        if s.drafted:
            assert 0.0 <= s.alpha <= 1.0 and 0.0 <= s.alpha_leviathan <= 1.0
        else:  # nothing drafted: nothing accepted or rejected either
            assert s.alpha is None and s.alpha_leviathan is None
        assert sum(s.drafted_by.values()) == s.drafted and sum(s.accepted_by.values()) == s.accepted
    assert batch.new_tokens == sum(len(o.tokens) for o in outputs)
    assert batch.row_passes == sum(o.stats.target_passes for o in outputs)
    assert batch.tau * batch.row_passes == pytest.approx(batch.new_tokens)
    assert batch.rounds.drafted + batch.rounds.undrafted == batch.row_passes - len(outputs)  # not prefills
    assert batch.predicted_speedup > 0
    assert batch.accepted <= batch.drafted
    assert (
        sum(batch.drafted_by.values()) == batch.drafted and sum(batch.accepted_by.values()) == batch.accepted
    )
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


def test_the_engine_learns_whether_rows_run_to_the_limit(case):
    target, draft, _, prompts, eos, _ = case
    engine = SpeculativeEngine(target, draft, eos_token_ids=eos, pad_token_id=0)
    outputs, _ = engine.generate(prompts, 2)
    assert all(o.finish_reason == "length" for o in outputs)
    long_rows = engine.policy.runs_to_limit.value
    assert long_rows > 0.7
    outputs, _ = engine.generate(prompts, MAX_NEW, batch_size=3)
    assert any(o.finish_reason == "eos" for o in outputs)
    assert engine.policy.runs_to_limit.value < long_rows


@pytest.mark.parametrize("drafter", ["none", "draft_model", "prompt_lookup", "suffix", "auto"])
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


@pytest.mark.parametrize("batch_size", [1, 3])
def test_earlier_outputs_feed_the_suffix_drafter_of_later_rows(case, batch_size):
    """The engine keeps its outputs for the suffix drafter across calls (an actor's shards):
    decoding a document again drafts its whole output from them, and stays the target's own.
    `corpus=False` keeps a call to the rows' own text and its outputs out of the corpus."""
    target, draft, _, prompts, eos, refs = case
    config = EngineConfig(drafter="suffix", gamma_max=8, adaptive=False)
    engine = SpeculativeEngine(target, draft, eos_token_ids=eos, pad_token_id=0, config=config)
    first, before = engine.generate(prompts, MAX_NEW, batch_size=batch_size)
    held = engine.suffix.corpus.tokens
    assert held == sum(map(len, refs))  # every output went into the corpus
    alone, own_text = engine.generate(prompts, MAX_NEW, batch_size=batch_size, corpus=False)
    assert engine.suffix.corpus.tokens == held  # nothing more learnt
    again, after = engine.generate(prompts, MAX_NEW, batch_size=batch_size)
    for outputs in (first, alone, again):
        assert [o.tokens for o in outputs] == refs
    assert after.accepted > max(before.accepted, own_text.accepted)
    assert after.target_passes < min(before.target_passes, own_text.target_passes)
    assert after.drafted_by == {"suffix": after.drafted}
    engine.forget_outputs()
    assert engine.suffix.corpus.tokens == 0


def test_auto_drafts_only_from_its_sources(case):
    """`auto_sources` leaves drafters out of auto (how the bench measures what suffix adds):
    with the same outputs in the corpus, auto without suffix never drafts from it."""
    target, draft, _, prompts, eos, refs = case
    drafted = {}
    for sources in (
        ("draft_model", "prompt_lookup", "suffix"),
        ("prompt_lookup", "suffix"),
        ("draft_model",),
    ):
        config = EngineConfig(gamma_max=4, adaptive=False, auto_sources=sources)
        engine = SpeculativeEngine(target, draft, eos_token_ids=eos, pad_token_id=0, config=config)
        engine.remember_outputs(refs)
        outputs, batch = engine.generate(prompts, MAX_NEW, batch_size=3)
        assert [o.tokens for o in outputs] == refs
        assert set(batch.drafted_by) <= set(sources) and batch.drafted > 0
        if "draft_model" not in sources:
            assert batch.draft_passes == 0
        drafted[sources] = batch.drafted_by
    assert drafted[("prompt_lookup", "suffix")].get("suffix", 0) > 0
    with pytest.raises(ValueError, match="auto_sources"):
        EngineConfig(auto_sources=("suffix", "beam"))


class ScriptedDrafter:
    """Drafts each row's true continuation (the target's own output), right for a scripted
    number of tokens and then wrong; every fifth proposal is nothing. What the target will
    accept is known before it verifies, and recorded as (drafted, accepted, produced)."""

    name = PROMPT_LOOKUP

    def __init__(self, outputs: list[list[int]]):
        self.outputs = outputs  # each row's prompt + its reference output
        self.calls = 0
        self.rounds: list[tuple[int, int, int]] = []

    def start(self, prompts):
        pass

    admit = start

    def evict(self, keep, finished):
        pass

    def propose(self, seqs, gamma, params, generator, keep=None, guess=None):
        tokens = []
        for row, seq in enumerate(seqs):
            ahead = next(o for o in self.outputs if o[: len(seq)] == seq)[len(seq) :]
            right = (self.calls + row) % 5
            draft = ahead[:right] + [(ahead[right] + 1) % 100] if right < len(ahead) else ahead
            draft = draft[:gamma] if right < 4 else []
            accepted = min(right, len(draft))
            if draft:
                self.rounds.append((len(draft), accepted, min(accepted + 1, len(ahead))))
            tokens.append(draft)
        self.calls += 1
        return Proposal(tokens, [None] * len(seqs), depths=[1] * len(seqs))


def test_acceptance_by_position_counts_what_a_scripted_drafter_got_accepted(case):
    target, draft, _, prompts, eos, refs = case
    config = EngineConfig(drafter="prompt_lookup", gamma_max=4, adaptive=False)
    engine = SpeculativeEngine(target, draft, eos_token_ids=eos, pad_token_id=0, config=config)
    engine.lookup = ScriptedDrafter([p + r for p, r in zip(prompts, refs)])
    outputs, batch = engine.generate(prompts, MAX_NEW, batch_size=3)
    assert [o.tokens for o in outputs] == refs
    script = engine.lookup.rounds
    counts = batch.rounds.by_drafter[PROMPT_LOOKUP]
    assert counts.rounds == len(script) and set(batch.rounds.by_drafter) == {PROMPT_LOOKUP}
    for k in range(1, 5):
        reached = [a >= k for d, a, _ in script if d >= k]
        assert counts.by_position()[k - 1] == pytest.approx(sum(reached) / len(reached)), k
    assert counts.accepted_lengths() == {n: c for n in range(5) if (c := [a for _, a, _ in script].count(n))}
    assert batch.rounds.tau_drafted == pytest.approx(sum(p for *_, p in script) / len(script))
    undrafted = batch.row_passes - len(prompts) - len(script)  # every round but the prefills'
    assert undrafted > 0 and batch.rounds.undrafted == undrafted
    assert batch.rounds.undrafted_share == pytest.approx(undrafted / (undrafted + len(script)))
