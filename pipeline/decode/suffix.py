"""The suffix drafter: continuations of the row's longest matched suffix, in its own text and in
the outputs this engine produced before.

Prompt lookup copies from the row's own prompt only. A corpus job sees more: its documents share
boilerplate, and the outputs of earlier documents hold the phrasing the target will use again
(a recurring term in a translation, a summary's opening), which a translation never finds in its
own, other-language, prompt. So this drafter matches the end of every row's text in
the row's own text (its prompt and output so far) and in a bounded corpus of the outputs already
finished by this engine (which lives as long as its actor, across shards), follows the most
frequent continuation, and proposes it; a draft costs no model pass.

The corpus is kept in suffix automata: an automaton holds every substring of its text in at most
twice as many states as tokens, and the end of a text is matched in steps proportional to the
matched length, however large the text. Each state counts the text's occurrences of its strings,
which weighs continuations by frequency. An automaton cannot forget a text, so the corpus is
several automata, and the oldest is dropped whole when the corpus would exceed its cap.

A row's own text is not: an automaton is built token by token in Python, and a row's prompt
(hundreds of tokens, twice with its reflowed copy) would be built for the few dozen rounds the
row lasts, where passes of a few milliseconds (a captured GPU pass) make that the round's main
cost (docs/engine.md, at batch 64). A row's text is short, so it is scanned instead (`RowText`),
and the continuations are the ones its automaton would give: the same occurrences, counted the
same way.

A row's own text also holds its prompt reflowed (`Reflow`): every run of whitespace one space,
tokenized again. Documents are often hard-wrapped, and a summary that quotes one reflows it, so
the quote's tokens differ from the prompt's at every line break (the prompt's "Stichting",
newline, "Math" is "Stichting", " Math" quoted), and a copy of the prompt as it stands ends there.

Where the system's C++ compiler can build `lookups.cpp`, the corpus automata live there and a
round's lookups for every row run there in one call (`NativeAutomaton`, `_propose_native`): at 64
rows the Python took 2.5-3 ms a round (docs/engine.md). The Python here stays the reference and
the path where it cannot be built; both propose the same drafts (the tests run both).
"""

from __future__ import annotations

import ctypes
import re
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.decode import lookups
from pipeline.decode.drafters import SEPARATOR, KeepRule, Matches, Proposal, RowText, texts_matches
from pipeline.decode.sampling import SamplingParams
from pipeline.decode.settings import SUFFIX, SUFFIX_MAX_DEPTH

NO_EDGE, MANY = -1, -2
# A continuation's tokens count towards its score while its estimated chance of being right all
# along stays at or above this; it goes on to the limit regardless, and the policy verifies as
# many of its tokens as their measured acceptance by position pays for.
MIN_CHANCE = 0.1
# The longest suffix of a row's text looked for in the corpus, and the deepest match depth the
# policy tells apart; a longer match says little more about what follows.
MAX_DEPTH = SUFFIX_MAX_DEPTH
# The corpus is this many automata: the cap is kept within a quarter of it, oldest out first.
CORPUS_BLOCKS = 4
MEMO_FIELDS = 6  # a row's `Remembered` match in a block (lookups.cpp)
# Outputs finished while no round asks for drafts wait for the corpus up to this many tokens, the
# oldest dropped: otherwise a probe builds the whole backlog into automata for drafts that had
# not paid (docs/engine.md, at batch 64). Drafting rounds take each output as it finishes.
BACKLOG_TOKENS = 4096


