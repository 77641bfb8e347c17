"""The speculative decoder: a batch of prompts in, the target model's own completions out.

`generate` runs rounds until every row is done; one round (`_round`), for every unfinished row
at once:
  1. draft: the free drafters (prompt lookup, suffix) offer copies, the policy (`policy.py`) chooses
     each row's source and how many tokens from measured costs and acceptance, and the draft
     model drafts for the rows it serves, stopping a row early where its confidence says one
     more draft will not pay;
  2. verify: ONE target forward pass over each row's unfed tokens plus its drafts;
  3. accept: each row keeps the drafts the target agrees with (greedy: equal to its argmax;
     sampling: the accept/resample rule) plus one token from the target itself;
  4. evict: rows that hit EOS, a stop string or max_new_tokens leave the batch, and waiting
     prompts take their places (prefilled beside the running rows: continuous batching).
The caches are rolled back lazily at the start of the next round (`BatchedLM.sync`).
With the drafter "none" the same loop is plain target-only decoding: the baseline for speedups.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from pipeline.decode import static_lm
from pipeline.decode.costs import CostModel
from pipeline.decode.drafters import Drafter, DraftModelDrafter, PromptLookupDrafter, Proposal
from pipeline.decode.head import DraftHead, HeadDrafter, OnlineHead
from pipeline.decode.policy import Choice, DraftingGate, Offer, Policy, RoundOptions
from pipeline.decode.sampling import SamplingParams, choose, greedy_choices, verify
from pipeline.decode.settings import DRAFT_MODEL, DRAFTERS, HEAD, PROMPT_LOOKUP, EngineConfig
from pipeline.decode.stats import BatchStats, RowStats
from pipeline.decode.suffix import Reflow, SuffixCorpus, SuffixDrafter
from pipeline.models.architecture import plain_head


class PromptError(ValueError):
    """A prompt the engine cannot decode (empty, or too long and the caller chose to refuse)."""


@dataclass
class RowOutput:
    tokens: list[int]
    finish_reason: str  # "eos", "stop" or "length"
    prompt_tokens: int
    truncated_tokens: int  # prompt tokens dropped to fit the context window
    stats: RowStats


@dataclass
class _Row:
    """Book-keeping for one row while it decodes."""

    index: int
    seq: list[int]
    prompt_len: int
    stats: RowStats = field(default_factory=RowStats)
    finish_reason: str | None = None
    admitted: float = 0.0  # perf_counter when it joined the batch


@dataclass
class _Batch:
    """One `generate` call while it runs: its rows, the rows decoding now, and its drafters."""

    rows: list[_Row]
    waiting: deque[_Row]
    size: int  # places: rows decoding at once
    max_new_tokens: int
    stop_strings: Sequence[str]
    sampling: SamplingParams
    generator: torch.Generator
    drafters: list[Drafter]  # every drafter that follows the rows
    copiers: list[Drafter]  # the free drafters whose proposals are offered, in order of preference
    model: DraftModelDrafter | None  # the draft model, when it may draft
    stats: BatchStats
    head: HeadDrafter | None = None  # the draft head, when the batch drafts with it
    active: list[_Row] = field(default_factory=list)
    idle_seconds: float = 0.0  # rounds' seconds times the share of places left free while rows waited


# Drafts a prompt-lookup round on the device verifies at most (`EngineConfig.lookup_steps`): a
# pass of width 4, one of the captured widths (`static_lm.WIDTHS`), or of width 2 where
# gamma_max is below 3
LOOKUP_GAMMA = 3
# Of a plain pass's expected seconds, the most the host spends on the suffix drafter's waiting
# work while a pass runs (`EngineConfig.prepare_in_passes`): past the pass's end it would delay
# the round.
PREPARE_SHARE = 0.5


@dataclass
class _Drafts:
    """One round's drafts, per row: tokens, their distributions (sampled drafts, else None) and
    the (source, depth) their acceptance is kept under (None: no draft)."""

    tokens: list[list[int]]
    probs: list[torch.Tensor | None]
    keys: list[tuple[str, int] | None]
    model_passes: int  # the draft model's passes this round (every row took part in them)

    def add(self, tokens: list[int], probs: torch.Tensor | None, key: tuple[str, int] | None) -> None:
        self.tokens.append(tokens)
        self.probs.append(probs)
        self.keys.append(key)

    @classmethod
    def none(cls, rows: int) -> _Drafts:
        """A round that asked no drafter: every row takes the target's token only."""
        return cls([[] for _ in range(rows)], [None] * rows, [None] * rows, 0)


