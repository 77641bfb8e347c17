"""The copying drafters' per-round work in C++ (`lookups.cpp`): the suffix drafter's corpus
automata and lookups, and prompt lookup's matches, for every row of a round in one call.

Why: at 64 rows these were 3-4 ms of Python and numpy a round, beside a captured GPU pass of a
few (docs/engine.md). The Python in `drafters` and `suffix` stays the reference and the path
where the C++ cannot be built; the tests run both and compare their proposals.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import numpy as np

from pipeline import native

SOURCE = Path(__file__).with_name("lookups.cpp")
FLAGS = ["-O2", "-shared", "-fPIC", "-std=c++17"]


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """`lookups.cpp` compiled (on first use) and loaded; None, with one warning, where it cannot
    be, or where the environment sets PIPELINE_NATIVE_LOOKUPS=0: the drafters then run their
    Python, which proposes the same drafts."""
    lib = native.optional(SOURCE, FLAGS, "PIPELINE_NATIVE_LOOKUPS", "the copying drafters' native lookups")
    if lib is None:
        return None
    pointer, integer = ctypes.c_void_p, ctypes.c_int64
    lib.suffix_automaton_new.restype = pointer
    lib.suffix_automaton_free.argtypes = [pointer]
    lib.suffix_automaton_add.argtypes = [pointer, pointer, integer]
    for name in ("suffix_automaton_tokens", "suffix_automaton_states", "suffix_automaton_nbytes"):
        getattr(lib, name).argtypes = [pointer]
        getattr(lib, name).restype = integer
    lib.suffix_automaton_match.argtypes = [pointer, pointer, integer, pointer]
    lib.suffix_automaton_match.restype = integer
    lib.suffix_automaton_remembered_match.argtypes = [pointer, pointer, *[integer] * 2, pointer, pointer]
    lib.suffix_automaton_remembered_match.restype = integer
    # rows, texts, sizes, starts, limit, min_match, max_depth, separator, blocks, count, memo,
    # memo_blocks, outputs
    lib.suffix_lookup.argtypes = [
        integer,
        *[pointer] * 3,
        *[integer] * 4,
        pointer,
        integer,
        pointer,
        integer,
        *[pointer] * 3,
    ]
    # rows, texts, sizes, starts, deepest, lengths, ends
    lib.longest_matches.argtypes = [integer, *[pointer] * 3, integer, pointer, pointer]
    return lib


def row_texts(texts: list) -> tuple:
    """The arrays `lookups.cpp` reads a round's rows from (`RowText`s): where each row's tokens
    are, how many, and where its own text starts; kept alive by the caller while it runs."""
    return (
        np.array([t.address for t in texts], dtype=np.uint64),
        np.array([len(t.tokens) for t in texts], dtype=np.int64),
        np.array([t.start for t in texts], dtype=np.int64),
    )
