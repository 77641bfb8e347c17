"""What each round drafts: which source serves each row, how many tokens, and when to stop.

Every round the engine offers the policy what the free drafters (prompt lookup, suffix) found
for each row and whether the draft model could run; the policy answers with the most tokens any
row may take from a copy (`cap`), the draft model's γ and each row's source, the choice that
maximizes expected tokens per second by the measured costs (`CostModel`) and the measured
acceptance of each source. It also says when the draft model should stop drafting a row early
(`draft_length`), and re-measures, now and then, what its choices can no longer observe:
plain decoding while it speculates, and a drafter it has stopped using.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from pipeline.decode import search
from pipeline.decode.costs import (
    AcceptanceByPosition,
    CostModel,
    RunningRate,
    ema,
    iid_survival,
)
from pipeline.decode.drafters import KeepRule
from pipeline.decode.head import HeadRule
from pipeline.decode.settings import DRAFT_MODEL

if TYPE_CHECKING:
    from pipeline.decode.batched_lm import BatchedLM
    from pipeline.decode.settings import EngineConfig


class Offer(NamedTuple):
    """Tokens a free drafter proposes for a row, and how deep its match was (see `Proposal`);
    `chances`: where the drafter knows them (the draft head), the chance that its drafts 1..k
    are all accepted, for each k, which the policy then takes over the source's measured rates.
    A named tuple: a round at 64 rows makes a hundred or more, at a third of a frozen
    dataclass's cost each."""

    source: str
    tokens: int
    depth: int
    chances: tuple[float, ...] = ()


@dataclass(frozen=True)
class RoundOptions:
    """What one round can choose from: each row's offers and the draft model's state."""

    offers: list[list[Offer]]  # per row, what each free drafter proposes (none: no match)
    use_model: bool
    gamma_cap: int
    remaining: int  # new tokens the active rows may still produce
    catch_up: float  # seconds the draft model needs before it can propose (see costs)
    # Each row's tokens left before max_new_tokens when no prompt waits for a place (the batch
    # only drains); None while prompts wait, when every token anywhere brings the end closer.
    drain_budgets: list[int] | None = None

    def offered(self, row: int, source: str | None) -> int:
        """Tokens `source` offers the row (0: none, or not a free drafter)."""
        return next((o.tokens for o in self.offers[row] if o.source == source), 0)


