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
