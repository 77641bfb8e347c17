"""The speculative decoder: a batch of prompts in, the target model's own completions out.

One round, for every unfinished row at once:
  1. drafters propose up to gamma tokens per row (prompt lookup first, the draft model for rows
     without a lookup match), gamma chosen from measured costs and acceptance, and the draft
     model stopping a row early where its confidence says one more draft will not pay;
  2. ONE target forward pass over each row's unfed tokens plus its drafts;
  3. each row keeps the drafts the target agrees with (greedy: equal to its argmax; sampling:
     the accept/resample rule) plus one token from the target itself;
  4. rows that hit EOS, a stop string or max_new_tokens leave the batch, and waiting prompts
     take their places (prefilled beside the running rows: continuous batching).
The caches are rolled back lazily at the start of the next round (`BatchedLM.sync`).
With the drafter "none" the same loop is plain target-only decoding: the baseline for speedups.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from pipeline.decode.batched_lm import BatchedLM
from pipeline.decode.costs import (
    AcceptanceByPosition,
    CostModel,
    RunningRate,
    alpha_from_tau,
    expected_drain_advance,
    iid_survival,
)
from pipeline.decode.drafters import DraftModelDrafter, PromptLookupDrafter, Proposal
from pipeline.decode.sampling import SamplingParams, choose, verify

DRAFTERS = ("auto", "draft_model", "prompt_lookup", "none")


class PromptError(ValueError):
    """A prompt the engine cannot decode (empty, or too long and the caller chose to refuse)."""


@dataclass(frozen=True)
class EngineConfig:
    """How to speculate. `adaptive=False` always drafts `gamma_max` tokens (fixed gamma)."""

    drafter: str = "auto"
    gamma_max: int = 8
    adaptive: bool = True
    ngram_min: int = 1
    ngram_max: int = 4
    probe_every: int = 32  # rounds without a drafter (draft model, prompt lookup) before trying it again
    probe_alpha: float = 0.95  # acceptance a probe hopes for: no probe when even that cannot pay
    probe_budget: float = 0.05  # most a probe may risk on catch-up, as a share of the plain decoding left
    # The draft model proposes among token ids below this (plus prompt tokens and EOS); 0: all.
    draft_vocab: int = 32768
    # Speculate only when the expected rate beats target-only by this much: cost estimates are
    # noisy (a slow spell inflates one measurement), and a marginal gain is not worth the risk.
    min_gain: float = 0.05
    # A lone row's draft model checks this many tokens of a prompt-lookup copy in one pass as a
    # guess at its own next drafts (see `DraftModelDrafter.propose`); 0: one pass per draft.
    guess_tokens: int = 3

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if not 0 <= self.gamma_max <= 64:
            raise ValueError(f"gamma_max must be in 0..64, got {self.gamma_max}")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0, got {self.draft_vocab}")
        if self.guess_tokens < 0:
            raise ValueError(f"guess_tokens must be >= 0, got {self.guess_tokens}")


@dataclass(frozen=True)
class RoundOptions:
    """What one round can choose from: each row's lookup match and the draft model's state."""

    look_lens: list[int]  # tokens prompt lookup offers per row (0: no match)
    look_keys: list[str]  # the acceptance-rate key of each row's match ("prompt_lookup:n")
    use_model: bool
    gamma_cap: int
    remaining: int  # new tokens the active rows may still produce
    catch_up: float  # seconds the draft model needs before it can propose (see costs)
    # Each row's tokens left before max_new_tokens when no prompt waits for a place (the batch
    # only drains); None while prompts wait, when every token anywhere brings the end closer.
    drain_budgets: list[int] | None = None


@dataclass
class RowStats:
    """What speculation did for one row. Invariant: new_tokens == accepted + target_tokens."""

    new_tokens: int = 0
    target_passes: int = 0  # target forward passes this row took part in (prefill included)
    draft_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    target_tokens: int = 0  # tokens the target chose itself: corrections, bonuses, the first
    gamma_sum: int = 0  # sum over rounds of the gamma offered to this row
    drafted_by: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0  # from joining the batch (its prefill) until this row finished

    @property
    def alpha(self) -> float:
        """Acceptance rate per drafted token."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens produced per target pass."""
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def mean_gamma(self) -> float:
        rounds = self.target_passes - 1
        return self.gamma_sum / rounds if rounds > 0 else 0.0

    @property
    def alpha_leviathan(self) -> float:
        """The i.i.d. acceptance rate that explains the measured tau at the mean gamma."""
        return alpha_from_tau(self.tau, self.mean_gamma)


