"""Measured costs and acceptance: what the policy (`policy.py`) prices its choices with.

Whether speculation pays depends on the hardware and dtype: on a GPU a verify pass over 9
tokens costs about what a 1-token pass costs; on a CPU in float32 it can cost several times
more, and a draft model that is cheap in bf16 may not be in float32. So nothing here is
assumed for long: the engine times every target and draft pass, the policy keeps the acceptance
rate of each drafter, and picks gamma per round from those numbers. Priors only cover the first
rounds.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field


def iid_survival(alpha: float, drafts: int) -> list[float]:
    """P(a row verifying `drafts` drafts gains at least k tokens), k = 1..drafts+1, when each
    draft is accepted with chance alpha given the ones before it were: alpha^(k-1). Their sum
    is the expected tokens of the pass, (1 - alpha^(drafts+1)) / (1 - alpha): the accepted
    prefix plus the target's own token."""
    return [alpha**k for k in range(drafts + 1)]


def expected_drain_advance(rows: list[tuple[int, list[float]]]) -> float:
    """Tokens one round is expected to take off the most any row has left: in a batch that only
    drains (no prompts wait for places) that row sets how many rounds remain.

    Each row is (lead, survival): how many tokens fewer it has left than the row furthest
    behind, and P(it gains at least k tokens) for k = 1..drafts+1 (`iid_survival`,
    `AcceptanceByPosition.survival`). The most left falls by k only if every row gets within k
    of its own limit: P = prod over rows of P(tokens >= k - lead). With every row even, one row
    that drafts nothing keeps the advance at 1: speculation must serve them all, or it only
    widens the pass.

    The rule as written; `Policy.best` works it out for all its candidates at once, in arrays
    (`_Candidates._drain_advance`), checked against this one (tests/test_policy.py).
    """
    total, k = 0.0, 1
    while True:
        p = 1.0
        for lead, survival in rows:
            need = k - lead
            if need <= 1:
                continue
            if need > len(survival):
                return total
            p *= survival[need - 1]
        total += p
        k += 1


def alpha_from_tau(tau: float, gamma: float) -> float:
    """Leviathan's alpha from the measured tokens per pass: the alpha whose expected tokens per
    pass with gamma drafts, (1 - alpha^(gamma+1)) / (1 - alpha), equal tau."""
    if gamma <= 0 or tau <= 1.0:
        return 0.0
    if tau >= gamma + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        # increasing in alpha; a fractional gamma (a mean) interpolates the closed form
        value = (1.0 - mid ** (gamma + 1)) / (1.0 - mid) if mid < 1 else gamma + 1
        lo, hi = (mid, hi) if value < tau else (lo, mid)
    return (lo + hi) / 2


def predicted_speedup(tau: float, draft_steps_per_pass: float, cost_ratio: float) -> float:
    """Leviathan et al.'s speedup from measured quantities: tokens per target pass over its cost.

    A round costs one target pass plus `draft_steps_per_pass` draft steps of `cost_ratio` (a
    draft step over a 1-token target pass) each. The formula assumes a verify pass costs what a
    1-token pass does; where wider passes cost more (a CPU), measured falls short of this.
    """
    return tau / (draft_steps_per_pass * cost_ratio + 1.0)


@dataclass
class RunningRate:
    """Acceptance rate with exponential forgetting, starting from a prior worth `weight` drafts
    (`cap`: the most it says; above 1 for a ratio of accepted to promised drafts)."""

    prior: float
    weight: float = 8.0
    decay: float = 0.97
    accepted: float = 0.0
    drafted: float = 0.0
    cap: float = 0.99

    def update(self, accepted: float, drafted: float) -> None:
        if drafted:
            self.accepted = self.decay * self.accepted + accepted
            self.drafted = self.decay * self.drafted + drafted

    def observe(self, outcomes: list[tuple[int, int]]) -> None:
        """One round's rows: (accepted, drafted) each."""
        self.update(sum(a for a, _ in outcomes), sum(d for _, d in outcomes))

    @property
    def value(self) -> float:
        if not self.drafted + self.weight:  # no prior's weight and nothing seen: the prior
            return min(self.prior, self.cap)
        rate = (self.accepted + self.prior * self.weight) / (self.drafted + self.weight)
        return min(rate, self.cap)


