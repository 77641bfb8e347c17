"""What speculation did, counted: per row (`RowStats`) and per batch (`BatchStats`).

The counters add up (a shard is many batches, a bench many runs), and every rate is a
property computed from them here, once: α is `acceptance(accepted, drafted)` wherever it is
shown, in shard stats, job totals, the bench and the progress line. No torch here: the job's
totals and the report read these figures back without loading a model stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.decode.costs import alpha_from_tau
from pipeline.decode.rounds import Rounds, row_tau


def acceptance(accepted: int, drafted: int) -> float | None:
    """α, the share of drafted tokens the target accepted; None (not 0) when nothing was
    drafted, since nothing was rejected either."""
    return accepted / drafted if drafted else None


def mean_gamma(drafted: int, rounds: int) -> float:
    """Drafted tokens per verify round: the mean γ."""
    return drafted / rounds if rounds > 0 else 0.0


@dataclass
class RowStats:
    """What speculation did for one row. Invariant: new_tokens == accepted + target_tokens."""

    new_tokens: int = 0
    target_passes: int = 0  # target forward passes this row took part in (prefill included)
    draft_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    target_tokens: int = 0  # tokens the target chose itself: corrections, bonuses, the first
    drafted_by: dict[str, int] = field(default_factory=dict)  # drafted tokens by source
    accepted_by: dict[str, int] = field(default_factory=dict)  # accepted tokens by source
    seconds: float = 0.0  # from joining the batch (its prefill) until this row finished

    @property
    def alpha(self) -> float | None:
        return acceptance(self.accepted, self.drafted)

    @property
    def tau(self) -> float:
        """Mean tokens produced per target pass."""
        return row_tau(self.new_tokens, self.target_passes)

    @property
    def mean_gamma(self) -> float:
        """Drafted tokens per round after the prefill (the γ the policy chose, on average)."""
        return mean_gamma(self.drafted, self.target_passes - 1)

    @property
    def alpha_leviathan(self) -> float | None:
        """The i.i.d. acceptance rate that explains the measured tau at the mean gamma."""
        return alpha_from_tau(self.tau, self.mean_gamma) if self.drafted else None


@dataclass
class BatchStats:
    """Whole-batch counters: passes here are batched passes, not per row."""

    rows: int = 0
    new_tokens: int = 0
    target_passes: int = 0
    row_passes: int = 0  # target passes counted once per row in them (prefills included)
    draft_passes: int = 0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    prefill_tokens: int = 0  # prompt tokens the target's prefill computed (not a template's)
    prefill_seconds: float = 0.0  # the target's prefill pass, part of target_seconds
    draft_prefill_seconds: float = 0.0  # the draft's cold catch-up passes, part of draft_seconds
    wall_seconds: float = 0.0
    # the drafters' own time in the rounds (lookups, automata, the policy's choice), their
    # model passes aside: where a pass costs a millisecond it decides (docs/engine.md)
    asking_seconds: float = 0.0
    asked_rounds: int = 0  # the rounds that asked the drafters: asking_seconds / this, a round's
    drafted: int = 0
    accepted: int = 0
    gamma_histogram: dict[int, int] = field(default_factory=dict)
    drafted_by: dict[str, int] = field(default_factory=dict)  # by draft source, as in RowStats
    accepted_by: dict[str, int] = field(default_factory=dict)
    rounds: Rounds = field(default_factory=Rounds)  # acceptance by position, per drafter
    # The decoding rounds priced by the cost model (target passes at their width, draft steps),
    # and what target-only decoding would have paid for the same tokens: see predicted_speedup.
    priced_seconds: float = 0.0
    priced_plain_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds else 0.0

    @property
    def tau(self) -> float:
        return row_tau(self.new_tokens, self.row_passes)

    @property
    def alpha(self) -> float | None:
        return acceptance(self.accepted, self.drafted)

    @property
    def mean_gamma(self) -> float:
        """Drafted tokens per row and round, prefills left out (each row has one)."""
        return mean_gamma(self.drafted, self.row_passes - self.rows)

    @property
    def alpha_leviathan(self) -> float | None:
        """The i.i.d. acceptance rate that explains the measured tau at the mean gamma."""
        return alpha_from_tau(self.tau, self.mean_gamma) if self.drafted else None

    @property
    def predicted_speedup(self) -> float | None:
        """The speedup the measured pass costs predict for the rounds as they ran.

        Each round is priced at the cost of its own verify pass (its width: the γ chosen, the
        rows in it) plus its draft steps, and its tokens at what plain 1-token passes of that
        many rows cost; the prefills, the same either way, are added to both as measured.
        Leviathan's formula prices every verify pass as a 1-token one, which a CPU's wider
        passes belie. A measured speedup well below this points at time the passes do not
        account for (bookkeeping, drafting, a busy machine), not at acceptance or γ.
        """
        speculative = self.priced_seconds + self.prefill_seconds + self.draft_prefill_seconds
        if not speculative:
            return None
        return (self.priced_plain_seconds + self.prefill_seconds) / speculative

    def add(self, other: BatchStats) -> None:
        """Accumulate another batch's counters (a shard or a benchmark is many batches)."""
        for key in (
            "rows",
            "new_tokens",
            "prefill_tokens",
            "target_passes",
            "row_passes",
            "draft_passes",
            "drafted",
            "accepted",
            "asked_rounds",
        ):
            setattr(self, key, getattr(self, key) + getattr(other, key))
        for key in (
            "target_seconds",
            "draft_seconds",
            "prefill_seconds",
            "draft_prefill_seconds",
            "wall_seconds",
            "asking_seconds",
            "priced_seconds",
            "priced_plain_seconds",
        ):
            setattr(self, key, getattr(self, key) + getattr(other, key))
        self.rounds.add(other.rounds)
        for mine, theirs in (
            (self.gamma_histogram, other.gamma_histogram),
            (self.drafted_by, other.drafted_by),
            (self.accepted_by, other.accepted_by),
        ):
            for key, count in theirs.items():
                mine[key] = mine.get(key, 0) + count