@dataclass
class DraftingGate:
    """Whether a round asks the drafters at all, from whole rounds timed both ways.

    Why: `Policy` prices a round by its passes, but a round that drafts also spends time no pass
    shows: the copying drafters' lookups, the suffix automaton, the policy's own search, a wider
    pass to lay out. Where a pass costs a few milliseconds (a captured GPU pass, a small model)
    that time decides, and a job whose drafts are seldom accepted ran at 0.69x of target-only
    while drafting in only 12% of its rounds. So rounds are timed whole, tokens per second of the
    batch by its number of rows, those that asked the drafters apart from those that did not.
    Once asking runs slower than not asking by `margin`, rounds stop asking, except probes, the
    first `probe_every` rounds later and each one after twice as many rounds as the one before, up
    to 4 × `probe_every`. A probe asks until the policy drafts something (at most PROBE_ROUNDS
    rounds: a round without a copy to offer tells nothing) and makes the policy try its drafters
    (a draft head's only where it is near paying: `Policy.head_length`);
    it keeps the drafting rate current, so a stretch of text that copies well turns drafting back
    on. Not asking is timed again now and then while drafting is on: one round in
    4 × `probe_every` of those at each batch size.
    Where asking costs next to nothing (the drafters' own time in a round, their model passes
    aside, under `margin` of a plain round: a CPU pass of tens of milliseconds against lookups
    and the policy's search of a fraction of one), the gate never stops asking: stopping could
    then save at most that much, and whole rounds compared across stretches of text mostly
    compare the text. A summary's documents copy their input in turns, and the gate turned
    drafting off in a stretch that did not copy and kept it off through the next one that did
    (the 1.5B's license summaries on a Zen 4 EPYC, measured in docs/engine.md). Which drafts pay
    is then the policy's call, round by round, from each source's measured acceptance and the
    measured pass costs.
    A plain round does the same work whatever the text (one token per row a pass), so a
    slower one is the machine's other work (Ray's own processes, a collection), not news, and
    its rate is that of the fastest of the last `PLAIN_KEPT` plain rounds at that batch size.
    As one of a smoothed rate, one plain round timed at about 5 times its usual seconds kept
    the tiny pair's gate drafting at one row, where drafting lost, for half a job; as the
    median of the last 5, a spell that slowed 3 of them did the same for 5 to 7 shards, plain
    rounds being re-timed one in 128 while drafting is on (docs/engine.md).
    A batch that drains (no document left to admit) passes through row counts that last a round
    or two each, too few to judge: a count not judged yet follows the nearest judged count above
    it, the batch it drained from, rather than drafting its first rounds at each count.
    A probe is priced too: each of its rounds loses what an asking round loses against a plain
    one at that batch size (both measured), and probes come no more often than keeps that loss
    within `probe_share` of the plain rounds' time between them. Where asking is dear beside a
    pass (the tiny pair on an AVX2 CPU: an asking round 5.1 ms against a plain one's 1.9 ms at one
    row) probes every 32 to 128 rounds took about 4% of a job that never drafted.
    Lossless either way: the drafts only ever change how many tokens a pass checks.
    """

    probe_every: int = 32
    margin: float = 0.03
    probe_share: float = 0.01  # of a batch size's time, the most its probes are expected to lose
    min_rounds: int = 6  # drafting rounds at a batch size before they are judged
    smoothing: float = 0.1
    rounds: dict[tuple[bool, int], int] = field(default_factory=dict)  # (asked, rows) -> rounds
    # rows -> smoothed tokens and seconds of a round that asked, whose ratio is the rate (`rate`)
    _tokens: dict[int, float] = field(default_factory=dict)
    _seconds: dict[int, float] = field(default_factory=dict)
    # rows -> the last PLAIN_KEPT plain rounds' seconds per token
    _plain: dict[int, deque[float]] = field(default_factory=dict)
    _plain_rate: dict[int, float] = field(default_factory=dict)  # rows -> 1 / the least of `_plain`
    off: set[int] = field(default_factory=set)  # batch sizes whose rounds do not ask
    judged: set[int] = field(default_factory=set)  # batch sizes timed both ways enough to judge
    _since_switch: int = 0  # rounds since the last probe
    _since_plain: dict[int, int] = field(default_factory=dict)  # rows -> asking rounds since a plain one
    _probe_gap: int = 0  # rounds between probes while off: doubles after each that finds no gain
    probing: bool = False  # this round asks only to probe: the policy should try its drafters
    _probe_left: int = 0  # rounds a probe that has drafted nothing yet may still ask
    PROBE_ROUNDS = 3  # the most rounds one probe asks in, waiting for something to draft
    PLAIN_KEPT = 5  # plain rounds whose fastest is the plain rate
    # rows -> smoothed seconds a round spent asking the drafters, their model passes aside
    _asking: dict[int, float] = field(default_factory=dict)
    # the actor stood down: its measured pairs lay wholly below 1 (`pipeline.job.speedup.StandDown`,
    # whose own probe is a shard drafting again): no round asks, none probes
    resting: bool = False

    def asks(self, rows: int) -> bool:
        """Should this round of `rows` rows ask the drafters?"""
        self.probing = False
        if self.resting:
            return False
        self._since_switch += 1
        if self.is_off(rows):
            if self._probe_left:  # the last probe found nothing to draft yet: it goes on
                self._probe_left -= 1
                self.probing = True
                return True
            gap = self._probe_gap or self.probe_every
            # (priced only once the rounds' clock is due: it is read on every round drafting is off)
            if self._since_switch >= gap and self._switch(max(gap, self.priced_gap(rows))):
                self._probe_gap = min(2 * (self._probe_gap or self.probe_every), 4 * self.probe_every)
                self._probe_left = min(self.probe_every, self.PROBE_ROUNDS) - 1
                self.probing = True
                return True
            return False
        if self.rounds.get((True, rows), 0) >= self.min_rounds and self.rounds.get((False, rows), 0) < 2:
            return False  # time plain rounds at this batch size, to judge drafting against
        # Re-time a plain round after 4 x probe_every asking rounds of this batch size: counted
        # on the probes' clock, which another batch size's probes reset, a batch size could keep
        # its plain rate for good (the tiny pair's one-row rounds, docs/engine.md).
        since = self._since_plain.get(rows, 0) + 1
        self._since_plain[rows] = since % (4 * self.probe_every)
        return since < 4 * self.probe_every

    def is_off(self, rows: int) -> bool:
        """Whether rounds of `rows` rows do not ask: as judged at that batch size, or, not judged
        there yet, as at the nearest judged size above it."""
        if rows in self.off or rows in self.judged:
            return rows in self.off
        above = min((r for r in self.judged if r > rows), default=None)
        return above in self.off

    def _switch(self, every: int) -> bool:
        if self._since_switch >= every:
            self._since_switch = 0
            return True
        return False

    def observe(
        self,
        rows: int,
        asked: bool,
        tokens: int,
        seconds: float,
        drafted: int = 0,
        asking: float | None = None,
        passes: int = 1,
    ) -> None:
        """A round of `rows` rows that did (or did not) ask the drafters made `tokens`, having
        verified `drafted` drafts; `asking`: the seconds it spent asking them, the draft model's
        and head's passes aside, which the policy prices (None: not timed). `passes`: the target
        passes it made; a plain round's passes back to back (`EngineConfig.plain_steps`) move the
        probes' clock as that many rounds would, so that drafting off is retried as soon, in
        tokens, as with one pass a round."""
        self._since_switch += passes - 1
        if self.probing and drafted:
            self._probe_left = 0
        if seconds <= 0 or tokens <= 0:
            return
        if asked and asking is not None:
            self._asking[rows] = ema(self._asking.get(rows), asking, self.smoothing)
        key = (asked, rows)
        self.rounds[key] = self.rounds.get(key, 0) + 1
        if asked:
            # Tokens over seconds, each smoothed: a round counts by its time, as in a job's own
            # rate. Smoothing each round's rate instead, over about 5 rounds, let a short stretch
            # that copies badly turn drafting off (auto on the 1.5B's license summaries, batch 1:
            # off in 2 of 3 runs, 1.21x target-only against 1.34x with drafting always asked).
            # Over about 10 rounds it stays on there, and still turns off on the tiny pair, where
            # drafting does not pay (docs/benchmarks/, 2026-11-29). The first rounds are a plain
            # mean (weight 1/n), so that the first round does not stand for ten. A probe while
            # drafting is off counts for more, or a good stretch would be half over when noticed.
            smoothing = 0.5 if self.is_off(rows) else self.smoothing
            weight = max(smoothing, 1 / self.rounds[key])
            self._tokens[rows] = ema(self._tokens.get(rows), tokens, weight)
            self._seconds[rows] = ema(self._seconds.get(rows), seconds, weight)
        else:
            kept = self._plain.setdefault(rows, deque(maxlen=self.PLAIN_KEPT))
            kept.append(seconds / tokens)
            self._plain_rate[rows] = 1 / min(kept)  # read every round: kept, not recomputed
        drafting, plain = self.rate(True, rows), self.rate(False, rows)
        if self.rounds.get((True, rows), 0) < self.min_rounds or self.rounds.get((False, rows), 0) < 2:
            return
        self.judged.add(rows)
        if self.asking_is_cheap(rows):
            self.off.discard(rows)
        elif drafting < plain * (1 - self.margin):
            if rows not in self.off:
                self.off.add(rows)
                self._since_switch = 0  # the first probe a full `probe_every` rounds later
        elif drafting > plain * (1 + self.margin) and rows in self.off:
            self.off.discard(rows)
            self._probe_gap = self._since_switch = 0

    def priced_gap(self, rows: int) -> int:
        """Rounds between probes at `rows` rows such that a probe's rounds (PROBE_ROUNDS at
        most), each losing what an asking round loses against a plain one, cost at most
        `probe_share` of the plain rounds between (0 until both kinds are timed there)."""
        drafting, plain = self.rate(True, rows), self.rate(False, rows)
        if drafting is None or plain is None:
            return 0
        loss = self._seconds[rows] - self._tokens[rows] / plain  # an asking round's, in seconds
        return max(math.ceil(self.PROBE_ROUNDS * loss / (self.probe_share * rows / plain)), 0)

    def asking_is_cheap(self, rows: int) -> bool:
        """Whether asking the drafters takes a round of `rows` rows under `margin` of a plain
        round (False until both are timed)."""
        asking, plain = self._asking.get(rows), self.rate(False, rows)
        return asking is not None and plain is not None and asking < self.margin * rows / plain

    def rate(self, asked: bool, rows: int) -> float | None:
        """Tokens per second of rounds of `rows` rows that did (or did not) ask; None: none yet."""
        if asked:
            return self._tokens[rows] / self._seconds[rows] if rows in self._seconds else None
        return self._plain_rate.get(rows)

    def record(self) -> dict:
        """What the gate measured, for stats: rates by batch size, and where it stopped asking."""
        return {
            "drafting_tokens_per_second": {r: self.rate(True, r) for r in sorted(self._seconds)},
            "plain_tokens_per_second": {r: self.rate(False, r) for r in sorted(self._plain)},
            "off_at_rows": sorted(self.off),
            "asking_seconds": dict(sorted(self._asking.items())),
            "probe_gap_rounds": {r: self.priced_gap(r) for r in sorted(self.off)},
        }


