"""Speculative sampling must follow the target's distribution, not the draft's.

On a vocabulary of 8 tokens the exact distribution of the 2nd and 3rd generated tokens can be
enumerated from the target; thousands of speculative samples (one batch of identical rows)
are compared with it by a chi-square test. The same test run on a naive sampler that accepts
every draft must fail, which shows the test can tell the difference.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from decode_case import DEVICE
from transformers import LlamaConfig, LlamaForCausalLM

import pipeline.decode.engine as engine_module
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.sampling import SamplingParams, probabilities
from pipeline.decode.settings import EngineConfig

VOCAB = 8
PROMPT = [3, 5, 2, 7, 3, 5]
SAMPLES = 3000
CHI2_CRITICAL = {7: 24.32, 63: 103.4}  # p = 0.001


def tiny_lm(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.5,
    )
    return LlamaForCausalLM(config).eval().to(DEVICE)


@pytest.fixture(scope="module")
def pair():
    return tiny_lm(1), tiny_lm(2)


def exact_joint(target, params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3 | PROMPT) under the transformed target distribution, shape [V, V, V]."""
    seqs = torch.tensor(
        [PROMPT + [a, b] for a, b in itertools.product(range(VOCAB), repeat=2)], device=target.device
    )
    with torch.no_grad():
        logits = target(seqs).logits
    probs = probabilities(logits, params)
    p1 = probs[0, -3]  # after PROMPT
    p2 = probs.view(VOCAB, VOCAB, -1, VOCAB)[:, 0, -2]  # after PROMPT + a
    p3 = probs.view(VOCAB, VOCAB, -1, VOCAB)[:, :, -1]  # after PROMPT + a + b
    return (p1[:, None, None] * p2[:, :, None] * p3).cpu()


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    expected = expected_probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def sample_tokens(
    target, draft, drafter: str, params: SamplingParams, draft_vocab: int, stop_early: bool = False
) -> torch.Tensor:
    engine = SpeculativeEngine(
        target,
        draft,
        eos_token_ids=[],
        pad_token_id=0,
        config=EngineConfig(drafter=drafter, gamma_max=2, adaptive=False, draft_vocab=draft_vocab),
    )
    if stop_early:  # rows whose first draft the draft model doubts draft no second one
        engine.policy.draft_length = lambda options, cap, gamma, sources: (gamma, _confident_rows)
    prefill_together(engine)
    outputs, batch = engine.generate([PROMPT] * SAMPLES, 3, params)
    assert 0 < batch.accepted < batch.drafted
    return torch.tensor([o.tokens for o in outputs])


def prefill_together(engine: SpeculativeEngine) -> None:
    """One prefill pass for all the identical rows. On a CPU the engine prefills row by row,
    which here is thousands of model calls, most of the test's time, and nothing to do with
    sampling."""
    for lm in (engine.target, engine.draft.lm if engine.draft else None):
        if lm is not None:
            lm.per_row_prefill = False


def _confident_rows(chances: list[float], drafted: list[int]) -> list[bool]:
    going = [c >= 0.5 for c in chances]
    assert 0 < sum(going) < len(going)  # the sample splits: some rows go on, some stop
    return going


def statistics(tokens: torch.Tensor, joint: torch.Tensor) -> tuple[float, float]:
    """Chi-square of the 2nd token's marginal (7 dof) and of the (2nd, 3rd) pair (63 dof)."""
    second = torch.bincount(tokens[:, 1], minlength=VOCAB).float()
    pairs = torch.bincount(tokens[:, 1] * VOCAB + tokens[:, 2], minlength=VOCAB * VOCAB).float()
    return chi_square(second, joint.sum((0, 2))), chi_square(pairs, joint.sum(0).flatten())


@pytest.mark.parametrize(
    "drafter,params,draft_vocab,stop_early",
    [
        ("draft_model", SamplingParams(greedy=False, seed=11), 0, False),
        ("draft_model", SamplingParams(greedy=False, temperature=0.7, top_k=5, top_p=0.9, seed=12), 0, False),
        ("prompt_lookup", SamplingParams(greedy=False, seed=13), 0, False),
        # a draft restricted to ids 0, 1 and the prompt's: it never proposes 4 or 6, the target may
        ("draft_model", SamplingParams(greedy=False, seed=14), 2, False),
        # drafts whose length depends on the draft's confidence (the adaptive rule's kind)
        ("draft_model", SamplingParams(greedy=False, seed=15), 0, True),
    ],
)
def test_speculative_sampling_follows_the_target(pair, drafter, params, draft_vocab, stop_early):
    target, draft = pair
    joint = exact_joint(target, params)
    tokens = sample_tokens(target, draft, drafter, params, draft_vocab, stop_early)
    second, pairs = statistics(tokens, joint)
    assert second < CHI2_CRITICAL[7], second
    assert pairs < CHI2_CRITICAL[63], pairs


def test_naive_always_accept_sampler_is_caught(pair, monkeypatch):
    """Accepting every draft samples the draft's distribution: the same test must reject it."""
    target, draft = pair
    params = SamplingParams(greedy=False, seed=21)

    def always_accept(target_logits, draft_tokens, draft_probs, params, generator, argmax=None):
        bonus = torch.multinomial(probabilities(target_logits[-1], params).cpu(), 1, generator=generator)
        return len(draft_tokens), int(bonus)

    monkeypatch.setattr(engine_module, "verify", always_accept)
    engine = SpeculativeEngine(
        target,
        draft,
        eos_token_ids=[],
        pad_token_id=0,
        config=EngineConfig(drafter="draft_model", gamma_max=2, adaptive=False),
    )
    prefill_together(engine)
    outputs, _ = engine.generate([PROMPT] * SAMPLES, 3, params)
    tokens = torch.tensor([o.tokens for o in outputs])
    second, pairs = statistics(tokens, exact_joint(target, params))
    assert second > CHI2_CRITICAL[7] or pairs > CHI2_CRITICAL[63]