@dataclass
class RowOutput:
    tokens: list[int]
    finish_reason: str  # "eos", "stop" or "length"
    prompt_tokens: int
    truncated_tokens: int  # prompt tokens dropped to fit the context window
    stats: RowStats


@dataclass
class BatchStats:
    """Whole-batch counters: passes here are batched passes, not per row."""

    rows: int = 0
    new_tokens: int = 0
    target_passes: int = 0
    draft_passes: int = 0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    prefill_tokens: int = 0  # prompt tokens the target's prefill computed (not a template's)
    prefill_seconds: float = 0.0  # the target's prefill pass, part of target_seconds
    draft_prefill_seconds: float = 0.0  # the draft's cold catch-up passes, part of draft_seconds
    wall_seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    gamma_histogram: dict[int, int] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds else 0.0

    def add(self, other: BatchStats) -> None:
        """Accumulate another batch's counters (a shard or a benchmark is many batches)."""
        for key in (
            "rows",
            "new_tokens",
            "prefill_tokens",
            "target_passes",
            "draft_passes",
            "drafted",
            "accepted",
        ):
            setattr(self, key, getattr(self, key) + getattr(other, key))
        for key in (
            "target_seconds",
            "draft_seconds",
            "prefill_seconds",
            "draft_prefill_seconds",
            "wall_seconds",
        ):
            setattr(self, key, getattr(self, key) + getattr(other, key))
        for gamma, count in other.gamma_histogram.items():
            self.gamma_histogram[gamma] = self.gamma_histogram.get(gamma, 0) + count


@dataclass
class _Row:
    """Book-keeping for one row while it decodes."""

    index: int
    seq: list[int]
    prompt_len: int
    stats: RowStats = field(default_factory=RowStats)
    finish_reason: str | None = None
    admitted: float = 0.0  # perf_counter when it joined the batch