@dataclass
class CopierPrices:
    """Which free drafters (prompt lookup, suffix) a round asks, where more than one copies:
    each one's own seconds in a round against the tokens it adds over the others' offers.

    Why: the policy prices a round's passes, and `DraftingGate` whether asking pays at all,
    but two copiers mostly offer the same copy, each at its own price. At 64 rows on a CPU the
    two took most of a round's time besides its pass (docs/engine.md), and a captured GPU pass
    costs a few milliseconds, so a copier that adds nothing the other offers costs a share of
    the round for no token.
    A copier's worth in a round: for each row that took its copy, the copy's expected tokens
    at the round's cap less those of the row's best other offer (one token where it has none),
    the tokens the round would lose without it, each worth what a token costs lately
    (`CostModel.token_seconds`). Worth and seconds are smoothed over the rounds that asked it.
    Once every copier asked has `min_rounds` of both, the one whose worth falls furthest short
    of its seconds rests: rounds ask the others. It is asked again in probes, `PROBE_ROUNDS`
    rounds in a row, the first `probe_every` asking rounds later and each one after twice as
    many rounds as the one before, up to 4 x `probe_every`; a probe that finds it worth its
    seconds ends its rest. One rests at a time, so the last copier standing is judged by the
    gate alone. A copier whose seconds are under `margin` of a plain pass never rests (a CPU
    pass of tens of milliseconds against a lookup of one): resting could save little, and a
    copier whose worth comes in rare long copies (a recurring term from the corpus) is seen
    only in its probes while it rests.
    Lossless either way: the copies only ever change how many tokens a pass checks.
    """

    probe_every: int = 32
    smoothing: float = 0.1
    min_rounds: int = 8
    margin: float = 0.03  # of a plain pass: a copier cheaper than that never rests
    PROBE_ROUNDS = 3
    resting: str | None = None  # the copier rounds do not ask now
    rested_rounds: dict[str, int] = field(default_factory=dict)  # rounds each was not asked
    _worth: dict[str, float] = field(default_factory=dict)  # smoothed seconds saved a round
    _seconds: dict[str, float] = field(default_factory=dict)  # smoothed seconds of proposing
    _rounds: dict[str, int] = field(default_factory=dict)
    _since_probe: int = 0
    _probe_gap: int = 0
    _probe_left: int = 0
    _probed: bool = False  # a probe's rounds ran since the copier rested or was last judged

    def asked(self, names: list[str]) -> list[str]:
        """The copiers among `names` (those the batch uses) this round asks."""
        if self.resting not in names:
            return names
        if self._probe_left:
            self._probe_left -= 1
            return names
        if self._probed:  # a probe just ended (judged here: its rounds may not all have copied)
            self._probed = False
            if self._net(self.resting) >= 0:
                self.resting, self._probe_gap, self._since_probe = None, 0, 0
                return names
        self._since_probe += 1
        if self._since_probe >= (self._probe_gap or self.probe_every):
            self._since_probe = 0
            self._probe_gap = min(2 * (self._probe_gap or self.probe_every), 4 * self.probe_every)
            self._probe_left, self._probed = self.PROBE_ROUNDS - 1, True
            return names
        self.rested_rounds[self.resting] = self.rested_rounds.get(self.resting, 0) + 1
        return [n for n in names if n != self.resting]

    def observe(self, seconds: dict[str, float], worth: dict[str, float], plain_seconds: float) -> None:
        """One round's seconds of each copier asked and the seconds its copies saved;
        `plain_seconds`: a plain pass's at this batch size, beside which a copier under
        `margin` of it is too cheap to rest."""
        if len(seconds) < 2:  # a copier alone is the gate's to judge
            return
        probing = self.resting in seconds
        for name, spent in seconds.items():
            self._rounds[name] = rounds = self._rounds.get(name, 0) + 1
            weight = max(0.5 if probing else self.smoothing, 1 / rounds)
            self._seconds[name] = ema(self._seconds.get(name), spent, weight)
            self._worth[name] = ema(self._worth.get(name), worth.get(name, 0.0), weight)
        if probing:  # judged once the probe ends (`asked`)
            return
        if self.resting is None and min(self._rounds[n] for n in seconds) >= self.min_rounds:
            dear = [n for n in seconds if self._seconds[n] >= self.margin * plain_seconds]
            dearest = min(dear, key=self._net, default=None)
            if dearest is not None and self._net(dearest) < 0:
                self.resting, self._since_probe = dearest, 0

    def _net(self, name: str) -> float:
        return self._worth[name] - self._seconds[name]

    def record(self) -> dict:
        """What was measured, for stats: each copier's seconds and worth a round, and rests."""
        return {
            "seconds_per_round": dict(sorted(self._seconds.items())),
            "worth_seconds_per_round": dict(sorted(self._worth.items())),
            "resting": self.resting,
            "rested_rounds": dict(sorted(self.rested_rounds.items())),
        }


class Choice(NamedTuple):
    """A round's plan: copies of at most `cap` tokens, `gamma` draft-model passes at most, and
    each row's source (None: the row takes the target's token only)."""

    cap: int
    gamma: int
    sources: list[str | None]


def copy_prior(depth: int) -> float:
    """The acceptance a copy is assumed to have before any was verified: a longer match is a
    stronger hint, alike for both copying drafters (an n-gram of n tokens for prompt lookup, a
    matched suffix of `depth` tokens or more for suffix)."""
    return min(0.2 + 0.15 * depth, 0.8)