class SuffixAutomaton:
    """Every substring of the documents added, each state with how often its strings occur.

    A state's edges map a token to the state of the strings extended by it. Most states of a
    text's automaton have a single edge, so one edge per state lives in two flat arrays and
    only states that branch get a dict: a fraction of the memory of a dict for every state.
    """

    __slots__ = ("link", "length", "count", "edge_token", "edge_target", "branches", "last", "tokens")

    def __init__(self) -> None:
        self.link = array("i", [-1])  # suffix link: the state of the longest suffix found elsewhere
        self.length = array("i", [0])  # the longest string of the state
        self.count = array("i", [0])  # occurrences (end positions) of the state's strings
        self.edge_token = array("i", [NO_EDGE])
        self.edge_target = array("i", [0])
        self.branches: dict[int, dict[int, int]] = {}
        self.last = 0  # the state of the whole current document
        self.tokens = 0

    def add(self, tokens: Iterable[int]) -> None:
        """Add a document: its substrings become states, none spanning into another document."""
        self.begin()
        for token in tokens:
            self.extend(token)

    def begin(self) -> None:
        """Start a new document, which `extend` then grows token by token."""
        self.last = 0

    def extend(self, token: int) -> None:
        """Append one token to the current document (the standard online construction, with
        the check that makes it a generalized automaton over several documents)."""
        p, length = self.last, self.length
        q = self.step(p, token)
        if q >= 0:  # the document so far plus this token occurred before, in another document
            cur = q if length[p] + 1 == length[q] else self._clone(p, q, token)
        else:
            cur = self._new(length[p] + 1, 0, 0)
            while p != -1 and self.step(p, token) < 0:
                self._set(p, token, cur)
                p = self.link[p]
            if p != -1:
                q = self.step(p, token)
                self.link[cur] = q if length[p] + 1 == length[q] else self._clone(p, q, token)
        self.last = cur
        self.tokens += 1
        # every suffix of the document so far occurs once more: the states on the link path
        count, link, s = self.count, self.link, cur
        while s > 0:
            count[s] += 1
            s = link[s]

    def step(self, state: int, token: int) -> int:
        """The state `token` leads to from `state`, or -1."""
        edge = self.edge_token[state]
        if edge == token:
            return self.edge_target[state]
        if edge == MANY:
            return self.branches[state].get(token, -1)
        return -1

    def match(self, context: Sequence[int]) -> tuple[int, int]:
        """The state of the longest suffix of `context` that occurs here, and its length."""
        # `step` inlined: this runs for every row's last MAX_DEPTH tokens in every corpus block
        edge_token, edge_target, branches = self.edge_token, self.edge_target, self.branches
        link, length = self.link, self.length
        state, matched = 0, 0
        for token in context:
            while True:
                edge = edge_token[state]
                if edge == token:
                    state, matched = edge_target[state], matched + 1
                    break
                if edge == MANY:
                    nxt = branches[state].get(token, -1)
                    if nxt >= 0:
                        state, matched = nxt, matched + 1
                        break
                if state == 0:
                    matched = 0
                    break
                state = link[state]
                matched = length[state]
        return state, matched

    @property
    def states(self) -> int:
        return len(self.length)

    def nbytes(self) -> int:
        """Bytes held: the flat arrays and the dicts of branching states."""
        flat = (self.link, self.length, self.count, self.edge_token, self.edge_target)
        arrays = sum(a.buffer_info()[1] * a.itemsize for a in flat)
        return arrays + sys.getsizeof(self.branches) + sum(map(sys.getsizeof, self.branches.values()))

    def _new(self, length: int, link: int, count: int, like: int = -1) -> int:
        s = len(self.length)
        self.length.append(length)
        self.link.append(link)
        self.count.append(count)
        self.edge_token.append(self.edge_token[like] if like >= 0 else NO_EDGE)
        self.edge_target.append(self.edge_target[like] if like >= 0 else 0)
        if like >= 0 and self.edge_token[like] == MANY:
            self.branches[s] = dict(self.branches[like])
        return s

    def _set(self, state: int, token: int, target: int) -> None:
        edge = self.edge_token[state]
        if edge == NO_EDGE or edge == token:
            self.edge_token[state], self.edge_target[state] = token, target
        elif edge == MANY:
            self.branches[state][token] = target
        else:
            self.branches[state] = {edge: self.edge_target[state], token: target}
            self.edge_token[state] = MANY

    def _clone(self, p: int, q: int, token: int) -> int:
        """Split `q`: its strings up to length[p] + 1 now also end elsewhere."""
        clone = self._new(self.length[p] + 1, self.link[q], self.count[q], like=q)
        while p != -1 and self.step(p, token) == q:
            self._set(p, token, clone)
            p = self.link[p]
        self.link[q] = clone
        return clone


