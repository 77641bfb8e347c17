"""Drafters: anything that proposes the next few tokens of each row for the target to check.

Three sources, named as the job spec names them: the draft model (a small LM, one forward pass
per drafted token), prompt lookup (a copy of what followed the row's last n-gram earlier in its
own text) and suffix (the most frequent continuation of the row's longest matched suffix in
its own text and in the outputs this engine produced before, see `suffix`). The last two cost
no model pass. All implement `Drafter`; the engine's round treats them alike, and the policy
(`policy.py`) chooses among their proposals.

Drafters that sample report the distribution each token came from, so that speculative
sampling stays exact; deterministic drafters report None (a point mass).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from transformers import PreTrainedModel

from pipeline.decode import lookups, static_lm
from pipeline.decode.sampling import SamplingParams, choose, confidence, greedy_choices
from pipeline.decode.settings import DRAFT_MODEL, PROMPT_LOOKUP

# Which rows draft one more token, given each row's chance that its drafts so far are all
# accepted and how many it has (see `DraftModelDrafter.propose`).
KeepRule = Callable[[list[float], list[int]], list[bool]]


@dataclass
class Proposal:
    """Per row: drafted tokens and, for sampled drafts, their distributions [n, V] (else None).

    `depths`: how specific each row's match was, for a drafter that copies (prompt lookup: the
    matched n-gram's size; suffix: the matched suffix's length class); the policy keeps a
    copy's acceptance per depth, since a long match is a much stronger hint than a short one.
    """

    tokens: list[list[int]]
    probs: list[torch.Tensor | None]
    passes: list[PassTiming] = field(default_factory=list)  # model forward passes it ran
    depths: list[int] = field(default_factory=list)

    @property
    def model_passes(self) -> int:
        return len(self.passes)


@dataclass(frozen=True)
class PassTiming:
    """One forward pass of a drafter's model, for the cost model."""

    cost_tokens: int  # what the pass cost in tokens (see `BatchedLM.pass_tokens`)
    seconds: float
    cold: bool  # the cache was empty: a prefill, timed per token rather than per step
    tokens: int  # tokens computed (a prefill pads no row, and reuses a template's start)


class Drafter(Protocol):
    """What the engine asks of every draft source.

    A drafter follows the batch's rows: `start` empties it, `admit` appends rows, `evict`
    keeps the rows still decoding (the order the engine's rows are in). `propose` sees each
    row's full sequence (prompt + output so far) every round.
    """

    name: str  # the source's name in stats and in the policy: DRAFT_MODEL, PROMPT_LOOKUP, SUFFIX

    def start(self, prompts: list[list[int]]) -> None:
        """A new batch begins with these rows."""

    def admit(self, prompts: list[list[int]]) -> None:
        """New rows join the batch, after the running ones."""

    def propose(
        self,
        seqs: list[list[int]],
        gamma: int,
        params: SamplingParams,
        generator: torch.Generator,
        keep: KeepRule | None = None,
        guess: list[int] | None = None,
    ) -> Proposal:
        """Up to `gamma` tokens after each sequence. `keep` and `guess` are for drafters that
        run a model (see `DraftModelDrafter.propose`); a free drafter ignores them."""

    def evict(self, keep: list[int], finished: list[list[int]]) -> None:
        """Keep only the rows `keep`; `finished` are the outputs of the rows that ended."""


# A row's matches (`RowText.matches`): each occurrence's following index, and its match length.
Matches = tuple[list[int], list[int]]

# Between a row's reflowed prompt and its text in `RowText`: no token equals it, so no match spans it.
SEPARATOR = -1