@dataclass
class Policy:
    """The choice of drafts, from the engine's measured costs and its own measured acceptance.

    One per engine: what it learns (acceptance per source, how often rows run to the limit)
    carries over from batch to batch like the costs do.
    """

    config: EngineConfig
    costs: CostModel
    target: BatchedLM  # prices a pass by its rows' lengths (`pass_tokens`)
    draft: BatchedLM | None = None  # the draft model's runner, which prices its steps alike
    # The draft model's acceptance by position: how often its j-th draft is accepted when the
    # ones before it were. Measured as the copies' is, so that the two compare fairly: accepted
    # per drafted token would count the drafts after a row's first miss as misses, when the
    # target never tested them, and price the draft model below copies that do no better.
    model_rates: AcceptanceByPosition = field(default_factory=lambda: AcceptanceByPosition(prior=0.6))
    # A copy's acceptance per source and match depth, and per position in the copy, since a
    # copy that has begun to match tends to go on matching.
    copy_rates: dict[tuple[str, int], AcceptanceByPosition] = field(default_factory=dict)
    # How often a row runs to max_new_tokens rather than ending at EOS or a stop string: a
    # draining batch's end is set by the row with most tokens left only when rows run that far.
    runs_to_limit: RunningRate = field(default_factory=lambda: RunningRate(prior=0.5, weight=4.0))
    _rounds_without_model: int = 0
    _rounds_without_copies: int = 0
    _rounds_without_head: int = 0  # rounds whose head drafts the rule cut to none (`head_length`)
    _rounds_since_plain: int = 0
    copiers: CopierPrices = field(default_factory=CopierPrices)  # which free drafters a round asks
    PROBE_SHORTFALL = 0.5  # how far short of paying for its verify token a head's probe draft may fall

    def __post_init__(self) -> None:
        self.copiers.probe_every = self.config.probe_every

    def copy_rate(self, source: str, depth: int) -> AcceptanceByPosition:
        key = (source, depth)
        if key not in self.copy_rates:
            self.copy_rates[key] = AcceptanceByPosition(prior=copy_prior(depth))
        return self.copy_rates[key]

    def observe(self, outcomes: dict[tuple[str, int], list[tuple[int, int]]]) -> None:
        """One round's verified drafts, (accepted, drafted) per row, by (source, depth)."""
        for (source, depth), rows in outcomes.items():
            rates = self.model_rates if source == DRAFT_MODEL else self.copy_rate(source, depth)
            rates.observe(rows)

    def choose(
        self, options: RoundOptions, probe: bool = False, copier_seconds: dict[str, float] | None = None
    ) -> Choice:
        """Pick the copy cap and the draft-model gamma that maximize expected tokens/s.

        Each row takes up to `cap` tokens of one free drafter's offer, or `gamma` draft-model
        tokens, or none (see `best`); expected tokens come from the running acceptance (the
        draft model's per token; a copy's per source, depth and position), round time from the
        measured target cost of the resulting pass plus gamma draft steps, plus the draft's
        catch-up seconds spread over the rounds left for the remaining tokens. Gamma 0 with no
        copy is plain target-only decoding, always a candidate. The draft model may then stop
        short of gamma (`draft_length`). `probe`: the round is a `DraftingGate` probe, which
        must try the drafters, as the policy's own probes do, to be worth its time.
        `copier_seconds`: the seconds each free drafter asked spent proposing this round, which
        `copiers` weighs against the tokens the choice takes from its copies.
        """
        rows, gamma_cap = len(options.offers), options.gamma_cap
        plain = Choice(0, 0, [None] * rows)
        if gamma_cap <= 0:
            return plain
        if not self.config.adaptive:
            gamma = gamma_cap if options.use_model and not all(options.offers) else 0
            first = [offers[0].source if offers else None for offers in options.offers]
            return Choice(gamma_cap, gamma, [s or (DRAFT_MODEL if gamma else None) for s in first])
        if not self.costs.has_target(self._plain_tokens(rows)):
            # Measure plain decoding at this batch size first: every choice is compared with it.
            return plain
        self._rounds_since_plain += 1
        if self._rounds_since_plain > 4 * self.config.probe_every:
            # Re-measure plain decoding now and then: while speculating its cost is never
            # observed, and a value inflated by one slow spell would keep speculation looking good.
            self._rounds_since_plain = 0
            return plain
        if probe:  # the probes below fire this round if its best choice drafts nothing
            self._rounds_without_model = max(self._rounds_without_model, self.config.probe_every - 1)
            self._rounds_without_copies = max(self._rounds_without_copies, self.config.probe_every - 1)
        if not options.use_model and not any(options.offers):  # nothing to weigh: plain, as `best` says
            self._rounds_since_plain = 0
            return plain
        copies = _lay_out(options.offers, gamma_cap, self._survival)
        cap, gamma, sources = self.best(options, self.model_rates.survival(gamma_cap), copies)
        if options.use_model and gamma == 0 and None in sources:
            self._rounds_without_model += 1
            if self._rounds_without_model >= self.config.probe_every:
                self._rounds_without_model = 0
                # Re-measure the draft's acceptance, unless even a very good draft would not
                # pay here (verify passes too dear, or a catch-up the rounds left cannot repay).
                # A probe also risks the draft's catch-up (a whole prefill when cold), which a
                # poor acceptance found by the probe may never repay: it may risk only a share.
                plain_left = options.remaining / rows * self.costs.target_time(self._plain_tokens(rows))
                affordable = options.catch_up <= self.config.probe_budget * plain_left
                hopeful = iid_survival(self.config.probe_alpha, gamma_cap)
                if affordable and self.best(options, hopeful, copies).gamma:
                    gamma, sources = 1, [s or DRAFT_MODEL for s in sources]
        copying = any(s not in (None, DRAFT_MODEL) for s in sources)
        if gamma == 0 and not copying and any(options.offers):
            self._rounds_without_copies += 1
            if self._rounds_without_copies >= self.config.probe_every:
                self._rounds_without_copies = 0
                # Re-measure the copies' acceptance and the cost of a 2-token verify pass at
                # this batch size. Until measured that cost is extrapolated from other shapes
                # (4 rows x 1 token next to 1 row x 3), which can overprice it so much that no
                # copy is ever tried. A probe costs one slightly wider pass, no draft steps.
                cap, sources = 1, [offers[0].source if offers else None for offers in options.offers]
                copying = True
        if gamma == 0 and not copying:
            self._rounds_since_plain = 0  # this round measures plain decoding anyway
        token_seconds = self.costs.token_seconds()
        if copying and len(copier_seconds or ()) > 1 and token_seconds:
            gained = self._copy_gains(copies, cap, sources)
            worth = {s: n * token_seconds for s, n in gained.items()}
            self.copiers.observe(copier_seconds, worth, self.costs.target_time(self._plain_tokens(rows)))
        return Choice(cap, gamma, sources)

    @staticmethod
    def _copy_gains(copies: _Copies | _LoneCopies, cap: int, sources: list[str | None]) -> dict[str, float]:
        """Expected tokens each source's copies add this round over each row's best other
        offer (one token where it has none), as taken at `cap` (see `CopierPrices`)."""
        gains: dict[str, float] = {}
        expected = copies.expected_at(cap)
        for i, source in enumerate(sources):
            if source is None or source == DRAFT_MODEL:
                continue
            mine, other = 1.0, 1.0
            for j, offer in enumerate(copies.offers[i]):
                if offer.source == source:
                    mine = expected[i][j]
                else:
                    other = max(other, expected[i][j])
            gains[source] = gains.get(source, 0.0) + max(mine - other, 0.0)
        return gains

    def draft_length(
        self, options: RoundOptions, cap: int, gamma: int, sources: list[str | None]
    ) -> tuple[int, KeepRule | None]:
        """How many draft passes at most, and the rule that ends drafting earlier (see
        `DraftModelDrafter.propose`); fixed gamma (`adaptive=False`) has no rule.

        `best` prices gamma as if every draft were accepted with the same chance. The draft
        model knows better token by token: a row whose drafts so far are all accepted with
        chance P (the product of the draft's confidences) gains P·α more tokens from one more
        draft, α being how often a draft at the row's next position is accepted after accepted
        ones (`model_rates`).
        That gain is worth its seconds at the rate rounds have been making tokens; one more
        pass costs a draft step, and each row that goes on one more verify token. So drafting
        goes long while the draft is sure and stops at its first doubt.
        Every token counts while prompts wait or in a lone row, and drafting may then go to
        `gamma_cap`; a draining batch keeps the gamma its drain pricing chose as the most.
        """
        if not self.config.adaptive:
            return gamma, None
        rows = len(sources)
        steps = options.gamma_cap if rows == 1 or options.drain_budgets is None else gamma
        token_value = self.costs.token_seconds()
        if steps <= 1 or token_value is None:
            return gamma, None
        step_seconds = self.costs.draft_time(self._step_tokens(rows)) or 0.0
        copied = [min(options.offered(i, s), cap) for i, s in enumerate(sources)]
        model_rows = [i for i, s in enumerate(sources) if s == DRAFT_MODEL]

        def keep(chances: list[float], drafted: list[int]) -> list[bool]:
            lengths = [1 + n + (drafted[i] if sources[i] == DRAFT_MODEL else 0) for i, n in enumerate(copied)]
            now = self.costs.target_time(self.target.pass_tokens(lengths))
            changed = self._row_changed(lengths)
            going, net = [False] * rows, 0.0
            for i in model_rows:
                verify_token = max(changed(i, lengths[i] + 1) - now, 0.0)
                gain = chances[i] * self.model_rates.rate(drafted[i]) * token_value - verify_token
                if gain > 0:
                    going[i], net = True, net + gain
            return going if net > step_seconds else [False] * rows

        return steps, keep

    def _row_changed(self, lengths: list[int]) -> Callable[[int, int], float]:
        """Seconds of a target pass of rows `lengths` but row i's `to` long, as `seconds(i, to)`.

        A pass's cost depends on its rows' lengths, not on which row has which
        (`BatchedLM.pass_tokens`: their sum, or their count and the longest), so every row of
        one length changed to one other gives the same pass: it is priced once. Priced a row at
        a time, each a list of every row, the draft model's and the head's rules cost O(rows²)
        a draft step, milliseconds at 256 rows beside a GPU's draft step (docs/engine.md,
        "Draft length")."""
        priced: dict[tuple[int, int], float] = {}

        def seconds(i: int, to: int) -> float:
            key = (lengths[i], to)
            if key not in priced:
                other = [*lengths[:i], to, *lengths[i + 1 :]]
                priced[key] = self.costs.target_time(self.target.pass_tokens(other))
            return priced[key]

        return seconds

    def _survival(self, offer: Offer, gamma_cap: int) -> list[float]:
        """P(an offer's first drafts gain at least k tokens), k = 1, 2, ...: its own chances
        where it has them, else its source's measured acceptance by depth and position."""
        drafts = min(offer.tokens, gamma_cap)
        if offer.chances:
            return [1.0, *offer.chances[:drafts]]
        return self.copy_rate(offer.source, offer.depth).survival(drafts)

    def head_length(self, step_seconds: float | None, probe: bool = False) -> HeadRule | None:
        """When the draft head's rows stop drafting (see `HeadDrafter.propose`); no rule (draft
        gamma) until a round's worth of a token has been measured, or with `adaptive=False`.

        A head step costs a small share of a target pass, and its confidence is read before
        the draft goes to the target, so each draft is judged on its own: it is kept while the
        chance that the row's drafts up to it are all accepted (`chances`, calibrated), times
        what a token is worth lately, pays for the verify token it adds to the pass; the row
        drafts one more while it pays for a head step too. Drafts that fade stop at the first
        doubt, and a head that is seldom right drafts nothing where verify tokens are dear.

        What the rule weighs, though, only the drafts it lets through re-measure: the head's
        calibration and the cost of the wider verify pass. A head trained on while the job
        runs, or a wider pass timed in a slow spell (another process running), would be cut
        for good on figures no longer true (docs/choosing-a-draft.md). So after
        `probe_every` rounds whose drafts it cut to none, and in a `DraftingGate` probe
        (`probe`), the rule sends a row's first draft that falls short of paying by at most
        `PROBE_SHORTFALL` of its verify token, and no more: the drafts that figures off by
        that much would have let through, the surest the head has, where a probe costs least
        and measures what decides. Probes that sent a draft wherever the head stood drafted
        where it was least sure (none of 52 accepted in a job, docs/choosing-a-draft.md). A
        probe waits for such a draft; after as many rounds again it sends the first draft
        whatever its chance, so that a verify pass priced far too high is still re-measured.
        Rounds count where the rule judged drafts: not those the head rests in (`HeadDrafter.
        _judge`), nor those the gate keeps from asking, so that wait is long where the head
        seldom pays, as it should be, since every such probe costs a verify token."""
        token_value = self.costs.token_seconds()
        if not self.config.adaptive or token_value is None:
            return None
        probe = probe or self._rounds_without_head >= self.config.probe_every
        anyhow = self._rounds_without_head >= 2 * self.config.probe_every

        def rule(chances: list[float], drafted: list[int]) -> list[tuple[bool, bool]]:
            lengths = [1 + d for d in drafted]
            now = self.costs.target_time(self.target.pass_tokens(lengths))
            changed = self._row_changed(lengths)
            going = sum(d > 0 for d in drafted) or 1
            verdicts = []
            for i, (chance, d) in enumerate(zip(chances, drafted)):
                if not d:
                    verdicts.append((False, False))
                    continue
                verify_token = max(now - changed(i, d), 0.0)
                gain = chance * token_value - verify_token
                if probe:
                    near = anyhow or gain >= -self.PROBE_SHORTFALL * verify_token
                    verdicts.append((d == 1 and near, False))
                else:
                    verdicts.append((gain > 0, gain > (step_seconds or 0.0) / going))
            if max(drafted) == 1:  # a round's first step: does it keep any draft at all?
                kept = any(keep for keep, _ in verdicts)
                self._rounds_without_head = 0 if kept else self._rounds_without_head + 1
            return verdicts

        return rule

    def best(
        self, options: RoundOptions, from_model: list[float], copies: _Copies | _LoneCopies | None = None
    ) -> Choice:
        """The choice of `choose` when the draft model, drafting k tokens, gains at least j of
        them with chance `from_model[j]` (j = 0..gamma_cap, see `AcceptanceByPosition.survival`).

        Each row takes the source worth most to it: expected tokens, less what its extra verify
        tokens cost at the best rate so far. In a padded pass (a GPU) the verify tokens are
        priced at nothing, since the widest row sets the cost; in a packed one (a CPU) a row
        pays for its own, so a weak 1-gram match is not worth verifying there.
        While prompts wait for places every token brings the end of the job closer. A batch
        that only drains ends when its row with most tokens left does, if rows run to
        max_new_tokens: then a round is worth how far it takes that row's count down
        (`expected_drain_advance`), and tokens of rows ahead of it are worth nothing. With 8
        even rows that is the rare round where all 8 accept, so such a batch decodes plainly
        instead of widening its passes. Rows that end at EOS make the row with most tokens
        left a guess, so the two values are weighed by how often rows have run to the limit.
        A lone row needs no such split: the whole round's rate below decides for it.

        The candidates, every copy cap with every gamma, are tried in that order, and one
        replaces the best so far only if it beats it. They are weighed together, in arrays
        (`_Candidates`): one by one, in Python, the search cost a round at 3 rows on a CPU
        more than the round's pass (docs/engine.md). Since a verify token's price follows the
        best rate so far, the candidates after each better one are weighed again at its price,
        so the choice is the one the candidates tried one by one would make. A lone row's
        few candidates are tried one by one (`_best_lone`): there the arrays' own overhead was
        most of a round's host time (docs/engine.md).
        """
        offers, gamma_cap = options.offers, options.gamma_cap
        rows = len(offers)
        copies = copies or _lay_out(offers, gamma_cap, self._survival)  # `choose` lays them out once
        if rows == 1:
            return self._best_lone(options, from_model, copies)
        best_rate, per_token = self._plain_bar(rows)
        return _Candidates(self, options, from_model, copies).best(best_rate, per_token, search.library())[0]

    def _plain_tokens(self, rows: int) -> int:
        """What a plain pass at `rows` rows costs in tokens, as the target's runner counts it
        (`BatchedLM.pass_tokens`) and so as its passes were measured: a static runner's pass
        computes every slot, so a draining batch's 40 rows of 64 cost 64 tokens, never measured
        as 40 (its plain rate was never known there, and every round decoded plainly)."""
        return self.target.pass_tokens([1] * rows)

    def _step_tokens(self, rows: int) -> int:
        """What a draft model's step at `rows` rows costs in tokens, as its runner counts it
        (`_plain_tokens`' rule for the draft's passes)."""
        return self.draft.pass_tokens([1] * rows) if self.draft is not None else rows

    def _plain_bar(self, rows: int) -> tuple[float, float]:
        """What a choice of `best` at `rows` > 1 rows must beat, plain decoding's rate with the
        margin, and the seconds an extra verify token costs (nothing in a padded pass)."""
        plain_seconds = self.costs.target_time(self._plain_tokens(rows))
        per_token = 0.0
        if self.target.pack:
            per_token = max((self.costs.target_time(3 * rows) - plain_seconds) / (2 * rows), 0.0)
        return rows / plain_seconds * (1 + self.config.min_gain), per_token

    def _best_lone(self, options: RoundOptions, from_model: list[float], copies: _LoneCopies) -> Choice:
        """`best` for a lone row, its candidates tried one by one in the same order, on the same
        numbers, by the same operations as `_Candidates` weighs them (a lone row: every weight 1,
        a verify token priced at nothing, no drain), so the choice is the same. A candidate
        whose draft model the row would not take is not tried; one with the draft model is worth
        the same at every cap where the row takes it, so only its first such cap can win."""
        costs, target = self.costs, self.target
        best, best_rate = (
            Choice(0, 0, [None]),
            1 / costs.target_time(self._plain_tokens(1)) * (1 + self.config.min_gain),
        )
        model_tokens = list(itertools.accumulate(from_model[: options.gamma_cap + 1]))  # summed in order
        draft_time = costs.draft_time(self._step_tokens(1)) or 0.0
        gammas = range(options.gamma_cap + 1) if options.use_model else range(1)
        seconds: dict[int, float] = {}  # a pass's seconds by its row's length

        def pass_seconds(length: int) -> float:
            if length not in seconds:
                seconds[length] = costs.target_time(target.pass_tokens([length]))
            return seconds[length]

        for cap in range(copies.longest + 1) if copies.offers[0] else range(1):
            copy_tokens, copy_drafts, copy_source = copies.best_at(cap)
            for gamma in gammas:
                if gamma:
                    tokens = model_tokens[gamma]
                    if not tokens > 1.0 or copy_tokens > tokens:
                        continue  # the row takes a copy or plain: the draft model would run for nobody
                    drafts, source = gamma, DRAFT_MODEL
                elif copy_tokens > 1.0:
                    tokens, drafts, source = copy_tokens, copy_drafts, copy_source
                else:
                    tokens, drafts, source = 1.0, 0, None
                round_seconds = gamma * draft_time + pass_seconds(drafts + 1)
                if gamma:
                    round_seconds += options.catch_up * min(tokens / max(options.remaining, 1), 1.0)
                if tokens / round_seconds > best_rate * 1.0001:
                    best, best_rate = Choice(cap, gamma, [source]), tokens / round_seconds
        return best