@dataclass
class AcceptanceByPosition:
    """How often a row's j-th draft is accepted when the drafts before it were, per position j,
    with exponential forgetting; a position not seen yet takes the rate of the one before it.

    Copied drafts are accepted in runs, not token by token: a copy's first token is often
    rejected, and once it has begun to match the next ones are nearly always accepted. One
    rate for every drafted token prices a long copy far below what it yields, and keeps copies
    short (measured in docs/engine.md, "The cost model").
    """

    prior: float
    weight: float = 8.0
    decay: float = 0.97
    tried: list[float] = field(default_factory=list)  # by position: drafts the target tested
    accepted: list[float] = field(default_factory=list)
    # `survival`'s answers while `tried` and `accepted` are the lists they were computed from
    _survivals: tuple | None = field(default=None, repr=False, compare=False)

    def observe(self, outcomes: list[tuple[int, int]]) -> None:
        """One round's rows: (accepted, drafted) each. A row tested its accepted drafts and the
        first one after them; the drafts beyond that first miss say nothing."""
        outcomes = [(a, d) for a, d in outcomes if d]
        if not outcomes:
            return
        longest = max(d for _, d in outcomes)
        self.tried = [t * self.decay for t in self.tried] + [0.0] * (longest - len(self.tried))
        self.accepted = [a * self.decay for a in self.accepted] + [0.0] * (longest - len(self.accepted))
        for accepted, drafted in outcomes:
            for j in range(min(accepted + 1, drafted)):
                self.tried[j] += 1
                self.accepted[j] += j < accepted

    def rates(self, drafts: int) -> list[float]:
        """The chance that the j-th draft is accepted when the ones before it were, j < drafts."""
        out, rate = [], self.prior
        for j in range(drafts):
            if j < len(self.tried):
                rate = (self.accepted[j] + rate * self.weight) / (self.tried[j] + self.weight)
            out.append(min(rate, 0.99))
        return out

    def rate(self, position: int) -> float:
        """The chance that a draft at `position` (0: a row's first) is accepted when the ones
        before it were."""
        return self.rates(position + 1)[-1]

    def survival(self, drafts: int) -> list[float]:
        """P(a row verifying `drafts` drafts gains at least k tokens), k = 1..drafts+1.

        The same list for the same question until `observe` (which makes new lists of counts):
        the policy asks it for every source and depth every round (at 64 rows, a tenth of its
        choice), and reads it only."""
        known = self._survivals
        if known is None or known[0] is not self.tried or known[1] is not self.accepted:
            known = self._survivals = (self.tried, self.accepted, {})
        chances = known[2].get(drafts)
        if chances is None:
            chances = [1.0]
            for rate in self.rates(drafts):
                chances.append(chances[-1] * rate)
            known[2][drafts] = chances
        return chances


def ema(old: float | None, new: float, smoothing: float) -> float:
    """Exponential moving average: recent measurements count most, one outlier not too much."""
    return new if old is None else old + smoothing * (new - old)