class NativeAutomaton:
    """A `SuffixAutomaton` held by `lookups.cpp`: the same states, counts and edge order,
    built and read there (`SuffixDrafter.propose` reads a round's rows from it at once)."""

    __slots__ = ("handle", "_lib")

    def __init__(self) -> None:
        self._lib = lookups.library()
        self.handle = self._lib.suffix_automaton_new()

    def __reduce_ex__(self, protocol):
        # a copy would share the C++ automaton and free it twice
        raise TypeError("a NativeAutomaton cannot be copied or pickled")

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self._lib.suffix_automaton_free(self.handle)
            self.handle = None

    def add(self, tokens: Iterable[int]) -> None:
        """Add a document (as `SuffixAutomaton.add`)."""
        held = np.fromiter(tokens, dtype=np.int64)
        self._lib.suffix_automaton_add(self.handle, held.ctypes.data, len(held))

    @property
    def tokens(self) -> int:
        return self._lib.suffix_automaton_tokens(self.handle)

    @property
    def states(self) -> int:
        return self._lib.suffix_automaton_states(self.handle)

    def match(self, context: Sequence[int]) -> tuple[int, int]:
        """As `SuffixAutomaton.match`."""
        held = np.ascontiguousarray(np.asarray(context, dtype=np.int64))
        matched = ctypes.c_int64()
        state = self._lib.suffix_automaton_match(
            self.handle, held.ctypes.data, len(held), ctypes.byref(matched)
        )
        return state, matched.value

    def remembered_match(self, text: np.ndarray, context: int, memo: np.ndarray) -> tuple[int, int]:
        """The match of `text`'s last `context` tokens as a round's lookup finds it: from
        `memo` (MEMO_FIELDS, rewritten), what the row remembers of its last match here, where
        the automaton is unchanged and the text only grew since; else afresh, as `match`."""
        matched = ctypes.c_int64()
        state = self._lib.suffix_automaton_remembered_match(
            self.handle, text.ctypes.data, len(text), context, memo.ctypes.data, ctypes.byref(matched)
        )
        return state, matched.value

    def nbytes(self) -> int:
        """Bytes held, about: the flat arrays and the branching states' edges."""
        return self._lib.suffix_automaton_nbytes(self.handle)


@dataclass(frozen=True)
class Continuation:
    """A proposal from one match: its tokens, its score (the expected number of them accepted
    if the text's frequencies hold: the sum of each prefix's estimated chance) and the match
    length it follows."""

    tokens: list[int]
    score: float
    depth: int


def continuations(automaton: SuffixAutomaton, state: int, matched: int, limit: int, min_match: int):
    """The most frequent continuation after each match at least `min_match` long: from the
    longest match (`state`, `matched`), then each shorter one down its suffix links.

    A continuation follows, token after token, the edge most occurrences took; its chance is
    the product of each step's share of the occurrences that went on.
    """
    count, link, length = automaton.count, automaton.link, automaton.length
    edge_token, edge_target, branches = automaton.edge_token, automaton.edge_target, automaton.branches
    while state > 0 and matched >= min_match:
        tokens, chance, score, at = [], 1.0, 0.0, state
        while len(tokens) < limit:
            edge = edge_token[at]  # the state's edges: most states have one, in the flat arrays
            if edge == NO_EDGE:
                break
            if edge != MANY:
                best, best_state = edge, edge_target[at]
                best_count = going = count[best_state]
            else:
                going, best, best_count, best_state = 0, -1, 0, 0
                for token, child in branches[at].items():
                    going += count[child]
                    if count[child] > best_count:
                        best, best_count, best_state = token, count[child], child
            if not going:
                break
            chance *= best_count / going
            tokens.append(best)
            score += chance if chance >= MIN_CHANCE else 0.0
            at = best_state
        if tokens:
            yield Continuation(tokens, score, matched)
        state = link[state]
        matched = length[state]