class RowText:
    """A row's own text as the copying drafters match it: for the suffix drafter its prompt
    reflowed first and a separator, then the row's prompt and output as they grow.

    Each lookup scans it (`texts_matches`, every row of a batch at once). An index kept per token (a
    dict of n-grams, an automaton) costs Python work for every prompt token of every row a batch
    admits, though a gated engine may never ask for the row's drafts: where passes take a few
    milliseconds that work outweighed the drafts (docs/engine.md, at batch 64).
    """

    __slots__ = ("address", "array", "tokens", "start")

    def __init__(self, reflowed: list[int] | tuple[()] = ()):
        self.tokens: list[int] = [*reflowed, SEPARATOR] if reflowed else []
        self.start = len(self.tokens)  # where the row's text begins
        self.array = np.empty(max(256, 2 * self.start), dtype=np.int64)
        self.array[: self.start] = self.tokens
        self.address = self.array.ctypes.data  # where `lookups.cpp` reads it

    @property
    def fed(self) -> int:
        """Tokens of the row's text held."""
        return len(self.tokens) - self.start

    def feed(self, seq: list[int]) -> None:
        """Hold the row's text up to `seq` (its prompt and output so far: it only grows)."""
        new = seq[self.fed :]
        if not new:
            return
        n = len(self.tokens)
        if n + len(new) > len(self.array):
            grown = np.empty(2 * (n + len(new)), dtype=np.int64)
            grown[:n] = self.array[:n]
            self.array, self.address = grown, grown.ctypes.data
        if len(new) == 1:  # most rounds: a scalar write, a sixth of a slice's from a list
            self.array[n] = new[0]
        else:
            self.array[n : n + len(new)] = new
        self.tokens += new

    def matches(self, deepest: int) -> Matches:
        """Where the text's end occurred before: for each occurrence the index of the token that
        followed it, and how many of the text's last tokens it matches (at most `deepest`).
        One row's `texts_matches`."""
        return texts_matches([self], deepest)[0]


def texts_matches(texts: list[RowText], deepest: int) -> list[Matches]:
    """`RowText.matches` of every row at once: the rows' texts laid end to end, each occurrence
    of a row's last token compared with that row's end at every distance back in one table.

    A row at a time, or a distance at a time while any match lasted, each was a few array
    operations: at batch 64, more than a captured GPU pass in all (docs/engine.md). A lone row
    skips the laying out (`_lone_matches`)."""
    if len(texts) == 1:
        return [_lone_matches(texts[0], deepest)]
    sizes = np.array([len(t.tokens) for t in texts], dtype=np.int64)
    if not sizes.sum():
        return [([], []) for _ in texts]
    held = [t.array[:n] for t, n in zip(texts, sizes.tolist())]
    flat = np.concatenate(held) if len(held) > 1 else held[0]
    offsets = np.cumsum(sizes) - sizes
    lasts = offsets + sizes - 1  # each row's last token
    fed = sizes - np.array([t.start for t in texts], dtype=np.int64)
    row_of = np.repeat(np.arange(len(texts)), sizes)
    same_as_last = flat == flat[np.maximum(lasts, 0)][row_of]
    same_as_last[lasts[fed > 0]] = False  # a row's end is not an occurrence of itself
    same_as_last &= (fed > 0)[row_of]  # a row with none of its own text yet matches nothing
    at_end = np.flatnonzero(same_as_last)
    rows = row_of[at_end]
    back = np.arange(1, max(deepest, 1))  # distances compared past the last token
    at = at_end[:, None] - back  # each occurrence's token at each distance
    mine = lasts[rows][:, None] - back  # the row's own token there
    # never past a row's own text (nor `deepest`), never before the row's first token
    inside = (back < np.minimum(deepest, fed[rows])[:, None]) & (at >= offsets[rows][:, None])
    same = inside & (flat[np.maximum(at, 0)] == flat[np.maximum(mine, 0)])
    lengths = (1 + np.cumprod(same, axis=1).sum(axis=1)).tolist()
    ends = (at_end + 1 - offsets[rows]).tolist()
    cuts = np.cumsum(np.bincount(rows, minlength=len(texts))).tolist()
    return [(ends[a:b], lengths[a:b]) for a, b in zip([0, *cuts], cuts)]


def _lone_matches(text: RowText, deepest: int) -> Matches:
    """`texts_matches` of one row, with none of the bookkeeping that lays rows end to end."""
    size, fed = len(text.tokens), text.fed
    if fed <= 0:
        return [], []
    flat = text.array[:size]
    at_end = np.flatnonzero(flat[: size - 1] == flat[size - 1])
    if not len(at_end):
        return [], []
    back = np.arange(1, max(deepest, 1))
    at = at_end[:, None] - back
    inside = (back < min(deepest, fed)) & (at >= 0)
    same = inside & (flat[np.maximum(at, 0)] == flat[np.maximum(size - 1 - back, 0)])
    return (at_end + 1).tolist(), (1 + np.cumprod(same, axis=1).sum(axis=1)).tolist()