class SpeculativeEngine:
    """Speculative decoding with a target model, an optional draft model and prompt lookup.

    One engine per model pair and process: it keeps the measured costs across batches, so the
    first batch teaches it what a pass costs on this hardware.
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
        vocab_size: int | None = None,
    ):
        self.config = config or EngineConfig()
        if self.config.drafter == "draft_model" and draft is None:
            raise ValueError("drafter 'draft_model' needs a draft model")
        # Embedding matrices are often padded past the tokenizer (and differ between a target
        # and its draft): compare distributions over the tokens both models can produce.
        vocab = vocab_size or min(m.config.vocab_size for m in (target, draft) if m is not None)
        self.target = BatchedLM(target, pad_token_id, vocab)
        self.draft = None
        if draft is not None:
            self.draft = DraftModelDrafter(
                draft, pad_token_id, vocab, head_tokens=self.config.draft_vocab, always=tuple(eos_token_ids)
            )
        self.lookup = PromptLookupDrafter(self.config.ngram_max, self.config.ngram_min)
        self.eos = frozenset(eos_token_ids)
        self.decode_text = decode_text
        self.max_context = getattr(target.config, "max_position_embeddings", None)
        self.costs = CostModel()
        # Acceptance per drafter; prompt lookup's per matched n-gram size, since a 1-gram match
        # is a much weaker hint than a 4-gram match, and per position in the copy, since a copy
        # that has begun to match tends to go on matching.
        self.alpha: dict[str, RunningRate | AcceptanceByPosition] = {"draft_model": RunningRate(prior=0.6)}
        for n in range(self.config.ngram_min, self.config.ngram_max + 1):
            self.alpha[f"prompt_lookup:{n}"] = AcceptanceByPosition(prior=min(0.2 + 0.15 * n, 0.8))
        # How often a row runs to max_new_tokens rather than ending at EOS or a stop string: a
        # draining batch's end is set by the row with most tokens left only when rows run that far.
        self.runs_to_limit = RunningRate(prior=0.5, weight=4.0)
        # How often a draft-model token is accepted when every draft before it in its row was:
        # what drafting one more token is worth (see `_draft_length`).
        self.draft_next = RunningRate(prior=0.6)
        self._rounds_without_model = 0
        self._rounds_without_lookup = 0
        self._rounds_since_plain = 0

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
    ) -> tuple[list[RowOutput], BatchStats]:
        """Decode every prompt; results keep the input order.

        `drafter` overrides the configured one for this call ("none" gives the target-only
        baseline). `overlong` is "error" (raise PromptError) or "truncate" (keep the last
        tokens that fit the context with room for `max_new_tokens`, and report how many went).
        `batch_size` rows decode at once (None: all); whenever rows finish, waiting prompts
        take their places (continuous batching), so a row that speculation finishes early
        frees its place for the next one instead of idling until the slowest row is done.
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
        use_model = drafter in ("auto", "draft_model") and self.draft is not None
        if drafter == "draft_model" and self.draft is None:
            raise ValueError("drafter 'draft_model' needs a draft model")
        use_lookup = drafter in ("auto", "prompt_lookup")

        rows, truncated = self._prepare(prompts, max_new_tokens, overlong)
        waiting = deque(rows)
        size = batch_size or len(rows)
        generator = torch.Generator().manual_seed(sampling.seed)
        batch = BatchStats(rows=len(rows))
        started = time.perf_counter()
        target_seconds0, draft_seconds0 = self.target.forward_seconds, self._draft_seconds()
        self.target.reset(0)
        self.lookup.start([])
        if use_model:
            self.draft.start([])

        def admit(active: list[_Row]) -> list[_Row]:
            """Prefill waiting rows into free places: one target pass gives each its first token."""
            new = [waiting.popleft() for _ in range(min(size - len(active), len(waiting)))]
            for row in new:
                row.admitted = time.perf_counter()
            before = self.target.forward_seconds
            logits = self.target.admit([r.seq for r in new], [1] * len(new))
            seconds = self.target.forward_seconds - before
            batch.prefill_seconds += seconds
            batch.prefill_tokens += self.target.fed_tokens
            self.costs.observe_prefill("target", self.target.fed_tokens, seconds)
            batch.target_passes += 1
            for row, row_logits in zip(new, logits):
                token, _ = choose(row_logits[-1], sampling, generator)
                self._append(row, [token], max_new_tokens, stop_strings)
                row.stats.target_passes += 1
                row.stats.target_tokens += 1
            self.lookup.admit([r.seq for r in new])
            if use_model:
                self.draft.admit([r.seq for r in new])
            active = active + new
            keep = [i for i, r in enumerate(active) if r.finish_reason is None]
            self._keep(keep, use_model)
            return [active[i] for i in keep]

        active: list[_Row] = []
        while waiting and len(active) < size:  # rows that end at their first token free places
            active = admit(active)

        while active:
            round_began = time.perf_counter()
            seqs = [r.seq for r in active]
            left = [max_new_tokens - r.stats.new_tokens for r in active]  # each row's budget
            room = min(left)
            gamma_cap = min(self.config.gamma_max, room)

            # 1. Draft: prompt lookup (free) first, then the draft model for rows it serves worse.
            # A lone row's copy is also a guess at the draft model's own chain (see propose).
            guessing = use_model and len(active) == 1 and self.config.guess_tokens > 0
            look = self.lookup.propose(seqs, gamma_cap if use_lookup or guessing else 0, sampling, generator)
            look_keys = [f"prompt_lookup:{n}" for n in self.lookup.matched_ngram]
            options = RoundOptions(
                look_lens=[len(t) if use_lookup else 0 for t in look.tokens],
                look_keys=look_keys,
                use_model=use_model,
                gamma_cap=gamma_cap,
                remaining=sum(left),
                catch_up=self._draft_catch_up(seqs) if use_model else 0.0,
                drain_budgets=None if waiting else left,
            )
            cap, model_gamma, chosen = self._choose_gammas(options)
            model = Proposal([[] for _ in active], [None] * len(active))
            if model_gamma:
                steps, keep_drafting = self._draft_length(options, cap, model_gamma, chosen)
                guess = look.tokens[0][: self.config.guess_tokens] if guessing else None
                model = self.draft.propose(seqs, steps, sampling, generator, keep_drafting, guess)
                batch.draft_passes += model.model_passes
                for p in model.passes:
                    if p.cold:
                        batch.draft_prefill_seconds += p.seconds
                        self.costs.observe_prefill("draft", p.tokens, p.seconds)
                    else:
                        self.costs.observe_draft(p.cost_tokens, p.seconds)
            drafts, probs, sources = [], [], []
            for i, source in enumerate(chosen):
                if source == "lookup":
                    drafts.append(look.tokens[i][:cap])
                    probs.append(None)
                    sources.append(look_keys[i])
                elif source == "model" and model.tokens[i]:
                    drafts.append(model.tokens[i])
                    probs.append(model.probs[i])
                    sources.append("draft_model")
                else:
                    drafts.append([])
                    probs.append(None)
                    sources.append(None)

            # 2. Verify: one target pass over each row's unfed tokens plus its drafts.
            unfed = self.target.sync(seqs)
            blocks = [u + d for u, d in zip(unfed, drafts)]
            before = self.target.forward_seconds
            logits = self.target.forward(blocks, [len(d) + 1 for d in drafts])
            cost = self.target.pass_tokens([len(b) for b in blocks])
            self.costs.observe_target(cost, self.target.forward_seconds - before)
            batch.target_passes += 1
            batch.gamma_histogram[max(map(len, drafts))] = (
                batch.gamma_histogram.get(max(map(len, drafts)), 0) + 1
            )

            # 3. Accept: per row, the agreeing drafts plus one token of the target's own.
            outcomes: dict[str, list[tuple[int, int]]] = {name: [] for name in self.alpha}
            produced = 0
            for row, draft, draft_probs, source, row_logits in zip(active, drafts, probs, sources, logits):
                accepted, token = verify(row_logits, draft, draft_probs, sampling, generator)
                kept = self._append(row, draft[:accepted] + [token], max_new_tokens, stop_strings)
                produced += kept
                stats = row.stats
                stats.target_passes += 1
                stats.draft_passes += model.model_passes
                stats.drafted += len(draft)
                stats.accepted += min(accepted, kept)
                stats.target_tokens += kept - min(accepted, kept)
                stats.gamma_sum += len(draft)
                if source:
                    drafter_name = source.split(":")[0]
                    stats.drafted_by[drafter_name] = stats.drafted_by.get(drafter_name, 0) + len(draft)
                    outcomes[source].append((accepted, len(draft)))
                batch.drafted += len(draft)
                batch.accepted += accepted
            for name, rows_drafted in outcomes.items():
                self.alpha[name].observe(rows_drafted)
            # the drafts the target tested: the accepted ones and the first miss
            self.draft_next.observe([(a, min(a + 1, d)) for a, d in outcomes["draft_model"]])
            self.costs.observe_round(produced, time.perf_counter() - round_began)

            # 4. Finished rows leave the batch and stop costing compute; waiting rows join.
            keep = [i for i, r in enumerate(active) if r.finish_reason is None]
            active = [active[i] for i in keep]
            self._keep(keep, use_model)
            while waiting and len(active) < size:
                active = admit(active)

        batch.new_tokens = sum(r.stats.new_tokens for r in rows)
        batch.wall_seconds = time.perf_counter() - started
        batch.target_seconds = self.target.forward_seconds - target_seconds0
        batch.draft_seconds = self._draft_seconds() - draft_seconds0
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
        return outputs, batch

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

    def _append(self, row: _Row, tokens: list[int], max_new_tokens: int, stop_strings) -> int:
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
            elif stop_strings and self._hits_stop(row, stop_strings):
                row.finish_reason = "stop"
            elif row.stats.new_tokens >= max_new_tokens:
                row.finish_reason = "length"
            if row.finish_reason:
                row.stats.seconds = time.perf_counter() - row.admitted
                self.runs_to_limit.update(int(row.finish_reason == "length"), 1)
                break
        return kept

    def _hits_stop(self, row: _Row, stop_strings) -> bool:
        longest = max(len(s) for s in stop_strings)
        # a stop string can only end in the last token; a few tokens of context cover it
        tail = self.decode_text(row.seq[max(row.prompt_len, len(row.seq) - longest - 4) :])
        return any(s in tail for s in stop_strings)

    def _keep(self, keep: list[int], use_model: bool) -> None:
        self.target.select(keep)
        self.lookup.select(keep)
        if use_model:
            self.draft.select(keep)

    def cost_ratio(self, batch: int) -> float | None:
        """Measured draft step over 1-token target pass at this batch size (None if unknown)."""
        target, draft = self.costs.target_time(batch), self.costs.draft_time(batch)
        return draft / target if target and draft and self.costs.draft.points else None

    def _draft_catch_up(self, seqs: list[list[int]]) -> float:
        """Seconds the draft model would spend catching up before it can propose (see costs)."""
        lm = self.draft.lm
        if lm.cold:
            return self.costs.prefill_time("draft", lm.prefill_tokens(seqs))
        return self.costs.catch_up_time(len(seqs), lm.catch_up_tokens(seqs))

    def _draft_seconds(self) -> float:
        return self.draft.lm.forward_seconds if self.draft else 0.0

    def _choose_gammas(self, options: RoundOptions) -> tuple[int, int, list[str | None]]:
        """Pick the prompt-lookup cap and the draft-model gamma that maximize expected tokens/s.

        Each row takes up to `cap` copied tokens from its lookup match, or `gamma` draft-model
        tokens, or none (see `_best`); expected tokens come from the running acceptance (per
        drafter; for copies per n-gram size and position), round time from the measured target
        cost of the resulting pass plus gamma draft steps, plus the draft's catch-up seconds
        spread over the rounds left for the remaining tokens. Gamma 0 with no lookup is plain
        target-only decoding, always a candidate. The draft model may then stop short of gamma
        (`_draft_length`). Returns (cap, gamma, each row's source: "lookup", "model" or None).
        """
        rows, gamma_cap = len(options.look_lens), options.gamma_cap
        plain: list[str | None] = [None] * rows
        if gamma_cap <= 0:
            return 0, 0, plain
        if not self.config.adaptive:
            gamma = gamma_cap if options.use_model and not all(options.look_lens) else 0
            return (
                gamma_cap,
                gamma,
                ["lookup" if n else "model" if gamma else None for n in options.look_lens],
            )
        if not self.costs.has_target(rows):
            # Measure plain decoding at this batch size first: every choice is compared with it.
            return 0, 0, plain
        self._rounds_since_plain += 1
        if self._rounds_since_plain > 4 * self.config.probe_every:
            # Re-measure plain decoding now and then: while speculating its cost is never
            # observed, and a value inflated by one slow spell would keep speculation looking good.
            self._rounds_since_plain = 0
            return 0, 0, plain
        cap, gamma, sources = self._best(options, self.alpha["draft_model"].value)
        if options.use_model and gamma == 0 and None in sources:
            self._rounds_without_model += 1
            if self._rounds_without_model >= self.config.probe_every:
                self._rounds_without_model = 0
                # Re-measure the draft's acceptance, unless even a very good draft would not
                # pay here (verify passes too dear, or a catch-up the rounds left cannot repay).
                # A probe also risks the draft's catch-up (a whole prefill when cold): at batch 4
                # on translations one spent 12% of the job on a prefill that α 0.57 never repaid.
                plain_left = options.remaining / rows * self.costs.target_time(rows)
                affordable = options.catch_up <= self.config.probe_budget * plain_left
                if affordable and self._best(options, self.config.probe_alpha)[1]:
                    gamma, sources = 1, [s or "model" for s in sources]
        if gamma == 0 and "lookup" not in sources and any(options.look_lens):
            self._rounds_without_lookup += 1
            if self._rounds_without_lookup >= self.config.probe_every:
                self._rounds_without_lookup = 0
                # Re-measure prompt lookup's acceptance and the cost of a 2-token verify pass at
                # this batch size. Until measured that cost is extrapolated from other shapes (4
                # rows x 1 token next to 1 row x 3), which can overprice it so much that lookup
                # is never tried. A probe costs one slightly wider pass, no draft steps.
                cap, sources = 1, ["lookup" if n else None for n in options.look_lens]
        if gamma == 0 and "lookup" not in sources:
            self._rounds_since_plain = 0  # this round measures plain decoding anyway
        return cap, gamma, sources

    def _draft_length(
        self, options: RoundOptions, cap: int, gamma: int, sources: list[str | None]
    ) -> tuple[int, Callable[[list[float], list[int]], list[bool]] | None]:
        """How many draft passes at most, and the rule that ends drafting earlier (see
        `DraftModelDrafter.propose`); fixed gamma (`adaptive=False`) has no rule.

        `_best` prices gamma as if every draft were accepted with the same chance. The draft
        model knows better token by token: a row whose drafts so far are all accepted with
        chance P (the product of the draft's confidences) gains P·α more tokens from one more
        draft, α being how often a draft is accepted after accepted ones (`draft_next`).
        That gain is worth its seconds at the rate rounds have been making tokens; one more
        pass costs a draft step, and each row that goes on one more verify token. So drafting
        goes long while the draft is sure and stops at its first doubt: simulated on the
        teacher-forced draft of docstring summaries (Qwen2.5-Coder 0.5B for 1.5B, this CPU's
        costs), 1.95× the decoding speed of target-only against 1.78× for the best fixed gamma.
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
        step_seconds = self.costs.draft_time(rows) or 0.0
        chance_next = self.draft_next.value
        copied = [min(n, cap) if s == "lookup" else 0 for s, n in zip(sources, options.look_lens)]
        model_rows = [i for i, s in enumerate(sources) if s == "model"]

        def keep(chances: list[float], drafted: list[int]) -> list[bool]:
            lengths = [1 + n + (drafted[i] if sources[i] == "model" else 0) for i, n in enumerate(copied)]
            now = self.costs.target_time(self.target.pass_tokens(lengths))
            going, net = [False] * rows, 0.0
            for i in model_rows:
                wider = lengths[:i] + [lengths[i] + 1] + lengths[i + 1 :]
                verify_token = max(self.costs.target_time(self.target.pass_tokens(wider)) - now, 0.0)
                gain = chances[i] * chance_next * token_value - verify_token
                if gain > 0:
                    going[i], net = True, net + gain
            return going if net > step_seconds else [False] * rows

        return steps, keep

    def _best(self, options: RoundOptions, a_model: float) -> tuple[int, int, list[str | None]]:
        """The choice of `_choose_gammas` with the draft model accepting at rate `a_model`.

        Each row takes the source worth most to it: expected tokens, less what its extra verify
        tokens cost at the best rate so far. In a padded pass (a GPU) the verify tokens are
        priced at nothing, since the widest row sets the cost; in a packed one (a CPU) a row
        pays for its own: at batch 8 on the 1.5B target in bf16 a token beyond the first of
        each row costs 2-8% of a pass (the pass's first such token 10-16%), so a weak 1-gram
        match is not worth verifying there.
        While prompts wait for places every token brings the end of the job closer. A batch
        that only drains ends when its row with most tokens left does, if rows run to
        max_new_tokens: then a round is worth how far it takes that row's count down
        (`expected_drain_advance`), and tokens of rows ahead of it are worth nothing. With 8
        even rows that is the rare round where all 8 accept, so such a batch decodes plainly
        instead of widening its passes (measured: 63-64 passes for 64 tokens whatever the
        drafter). Rows that end at EOS make the row with most tokens left a guess, so the two
        values are weighed by how often rows have run to the limit so far.
        A lone row needs no such split: the whole round's rate below decides for it.
        """
        look_lens, look_keys, gamma_cap = options.look_lens, options.look_keys, options.gamma_cap
        rows = len(look_lens)
        draft_time = self.costs.draft_time(rows) or 0.0
        plain_seconds = self.costs.target_time(rows)
        per_token = 0.0  # seconds per extra verify token at this batch size; one row: see above
        if self.target.pack and rows > 1:
            per_token = max((self.costs.target_time(3 * rows) - plain_seconds) / (2 * rows), 0.0)
        budgets = options.drain_budgets if rows > 1 else None
        to_limit = self.runs_to_limit.value if budgets else 0.0
        leads = [max(budgets) - b for b in budgets] if budgets else [0] * rows
        best = (0, 0, [None] * rows)
        best_rate = rows / plain_seconds * (1 + self.config.min_gain)
        # P(at least k tokens) by drafts verified: the draft model's i.i.d., each copy's by position
        from_model = iid_survival(a_model, gamma_cap)
        from_copy = [
            self.alpha[key].survival(min(n, gamma_cap)) if n else [] for n, key in zip(look_lens, look_keys)
        ]
        for cap in range(gamma_cap + 1) if any(look_lens) else [0]:
            for gamma in range(gamma_cap + 1) if options.use_model else [0]:
                model_survival = from_model[: gamma + 1]
                model_tokens = sum(model_survival)
                # In a drain only rows within `reach` of the one furthest behind can hold its end
                # back this round; they share what the round is worth, the rows ahead get nothing.
                reach = max(cap, gamma)
                near = sum(lead < reach for lead in leads)
                tokens, lengths, sources, drains = 0.0, [], [], []
                for n, copy_survival, lead in zip(look_lens, from_copy, leads):
                    choices = [(1.0, 0, None, [1.0])]
                    if gamma:
                        choices.append((model_tokens, gamma, "model", model_survival))
                    if n and cap:
                        copy = copy_survival[: min(n, cap) + 1]
                        choices.append((sum(copy), min(n, cap), "lookup", copy))
                    weight = 1.0 - to_limit + (to_limit * rows / near if lead < reach else 0.0)
                    expected, drafts, source, survival = max(
                        choices, key=lambda c: weight * c[0] - best_rate * per_token * c[1]
                    )
                    tokens += expected
                    lengths.append(drafts + 1)
                    sources.append(source)
                    drains.append((lead, survival))
                if gamma and "model" not in sources:
                    continue  # the draft model would run for nobody
                seconds = gamma * draft_time + self.costs.target_time(self.target.pass_tokens(lengths))
                if gamma:  # this round's share of the one-off catch-up: tokens / remaining of it
                    seconds += options.catch_up * min(tokens / max(options.remaining, 1), 1.0)
                worth = tokens
                if budgets:
                    worth = (1.0 - to_limit) * tokens + to_limit * rows * expected_drain_advance(drains)
                if worth / seconds > best_rate * 1.0001:
                    best, best_rate = (cap, gamma, sources), worth / seconds
        return best
