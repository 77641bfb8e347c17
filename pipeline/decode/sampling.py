"""Token choice and the speculative acceptance rule.

The same transforms (temperature, top-k, top-p) are applied to draft and target logits, so the
accept/resample rule below reproduces sampling from the *transformed* target distribution,
which is what a user asking for temperature/top-p from the target alone would get.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. `greedy=True` ignores every other field."""

    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits [..., V] into the sampling distribution after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing it stays)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def choose(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[int, torch.Tensor | None]:
    """Pick one token from logits [V]; also return its distribution (None when greedy).

    Draws happen on the CPU with the batch's CPU generator, so a seed draws alike on any device."""
    if params.greedy:
        return int(torch.argmax(logits)), None
    probs = probabilities(logits, params)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator)), probs


def confidence(logits: torch.Tensor, probs: torch.Tensor | None) -> float:
    """The drafter's belief in its choice: the largest probability of its distribution (`probs`
    when sampling, else the softmax of `logits`). A draft model's confidence tracks how often
    the target agrees (measured in docs/engine.md, "Draft length")."""
    if probs is None:
        probs = torch.softmax(logits.float(), dim=-1)
    return float(probs.max())


class RowLogits(list):
    """Rows' logits ([positions, V] each) split from one pass's logits `whole` [all positions,
    V], as a runner returns them: a batch's choices then come from one op over `whole`, neither
    joining the rows again (a copy of every logit, dearer than the argmax itself on a CPU) nor
    one op a row (a launch each on a GPU)."""

    def __init__(self, whole: torch.Tensor, counts: list[int]):
        super().__init__(whole.split(counts))
        self.whole = whole
        self.counts = counts  # each row's positions, read without asking its tensor (~1.5 us each)


def greedy_choices(logits: list[torch.Tensor], confident: bool) -> tuple[list[list[int]], list[list[float]]]:
    """Per row of `logits` ([positions, V] each): the argmax at each position, and with
    `confident` the `confidence` there (else empty lists), all rows read back at once.

    A GPU answers each read only after everything queued before it: one read a position would
    cost a round trip per row and draft step (128 of them a step at batch 64)."""
    if isinstance(logits, RowLogits):
        rows, counts = [logits.whole], logits.counts
    else:  # per row, then the small results joined: joining the logits would copy them all
        rows = list(logits)
        counts = [len(row) for row in rows]
    tokens = torch.cat([torch.argmax(row, dim=-1) for row in rows]).tolist()
    sure = (
        torch.cat([torch.softmax(row.float(), dim=-1).amax(dim=-1) for row in rows]).tolist()
        if confident
        else []
    )
    out_tokens, out_sure, start = [], [], 0
    for count in counts:
        end = start + count
        out_tokens.append(tokens[start:end])
        out_sure.append(sure[start:end])
        start = end
    return out_tokens, out_sure


def verify(
    target_logits: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator,
    argmax: list[int] | None = None,
) -> tuple[int, int]:
    """Check one row's drafts against the target; return (accepted count, next token).

    `target_logits` is [len(draft_tokens) + 1, V]: row j predicts the token after draft j-1.
    Greedy keeps drafts while they equal the target's argmax. Sampling accepts draft x with
    probability min(1, p(x)/q(x)) and on rejection samples from norm(max(p - q, 0)); when all
    drafts pass, the last row gives a bonus token. `draft_probs` None means the drafter was
    deterministic (prompt lookup): q is then a point mass on the drafted token. `argmax`: the
    logits' argmax per row where the caller took it for a whole batch at once (one read from
    a GPU per round rather than one per row).
    """
    if params.greedy:
        predicted = argmax if argmax is not None else torch.argmax(target_logits, dim=-1).tolist()
        n = 0
        while n < len(draft_tokens) and draft_tokens[n] == predicted[n]:
            n += 1
        return n, predicted[n]

    p = probabilities(target_logits, params).cpu()  # CPU draws: see `choose`
    draft_probs = None if draft_probs is None else draft_probs.cpu()
    uniforms = torch.rand(len(draft_tokens), generator=generator).tolist()
    for j, token in enumerate(draft_tokens):
        q_token = 1.0 if draft_probs is None else float(draft_probs[j, token])
        if uniforms[j] * q_token < float(p[j, token]):
            continue
        if draft_probs is None:
            residual = p[j].clone()
            residual[token] = 0.0
        else:
            residual = (p[j] - draft_probs[j]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: any draw from p is exact
            residual = p[j]
        return j, int(torch.multinomial(residual, 1, generator=generator))
    return len(draft_tokens), int(torch.multinomial(p[-1], 1, generator=generator))