@dataclass
class PromptLookupDrafter:
    """Copy what followed the most recent earlier occurrence of the row's last n tokens.

    Summaries and extractions copy spans of their input; when the last n generated tokens
    appeared before (in the prompt or the output), the tokens that followed are a free, often
    correct guess. Longest n-gram first, most recent occurrence first. No model pass.
    """

    ngram_max: int = 4
    ngram_min: int = 1
    name: str = PROMPT_LOOKUP
    _rows: list[RowText] = field(default_factory=list, repr=False)

    def start(self, prompts: list[list[int]]) -> None:
        self._rows = []
        self.admit(prompts)

    def admit(self, prompts: list[list[int]]) -> None:
        self._rows += [RowText() for _ in prompts]

    def propose(
        self,
        seqs: list[list[int]],
        gamma: int,
        params: SamplingParams,
        generator: torch.Generator,
        keep: KeepRule | None = None,
        guess: list[int] | None = None,
    ) -> Proposal:
        tokens, depths = [], []
        for text, seq in zip(self._rows, seqs, strict=True):
            text.feed(seq)
        for seq, (matched, follower) in zip(seqs, self._longest()):
            if matched < self.ngram_min:
                matched = 0
            tokens.append(seq[follower : follower + gamma] if gamma and matched else [])
            depths.append(matched)
        return Proposal(tokens=tokens, probs=[None] * len(seqs), depths=depths)

    def _longest(self) -> list[tuple[int, int]]:
        """Each row's longest n-gram match and the index after its most recent occurrence
        ((0, 0): none): in one call of `lookups.cpp`, or from `texts_matches`."""
        lib = lookups.library()
        if lib is None:
            every = texts_matches(self._rows, self.ngram_max)
            return [max(zip(lengths, ends, strict=True), default=(0, 0)) for ends, lengths in every]
        addresses, sizes, starts = lookups.row_texts(self._rows)
        lengths, ends = np.zeros(len(self._rows), dtype=np.int64), np.zeros(len(self._rows), dtype=np.int64)
        lib.longest_matches(
            len(self._rows), addresses.ctypes.data, sizes.ctypes.data, starts.ctypes.data,
            self.ngram_max, lengths.ctypes.data, ends.ctypes.data,
        )  # fmt: skip
        return list(zip(lengths.tolist(), ends.tolist()))

    def evict(self, keep: list[int], finished: list[list[int]]) -> None:
        self._rows = [self._rows[r] for r in keep]


