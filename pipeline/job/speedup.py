"""The measured speedup over target-only decoding: matched pairs, and a 95% interval from them.

A shard's speedup comes from decoding some of its rows again both ways on the same actor, in
pairs: one chunk of rows speculatively and the same chunk target-only, back to back, the order
alternating from pair to pair. A slow spell of a shared machine then hits both halves of a
pair, and the pairs' spread shows how far one shard's figure can be trusted.

The figure is a ratio of means, Σ target-only seconds / Σ speculative seconds. Its interval is
the delta method's for a ratio of means, with Student's t over the pairs: with the few pairs a
small shard affords, t widens the interval honestly where a bootstrap over 3 or 4 pairs would
come out too narrow. The job's figure pools every shard's pairs the same way.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

FASTER, SLOWER, NO_DIFFERENCE = "faster", "slower", "no measurable difference"


def sample_chunks(rows: int, share: float, batch_size: int) -> list[list[int]]:
    """The rows (indices) decoded in matched pairs, as the pairs' chunks.

    `share` of the rows (at least one), spread over the shard, in chunks of up to `batch_size`
    rows but at least two chunks where two rows or more are sampled: an interval needs two
    pairs, and a chunk as wide as the job's batch measures the speedup at the job's batch.
    """
    if not rows:
        return []
    count = min(rows, max(1, math.ceil(share * rows)))
    step = rows / count
    picked = sorted({int(i * step) for i in range(count)})
    size = min(batch_size, max(1, math.ceil(count / 2)))
    return [picked[i : i + size] for i in range(0, len(picked), size)]


def pair_seconds(speculative: tuple[int, float], target_only: tuple[int, float]) -> list[float]:
    """One pair's [speculative seconds, target-only seconds for as many tokens], from each
    half's (tokens, seconds). Greedy halves make the same tokens; sampled ones may not."""
    (spec_tokens, spec_seconds), (base_tokens, base_seconds) = speculative, target_only
    return [spec_seconds, base_seconds * spec_tokens / base_tokens if base_tokens else 0.0]


def paired_speedup(pairs: list[list[float]]) -> dict:
    """{"measured", "ci95", "pairs", "median_pair_ratio"} from [speculative, target-only]
    seconds per pair.

    measured R = Σx / Σy (x target-only, y speculative seconds). Its standard error by the delta
    method is sqrt(Σ(x_i - R·y_i)² / (n(n-1))) / ȳ; the interval is R ± t(0.975, n-1)·se, cut
    at 0. One pair gives no interval (None). Beside it, the median of the pairs' own ratios
    x_i / y_i: one pair slowed by a passing spell moves a ratio of sums, not the median.
    """
    n = len(pairs)
    spec = sum(y for y, _ in pairs)
    base = sum(x for _, x in pairs)
    ratios = [x / y for y, x in pairs if y]
    median = statistics.median(ratios) if ratios else None
    if not spec:
        return {"measured": None, "ci95": None, "pairs": n, "median_pair_ratio": median}
    ratio = base / spec
    ci95 = None
    if n > 1:
        residuals = sum((x - ratio * y) ** 2 for y, x in pairs)
        se = math.sqrt(residuals / (n * (n - 1))) / (spec / n)
        half = t975(n - 1) * se
        ci95 = [max(ratio - half, 0.0), ratio + half]  # a ratio of times is never below 0
    return {"measured": ratio, "ci95": ci95, "pairs": n, "median_pair_ratio": median}


def verdict(ci95: list[float] | None) -> str | None:
    """What an interval says: faster, slower, or no measurable difference where it holds 1.0."""
    if not ci95:
        return None
    low, high = ci95
    return FASTER if low > 1.0 else SLOWER if high < 1.0 else NO_DIFFERENCE


