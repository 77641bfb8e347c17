"""The suffix drafter's structure: matches, frequency-weighted continuations, a bounded corpus."""

from __future__ import annotations

import copy
import functools
import pickle
import random
import time

import numpy as np
import pytest
import torch
from tiny_models import build_tokenizer

from pipeline.decode.drafters import RowText
from pipeline.decode.sampling import SamplingParams
from pipeline.decode.suffix import (
    BACKLOG_TOKENS,
    CORPUS_BLOCKS,
    MEMO_FIELDS,
    Continuation,
    NativeAutomaton,
    Reflow,
    SuffixAutomaton,
    SuffixCorpus,
    SuffixDrafter,
    continuations,
    depth_class,
    own_continuations,
)

# every test here runs with the drafter's rounds in Python and, where it builds, in C++
pytestmark = pytest.mark.usefixtures("lookups")


def occurrences(docs: list[list[int]], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(doc[i : i + n] == pattern for doc in docs for i in range(len(doc) - n + 1))


def test_every_substring_is_a_state_counted_as_often_as_it_occurs():
    rng = random.Random(0)
    docs = [[rng.randrange(4) for _ in range(rng.randint(1, 30))] for _ in range(12)]
    automaton = SuffixAutomaton()
    for doc in docs:
        automaton.add(doc)
    assert automaton.tokens == sum(map(len, docs))
    assert len(automaton.length) <= 2 * automaton.tokens  # linear in the text
    for _ in range(300):
        doc = rng.choice(docs)
        i = rng.randrange(len(doc))
        pattern = doc[i : i + rng.randint(1, 8)]
        state, matched = automaton.match(pattern)
        assert matched == len(pattern)
        assert automaton.count[state] == occurrences(docs, pattern), pattern


def test_a_match_is_the_longest_suffix_that_occurs():
    automaton = SuffixAutomaton()
    automaton.add([1, 2, 3, 4, 5])
    assert automaton.match([9, 9, 2, 3, 4])[1] == 3  # "2 3 4"
    assert automaton.match([3, 4, 9])[1] == 0
    assert automaton.match([7, 1, 2])[1] == 2
    # documents do not run into each other: a string spanning two is no substring
    automaton.add([6, 7])
    assert automaton.match([5, 6])[1] == 1


def test_the_most_frequent_continuation_wins_and_its_score_is_its_expected_acceptance():
    automaton = SuffixAutomaton()
    for _ in range(3):
        automaton.add([10, 11, 12, 13, 14])
    automaton.add([10, 11, 20, 21])
    state, matched = automaton.match([10, 11])
    best = next(continuations(automaton, state, matched, limit=8, min_match=2))
    assert best.tokens == [12, 13, 14]  # 3 of the 4 occurrences went on with 12
    assert best.score == pytest.approx(0.75 * 3) and best.depth == 2
    assert [c.tokens for c in continuations(automaton, state, matched, limit=2, min_match=2)] == [[12, 13]]
    # tokens past the point where the chance falls below MIN_CHANCE (0.1) are proposed, for the
    # policy to verify as their measured acceptance pays, but add nothing to the score: here
    # after 4, where 12 occurrences go 12 ways
    split = SuffixAutomaton()
    for k in range(12):
        split.add([1, 2, 3, 4, 100 + k])
    # ("2 3" never occurs without the 1 before it: one state, one continuation, for both)
    chosen = list(continuations(split, *split.match([1, 2, 3]), limit=8, min_match=2))
    assert chosen == [Continuation([4, 100], 1.0, 3)]


def test_a_match_shorter_than_min_match_proposes_nothing():
    automaton = SuffixAutomaton()
    automaton.add([1, 2, 3, 4])
    state, matched = automaton.match([9, 2])
    assert matched == 1
    assert list(continuations(automaton, state, matched, limit=4, min_match=2)) == []
    assert [c.tokens for c in continuations(automaton, state, matched, limit=4, min_match=1)] == [[3, 4]]


def test_the_corpus_keeps_within_its_cap_and_drops_the_oldest_outputs_first():
    corpus = SuffixCorpus(max_tokens=400)
    outputs = [[1000 + k] + [k % 7, (k * 3) % 11] * 15 for k in range(60)]  # 31 tokens each
    for output in outputs:
        corpus.add(output)
        assert corpus.tokens <= 400
        assert len(corpus.blocks) <= CORPUS_BLOCKS + 1
    assert corpus.tokens > 400 - 2 * 400 // CORPUS_BLOCKS  # most of the cap is in use
    # the newest outputs are there, the oldest are gone
    assert any(block.match([1059])[1] == 1 for block in corpus.blocks)
    assert not any(block.match([1000])[1] for block in corpus.blocks)
    # an output larger than a block's share is not kept; a cap of 0 keeps nothing
    corpus.add(list(range(200)))
    assert not any(block.match([150, 151])[1] == 2 for block in corpus.blocks)
    empty = SuffixCorpus(max_tokens=0)
    empty.add([1, 2, 3])
    assert empty.tokens == 0 and not empty.blocks


def test_a_lookup_walks_the_match_not_the_corpus():
    """Matching steps are bounded by the context's length, whatever the corpus holds."""
    steps = 0

    class Counting(SuffixAutomaton):
        def step(self, state, token):
            nonlocal steps
            steps += 1
            return super().step(state, token)

    rng = random.Random(1)
    for size in (100, 3000):
        automaton = Counting()
        for _ in range(size // 50):
            automaton.add([rng.randrange(50) for _ in range(50)])
        steps = 0
        automaton.match([rng.randrange(50) for _ in range(16)])
        assert steps <= 2 * 16 + 1


def test_a_rows_own_text_is_scanned_into_the_continuations_its_automaton_gives():
    """The row's text is scanned, not built into an automaton (the module's docstring says
    why): the same continuations, scores and match depths, ties broken alike."""
    rng = random.Random(0)
    for _ in range(1500):
        vocab = rng.choice([3, 5, 20])
        reflowed = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        text = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        automaton = SuffixAutomaton()
        if reflowed:
            automaton.add(reflowed)
            automaton.begin()
        for token in text:
            automaton.extend(token)
        row = RowText(reflowed)
        row.feed(text[: len(text) // 2])
        row.feed(text)  # fed as a row grows
        for min_match in (1, 2):
            found = continuations(automaton, automaton.last, len(text), 6, min_match)
            scanned = own_continuations(row, 6, min_match)
            # matches deeper than MAX_DEPTH are one class (depth_class), not told apart
            assert [c for c in scanned if c.depth < 32] == [c for c in found if c.depth < 32]


def test_the_drafter_proposes_from_the_rows_own_text_and_from_earlier_outputs():
    drafter = SuffixDrafter(max_tokens=1 << 12, min_match=2)
    greedy, generator = SamplingParams(), torch.Generator()
    prompt = [5, 6, 7, 8, 9, 1, 2, 5, 6]
    drafter.start([prompt])
    proposal = drafter.propose([prompt], 4, greedy, generator)
    assert proposal.tokens == [[7, 8, 9, 1]] and proposal.depths == [2]  # its own prompt
    assert proposal.probs == [None]
    # an output finished earlier feeds later rows: a row with no repeat in its own text
    drafter.evict([], [[40, 41, 42, 43, 44, 45]])
    drafter.admit([[30, 31, 40, 41]])
    assert drafter.propose([[30, 31, 40, 41]], 3, greedy, generator).tokens == [[42, 43, 44]]
    # no match long enough: nothing
    drafter.start([[60, 61, 62]])
    assert drafter.propose([[60, 61, 62]], 3, greedy, generator).tokens == [[]]
    # rows follow the batch: evict keeps the rows asked for, in that order
    drafter.start([[1, 2, 1], [3, 4, 3]])
    drafter.evict([1], [])
    assert drafter.propose([[3, 4, 3, 4]], 2, greedy, generator).tokens == [[3, 4]]


def test_a_drafter_never_asked_builds_nothing_and_catches_up_when_asked():
    """Rounds that do not ask for drafts (the engine's gate) cost the drafter nothing: a row's
    reflowed prompt waits for its first proposal, finished outputs for the corpus's next use
    (the newest BACKLOG_TOKENS of them), and the proposals are then those of a drafter that
    built everything at once."""
    reflowed = []
    drafter = SuffixDrafter(max_tokens=1 << 12, min_match=2, reflow=lambda p: reflowed.append(p) or p)
    greedy, generator = SamplingParams(), torch.Generator()
    prompt = [5, 6, 7, 8, 9, 1, 2, 5, 6]
    drafter.start([prompt, [30, 31, 40, 41]])
    prompt.append(3)  # the engine's rows grow: the drafter keeps the prompt as admitted
    drafter.evict([1], [[40, 41, 42, 43, 44, 45]])
    assert reflowed == [] and drafter._corpus.tokens == 0  # nothing built yet
    assert drafter.propose([[30, 31, 40, 41]], 3, greedy, generator).tokens == [[42, 43, 44]]
    assert reflowed == [[30, 31, 40, 41]] and drafter.corpus.tokens == 6
    # outputs finished while no round asks wait up to BACKLOG_TOKENS, the oldest dropped
    lazy = SuffixDrafter(max_tokens=1 << 20, min_match=2)
    outputs = [[10_000 + k, 20_000 + k, 30_000 + k, 40_000 + k] for k in range(BACKLOG_TOKENS // 2)]
    for output in outputs:
        lazy.evict([], [output])
    assert lazy._corpus.tokens == 0 and lazy._finished_tokens == BACKLOG_TOKENS
    assert lazy.corpus.tokens == BACKLOG_TOKENS and lazy.corpus.outputs == BACKLOG_TOKENS // 4
    lazy.start([outputs[-1][:2], outputs[0][:2]])  # the newest output is there, the oldest not
    assert lazy.propose([outputs[-1][:2], outputs[0][:2]], 2, greedy, generator).tokens == [
        outputs[-1][2:],
        [],
    ]


def test_waiting_work_is_done_while_a_pass_runs_as_a_later_round_would():
    """`prepare` (called while a device's pass runs) reflows the rows' prompts and adds the
    finished outputs to the corpus, oldest first, and stops at its deadline; the proposals are
    then a lazy drafter's."""
    greedy, generator = SamplingParams(), torch.Generator()
    reflowed = []
    drafters = [SuffixDrafter(1 << 12, 2, reflow=lambda p: reflowed.append(p) or p) for _ in range(2)]
    rows = [[30, 31, 40, 41], [50, 51, 52]]
    for drafter in drafters:
        drafter.start([list(r) for r in rows])
        drafter.evict([0, 1], [[40, 41, 42, 43, 44], [50, 51, 52, 53]])
    eager, lazy = drafters
    eager.prepare(time.perf_counter() - 1.0)  # past its deadline: nothing done
    assert reflowed == [] and eager._corpus.tokens == 0
    eager.prepare(time.perf_counter() + 60.0)
    assert reflowed == rows and eager._corpus.tokens == 9 and eager._finished_tokens == 0
    assert eager._corpus.outputs == 2 and not eager._finished
    before = len(reflowed)
    assert [eager.propose(rows, 3, greedy, generator).tokens] == [
        lazy.propose(rows, 3, greedy, generator).tokens
    ]
    assert len(reflowed) == before + 2  # the lazy drafter reflowed its rows only now; the eager one not again


def test_depth_classes_are_powers_of_two_up_to_the_deepest_match_told_apart():
    assert [depth_class(n) for n in (1, 2, 3, 4, 7, 8, 31, 32, 500)] == [1, 2, 2, 4, 4, 8, 16, 32, 32]


def test_the_rows_own_text_wins_over_a_corpus_match_that_is_no_deeper():
    """A phrase seen once in an earlier output scores as a certainty; the row's own text, where
    the same phrase went on two ways, scores less. The own text is what prompt lookup copies
    and what the target follows most often: an earlier output counts only where it matched more."""
    greedy, generator = SamplingParams(), torch.Generator()
    row = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 3, 3, 5, 6]  # "5 6" went on with 7 twice, 3 once
    for output, expected in [([1, 5, 6, 20, 21, 22], 7), ([3, 3, 5, 6, 20, 21, 22], 20)]:
        drafter = SuffixDrafter(max_tokens=1 << 12, min_match=2)
        drafter.evict([], [output])
        drafter.start([row])
        proposal = drafter.propose([row], 3, greedy, generator)
        assert proposal.tokens[0][0] == expected


def test_a_quote_of_a_hard_wrapped_prompt_is_drafted_across_its_line_breaks():
    """A summary quotes a line-wrapped document with spaces where its lines broke: its tokens
    there are not the prompt's, and a copy of the prompt as it stands proposes the line break.
    The prompt reflowed proposes what the quote goes on with."""
    tokenizer = build_tokenizer()
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    prompt = encode(
        "Summarize: The licensor grants you a\nworld-wide, royalty-free\n  license to use the\nwork.\n"
    )
    row = prompt + encode("It grants a world-wide, royalty-free")
    quote = " license to use the work."
    greedy, generator = SamplingParams(), torch.Generator()

    as_it_stands = SuffixDrafter(max_tokens=0)
    as_it_stands.start([prompt])
    drafted = tokenizer.decode(as_it_stands.propose([row], 8, greedy, generator).tokens[0])
    assert drafted.startswith("\n")  # the line break, which the quote does not have

    reflowed = SuffixDrafter(max_tokens=0, reflow=Reflow(encode, tokenizer.decode))
    reflowed.start([prompt])
    proposal = reflowed.propose([row], 8, greedy, generator)
    assert quote.startswith(tokenizer.decode(proposal.tokens[0])) and len(proposal.tokens[0]) >= 4
    # the row's text grows from where the last round left it, apart from the reflowed prompt
    row += proposal.tokens[0][:2]
    assert reflowed.propose([row], 8, greedy, generator).tokens[0][:6] == proposal.tokens[0][2:8]


def test_a_lookup_stops_at_a_sure_continuation_and_proposes_what_weighing_all_would():
    """A row that copies its input matches deep, once, and its continuation is sure all the way
    (score = limit): no shallower match of its own text can score more or tie deeper, so the
    lookup stops there, and in each corpus block at its first sure continuation, matched
    deeper than the row's own text. It proposes what weighing every continuation would."""
    rng = random.Random(0)
    for _ in range(1500):
        vocab = rng.choice([3, 5, 20])
        outputs = rng.randint(0, 6)
        earlier = [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(outputs)]
        copied = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        row = copied + [rng.randrange(vocab) for _ in range(rng.randint(0, 5))] + copied[: rng.randint(1, 25)]
        # a small corpus keeps its outputs in several blocks, each weighed on its own
        drafter = SuffixDrafter(
            max_tokens=rng.choice([1 << 12, 48]), min_match=rng.choice([1, 2]), native=False
        )
        drafter.evict([], earlier)
        drafter.start([row])
        own = RowText()
        own.feed(row)
        limit = rng.choice([1, 3, 8])
        every = list(own_continuations(own, limit, drafter.min_match))
        deepest = max((c.depth for c in every), default=0)
        for block in drafter.corpus.blocks:
            matched = continuations(block, *block.match(row[-32:]), limit, drafter.min_match)
            every += [c for c in matched if c.depth > deepest]
        best = max(every, key=lambda c: (c.score, c.depth), default=None)
        mine = drafter._own(0)
        mine.feed(row)
        assert drafter.lookup(mine, row, limit) == best


def test_the_native_lookup_proposes_what_the_python_one_does(lookups):
    """`lookups.cpp` holds the corpus and runs a round's lookups for every row at once;
    its proposals are the Python path's, round after round as rows grow, on random rows with
    reflowed prompts, rows that copy themselves past `MAX_DEPTH`, corpora of several blocks
    (states with many edges among them), every `min_match` and gamma, ties and all (small
    vocabularies make them common)."""
    if lookups == "python":
        pytest.skip("compares the two paths")
    rng = random.Random(0)
    greedy, generator = SamplingParams(), torch.Generator()
    for trial in range(300):
        vocab = rng.choice([2, 3, 5, 20, 60])
        max_tokens, min_match = rng.choice([1 << 12, 64, 200]), rng.choice([1, 2, 3])
        drafters = [
            SuffixDrafter(max_tokens, min_match, reflow=lambda p: p[::-1], native=n) for n in (False, True)
        ]
        earlier = [
            [rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(rng.randint(0, 12))
        ]
        rows = [[rng.randrange(vocab) for _ in range(rng.randint(1, 50))] for _ in range(rng.randint(1, 9))]
        for row in rows[: rng.randint(0, 2)]:  # a row that copies itself: matches past MAX_DEPTH
            row += row * (40 // len(row) + 1)
        for drafter in drafters:
            drafter.evict([], [list(e) for e in earlier])
            drafter.start([list(r) for r in rows])
        for _ in range(rng.randint(1, 6)):
            gamma = rng.choice([0, 1, 3, 8, 12])
            python, native = (d.propose([list(r) for r in rows], gamma, greedy, generator) for d in drafters)
            assert (native.tokens, native.depths) == (python.tokens, python.depths), trial
            for row, drafted in zip(rows, python.tokens):
                row += drafted[: rng.randint(0, len(drafted))] + [rng.randrange(vocab)]
            if rng.random() < 0.3:  # a row finishes: its output joins both corpora
                done = rng.randrange(len(rows))
                keep = [r for r in range(len(rows)) if r != done] or [done]
                output = rows[done][-rng.randint(1, 30) :]
                for drafter in drafters:
                    drafter.evict(keep, [list(output)])
                rows = [rows[r] for r in keep]
        assert [b.tokens for b in drafters[0].corpus.blocks] == [b.tokens for b in drafters[1].corpus.blocks]


def test_a_rows_remembered_match_is_the_match_found_afresh(lookups):
    """`lookups.cpp` remembers each row's match in each block and walks only the tokens the
    row gained since (`Remembered`); its proposals stay the Python path's, which matches the
    last `MAX_DEPTH` tokens afresh every round: rows copying the corpus far past `MAX_DEPTH`
    (a remembered match not cut back to the window fails it), outputs added to the newest
    block between rounds (a match remembered across them fails it: states split), and blocks
    dropped while rows go on."""
    if lookups == "python":
        pytest.skip("compares the two paths")
    rng = random.Random(1)
    greedy, generator = SamplingParams(), torch.Generator()
    for trial in range(40):
        vocab = rng.choice([3, 6, 20])
        docs = [[rng.randrange(vocab) for _ in range(rng.randint(60, 140))] for _ in range(4)]
        max_tokens = rng.choice([1 << 12, 600])  # 600: four blocks of 150, the oldest dropped
        drafters = [SuffixDrafter(max_tokens, 1, native=n) for n in (False, True)]
        rows = []
        for _ in range(rng.randint(1, 6)):
            doc = rng.choice(docs)
            at = rng.randrange(len(doc) - 40)
            rows.append(doc[at : at + rng.randint(1, 40)])
        for drafter in drafters:
            drafter.evict([], [list(d) for d in docs[:2]])
            drafter.start([list(r) for r in rows])
        for _ in range(30):
            python, native = (d.propose([list(r) for r in rows], 8, greedy, generator) for d in drafters)
            assert (native.tokens, native.depths) == (python.tokens, python.depths), trial
            for row, drafted in zip(rows, python.tokens):
                row += drafted[: rng.randint(0, len(drafted))] or [rng.randrange(vocab)]
            if rng.random() < 0.3:  # an output joins the corpus while the rows go on
                output = list(rng.choice(docs))[rng.randrange(30) :]
                for drafter in drafters:
                    drafter.evict(list(range(len(rows))), [list(output)])


def test_a_remembered_match_is_the_match_found_afresh(lookups):
    """A row's match walked on from what it remembers (`NativeAutomaton.remembered_match`) is
    the match of its last `context` tokens found afresh, state and length, round after round:
    rows copying the block far past the window (a match not cut back to it fails this),
    outputs added between rounds (states split and grow: a match remembered across an
    addition fails this), rows growing past the window in one round, windows narrower and
    wider than the last (one remembered cut to 4 tokens cannot serve 32 a token later), and
    another block in its place."""
    if lookups == "python":
        pytest.skip("the native automaton's")
    rng = random.Random(2)
    for trial in range(60):
        vocab = rng.choice([2, 3, 6, 20])
        doc = [rng.randrange(vocab) for _ in range(rng.randint(40, 200))]
        block = NativeAutomaton()
        block.add(doc)
        at = rng.randrange(len(doc))
        text = doc[at : at + rng.randint(1, 60)]
        memo = np.zeros(MEMO_FIELDS, dtype=np.int64)
        for _ in range(40):
            context = min(len(text), rng.choice([4, 32]))
            held = np.array(text, dtype=np.int64)
            assert block.remembered_match(held, context, memo) == block.match(text[-context:]), trial
            grow = rng.choice([1, 1, 2, 5, 40])
            start = rng.randrange(len(doc))
            text += doc[start : start + grow] if rng.random() < 0.7 else [rng.randrange(vocab)] * grow
            if rng.random() < 0.2:  # an output joins the block: of this text, or of the document
                own = rng.random() < 0.5
                block.add(text[-rng.randint(1, len(text)) :] if own else doc[rng.randrange(10) :])
            elif rng.random() < 0.1:  # another block of as many tokens (a match named by size alone fails)
                other = NativeAutomaton()
                other.add([rng.randrange(vocab) for _ in range(block.tokens)])
                block = other


def test_a_native_automaton_is_never_copied(lookups):
    """A copy would hold the same C++ automaton and free it twice: copying or pickling one is
    refused, and the corpus it belongs to goes on working."""
    if lookups == "python":
        pytest.skip("the C++ automaton")
    corpus = SuffixCorpus(max_tokens=1 << 12)
    corpus.add([1, 2, 3, 4])
    (block,) = corpus.blocks
    for copier in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied"):
            copier(block)
    assert block.match([2, 3]) == block.match([2, 3]) and block.match([2, 3])[1] == 2


def test_the_environment_can_keep_the_lookups_in_python(monkeypatch, lookups):
    """PIPELINE_NATIVE_LOOKUPS=0 keeps both copying drafters in Python (a machine whose build
    misbehaves): no library, and a corpus of Python automata."""
    from pipeline.decode import lookups as native_lookups

    if lookups == "python":
        pytest.skip("the library is already replaced")
    monkeypatch.setenv("PIPELINE_NATIVE_LOOKUPS", "0")
    native_lookups.library.cache_clear()
    try:
        assert native_lookups.library() is None
        corpus = SuffixCorpus(max_tokens=1 << 12)
        corpus.add([1, 2, 3])
        assert not corpus.native and isinstance(corpus.blocks[0], SuffixAutomaton)
    finally:
        monkeypatch.delenv("PIPELINE_NATIVE_LOOKUPS")
        native_lookups.library.cache_clear()
    assert native_lookups.library() is not None