class DraftModelDrafter:
    """A small LM sharing the target's tokenizer proposes `gamma` tokens, one pass per token.

    Its cache is synced to each row's accepted sequence at the start of every proposal, so
    tokens it never saw (bonus tokens, drafts from prompt lookup) are fed in the first pass.
    """

    name = DRAFT_MODEL

    def __init__(
        self,
        model: PreTrainedModel,
        pad_token_id: int,
        vocab_size: int | None = None,
        *,
        head_tokens: int = 0,
        always: tuple[int, ...] = (),
    ):
        """`head_tokens` > 0 lets the draft propose only token ids below it, plus every token of
        the batch's prompts (what input-grounded outputs copy) and `always` (EOS): a cheaper
        output layer (see `BatchedLM.restrict_head`). Byte-level BPE vocabularies number
        tokens in merge order, so low ids are the common ones. Lossless either way: the target
        checks every proposal, and a sampled proposal reports the distribution it came from."""
        self.lm = static_lm.runner(model, pad_token_id, vocab_size)
        self.head_tokens = head_tokens if 0 < head_tokens < self.lm.vocab_size else 0
        self.always = always

    def start(self, prompts: list[list[int]]) -> None:
        self.lm.reset(0)
        self.lm.restrict_head(None)
        self._rare: set[int] = set()  # prompt tokens (and EOS) at or above head_tokens
        self._head_rare = -1  # how many of them the restricted head holds
        self.admit(prompts)

    def admit(self, prompts: list[list[int]]) -> None:
        self.lm.add_rows(len(prompts))
        if self.head_tokens:
            extra = {t for p in prompts for t in p}.union(self.always)
            self._rare |= {t for t in extra if self.head_tokens <= t < self.lm.vocab_size}

    def _restrict_head(self) -> None:
        """Gather the head's rows once they changed, when a proposal needs them rather than at
        every admission (the gather copies tens of megabytes of a draft's output layer)."""
        if self.head_tokens and self._head_rare != len(self._rare):
            rows = list(range(self.head_tokens)) + sorted(self._rare)
            self.lm.restrict_head(torch.tensor(rows, dtype=torch.long))
            self._head_rare = len(self._rare)

    def propose(
        self,
        seqs: list[list[int]],
        gamma: int,
        params: SamplingParams,
        generator: torch.Generator,
        keep: KeepRule | None = None,
        guess: list[int] | None = None,
    ) -> Proposal:
        """Up to `gamma` tokens per row, one draft pass per token (fewer with a right `guess`).

        With `keep`, drafting lengthens only while it is worth it: after each pass `keep` gets
        every row's chance that all its drafts so far are accepted (the product of the draft's
        confidence in each, 0 for rows that stopped) and how many it has, and says which rows
        draft one more. A row whose chain grows unlikely stops there; the passes stop when no
        row goes on. Lossless whatever `keep` says: it sees only the draft's side.

        `guess` (one row only) is a guess at the draft's own next tokens, such as a prompt-lookup
        copy: a pass feeds it behind the row's last token, and while the draft's choice at each
        position equals the guessed token there, the next position's logits are already
        computed, so the chain grows by several tokens in one pass. The drafts are the ones
        plain steps would make (up to rounding in the wider pass); only the number of passes
        changes. A draft pass of a few tokens costs little more than one of 1, and where the
        output copies its input the draft's chain often follows the copy for several tokens.
        """
        if gamma == 0:
            return Proposal(tokens=[[] for _ in seqs], probs=[None] * len(seqs))
        self._restrict_head()
        drafts: list[list[int]] = [[] for _ in seqs]
        dists: list[list[torch.Tensor]] = [[] for _ in seqs]
        chances = [1.0] * len(seqs)
        going = [True] * len(seqs)
        blocks = self.lm.sync(seqs)
        pending = list(guess or []) if len(seqs) == 1 and not self.lm.cold else []
        passes = []
        while True:
            fed = [b + pending for b in blocks] if pending else blocks
            cold, before = self.lm.cold, self.lm.forward_seconds
            logits = self.lm.forward(fed, [1 + len(pending)] * len(seqs))
            seconds = self.lm.forward_seconds - before
            cost = self.lm.pass_tokens([len(b) for b in fed])
            passes.append(PassTiming(cost, seconds, cold, self.lm.fed_tokens))
            blocks = []
            greedy = greedy_choices(logits, keep is not None) if params.greedy else None
            for i, row_logits in enumerate(logits):
                for position, position_logits in enumerate(row_logits):
                    if greedy:
                        token, probs = greedy[0][i][position], None
                        sure = greedy[1][i][position] if keep is not None else 1.0
                    else:
                        token, probs = choose(position_logits, params, generator)
                        sure = confidence(position_logits, probs) if keep is not None else 1.0
                    if going[i]:
                        drafts[i].append(token)
                        if probs is not None:
                            dists[i].append(probs)
                        chances[i] *= sure
                    if position == len(pending) or token != pending[position]:
                        break  # the logits further on were computed after a token not drafted
                    if len(drafts[i]) >= gamma or not self._keeps(keep, chances, drafts):
                        going[i] = False
                        break
                blocks.append([token])  # a stopped row is fed too: the pass is one rectangle
            if pending:
                # guessed tokens past the last draft sit in the cache: roll them back
                blocks = self.lm.sync([seq + d for seq, d in zip(seqs, drafts)])
                pending = []
            if max(len(d) for d in drafts) >= gamma or not any(going):
                break
            if keep is not None:
                going = [g and k for g, k in zip(going, keep(chances, [len(d) for d in drafts]))]
                chances = [c if g else 0.0 for c, g in zip(chances, going)]
                if not any(going):
                    break
        probs_out = [torch.stack(d) if d else None for d in dists]
        return Proposal(tokens=drafts, probs=probs_out, passes=passes)

    @staticmethod
    def _keeps(keep, chances: list[float], drafts: list[list[int]]) -> bool:
        """Whether the lone row may draft one more token within a guessed run (no rule: yes)."""
        return keep is None or keep(chances, [len(d) for d in drafts])[0]

    def evict(self, keep: list[int], finished: list[list[int]]) -> None:
        self.lm.select(keep)