@dataclass
class StandDown:
    """Whether an actor drafts at all, judged by the pairs it measured: once those since it last
    took up drafting pool to an interval wholly below 1, it stands down for a few shards.

    Why: `DraftingGate` judges drafting round by round, from whole rounds' rates, and keeps
    asking where asking costs next to nothing beside a pass; a round's rate cannot see what a
    speculative decode spends outside its rounds (a row admitted to the drafters, an output
    joining the suffix drafter's corpus, the draft model catching up), nor the text changing
    between the rounds it compares. The pairs time all of it, on the same rows both ways, and are
    what the job's speedup is. A job whose drafts were seldom accepted ran at 0.74x target-only,
    "slower", drafting from its first shard to its last.
    So after each shard the actor pools the pairs measured since it last took up drafting (the
    last `window` of them); where their interval lies wholly below 1 it stands down: the next
    `first_rest` shards decode without asking the drafters, rounds as target-only's (the gate's
    `resting`; the pairs go on timing what that path costs), and then it drafts again, its new
    pairs judging afresh: the probe, a shard's worth of pairs at least. Each stand-down after
    another rests twice as many shards, up to `longest_rest`; pairs that lie wholly above 1 set
    it back to `first_rest`. Pairs whose interval holds 1 leave drafting on: a difference the
    job cannot measure is the gate's to judge.
    Lossless either way: standing down only stops drafts, which change how many tokens a pass
    checks, never which.
    """

    first_rest: int = 2
    longest_rest: int = 16
    window: int = 32
    # [speculative, target-only] seconds of the pairs measured since drafting last resumed
    pairs: list[list[float]] = field(default_factory=list)
    rest_left: int = 0  # shards still to decode stood down
    next_rest: int = 2  # shards the next stand-down rests
    stand_downs: int = 0
    rested_shards: int = 0
    pooled: dict | None = None  # what the pairs said at the last judgement (`paired_speedup`)

    def __post_init__(self) -> None:
        self.next_rest = self.first_rest

    @property
    def resting(self) -> bool:
        """Whether the actor's next shard decodes without asking the drafters."""
        return self.rest_left > 0

    def after_shard(self, pairs: list[list[float]]) -> None:
        """A shard's pairs, measured as it decoded (resting or not); judges the next shard."""
        if self.resting:  # the pairs timed the stood-down path: they say nothing of drafting
            self.rest_left -= 1
            self.rested_shards += 1
            return
        self.pairs = (self.pairs + [list(p) for p in pairs])[-self.window :]
        self.pooled = paired_speedup(self.pairs)
        said = verdict(self.pooled["ci95"])
        if said == SLOWER:
            self.rest_left, self.pairs = self.next_rest, []
            self.next_rest = min(2 * self.next_rest, self.longest_rest)
            self.stand_downs += 1
        elif said == FASTER:
            self.next_rest = self.first_rest

    def record(self, rested: bool) -> dict:
        """For the shard's stats: whether it decoded stood down, and the actor's state after it."""
        pooled = self.pooled or {}
        return {
            "rested": rested,
            "rest_shards_left": self.rest_left,
            "pairs_judged": len(self.pairs),
            "pooled_measured": pooled.get("measured"),
            "pooled_ci95": pooled.get("ci95"),
            "stand_downs": self.stand_downs,
            "rested_shards": self.rested_shards,
        }


def t975(df: int) -> float:
    """Student's t 97.5% quantile with `df` degrees of freedom (12.71 at 1, 1.96 at infinity).

    Bisection on the CDF, integrated by Simpson's rule: a few milliseconds, and no SciPy.
    """
    scale = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def density(x: float) -> float:
        return scale * (1 + x * x / df) ** (-(df + 1) / 2)

    def cdf(t: float, steps: int = 256) -> float:
        h = t / steps
        inner = sum((4 if i % 2 else 2) * density(i * h) for i in range(1, steps))
        return 0.5 + h / 3 * (density(0.0) + inner + density(t))

    low, high = 0.0, 64.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < 0.975 else (low, mid)
    return (low + high) / 2