def own_continuations(text: RowText, limit: int, min_match: int, matches: Matches | None = None):
    """The most frequent continuation after each match of a row's own text at least
    `min_match` long, deepest first, as `continuations` finds them in an automaton of that text:
    each distinct match length is a state of it, its occurrences those matching at least that
    long (a test compares the two). `matches`: the text's `matches(MAX_DEPTH)`, where the caller
    took them for a batch at once."""
    ends, lengths = matches or text.matches(MAX_DEPTH)
    tokens, n = text.tokens, len(text.tokens)
    for depth in sorted({d for d in lengths if d >= min_match}, reverse=True):
        at = [e for e, d in zip(ends, lengths, strict=True) if d >= depth]
        if len(at) == 1:  # one occurrence (most matches): the text after it, every token sure
            drafted = tokens[at[0] : min(n, at[0] + limit)]
            drafted = drafted[: drafted.index(SEPARATOR)] if SEPARATOR in drafted else drafted
            if drafted:
                yield Continuation(drafted, float(len(drafted)), depth)
            continue
        drafted, chance, score = [], 1.0, 0.0
        while len(drafted) < limit:
            counts: dict[int, int] = {}
            for e in at:
                if e < n and tokens[e] != SEPARATOR:
                    counts[tokens[e]] = counts.get(tokens[e], 0) + 1
            if not counts:
                break
            best = max(counts, key=counts.__getitem__)  # a tie: the earliest occurrence's
            chance *= counts[best] / sum(counts.values())
            drafted.append(best)
            score += chance if chance >= MIN_CHANCE else 0.0
            at = [e + 1 for e in at if e < n and tokens[e] == best]
            if len(at) == 1:  # one occurrence left: it goes on as the text does, chance unchanged
                run = tokens[at[0] : min(n, at[0] + limit - len(drafted))]
                run = run[: run.index(SEPARATOR)] if SEPARATOR in run else run
                for token in run:
                    drafted.append(token)
                    score += chance if chance >= MIN_CHANCE else 0.0
                break
        if drafted:
            yield Continuation(drafted, score, depth)


class SuffixCorpus:
    """Outputs this engine has finished, at most `max_tokens` of them, the oldest dropped first.

    Kept in `CORPUS_BLOCKS` automata: new outputs go to the newest until it holds its share of
    the cap, and when a new one starts past the cap the oldest goes as a whole.
    """

    def __init__(self, max_tokens: int, native: bool | None = None):
        """`native`: blocks held in C++ (`NativeAutomaton`); None: where it can be built."""
        self.max_tokens = max_tokens
        self.native = lookups.library() is not None if native is None else native
        self.blocks: deque[SuffixAutomaton | NativeAutomaton] = deque()
        self.outputs = 0  # ever added (dropped ones included)

    @property
    def tokens(self) -> int:
        return sum(b.tokens for b in self.blocks)

    def add(self, output: Sequence[int]) -> None:
        share = self.max_tokens // CORPUS_BLOCKS
        if not output or len(output) > share:
            return
        if not self.blocks or self.blocks[-1].tokens + len(output) > share:
            self.blocks.append(NativeAutomaton() if self.native else SuffixAutomaton())
            while self.tokens + len(output) > self.max_tokens:
                self.blocks.popleft()
        self.blocks[-1].add(output)
        self.outputs += 1

    def nbytes(self) -> int:
        return sum(b.nbytes() for b in self.blocks)