def _lay_out(offers: list[list[Offer]], gamma_cap: int, survival) -> _Copies | _LoneCopies:
    """A round's copies as `Policy.best` weighs them: a lone row's in Python, more rows' in arrays."""
    if len(offers) == 1:
        return _LoneCopies(offers, gamma_cap, survival)
    return _Copies(offers, gamma_cap, survival, search.library())


class _LoneCopies:
    """A lone row's copies for `Policy._best_lone`: each offer's drafts up to `gamma_cap` and the
    expected tokens of its first k drafts, k = 0..., summed in order as `_Copies` sums them."""

    def __init__(self, offers: list[list[Offer]], gamma_cap: int, survival):
        self.offers = offers
        self.drafts = [min(offer.tokens, gamma_cap) for offer in offers[0]]
        self.sums = [list(itertools.accumulate(survival(offer, gamma_cap))) for offer in offers[0]]
        self.longest = max(self.drafts, default=0)

    def expected_at(self, cap: int) -> list[list[float]]:
        """Each offer's expected tokens when it is taken at `cap`, as `_Copies.expected_at`."""
        return [[sums[min(drafts, cap, len(sums) - 1)] for drafts, sums in zip(self.drafts, self.sums)]]

    def best_at(self, cap: int) -> tuple[float, int, str | None]:
        """The offer worth most at `cap` (the first of equals): its expected tokens, drafts and
        source; -inf tokens where none can be taken (cap 0, no offer)."""
        found = (-math.inf, 0, None)
        if cap:
            for offer, drafts, sums in zip(self.offers[0], self.drafts, self.sums):
                taken = min(drafts, cap)
                expected = sums[min(taken, len(sums) - 1)]  # no more past its last chance
                if expected > found[0]:
                    found = (expected, taken, offer.source)
        return found


