"""Drafters: what each proposes, through the one interface the engine uses."""

from __future__ import annotations

import random

import torch

from pipeline.decode.drafters import SEPARATOR, DraftModelDrafter, PromptLookupDrafter, RowText, texts_matches
from pipeline.decode.sampling import SamplingParams


def test_a_guess_at_the_drafts_chain_saves_passes_and_changes_no_draft(case):
    """A lone row's draft checks guessed tokens (a prompt-lookup copy) in one pass: right
    guesses skip passes, a wrong one costs none, the drafts are the plain steps' own, and the
    guessed tokens left in the cache are rolled back before the next proposal."""
    _, draft, _, prompts, _, _ = case
    greedy, generator = SamplingParams(), torch.Generator()

    def drafter():
        d = DraftModelDrafter(draft, 0)
        d.start([prompts[1]])
        d.propose([prompts[1]], 1, greedy, generator)  # the prefill: a cold cache takes no guess
        return d

    plain, guessed = drafter(), drafter()
    seq = prompts[1] + plain.propose([prompts[1]], 1, greedy, generator).tokens[0]
    guessed.propose([prompts[1]], 1, greedy, generator)
    chain = plain.propose([seq], 6, greedy, generator)
    assert chain.model_passes == 6
    right = guessed.propose([seq], 6, greedy, generator, guess=chain.tokens[0][:3])
    assert right.tokens == chain.tokens and right.model_passes == 3  # 4 drafts in the first pass
    wrong_token = (chain.tokens[0][1] + 1) % draft.config.vocab_size
    wrong = guessed.propose([seq], 6, greedy, generator, guess=[chain.tokens[0][0], wrong_token])
    assert wrong.tokens == chain.tokens and wrong.model_passes == 5
    # a row whose rule stops it inside a guessed run stops where plain steps would
    stop_after_two = lambda chances, drafted: [drafted[0] < 2]  # noqa: E731
    short = guessed.propose([seq], 6, greedy, generator, stop_after_two, guess=chain.tokens[0][:3])
    assert short.tokens == [chain.tokens[0][:2]] and short.model_passes == 1
    # the caches agree afterwards: the next proposals are the same
    later = seq + chain.tokens[0][:4]
    expected = plain.propose([later], 4, greedy, generator).tokens
    assert guessed.propose([later], 4, greedy, generator).tokens == expected


def test_prompt_lookup_copies_after_the_most_recent_occurrence_of_the_longest_ngram(lookups):
    """Against the rule read literally, on texts that grow between proposals as rows do, in
    Python and in C++ (`lookups.cpp`)."""

    def literal(seq, gamma, ngram_max, ngram_min):
        for n in range(min(ngram_max, len(seq)), ngram_min - 1, -1):
            ends = [e for e in range(n, len(seq)) if seq[e - n : e] == seq[-n:]]
            if ends:
                return (seq[ends[-1] : ends[-1] + gamma] if gamma else []), n
        return [], 0

    rng = random.Random(0)
    greedy, generator = SamplingParams(), torch.Generator()
    for _ in range(200):
        vocab = rng.choice([2, 4, 30])
        rows = [[rng.randrange(vocab) for _ in range(rng.randint(0, 30))] for _ in range(3)]
        drafter = PromptLookupDrafter(ngram_max=rng.choice([1, 4]), ngram_min=rng.choice([1, 2]))
        drafter.start([list(r) for r in rows])
        for _ in range(5):
            for row in rows:
                row += [rng.randrange(vocab) for _ in range(rng.randint(0, 3))]
            gamma = rng.randint(0, 6)
            proposal = drafter.propose(rows, gamma, greedy, generator)
            expected = [literal(r, gamma, drafter.ngram_max, drafter.ngram_min) for r in rows]
            assert list(zip(proposal.tokens, proposal.depths)) == expected, rows


def test_a_rows_text_finds_each_earlier_occurrence_of_its_end_and_how_far_back_it_matches():
    """`texts_matches` compares every occurrence at every distance at once, for every row of a
    batch at once; a match runs back while the tokens agree, at most `deepest` tokens and never
    past the row's own text into its reflowed prompt, though an occurrence may lie there."""
    rng = random.Random(0)

    def plain(reflowed: list[int], text: list[int], deepest: int) -> tuple[list[int], list[int]]:
        full = [*reflowed, SEPARATOR] if reflowed else []
        full += text
        ends, lengths = [], []
        for end in range(1, len(full)) if text else ():
            matched = 0
            while (
                matched < min(deepest, len(text))
                and end - 1 - matched >= 0
                and full[end - 1 - matched] == full[-1 - matched]
            ):
                matched += 1
            if matched:
                ends.append(end)
                lengths.append(matched)
        return ends, lengths

    for _ in range(1500):
        vocab = rng.choice([2, 3, 5, 50])
        deepest = rng.choice([1, 2, 4, 32])
        rows, expected = [], []
        for _ in range(rng.choice([1, 1, 2, 5])):
            reflowed = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
            text = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
            row = RowText(reflowed)
            row.feed(text)
            rows.append(row)
            expected.append(plain(reflowed, text, deepest))
        assert texts_matches(rows, deepest) == expected
        assert [row.matches(deepest) for row in rows] == expected