class SpeculativeEngine:
    """Speculative decoding with a target model, an optional draft model, prompt lookup and suffix.

    One engine per model pair and process: it keeps the measured costs and acceptance across
    batches, so the first batch teaches it what a pass costs on this hardware.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel | None = None,
        *,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        config: EngineConfig | None = None,
        decode_text: Callable[[list[int]], str] | None = None,
        encode_text: Callable[[str], list[int]] | None = None,
        vocab_size: int | None = None,
        head: DraftHead | None = None,
    ):
        self.config = config or EngineConfig()
        if self.config.drafter == DRAFT_MODEL and draft is None:
            raise ValueError("drafter 'draft_model' needs a draft model")
        if self.config.drafter == HEAD and head is None:
            raise ValueError("drafter 'head' needs a draft head")
        if head is not None and not plain_head(target):
            raise ValueError("a draft head needs a target whose logits are its output layer's (no soft cap)")
        # Embedding matrices are often padded past the tokenizer (and differ between a target
        # and its draft): compare distributions over the tokens both models can produce.
        vocab = vocab_size or min(m.config.vocab_size for m in (target, draft) if m is not None)
        self.target = static_lm.runner(target, pad_token_id, vocab)
        self.draft = None
        if draft is not None:
            self.draft = DraftModelDrafter(
                draft, pad_token_id, vocab, head_tokens=self.config.draft_vocab, always=tuple(eos_token_ids)
            )
        # a head that learns as the job runs: a float32 master learns, a packed copy drafts
        self.learner = None
        if head is not None and self.config.head_online:
            self.learner = OnlineHead(head, self.config.head_online_share)
            head = self.learner.drafting
        self.head = HeadDrafter(head, self.target) if head is not None else None
        self.lookup = PromptLookupDrafter(self.config.ngram_max, self.config.ngram_min)
        # given the tokenizer both ways, the suffix drafter also matches each prompt reflowed
        self.reflow = Reflow(encode_text, decode_text) if encode_text and decode_text else None
        # outlives the batch: its corpus of this engine's outputs feeds the rows that come later
        self.suffix = SuffixDrafter(self.config.suffix_max_tokens, self.config.suffix_min_match, self.reflow)
        self.eos = frozenset(eos_token_ids)
        self.decode_text = decode_text
        self.max_context = getattr(target.config, "max_position_embeddings", None)
        self.costs = CostModel()
        self.policy = Policy(self.config, self.costs, self.target, self.draft.lm if self.draft else None)
        self.gate = DraftingGate(self.config.probe_every)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: SamplingParams | None = None,
        *,
        stop_strings: Sequence[str] = (),
        drafter: str | None = None,
        overlong: str = "error",
        batch_size: int | None = None,
        corpus: bool = True,
    ) -> tuple[list[RowOutput], BatchStats]:
        """Decode every prompt; results keep the input order.

        `drafter` overrides the configured one for this call ("none" gives the target-only
        baseline). `overlong` is "error" (raise PromptError) or "truncate" (keep the last
        tokens that fit the context with room for `max_new_tokens`, and report how many went).
        `batch_size` rows decode at once (None: all); whenever rows finish, waiting prompts
        take their places (continuous batching), so a row that speculation finishes early
        frees its place for the next one instead of idling until the slowest row is done.
        `corpus=False` keeps the suffix drafter to each row's own text, and these outputs out of
        its corpus and out of a learning head's lessons: for decoding rows again whose outputs
        the corpus already holds (a speedup sample), which would otherwise find themselves there.
        """
        sampling = sampling or SamplingParams()
        drafter = drafter or self.config.drafter
        if drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {drafter!r}")
        if stop_strings and self.decode_text is None:
            raise ValueError("stop strings need decode_text (a tokenizer's decode)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drafter == DRAFT_MODEL and self.draft is None:
            raise ValueError("drafter 'draft_model' needs a draft model")
        if drafter == HEAD and self.head is None:
            raise ValueError("drafter 'head' needs a draft head")

        rows, truncated = self._prepare(prompts, max_new_tokens, overlong)
        batch = self._start(rows, max_new_tokens, sampling, stop_strings, drafter, batch_size, corpus)
        started = time.perf_counter()
        target_seconds0, draft_seconds0 = self.target.forward_seconds, self._draft_seconds()
        self._fill(batch)
        self.target.meanwhile = self._meanwhile(batch)
        try:
            while batch.active:
                self._round(batch)
        finally:
            self.target.meanwhile = None

        stats = batch.stats
        stats.new_tokens = sum(r.stats.new_tokens for r in rows)
        stats.wall_seconds = time.perf_counter() - started
        if batch.head and batch.head.learning:
            self.learner.add(batch.head.finished, stats.wall_seconds)
            batch.head.finished = []
        stats.target_seconds = self.target.forward_seconds - target_seconds0
        stats.draft_seconds = self._draft_seconds() - draft_seconds0
        outputs = [
            RowOutput(
                tokens=r.seq[r.prompt_len :],
                finish_reason=r.finish_reason or "length",
                prompt_tokens=r.prompt_len,
                truncated_tokens=cut,
                stats=r.stats,
            )
            for r, cut in zip(rows, truncated)
        ]
        return outputs, stats

    def sources(self, drafter: str) -> set[str]:
        """The drafters a run with `drafter` drafts from (`auto`: those it chooses among)."""
        return set(self.config.auto_sources) if drafter == "auto" else {drafter} - {"none"}

    def refine_head(self) -> dict | None:
        """With `head_online`: train the head on the rows decoded since the last call (see
        `OnlineHead.refine`) and draft with it from now on; what the training did, or None."""
        record = self.learner.refine() if self.learner else None
        if record:
            self.head.replace(self.learner.drafting, self.learner.calibration)
        return record

    def reserve(self, rows: int, prompt_tokens: int, max_new_tokens: int, drafter: str | None = None) -> None:
        """Static slots (`StaticLM.reserve`) for `rows` rows of prompts up to `prompt_tokens`
        long: prompt, output, a round's drafts. Slots only grow, so a caller that warms a path
        with short prompts first reserves what the real batch needs, keeping its slots and graphs."""
        model = self.draft if DRAFT_MODEL in self.sources(drafter or self.config.drafter) else None
        longest = prompt_tokens + max_new_tokens + self.config.gamma_max + 1
        for lm in [self.target] + ([model.lm] if model else []):
            lm.reserve(rows, longest)

    def _start(self, rows, max_new_tokens, sampling, stop_strings, drafter, batch_size, corpus) -> _Batch:
        """An empty batch with every row waiting, and the drafters `drafter` asks for reset."""
        uses = self.sources(drafter)
        model = self.draft if DRAFT_MODEL in uses else None
        suffix = self.suffix if corpus else SuffixDrafter(0, self.config.suffix_min_match, self.reflow)
        copiers = [d for d in (self.lookup, suffix) if d.name in uses]
        # prompt lookup follows the rows also for the draft model: a lone row's copy is a guess
        # at the draft's own next tokens (see `DraftModelDrafter.propose`)
        drafters = [self.lookup, *([model] if model else []), *([suffix] if suffix in copiers else [])]
        head = self.head if HEAD in uses else None
        self.target.keep_features = head is not None
        drafters += [head] if head else []
        if head:  # rows decoded again (corpus off) teach the head nothing new
            head.learning, head.finished = self.learner is not None and corpus, []
        self.target.reset(0)
        for d in drafters:
            d.start([])
        longest = max((r.prompt_len for r in rows), default=0)
        self.reserve(batch_size or len(rows), longest, max_new_tokens, drafter)
        return _Batch(
            rows=rows,
            waiting=deque(rows),
            size=batch_size or len(rows),
            max_new_tokens=max_new_tokens,
            stop_strings=stop_strings,
            sampling=sampling,
            generator=torch.Generator().manual_seed(sampling.seed),
            drafters=drafters,
            copiers=copiers,
            model=model,
            stats=BatchStats(rows=len(rows)),
            head=head,
        )

    def _round(self, batch: _Batch) -> None:
        """One round for every row decoding now: draft, verify, accept, evict."""
        began = time.perf_counter()
        rows = len(batch.active)
        drafters = batch.copiers or batch.model is not None or batch.head is not None
        loop = self._lookup_steps(batch)  # rounds of prompt lookup on the device (0: on the host)
        drafting = self.config.adaptive and drafters and not loop
        # target-only asks nobody: a policy weighing no offers costs ~0.3 ms at 64 rows, a
        # tenth of a captured GPU pass
        asked = drafters and not loop and (not drafting or self.gate.asks(rows))  # see `DraftingGate`
        asking, models = time.perf_counter(), self._draft_seconds()
        drafts = self._draft(batch) if asked else _Drafts.none(rows)
        # the drafters' own time: their model passes are priced by the policy (`DraftingGate`)
        asking = time.perf_counter() - asking - (self._draft_seconds() - models)
        batch.stats.asking_seconds += asking if asked else 0.0
        batch.stats.asked_rounds += bool(asked)
        steps = 1 if asked or loop else self._plain_steps(batch)
        if loop:
            produced = self._lookup_rounds(batch, loop)
        elif steps > 1:
            produced = self._greedy_steps(batch, steps)
        else:
            logits = self._verify(batch, drafts)
            produced = self._accept(batch, drafts, logits)
        if batch.head:
            batch.head.follow([r.seq for r in batch.active])
        # a head's catch-up feeding (a prompt's pairs) is a cost of following the rows, not
        # of this round's drafting: rounds are compared by their rate (`HeadDrafter.take_catch_up`)
        seconds = time.perf_counter() - began - (batch.head.take_catch_up() if batch.head else 0.0)
        self.costs.observe_round(produced, seconds)
        if drafting:
            self.gate.observe(rows, asked, produced, seconds, sum(map(len, drafts.tokens)), asking, steps)
        plain = self.costs.target_time(self.target.pass_tokens([1] * rows))
        batch.stats.priced_plain_seconds += produced * plain / rows
        if batch.waiting:
            batch.idle_seconds += seconds * (batch.size - rows) / batch.size
        self._evict(batch)
        self._fill(batch)

    def _meanwhile(self, batch: _Batch) -> Callable[[float], None] | None:
        """What the host does while the target's passes run (`BatchedLM.meanwhile`): the batch's
        suffix drafter prepares (`SuffixDrafter.prepare`), for up to PREPARE_SHARE of a plain
        pass at the batch's rows then. None where it is off (`EngineConfig.prepare_in_passes`)
        or the batch has no suffix drafter."""
        on = self.config.prepare_in_passes
        on = self.target.device.type == "cuda" if on is None else on
        suffix = next((d for d in batch.copiers if isinstance(d, SuffixDrafter)), None)
        if not on or suffix is None:
            return None

        def prepare(began: float) -> None:
            plain = self.costs.target_time(self.target.pass_tokens([1] * max(len(batch.active), 1)))
            if plain:
                suffix.prepare(began + PREPARE_SHARE * plain)

        return prepare

    def _draft(self, batch: _Batch) -> _Drafts:
        """The free drafters' copies and the draft head's chains, then the draft model for the
        rows the policy gives it; with the head alone, its drafts for every row."""
        seqs = [r.seq for r in batch.active]
        left = [batch.max_new_tokens - r.stats.new_tokens for r in batch.active]  # each row's budget
        gamma_cap = min(self.config.gamma_max, min(left))
        if self.target.max_verify_tokens:  # a verify pass feeds the drafts and the last token
            gamma_cap = min(gamma_cap, self.target.max_verify_tokens - 1)
        head = None
        if batch.head:  # a few cheap steps, each draft kept while it pays (`Policy.head_length`)
            rule = self.policy.head_length(batch.head.step_seconds, self.gate.probing)  # None: fixed gamma
            worth = self.costs.token_seconds() if self.config.adaptive else None  # None: never rests
            sampling, generator = batch.sampling, batch.generator
            head = batch.head.propose(seqs, gamma_cap, sampling, generator, rule=rule, token_seconds=worth)
            if not batch.copiers and batch.model is None:
                drafts = _Drafts([], [], [], 0)
                for tokens in head.tokens:
                    drafts.add(tokens, None, (HEAD, 0) if tokens else None)
                return drafts
        # A lone row's prompt-lookup copy is also a guess at the draft model's own chain.
        guessing = batch.model is not None and len(seqs) == 1 and self.config.guess_tokens > 0
        # where two copy, one whose copies add too little over the other's rests (`CopierPrices`)
        copiers = self.policy.copiers.asked([d.name for d in batch.copiers]) if self.config.adaptive else None
        asked = [d for d in batch.copiers if copiers is None or d.name in copiers]
        asked += [self.lookup] if guessing and self.lookup not in asked else []
        copies, seconds = {}, {}
        for d in asked:
            began = time.perf_counter()
            copies[d.name] = d.propose(seqs, gamma_cap, batch.sampling, batch.generator)
            seconds[d.name] = time.perf_counter() - began
        named = [d.name for d in batch.copiers if d.name in copies]  # in the copiers' order
        proposed = [(name, copies[name].tokens, copies[name].depths) for name in named]
        offers = [
            [Offer(name, len(tokens[i]), depths[i]) for name, tokens, depths in proposed if tokens[i]]
            for i in range(len(seqs))
        ]
        if head is not None:  # offered with its own chances, calibrated, for the policy to weigh
            copies[HEAD] = head
            for row, tokens, chances in zip(offers, head.tokens, batch.head.chances()):
                if tokens:
                    row.append(Offer(HEAD, len(tokens), 0, tuple(chances)))
        options = RoundOptions(
            offers=offers,
            use_model=batch.model is not None,
            gamma_cap=gamma_cap,
            remaining=sum(left),
            catch_up=self._draft_catch_up(seqs) if batch.model else 0.0,
            drain_budgets=None if batch.waiting else left,
        )
        copier_seconds = {name: seconds[name] for name in copiers or ()}  # those priced asked
        choice = self.policy.choose(options, probe=self.gate.probing, copier_seconds=copier_seconds)
        guess = copies[PROMPT_LOOKUP].tokens[0][: self.config.guess_tokens] if guessing else None
        model = self._draft_model(batch, seqs, options, choice, guess)
        drafts = _Drafts([], [], [], model.model_passes)
        for i, source in enumerate(choice.sources):
            if source == DRAFT_MODEL and model.tokens[i]:
                drafts.add(model.tokens[i], model.probs[i], (DRAFT_MODEL, 0))
            elif source in copies:
                drafts.add(copies[source].tokens[i][: choice.cap], None, (source, copies[source].depths[i]))
            else:
                drafts.add([], None, None)
        if head is not None:  # the head learns from the drafts of its that went to the target
            batch.head.sent([len(t) if k and k[0] == HEAD else 0 for t, k in zip(drafts.tokens, drafts.keys)])
        return drafts

    def _verify(self, batch: _Batch, drafts: _Drafts) -> list[torch.Tensor]:
        """One target pass over each row's unfed tokens plus its drafts: the logits after each."""
        unfed = self.target.sync([r.seq for r in batch.active])
        blocks = [u + d for u, d in zip(unfed, drafts.tokens)]
        before = self.target.forward_seconds
        logits = self.target.forward(blocks, [len(d) + 1 for d in drafts.tokens])
        cost = self.target.pass_tokens([len(b) for b in blocks])
        self._count_passes(batch, cost, self.target.forward_seconds - before, max(map(len, drafts.tokens)))
        return logits

    def _count_passes(self, batch: _Batch, cost: int, seconds: float, widest: int, passes: int = 1) -> None:
        """`passes` target passes of `cost` tokens each (`BatchedLM.pass_tokens`), `seconds` in
        all, the widest row verifying `widest` drafts: the costs learn each, the stats count them."""
        for _ in range(passes):
            self.costs.observe_target(cost, seconds / passes)
        batch.stats.priced_seconds += passes * self.costs.target_time(cost)
        batch.stats.target_passes += passes
        batch.stats.gamma_histogram[widest] = batch.stats.gamma_histogram.get(widest, 0) + passes

    def _plain_steps(self, batch: _Batch) -> int:
        """Passes a round without drafts makes back to back: greedy rows whose last token alone
        is unfed, a few passes, never past the nearest row's token limit, never while a free
        place waits for a row (1: a plain round)."""
        if not batch.sampling.greedy or batch.head is not None:
            return 1
        if batch.waiting and len(batch.active) < batch.size:
            return 1
        left = min(batch.max_new_tokens - r.stats.new_tokens for r in batch.active)
        return max(1, min(self.config.plain_steps or self.target.plain_steps, left))

    def _greedy_steps(self, batch: _Batch, steps: int) -> int:
        """`steps` target passes of one token a row, back to back (`BatchedLM.greedy_steps`);
        each row keeps its choices up to its EOS, limit or stop string, as that many plain
        rounds would. A row that ends early rode the remaining passes: a graph pass computes
        every slot anyway. Returns the tokens produced."""
        unfed = self.target.sync([r.seq for r in batch.active])
        if any(len(u) != 1 for u in unfed):  # a row catching up: one plain round
            drafts = _Drafts.none(len(unfed))
            return self._accept(batch, drafts, self._verify(batch, drafts))
        before = self.target.forward_seconds
        chosen = self.target.greedy_steps([u[0] for u in unfed], steps)
        cost = self.target.pass_tokens([1] * len(unfed))
        self._count_passes(batch, cost, self.target.forward_seconds - before, 0, steps)
        produced = 0
        for row, tokens in zip(batch.active, chosen):
            kept = self._append(row, tokens, batch)
            produced += kept
            row.stats.target_passes += kept
            row.stats.target_tokens += kept
            batch.stats.row_passes += kept
            batch.stats.rounds.observe(None, 0, 0, kept, rounds=kept)
        return produced

    def _lookup_steps(self, batch: _Batch) -> int:
        """Rounds of prompt lookup the device runs back to back now (`EngineConfig.
        lookup_steps`; 0: a round on the host): greedy prompt lookup alone, on a runner with
        such rounds (`StaticLM.lookup_steps`), never while a free place waits for a row."""
        if self.config.lookup_steps < 2 or self.config.gamma_max < 1:
            return 0
        if [d.name for d in batch.copiers] != [PROMPT_LOOKUP]:
            return 0
        if not batch.sampling.greedy or batch.head is not None or batch.model is not None:
            return 0
        if not hasattr(self.target, "lookup_steps") or self.target.keep_features:  # a head learning
            return 0
        if batch.waiting and len(batch.active) < batch.size:
            return 0
        return self.config.lookup_steps

    def _lookup_rounds(self, batch: _Batch, steps: int) -> int:
        """`steps` rounds of prompt lookup drafted, verified and accepted on the device
        (`StaticLM.lookup_steps`), each row keeping its tokens up to its EOS, limit or stop
        string as that many rounds would, and counted round by round. Returns the tokens produced."""
        unfed = self.target.sync([r.seq for r in batch.active])
        if any(len(u) != 1 for u in unfed):  # a row catching up: one plain round
            drafts = _Drafts.none(len(unfed))
            return self._accept(batch, drafts, self._verify(batch, drafts))
        budgets = [batch.max_new_tokens - r.stats.new_tokens for r in batch.active]
        before = self.target.forward_seconds
        gamma = LOOKUP_GAMMA if self.config.gamma_max >= LOOKUP_GAMMA else 1
        ngrams = tuple(range(self.config.ngram_max, self.config.ngram_min - 1, -1))  # the host lookup's
        made, rounds = self.target.lookup_steps([u[0] for u in unfed], gamma, steps, budgets, ngrams)
        cost = self.target.pass_tokens([gamma + 1] * len(unfed))
        self._count_passes(batch, cost, self.target.forward_seconds - before, gamma, steps)
        produced = 0
        for row, tokens, row_rounds in zip(batch.active, made, rounds):
            left = self._append(row, tokens, batch)
            produced += left
            for drafted, accepted in row_rounds:
                if left <= 0:
                    break
                kept = min(accepted + 1, left)
                left -= kept
                self._count_row(batch, row, PROMPT_LOOKUP if drafted else None, drafted, accepted, kept)
        return produced

    def _count_row(
        self,
        batch: _Batch,
        row: _Row,
        source: str | None,
        drafted: int,
        accepted: int,
        kept: int,
        draft_passes: int = 0,
    ) -> None:
        """A row's verify pass in the counters: `drafted` drafts of `source`, `accepted` of
        them, `kept` tokens kept (fewer where the row ended inside them)."""
        stats = row.stats
        stats.target_passes += 1
        stats.draft_passes += draft_passes
        stats.drafted += drafted
        stats.accepted += min(accepted, kept)
        stats.target_tokens += kept - min(accepted, kept)
        if source:
            for by, count in (
                (stats.drafted_by, drafted),
                (stats.accepted_by, min(accepted, kept)),
                (batch.stats.drafted_by, drafted),
                (batch.stats.accepted_by, accepted),
            ):
                by[source] = by.get(source, 0) + count
        batch.stats.drafted += drafted
        batch.stats.accepted += accepted
        batch.stats.row_passes += 1
        batch.stats.rounds.observe(source, drafted, accepted, kept)

    def _accept(self, batch: _Batch, drafts: _Drafts, logits: list[torch.Tensor]) -> int:
        """Each row keeps the drafts the target agrees with plus one token of the target's own;
        the counters and the policy learn how each source did. Returns the tokens produced."""
        outcomes: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
        produced = 0
        argmax: list[list[int] | None] = [None] * len(logits)
        if batch.sampling.greedy and logits:  # one read of the whole batch's choices
            argmax = greedy_choices(logits, False)[0]
        rows = zip(batch.active, drafts.tokens, drafts.probs, drafts.keys, logits, argmax)
        for row, draft, draft_probs, key, row_logits, row_argmax in rows:
            accepted, token = verify(
                row_logits, draft, draft_probs, batch.sampling, batch.generator, argmax=row_argmax
            )
            kept = self._append(row, draft[:accepted] + [token], batch)
            produced += kept
            source = key[0] if key else None
            self._count_row(batch, row, source, len(draft), accepted, kept, drafts.model_passes)
            if key:
                outcomes[key].append((accepted, len(draft)))
        self.policy.observe(outcomes)
        return produced

    def _draft_model(
        self,
        batch: _Batch,
        seqs: list[list[int]],
        options: RoundOptions,
        choice: Choice,
        guess: list[int] | None,
    ) -> Proposal:
        """The draft model's proposal for the round (none when the choice gives it no gamma)."""
        if not choice.gamma:
            return Proposal([[] for _ in seqs], [None] * len(seqs))
        steps, keep = self.policy.draft_length(options, *choice)
        model = batch.model.propose(seqs, steps, batch.sampling, batch.generator, keep, guess)
        batch.stats.draft_passes += model.model_passes
        for p in model.passes:
            if p.cold:
                batch.stats.draft_prefill_seconds += p.seconds
                self.costs.observe_prefill("draft", p.tokens, p.seconds)
            else:
                self.costs.observe_draft(p.cost_tokens, p.seconds)
                batch.stats.priced_seconds += self.costs.draft_time(p.cost_tokens)
        return model

    def _fill(self, batch: _Batch) -> None:
        """Prefill waiting rows into free places: one target pass gives each its first token.
        Rows that end at that token free their places again, so this repeats while it can."""
        while batch.waiting and len(batch.active) < batch.size and self._admits_now(batch):
            new = [
                batch.waiting.popleft()
                for _ in range(min(batch.size - len(batch.active), len(batch.waiting)))
            ]
            began = time.perf_counter()
            for row in new:
                row.admitted = began
            before = self.target.forward_seconds
            logits = self.target.admit([r.seq for r in new], [1] * len(new))
            seconds = self.target.forward_seconds - before
            batch.stats.prefill_seconds += seconds
            batch.stats.prefill_tokens += self.target.fed_tokens
            self.costs.observe_prefill("target", self.target.fed_tokens, seconds)
            batch.stats.target_passes += 1
            batch.stats.row_passes += len(new)
            # greedy: the batch's first tokens in one read (one a row costs a GPU round trip each)
            firsts = greedy_choices(logits, False)[0] if batch.sampling.greedy else None
            for n, (row, row_logits) in enumerate(zip(new, logits)):
                if firsts:
                    token = firsts[n][-1]
                else:
                    token, _ = choose(row_logits[-1], batch.sampling, batch.generator)
                self._append(row, [token], batch)
                row.stats.target_passes += 1
                row.stats.target_tokens += 1
            for d in batch.drafters:
                d.admit([r.seq for r in new])
            if self.target.fixed_prefill:
                self.costs.observe_prefill_pass(self.target.prefill_passes, time.perf_counter() - began)
            batch.idle_seconds = 0.0
            batch.active += new
            self._evict(batch)

    def _admits_now(self, batch: _Batch) -> bool:
        """Prefill the waiting rows now, or leave the freed places for a few rounds?

        Where a prefill pass replays one captured graph (a GPU's static path), it costs as much
        for one prompt as for a pass full of them, and rows that finish one at a time would each
        pay a whole pass, dearer than a decode round of the whole batch (docs/gpu.md). Freed places
        then wait for company (the ski-rental rule): until the prompts that would
        fill them make a full pass, or the places left empty have cost what a pass costs (their
        share of the rounds' seconds), so waiting never costs more than twice what knowing when
        the next rows finish would have. Nothing waits while no row decodes or when every waiting
        row has a place. Greedy outputs do not change: with batch-invariant numerics a row's
        tokens do not depend on when it joins (sampled rows draw in another order, from the same
        distributions)."""
        whole = self.target.fixed_prefill
        free = min(batch.size - len(batch.active), len(batch.waiting))
        if not whole or not batch.active or free == len(batch.waiting) or self.costs.prefill_pass is None:
            return True
        joining = static_lm.piece_count(len(r.seq) for r in itertools.islice(batch.waiting, free))
        return joining >= whole or batch.idle_seconds >= self.costs.prefill_pass

    def _evict(self, batch: _Batch) -> None:
        """Finished rows leave the batch: the target's cache and every drafter forget them."""
        if all(r.finish_reason is None for r in batch.active):
            return  # most rounds: every drafter's and runner's bookkeeping as it was
        keep = [i for i, r in enumerate(batch.active) if r.finish_reason is None]
        finished = [r.seq[r.prompt_len :] for r in batch.active if r.finish_reason is not None]
        batch.active = [batch.active[i] for i in keep]
        self.target.select(keep)
        for d in batch.drafters:
            d.evict(keep, finished)

    def _prepare(self, prompts, max_new_tokens: int, overlong: str) -> tuple[list[_Row], list[int]]:
        if overlong not in ("error", "truncate"):
            raise ValueError(f"overlong must be 'error' or 'truncate', got {overlong!r}")
        rows, truncated = [], []
        for i, prompt in enumerate(prompts):
            seq = [int(t) for t in prompt]
            if not seq:
                raise PromptError(f"prompt {i} is empty: there is nothing to continue")
            cut = 0
            if self.max_context and len(seq) + max_new_tokens > self.max_context:
                fits = self.max_context - max_new_tokens
                if overlong == "error" or fits < 1:
                    raise PromptError(
                        f"prompt {i} has {len(seq)} tokens; with max_new_tokens={max_new_tokens} it "
                        f"exceeds the model context of {self.max_context} tokens"
                    )
                cut = len(seq) - fits
                seq = seq[cut:]
            rows.append(_Row(index=i, seq=seq, prompt_len=len(seq)))
            truncated.append(cut)
        return rows, truncated

    def _append(self, row: _Row, tokens: list[int], batch: _Batch) -> int:
        """Add the round's tokens to a row, cutting at EOS, the length limit or a stop string.

        Returns how many tokens were kept. Cutting exactly where target-only decoding would
        have stopped keeps the output identical to it, token for token.
        """
        kept = 0
        for token in tokens:
            row.seq.append(token)
            row.stats.new_tokens += 1
            kept += 1
            if token in self.eos:
                row.finish_reason = "eos"
            elif batch.stop_strings and self._hits_stop(row, batch.stop_strings):
                row.finish_reason = "stop"
            elif row.stats.new_tokens >= batch.max_new_tokens:
                row.finish_reason = "length"
            if row.finish_reason:
                row.stats.seconds = time.perf_counter() - row.admitted
                self.policy.runs_to_limit.update(int(row.finish_reason == "length"), 1)
                break
        return kept

    def _hits_stop(self, row: _Row, stop_strings) -> bool:
        longest = max(len(s) for s in stop_strings)
        # a stop string can only end in the last token; a few tokens of context cover it
        tail = self.decode_text(row.seq[max(row.prompt_len, len(row.seq) - longest - 4) :])
        return any(s in tail for s in stop_strings)

    def remember_outputs(self, outputs: list[list[int]]) -> int:
        """Give the suffix drafter's corpus earlier outputs (token ids), as if this engine had
        produced them, e.g. an earlier run's; return how many it kept (over-long ones are not)."""
        before = self.suffix.corpus.outputs
        for output in outputs:
            self.suffix.corpus.add(output)
        return self.suffix.corpus.outputs - before

    def forget_outputs(self) -> None:
        """Empty the suffix drafter's corpus of earlier outputs: a benchmark that decodes the
        same documents again must not find their outputs there."""
        self.suffix.corpus = SuffixCorpus(self.config.suffix_max_tokens)

    def cost_ratio(self, batch: int) -> float | None:
        """Measured draft step over 1-token target pass at this batch size (None if unknown)."""
        target, draft = self.costs.target_time(batch), self.costs.draft_time(batch)
        return draft / target if target and draft and self.costs.draft.points else None

    def _draft_catch_up(self, seqs: list[list[int]]) -> float:
        """Seconds the draft model would spend catching up before it can propose (see costs)."""
        lm = self.draft.lm
        if lm.cold:
            return self.costs.prefill_time("draft", lm.prefill_tokens(seqs))
        return self.costs.catch_up_time(lm.pass_tokens([1] * len(seqs)), lm.catch_up_tokens(seqs))

    def release_memory(self) -> None:
        """Free the static runners' slots and graphs (`StaticLM.release`), before a batch that ran
        out of memory is decoded again at a smaller size."""
        for lm in (self.target, self.draft.lm if self.draft else None):
            if isinstance(lm, static_lm.StaticLM):
                lm.release()

    def static_record(self) -> dict | None:
        """The static pass path's graphs (capture seconds and memory) per model; None without it."""
        runners = {"target": self.target, "draft": self.draft.lm if self.draft else None}
        found = {k: lm.graph_record() for k, lm in runners.items() if isinstance(lm, static_lm.StaticLM)}
        return found or None

    def _draft_seconds(self) -> float:
        model = self.draft.lm.forward_seconds if self.draft else 0.0
        return model + (self.head.seconds if self.head else 0.0)