def depth_class(matched: int) -> int:
    """The match length as the policy keys a copy's acceptance: rounded down to a power of
    two, so that a few rates, each learnt from many rows, tell short matches from long ones."""
    return 1 << (min(matched, MAX_DEPTH).bit_length() - 1)


class Reflow:
    """A prompt as an output quotes it: its text with every run of whitespace one space,
    tokenized again (see the module's docstring)."""

    WHITESPACE = re.compile(r"\s+")

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]):
        self.encode, self.decode = encode, decode

    def __call__(self, prompt: list[int]) -> list[int]:
        return self.encode(self.WHITESPACE.sub(" ", self.decode(prompt)))


class SuffixDrafter:
    """Proposes the best-scored continuation of each row's text from its own automaton (prompt,
    output so far and, given `reflow`, the prompt reflowed) and the corpus of earlier outputs;
    nothing where no match reaches `min_match` tokens. No model pass. The policy sets how many
    of its tokens a row verifies, from this drafter's acceptance measured per match depth and
    position.
    """

    name = SUFFIX

    def __init__(
        self,
        max_tokens: int = 1 << 20,
        min_match: int = 1,
        reflow: Callable[[list[int]], list[int]] | None = None,
        native: bool | None = None,
    ):
        """`native`: the corpus and the rounds' lookups in C++ (see `SuffixCorpus`)."""
        self._corpus = SuffixCorpus(max_tokens, native)
        self._finished: deque[list[int]] = deque()  # outputs not in the corpus yet (`corpus`)
        self._finished_tokens = 0
        self.min_match = min_match
        self.reflow = reflow
        # each row's text, or its prompt until a round first asks for the row's drafts
        self._rows: list[RowText | list[int]] = []
        # each row's last match in each corpus block, for `lookups.cpp` (its `Remembered`):
        # a round then walks only the tokens a row gained since
        self._memo = np.zeros((0, CORPUS_BLOCKS, MEMO_FIELDS), dtype=np.int64)

    @property
    def corpus(self) -> SuffixCorpus:
        """The earlier outputs, those finished since the last draft added now (the last
        `BACKLOG_TOKENS` of them). Why the wait: an automaton is built token by token (in
        Python where `lookups.cpp` cannot be built), and where the engine's rounds stop asking
        for drafts (`DraftingGate`) a drafter that is not asked should cost nothing."""
        self._absorb()
        return self._corpus

    def _absorb(self, until: float | None = None) -> None:
        """Add the outputs finished since the last read to the corpus, oldest first (while
        `time.perf_counter()` is before `until`, if given)."""
        while self._finished and (until is None or time.perf_counter() < until):
            output = self._finished.popleft()
            self._finished_tokens -= len(output)
            self._corpus.add(output)

    @corpus.setter
    def corpus(self, corpus: SuffixCorpus) -> None:
        self._corpus, self._finished, self._finished_tokens = corpus, deque(), 0

    def prepare(self, until: float) -> None:
        """Until `until` (`time.perf_counter`), what no round's result changes and a later round
        would do anyway: the rows' reflowed prompts, then the finished outputs into the corpus,
        oldest first. Called while a device's pass runs (`EngineConfig.prepare_in_passes`),
        when the host would only wait, rather than by the next round that asks, which would
        pay it all at once (a probe at 64 rows reflowing 64 prompts, docs/engine.md)."""
        for row in range(len(self._rows)):
            if time.perf_counter() >= until:
                return
            self._own(row)
        self._absorb(until)

    def start(self, prompts: list[list[int]]) -> None:
        self._rows = []
        self._memo = self._memo[:0]
        self.admit(prompts)

    def admit(self, prompts: list[list[int]]) -> None:
        """New rows; each one's prompt is reflowed when its drafts are first asked for (see
        `corpus` for why)."""
        self._rows += [list(p) for p in prompts]
        fresh = np.zeros((len(prompts), CORPUS_BLOCKS, MEMO_FIELDS), dtype=np.int64)
        self._memo = np.concatenate([self._memo, fresh])

    def _own(self, row: int) -> RowText:
        """The row's own text: its prompt reflowed, then its text apart from it."""
        own = self._rows[row]
        if isinstance(own, RowText):
            return own
        own = RowText(self.reflow(own) if self.reflow is not None else ())
        self._rows[row] = own
        return own

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
        owns = [self._own(row) for row in range(len(seqs))]
        for own, seq in zip(owns, seqs, strict=True):
            own.feed(seq)
        if gamma > 0 and self.corpus.native:  # (the backlog joins the corpus before any row reads it)
            return self._propose_native(owns, gamma)
        every = texts_matches(owns, MAX_DEPTH) if gamma > 0 else [None] * len(seqs)
        for own, seq, matches in zip(owns, seqs, every):
            found = self.lookup(own, seq, gamma, matches)
            tokens.append(found.tokens if found else [])
            depths.append(depth_class(found.depth) if found else 0)
        return Proposal(tokens=tokens, probs=[None] * len(seqs), depths=depths)

    def _propose_native(self, owns: list[RowText], gamma: int) -> Proposal:
        """`propose` in one call of `lookups.cpp` for every row: each row's `lookup`."""
        rows, blocks = len(owns), self._corpus.blocks
        addresses, sizes, starts = lookups.row_texts(owns)
        handles = (ctypes.c_void_p * max(len(blocks), 1))(*[block.handle for block in blocks])
        drafted = np.zeros((rows, gamma), dtype=np.int64)
        lengths, found = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
        lookups.library().suffix_lookup(
            rows, addresses.ctypes.data, sizes.ctypes.data, starts.ctypes.data,
            gamma, self.min_match, MAX_DEPTH, SEPARATOR, handles, len(blocks),
            self._memo.ctypes.data, CORPUS_BLOCKS,
            drafted.ctypes.data, lengths.ctypes.data, found.ctypes.data,
        )  # fmt: skip
        lengths = lengths.tolist()
        return Proposal(
            tokens=[row[:n] for row, n in zip(drafted.tolist(), lengths)],
            probs=[None] * rows,
            depths=[depth_class(depth) if n else 0 for depth, n in zip(found.tolist(), lengths)],
        )

    def lookup(
        self, own: RowText, seq: list[int], limit: int, matches: Matches | None = None
    ) -> Continuation | None:
        """The best continuation of `seq`'s end: in its own text (`matches`: its matches, where
        taken for a batch at once) and in each corpus block, matched on the text's last
        `MAX_DEPTH` tokens. A higher score wins, a deeper match on a tie. (Python's path: a
        native corpus is read by `_propose_native`.)"""
        if limit <= 0:
            return None
        found = []
        for continuation in own_continuations(own, limit, self.min_match, matches):  # deepest first
            found.append(continuation)
            if continuation.score >= limit:  # sure all the way: no shallower match scores more
                break
        # the corpus counts where it matches deeper than the row's own text
        deeper = max(self.min_match, 1 + max((c.depth for c in found), default=0))
        context = seq[-MAX_DEPTH:]
        for block in self.corpus.blocks if deeper <= len(context) else ():
            for continuation in continuations(block, *block.match(context), limit, deeper):
                found.append(continuation)
                if continuation.score >= limit:
                    break
        return max(found, key=lambda c: (c.score, c.depth), default=None)

    def evict(self, keep: list[int], finished: list[list[int]]) -> None:
        self._finished += finished
        self._finished_tokens += sum(map(len, finished))
        while self._finished_tokens > min(BACKLOG_TOKENS, self._corpus.max_tokens):
            self._finished_tokens -= len(self._finished.popleft())
        self._rows = [self._rows[r] for r in keep]
        self._memo = self._memo[keep]