@dataclass
class PassCosts:
    """Seconds of one forward pass as a function of the tokens it processes: the real tokens
    of a packed pass, rows × width of a padded one (see `BatchedLM.pass_tokens`).

    Keyed by tokens, not by (rows, width): the weights' matrix products dominate a pass and
    cost about the same for 8 rows × 1 token as for 1 row × 8 tokens, while attention over a
    few hundred cached tokens is small beside them. One table then serves every batch size,
    and a batch that shrinks as its rows finish does not have to re-measure anything.
    """

    smoothing: float = 0.3
    points: dict[int, float] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)  # measurements behind each point
    _sorted: list[int] = field(default_factory=list, repr=False, compare=False)  # `_sizes`
    _sorted_key: tuple[int, int] | None = field(default=None, repr=False, compare=False)

    def observe(self, tokens: int, seconds: float) -> None:
        """A size's first pass may pay one-time costs (kernel choice, allocations; on an H200 a
        2-token pass once took 0.24 s against 0.05 s for its neighbours, docs/gpu.md), never a
        saving: a faster second measurement replaces it rather than being averaged with it."""
        first = self.counts.get(tokens) == 1
        old = min(self.points[tokens], seconds) if first else self.points.get(tokens)
        self.points[tokens] = ema(old, seconds, self.smoothing)
        self.counts[tokens] = self.counts.get(tokens, 0) + 1

    def has(self, tokens: int) -> bool:
        return tokens in self.points

    def time(self, tokens: int, prior_slope: float) -> float | None:
        """Measured, else interpolated between the nearest measured sizes, else extrapolated
        from the two nearest (or, from one, with `prior_slope`: relative extra cost per token).

        A size measured only once costs no more than its neighbours say until a second
        measurement confirms it: on a shared machine one pass in a slow spell can take twice
        its time, and a size that looks that dear is never chosen, so never measured again.
        """
        measured = self.points.get(tokens)
        if measured is not None and self.counts[tokens] >= 2:
            return measured  # the common case, first: `Policy.best` asks for many sizes every round
        sizes = self._sizes()
        # the other sizes, below and above (a size measured once is not its own anchor)
        below, above = sizes[: bisect_left(sizes, tokens)], sizes[bisect_right(sizes, tokens) :]
        estimate = _piecewise(self.points, below, above, tokens, prior_slope) if below or above else None
        if measured is None:
            return estimate
        return measured if estimate is None else min(measured, estimate)

    def _sizes(self) -> list[int]:
        """The measured sizes in order, sorted again only when a size is added: the policy
        estimates a handful of unmeasured sizes every round (sorting them each time was most of
        an estimate's 5 us)."""
        key = (id(self.points), len(self.points))
        if self._sorted_key != key:
            self._sorted, self._sorted_key = sorted(self.points), key
        return self._sorted


def _piecewise(
    row: dict[int, float], below: list[int], above: list[int], tokens: int, prior_slope: float
) -> float:
    """The cost at `tokens` from measured sizes (`below` and `above` it, in order): interpolated
    between the nearest, else extrapolated from the two nearest, or from one with `prior_slope`.

    Piecewise rather than one straight line, and a 1-token pass is never a slope anchor: on
    CPUs it takes a faster matrix-vector path, so the cost jumps from 1 token to 2 and then
    grows gently; a slope through 1 and 2 would make every wider pass look far too dear, and
    speculation would never be tried.
    """
    if below and above:
        n0, n1 = below[-1], above[0]
    else:
        anchors = below if below else above
        anchors = [n for n in anchors if n > 1] or anchors
        if len(anchors) == 1:
            n0 = anchors[0]
            base = row[n0] / (1 + prior_slope * (n0 - 1))
            return base * (1 + prior_slope * (tokens - 1))
        n0, n1 = (anchors[-2], anchors[-1]) if below else (anchors[0], anchors[1])
    slope = max((row[n1] - row[n0]) / (n1 - n0), 0.0)
    return max(row[n0] + slope * (tokens - n0), 1e-6)