class _Copies:
    """A round's copies as arrays for `Policy.best`, which weighs every row at each cap at once
    (a row at a time, at batch 64, cost more than a captured GPU pass): per row and offer, the
    drafts offered up to `gamma_cap`, the expected tokens of its first k drafts, k = 0..., and
    its survival (P(it gains at least k tokens), k = 1..., `survival_lengths` of them known)."""

    def __init__(self, offers: list[list[Offer]], gamma_cap: int, survival, lib: ctypes.CDLL | None = None):
        """`lib`: `search.library()`, which lays the arrays out in one call (at 3 rows the
        numpy below cost a round's lookups and search together, some twenty operations on
        arrays of a few dozen numbers); None: the numpy, the reference."""
        rows, self.width = len(offers), max([1, *map(len, offers)])  # a column held by none: no offers
        self.offers = offers
        shape, span = (rows, self.width), gamma_cap + 1  # span: k = 0..gamma_cap
        # Offers of one source and depth share their chances, a shorter one the first of a
        # longer one's (a head's are its own): each group's chances are asked for once, as deep
        # as its deepest offer, and every offer is written from its group's row of one table.
        groups: dict[object, int] = {}  # a group's key -> its row of the table
        firsts: list[Offer] = []  # each group's first offer
        deepest: list[int] = []  # each group's most drafts
        places: list[int] = []  # each offer's row, column, group and drafts, one after another
        for i, row in enumerate(offers):
            for j, (source, tokens, depth, own) in enumerate(row):
                key = (i, j) if own else (source, depth)
                drafts = tokens if tokens < gamma_cap else gamma_cap
                group = groups.get(key)
                if group is None:
                    group = groups[key] = len(firsts)
                    firsts.append(row[j])
                    deepest.append(drafts)
                elif drafts > deepest[group]:
                    deepest[group] = drafts
                places += (i, j, group, drafts)
        chances: list[float] = []  # `span` a group, each group's: past its last chance, unread ones
        known_by_group: list[int] = []
        for offer, drafts in zip(firsts, deepest):
            own = survival(offer._replace(tokens=drafts), gamma_cap)
            chances += own
            chances += [1.0] * (span - len(own))
            known_by_group.append(len(own))
        if lib is not None:
            self.tokens = np.empty(shape, dtype=np.int64)
            self.expected = np.empty((*shape, span))
            self.survivals = np.empty((*shape, span))
            self.survival_lengths = np.empty(shape, dtype=np.int64)
            self.held = np.empty(shape, dtype=bool)
            search.lay_out(lib, self, places, chances, known_by_group)
        else:
            self._lay_out(
                places, np.array(chances).reshape(-1, span), np.array(known_by_group, dtype=np.int64)
            )
        self.columns = np.arange(self.width)  # an offer's column, for indexing [rows, offers, k]
        self.longest = int(self.tokens.max(initial=0))

    def _lay_out(self, places: list[int], chances: np.ndarray, known_by_group: np.ndarray) -> None:
        """The arrays from the offers' places and their groups' chances, in numpy."""
        rows, depth = len(self.offers), chances.shape[1]
        self.tokens = np.zeros((rows, self.width), dtype=np.int64)
        self.expected = np.ones((rows, self.width, depth))
        self.survivals = np.ones((rows, self.width, depth))
        self.survival_lengths = np.ones((rows, self.width), dtype=np.int64)
        self.held = np.zeros((rows, self.width), dtype=bool)
        if not places:
            return
        sums = np.cumsum(chances, axis=1)  # summed in order, as `sum` would
        i, j, group, drafts = np.array(places, dtype=np.int64).reshape(-1, 4).T
        group = group[:, None]
        k = np.arange(depth)[None, :]
        most = known_by_group[group]
        known = np.minimum(drafts[:, None] + 1, most)  # the chances each offer has
        self.tokens[i, j] = drafts
        self.expected[i, j] = sums[group, np.minimum(k, known - 1)]  # no more past its last chance
        self.survivals[i, j] = np.where(k < known, chances[group, np.minimum(k, most - 1)], 1.0)
        self.survival_lengths[i, j] = known[:, 0]
        self.held[i, j] = True

    def source(self, row: int, offer: int) -> str:
        return self.offers[row][offer].source

    def expected_at(self, cap: int) -> list[list[float]]:
        """Each row's offers' expected tokens when taken at `cap` (a column held by none: 1)."""
        drafts = np.minimum(self.tokens, cap)
        return np.take_along_axis(self.expected, drafts[:, :, None], axis=2)[:, :, 0].tolist()


