"""Measured costs and acceptance, and the choice of gamma that maximizes expected tokens/s.

Whether speculation pays depends on the hardware and dtype: on a GPU a verify pass over 9
tokens costs about what a 1-token pass costs; on a CPU in float32 it can cost several times
more, and a draft model that is cheap in bf16 may not be in float32. So nothing here is
assumed for long: the engine times every target and draft pass, keeps the acceptance rate of
each drafter, and picks gamma per round from those numbers. Priors only cover the first rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens one verify pass yields with gamma drafts accepted i.i.d. with rate alpha.

    (1 - alpha^(gamma+1)) / (1 - alpha): the accepted prefix plus the correction/bonus token.
    """
    if gamma <= 0:
        return 1.0
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def alpha_from_tau(tau: float, gamma: float) -> float:
    """Invert `expected_tokens` (Leviathan's alpha from the measured tokens per pass)."""
    if gamma <= 0 or tau <= 1.0:
        return 0.0
    if tau >= gamma + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        # expected_tokens is increasing in alpha; fractional gamma interpolates the closed form
        value = (1.0 - mid ** (gamma + 1)) / (1.0 - mid) if mid < 1 else gamma + 1
        lo, hi = (mid, hi) if value < tau else (lo, mid)
    return (lo + hi) / 2


def predicted_speedup(alpha: float, gamma: float, cost_ratio: float, verify_ratio: float = 1.0) -> float:
    """Leviathan et al.'s speedup: tokens per pass over the cost of gamma drafts plus one verify.

    `cost_ratio` is a draft pass over a 1-token target pass; `verify_ratio` is a
    (gamma+1)-token target pass over a 1-token one (1.0 reproduces the paper's formula).
    """
    if gamma <= 0:
        return 1.0
    tau = (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha) if alpha < 1 else gamma + 1
    return tau / (gamma * cost_ratio + verify_ratio)


@dataclass
class RunningRate:
    """Acceptance rate with exponential forgetting, starting from a prior worth `weight` drafts."""

    prior: float
    weight: float = 8.0
    decay: float = 0.97
    accepted: float = 0.0
    drafted: float = 0.0

    def update(self, accepted: int, drafted: int) -> None:
        if drafted:
            self.accepted = self.decay * self.accepted + accepted
            self.drafted = self.decay * self.drafted + drafted

    @property
    def value(self) -> float:
        rate = (self.accepted + self.prior * self.weight) / (self.drafted + self.weight)
        return min(rate, 0.99)


@dataclass
class CostModel:
    """Wall-time estimates for target passes (by batch size and block width) and draft passes."""

    verify_slope_prior: float = 0.03  # extra cost per extra token in a verify pass, relative
    draft_ratio_prior: float = 0.4  # draft pass / 1-token target pass before any measurement
    smoothing: float = 0.3
    target: dict[int, dict[int, float]] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def observe_target(self, batch: int, width: int, seconds: float) -> None:
        row = self.target.setdefault(batch, {})
        row[width] = self._ema(row.get(width), seconds)

    def observe_draft(self, batch: int, passes: int, seconds: float) -> None:
        if passes:
            self.draft[batch] = self._ema(self.draft.get(batch), seconds / passes)

    @staticmethod
    def _nearest(table: dict, batch: int):
        return table.get(batch, table[min(table, key=lambda b: abs(b - batch))]) if table else None

    def has_target(self, batch: int, width: int) -> bool:
        return width in self.target.get(batch, {})

    def target_time(self, batch: int, width: int) -> float | None:
        """Seconds for one target pass: measured, else interpolated between the nearest measured
        widths, else extrapolated from the two nearest (or the prior slope from one).

        Piecewise rather than one straight line: on CPUs a 1-token pass often takes a faster
        matrix-vector path, so the cost jumps from width 1 to 2 and then grows gently; a line
        fitted through widths 2..6 would put width 1 far too high and make speculation look
        cheap.
        """
        row = self._nearest(self.target, batch)
        if not row:
            return None
        if width in row:
            return row[width]
        widths = sorted(row)
        below = [w for w in widths if w < width]
        above = [w for w in widths if w > width]
        if below and above:
            w0, w1 = below[-1], above[0]
        elif len(widths) == 1:
            w0 = widths[0]
            base = row[w0] / (1 + self.verify_slope_prior * (w0 - 1))
            return base * (1 + self.verify_slope_prior * (width - 1))
        else:
            w0, w1 = (below[-2], below[-1]) if below else (above[0], above[1])
        slope = max((row[w1] - row[w0]) / (w1 - w0), 0.0)
        return max(row[w0] + slope * (width - w0), 1e-6)

    def draft_could_pay(self, batch: int, gamma_cap: int, alpha: float) -> bool:
        """Whether the draft model could beat target-only here if it reached acceptance `alpha`.

        False when verify passes grow so fast with their width (a CPU in float32) that even a
        very good draft loses: re-measuring the draft's acceptance then only costs time. A
        draft not yet timed counts as free and a width not yet timed is extrapolated, so
        whatever is unknown says "could pay" and gets measured.
        """
        base = self.target_time(batch, 1)
        if base is None:
            return True
        draft = self._nearest(self.draft, batch) or 0.0
        return any(
            expected_tokens(alpha, g) / (g * draft + self.target_time(batch, g + 1)) > 1 / base
            for g in range(1, gamma_cap + 1)
        )

    def draft_time(self, batch: int) -> float | None:
        measured = self._nearest(self.draft, batch)
        if measured is not None:
            return measured
        base = self.target_time(batch, 1)
        return None if base is None else base * self.draft_ratio_prior