@dataclass
class CostModel:
    """Wall-time estimates: target passes, draft passes, and each model's prefill per token.

    A draft model whose cache is cold (a new batch) or far behind (rows served by a copying
    drafter) must first catch up, which can cost more than speculating saves over a short
    output. The policy charges that one-off cost against the rounds left (`prefill_time`,
    `catch_up_time`).
    """

    verify_slope_prior: float = 0.03  # extra cost per extra token in a pass, relative
    draft_ratio_prior: float = 0.4  # draft pass / target pass before any measurement
    smoothing: float = 0.3  # of the prefill rates
    target: PassCosts = field(default_factory=PassCosts)
    draft: PassCosts = field(default_factory=PassCosts)
    prefill: dict[str, float] = field(default_factory=dict)  # seconds per token, by model
    round_rate: float | None = None  # tokens per second of recent decoding rounds (all rows)
    # seconds of an admission's prefill pass where one costs the same whatever it holds (a
    # replayed graph), the drafters' admission included: what a row admitted alone pays
    prefill_pass: float | None = None

    def observe_target(self, tokens: int, seconds: float) -> None:
        self.target.observe(tokens, seconds)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        self.draft.observe(tokens, seconds)

    def observe_prefill(self, model: str, tokens: int, seconds: float) -> None:
        self.prefill[model] = ema(self.prefill.get(model), seconds / max(tokens, 1), self.smoothing)

    def observe_prefill_pass(self, passes: int, seconds: float) -> None:
        self.prefill_pass = ema(self.prefill_pass, seconds / max(passes, 1), self.smoothing)

    def seed(self, calibration: dict) -> None:
        """Start from a calibration's measured passes (`pipeline.decode.calibration.measure`) instead of
        priors: a fresh engine otherwise runs its first documents on guesses, and a draft
        prior far above the measured ratio can keep it from ever trying the draft.

        A pass of b rows × w tokens is a pass of b·w tokens (see `PassCosts`). The seeds count
        as confirmed measurements, and the passes a job times move them like any other.
        """
        tables = (
            (self.target, calibration.get("target_pass_seconds_by_batch") or {}),
            (self.draft, calibration.get("draft_step_seconds_by_batch") or {}),
        )
        for costs, by_batch in tables:
            for batch, by_width in by_batch.items():
                for width, seconds in by_width.items():
                    tokens = int(batch) * int(width)
                    if tokens not in costs.points:
                        costs.points[tokens], costs.counts[tokens] = float(seconds), 2
        for model, rate in (calibration.get("prefill_seconds_per_token") or {}).items():
            if rate is not None:
                self.prefill.setdefault(model, float(rate))

    def observe_round(self, tokens: int, seconds: float) -> None:
        """A decoding round (drafting, verifying, bookkeeping) made `tokens` over all rows."""
        if seconds > 0:
            self.round_rate = ema(self.round_rate, tokens / seconds, self.smoothing)

    def token_seconds(self) -> float | None:
        """Seconds one more token is worth: what the batch spends per token lately."""
        return 1.0 / self.round_rate if self.round_rate else None

    def has_target(self, tokens: int) -> bool:
        return self.target.has(tokens)

    def target_time(self, tokens: int) -> float | None:
        """Seconds for one target pass that costs `tokens` (see `BatchedLM.pass_tokens`)."""
        return self.target.time(tokens, self.verify_slope_prior)

    def draft_time(self, tokens: int) -> float | None:
        """Seconds for one draft pass; before any is timed, a prior share of the target's."""
        measured = self.draft.time(tokens, self.verify_slope_prior)
        if measured is not None:
            return measured
        base = self.target_time(tokens)
        return None if base is None else base * self.draft_ratio_prior

    def profile(self) -> dict[str, dict]:
        """What was measured, for a benchmark's record of where the time goes: seconds of a
        target and a draft pass by tokens processed (rows × width), prefill seconds per token."""
        return {
            "target_pass_seconds": dict(sorted(self.target.points.items())),
            "draft_pass_seconds": dict(sorted(self.draft.points.items())),
            "prefill_seconds_per_token": dict(sorted(self.prefill.items())),
        }

    def prefill_time(self, model: str, tokens: int) -> float:
        """Seconds for `model` to prefill `tokens` tokens from a cold cache: at its own measured
        rate, or before the draft's first prefill at the target's times the prior ratio."""
        rate = self.prefill.get(model)
        if rate is None and model == "draft" and "target" in self.prefill:
            rate = self.prefill["target"] * self.draft_ratio_prior
        return (rate or 0.0) * tokens

    def catch_up_time(self, step: int, catch_up: int) -> float:
        """Extra seconds a warm draft needs before its next proposal, beyond an ordinary step.

        `step` is what an ordinary step costs in tokens (as the draft's runner counts a pass of
        one token a row: a static runner's every slot), `catch_up` what the
        first pass costs when rows must feed the tokens the draft has not seen. That only
        matters when some row fell more than the usual 1–2 tokens behind (rows served by
        prompt lookup for a while).
        """
        if catch_up <= 2 * step:
            return 0.0
        return max((self.draft_time(catch_up) or 0.0) - (self.draft_time(step) or 0.0), 0.0)