class _Candidates:
    """A round's candidate choices for `Policy.best`, every (cap, gamma) in the order tried,
    weighed in arrays [candidate, row, ...] by the same operations, on the same numbers, in
    the same order as one at a time: sums and products run in row order (`accumulate`), so
    every rate is bit for bit what a loop over the candidates computes."""

    def __init__(self, policy: Policy, options: RoundOptions, from_model, copies: _Copies):
        self.policy, self.options, self.copies = policy, options, copies
        rows, gamma_cap = len(options.offers), options.gamma_cap
        budgets = options.drain_budgets if rows > 1 else None
        # Past the longest offer a larger cap changes no row's copy, only a drain's reach: the
        # choices would repeat, each costing a pass over every row.
        self.cap_count = (gamma_cap if budgets else copies.longest) + 1 if any(options.offers) else 1
        self.gamma_count = gamma_cap + 1 if options.use_model else 1
        self.from_model = np.asarray(from_model[: gamma_cap + 1], dtype=np.float64)
        model_sums = list(itertools.accumulate(from_model[: gamma_cap + 1]))  # summed in order
        self.model_sums = np.asarray(model_sums, dtype=np.float64)
        self.draining = budgets is not None
        self.to_limit = policy.runs_to_limit.value if budgets else 0.0
        most = max(budgets) if budgets else 0  # (once: a row at a time it was O(rows²))
        self.leads = np.array([most - b for b in budgets] if budgets else [0] * rows, dtype=np.int64)
        self.draft_time = policy.costs.draft_time(policy._step_tokens(rows)) or 0.0
        self.pass_seconds: dict[int, float | None] = {}  # a pass's seconds by its cost in tokens
        self._chosen: np.ndarray | None = None  # [candidates from _start on, rows]: each row's source
        self._weighed: tuple | None = None  # (price, weighed, rates) of the candidates from _start on
        self._start = 0

    # each candidate's cap, gamma and the draft model's expected tokens, for the arrays' path
    @functools.cached_property
    def caps(self) -> np.ndarray:
        return np.repeat(np.arange(self.cap_count, dtype=np.int64), self.gamma_count)

    @functools.cached_property
    def gammas(self) -> np.ndarray:
        return np.tile(np.arange(self.gamma_count, dtype=np.int64), self.cap_count)

    @functools.cached_property
    def model_tokens(self) -> np.ndarray:
        return self.model_sums[self.gammas]

    def best(self, best_rate: float, per_token: float, lib: ctypes.CDLL | None) -> tuple[Choice, float]:
        """The last candidate, in the order tried, to beat the best before it, starting from
        plain at `best_rate`, a verify token priced at `per_token` times the best rate so far;
        and its rate (plain's: `best_rate`). In one call of `search.cpp` where `lib` is given
        (`search.library()`), else weighed here in arrays: the same choice and rate, bit for bit."""
        plain = Choice(0, 0, [None] * len(self.leads))
        if lib is not None:
            found = search.best_candidate(
                lib,
                self.copies,
                self.cap_count,
                self.gamma_count,
                self.from_model,
                self.model_sums,
                self.leads if self.draining else None,
                self.to_limit,
                self.draft_time,
                self.options.catch_up,
                self.options.remaining,
                best_rate,
                per_token,
                self.policy.target.pack,
                self.policy.target.pass_tokens,
                self.policy.costs.target_time,
            )
            if found is None:
                return plain, best_rate
            cap, gamma, chosen, rate = found
            return Choice(cap, gamma, self._sources(chosen)), rate
        best, start = plain, 0
        while (better := self.first_better(start, best_rate, best_rate * per_token)) is not None:
            start, best_rate = better
            best = self.choice(start)
            start += 1
        return best, best_rate

    def first_better(self, start: int, best_rate: float, price: float) -> tuple[int, float] | None:
        """The first candidate from `start` on whose tokens (or a drain's worth) per second
        beat `best_rate` by the margin `best` asks, with a verify token priced at `price`, and
        its rate; None if none does. Candidates weighed at this price before are not weighed
        again: the bar only rises, so one left out below an earlier bar stays out."""
        bar = best_rate * 1.0001
        if self._weighed is None or self._weighed[0] != price or self._start > start:
            self._start = start
            self._weighed = (price, *self._weigh(start, bar, price))
        _, good, rates = self._weighed
        offset = start - self._start
        better = np.flatnonzero(good[offset:] & (rates[offset:] > bar))
        if not len(better):
            return None
        index = offset + int(better[0])
        return self._start + index, float(rates[index])

    def _weigh(self, start: int, bar: float, price: float) -> tuple[np.ndarray, np.ndarray]:
        """Which candidates from `start` on were weighed (a draft model running for nobody
        is not; in a drain, nor is one whose bound cannot pass `bar`) and their rates, with
        a verify token priced at `price`; each one's choice of source by row is kept for
        `choice`."""
        copies, rows, to_limit = self.copies, len(self.leads), self.to_limit
        caps, gammas, model_tokens = self.caps[start:], self.gammas[start:], self.model_tokens[start:]
        r = np.arange(rows)[None, :]
        weight = np.ones((len(caps), rows))
        if self.draining:
            # Only rows within `reach` of the one furthest behind can hold its end back this
            # round; they share what the round is worth, the rows ahead get nothing.
            holding = self.leads[None, :] < np.maximum(caps, gammas)[:, None]
            near = np.maximum(holding.sum(axis=1), 1)
            weight = 1.0 - to_limit + np.where(holding, to_limit * rows / near[:, None], 0.0)
            keys, per, key_weight = caps, np.arange(len(caps)), weight  # each candidate's own
        else:  # every weight 1: the candidates of a cap share its copies, weighed once
            keys, per = np.unique(caps, return_inverse=True)
            key_weight = np.ones((len(keys), rows))
        # each row's copies truncated at the cap: drafts and expected tokens [caps, rows, copies]
        drafts = np.minimum(copies.tokens[None], keys[:, None, None])
        expected = copies.expected[r[:, :, None], copies.columns[None, None, :], drafts]
        copyable = copies.held[None] & (keys > 0)[:, None, None]
        values = np.where(copyable, key_weight[:, :, None] * expected - price * drafts, -np.inf)
        key, column = np.arange(len(keys))[:, None], values.argmax(axis=2)
        copy_value, copy_drafts, copy_tokens = (
            values[key, r, column][per],
            drafts[key, r, column][per],
            expected[key, r, column][per],
        )
        column = column[per]
        # each row's choice: the first worth most of plain, the draft model, its copies
        model_value = weight * model_tokens[:, None] - price * gammas[:, None]
        model_value[gammas == 0] = -np.inf
        picked = copy_value > np.maximum(weight, model_value)
        by_model = (model_value > weight) & ~picked
        tried = (gammas == 0) | by_model.any(axis=1)  # else the draft model would run for nobody
        chosen = np.where(picked, 2 + column, by_model.astype(np.int64))
        row_drafts = np.where(by_model, gammas[:, None], np.where(picked, copy_drafts, 0))
        row_tokens = np.where(by_model, model_tokens[:, None], np.where(picked, copy_tokens, 1.0))
        tokens = np.add.accumulate(row_tokens, axis=1)[:, -1]  # in row order, as a choice is compared
        lengths = row_drafts + 1
        seconds = gammas * self.draft_time + self._pass_seconds(lengths, tried)
        # with the draft model, this round's share of its one-off catch-up: tokens / remaining of it
        catch_up = self.options.catch_up * np.minimum(tokens / max(self.options.remaining, 1), 1.0)
        seconds = np.where(gammas > 0, seconds + catch_up, seconds)
        with np.errstate(invalid="ignore"):
            if self.draining:
                # A drain's advance is at most the expected tokens of a row furthest behind
                # (`expected_drain_advance`: its chances bound every product, and the sums
                # round alike); it is worked out only where that bound could beat the bar.
                furthest = np.where(self.leads == 0, row_tokens, np.inf).min(axis=1)
                bound = ((1.0 - to_limit) * tokens + to_limit * rows * furthest) / seconds
                tried &= bound > bar
                advance = self._drain_advance(chosen, lengths, gammas, tried)
                rates = ((1.0 - to_limit) * tokens + to_limit * rows * advance) / seconds
            else:
                rates = tokens / seconds
        self._chosen = chosen
        return tried, rates

    def choice(self, index: int) -> Choice:
        """The candidate at `index`, as it was weighed last."""
        chosen = self._chosen[index - self._start].tolist()
        return Choice(int(self.caps[index]), int(self.gammas[index]), self._sources(chosen))

    def _sources(self, chosen: list[int]) -> list[str | None]:
        """Each row's source from its choice: 0 plain, 1 the draft model, 2 + c its copy in column c."""
        source = self.copies.source
        return [source(i, c - 2) if c >= 2 else DRAFT_MODEL if c else None for i, c in enumerate(chosen)]

    def _pass_seconds(self, lengths: np.ndarray, tried: np.ndarray) -> np.ndarray:
        """The target pass's measured seconds for each tried candidate's row lengths."""
        out = np.full(len(lengths), np.inf)
        target, costs, known = self.policy.target, self.policy.costs, self.pass_seconds
        for n in np.flatnonzero(tried).tolist():
            cost = target.pass_tokens(lengths[n].tolist())
            if cost not in known:
                known[cost] = costs.target_time(cost)
            out[n] = known[cost]
        return out

    def _drain_advance(self, chosen, lengths, gammas, tried) -> np.ndarray:
        """`expected_drain_advance` of each tried candidate's rows, as arrays: the chance that
        every row gets within k of its limit, a product in row order, summed over k in order
        up to the first k some row cannot reach."""
        copies, depth = self.copies, len(self.from_model)
        out = np.zeros(len(tried))
        index = np.flatnonzero(tried)
        if not len(index):
            return out
        chosen, lengths, gammas = chosen[index], lengths[index], gammas[index]
        r = np.arange(chosen.shape[1])[None, :]
        offer = np.clip(chosen - 2, 0, copies.width - 1)
        # how many of each row's chances count: gamma + 1 of the draft model's, the copy's up
        # to its length (or as deep as known), and a plain row's one
        known = np.where(
            chosen == 1,
            gammas[:, None] + 1,
            np.where(chosen >= 2, np.minimum(lengths, copies.survival_lengths[r, offer]), 1),
        )
        k = np.arange(1, depth + 2)[:, None]  # a row furthest behind has no chance past depth + 1
        need = k - self.leads[None, :]  # [k, rows]
        counted = need > 1
        at = np.clip(need - 1, 0, depth - 1)  # [k, rows]
        model = self.from_model[at][None]  # [1, k, rows]
        copied = copies.survivals[r[:, None, :], offer[:, None, :], at[None]]  # [candidates, k, rows]
        chance = np.where((chosen == 1)[:, None, :], model, np.where((chosen >= 2)[:, None, :], copied, 1.0))
        beyond = counted[None] & (need[None] > known[:, None, :])
        factor = np.where(counted[None] & ~beyond, chance, 1.0)
        p = np.multiply.accumulate(factor, axis=2)[:, :, -1]
        reached = ~np.logical_or.accumulate(beyond.any(axis=2), axis=1)
        out[index] = np.add.accumulate(np.where(reached, p, 0.0), axis=1)[:, -1]
        return out
