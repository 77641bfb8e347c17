"""What the rounds did, counted: τ and each drafter's acceptance by position.

Kept apart from the engine (no torch here) because the job's totals, `pipeline stats` and the
report read these figures back from stats files, and must not load a model stack to do so.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def row_tau(tokens: int, row_passes: int) -> float:
    """τ, tokens per target pass per row: a batched pass counts once for each row in it."""
    return tokens / row_passes if row_passes else 0.0


@dataclass
class DrafterRounds:
    """One drafter's rounds, where a round is one row's share of a verify pass that checked its
    drafts: how many there were, the tokens they produced, and how far each got by position.

    One α per drafter hides what matters for choosing γ: copies are accepted in runs, a draft
    model fades with depth, and a drafter that often drafts nothing looks better per drafted
    token than per round. Counted by position, as vLLM exports them, the counts add across
    batches, shards and jobs, and dashboards can take rates of them.
    """

    rounds: int = 0
    tokens: int = 0  # tokens these rounds produced: accepted drafts and the target's own
    drafted: list[int] = field(default_factory=list)  # [k-1]: rounds that drafted at least k tokens
    accepted: list[int] = field(default_factory=list)  # [k-1]: rounds whose k-th draft was accepted

    def observe(self, drafted: int, accepted: int, produced: int) -> None:
        """One round that drafted `drafted` tokens, of which the first `accepted` were kept."""
        self.rounds += 1
        self.tokens += produced
        self._grow(drafted)
        for k in range(drafted):
            self.drafted[k] += 1
            self.accepted[k] += k < accepted

    def add(self, other: DrafterRounds) -> None:
        self.rounds += other.rounds
        self.tokens += other.tokens
        self._grow(len(other.drafted))
        for k, (d, a) in enumerate(zip(other.drafted, other.accepted)):
            self.drafted[k] += d
            self.accepted[k] += a

    def _grow(self, positions: int) -> None:
        missing = positions - len(self.drafted)
        if missing > 0:
            self.drafted += [0] * missing
            self.accepted += [0] * missing

    def by_position(self) -> list[float]:
        """For k = 1..γmax: the share of rounds that drafted at least k tokens whose k-th draft
        was accepted (so also every draft before it)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted)]

    def accepted_lengths(self) -> dict[int, int]:
        """Rounds by how many drafts they had accepted: those that reached k less those that
        reached k + 1."""
        reached = [self.rounds, *self.accepted, 0]
        lengths = {k: reached[k] - reached[k + 1] for k in range(len(reached) - 1)}
        return {k: n for k, n in lengths.items() if n}

    def to_dict(self) -> dict:
        """The counts, for a stats file (and `from_dict` to pool them again)."""
        return {
            "rounds": self.rounds,
            "tokens": self.tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
        }

    @classmethod
    def from_dict(cls, counts: dict) -> DrafterRounds:
        return cls(counts["rounds"], counts["tokens"], list(counts["drafted"]), list(counts["accepted"]))


@dataclass
class Rounds:
    """Every round of a batch (or shard, or job): per drafter, and those that drafted nothing."""

    undrafted: int = 0  # rounds whose row took the target's token only
    by_drafter: dict[str, DrafterRounds] = field(default_factory=dict)

    def observe(
        self, drafter: str | None, drafted: int, accepted: int, produced: int, rounds: int = 1
    ) -> None:
        """A row's round (`rounds` of them alike where nothing was drafted: passes back to back)."""
        if not drafted:
            self.undrafted += rounds
            return
        self.by_drafter.setdefault(drafter, DrafterRounds()).observe(drafted, accepted, produced)

    def add(self, other: Rounds) -> None:
        self.undrafted += other.undrafted
        for name, counts in other.by_drafter.items():
            self.by_drafter.setdefault(name, DrafterRounds()).add(counts)

    @property
    def drafted(self) -> int:
        """Rounds that drafted at least one token."""
        return sum(d.rounds for d in self.by_drafter.values())

    @property
    def undrafted_share(self) -> float:
        total = self.undrafted + self.drafted
        return self.undrafted / total if total else 0.0

    @property
    def tau_drafted(self) -> float:
        """τ over the rounds that drafted: what speculation yields where it was tried. Beside τ
        over every pass, it tells a weak drafter from one that was seldom used."""
        return row_tau(sum(d.tokens for d in self.by_drafter.values()), self.drafted)

    def to_dict(self) -> dict:
        """The stats file's figures: the counts, and what they give per drafter."""
        drafters = dict(sorted(self.by_drafter.items()))
        return {
            "undrafted_rounds": self.undrafted,
            "undrafted_share": self.undrafted_share,
            "tau_drafted_rounds": self.tau_drafted,
            "acceptance_by_position": {name: d.by_position() for name, d in drafters.items()},
            "accepted_lengths": {name: d.accepted_lengths() for name, d in drafters.items()},
            "rounds_by_drafter": {name: d.to_dict() for name, d in drafters.items()},
        }

    @classmethod
    def from_stats(cls, stats: dict) -> Rounds:
        """The counts back from a stats file (`to_dict`); none from one written before them."""
        counts = stats.get("rounds_by_drafter") or {}
        by_drafter = {name: DrafterRounds.from_dict(c) for name, c in counts.items()}
        return cls(stats.get("undrafted_rounds", 0), by_drafter)
