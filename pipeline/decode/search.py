"""The policy's search over a round's candidates in C++ (`search.cpp`): `Policy.best` for more
than one row, every (cap, gamma) weighed row by row in one call, and the copies' arrays it
weighs laid out (`policy._Copies`) in another.

Why: at 64 rows the search in numpy (`policy._Candidates`) took 0.5-0.7 ms a round, some forty
array operations on arrays of a few hundred numbers, beside a captured GPU pass of a
millisecond or two (docs/engine.md). The numpy stays the reference and the path where the C++
cannot be built (or PIPELINE_NATIVE_SEARCH=0); the tests run both on random rounds and
require the same choice.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline import native

if TYPE_CHECKING:
    from pipeline.decode.policy import _Copies

SOURCE = Path(__file__).with_name("search.cpp")
# no contraction into fused multiply-adds: every rate rounds as numpy's separate operations do
FLAGS = ["-O2", "-shared", "-fPIC", "-std=c++17", "-ffp-contract=off"]
PASS_SECONDS = ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_int64)


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """`search.cpp` compiled (on first use) and loaded; None where it cannot be, or where the
    environment sets PIPELINE_NATIVE_SEARCH=0 (`native.optional`)."""
    lib = native.optional(SOURCE, FLAGS, "PIPELINE_NATIVE_SEARCH", "the policy's native search")
    if lib is None:
        return None
    pointer, integer, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    lib.lay_out.restype = None
    lib.lay_out.argtypes = [
        *[integer] * 4,  # rows, width, depth, count
        pointer,  # places
        integer,  # groups
        *[pointer] * 2,  # chances, known
        *[pointer] * 5,  # tokens, expected, survivals, survival_lengths, held
    ]
    lib.best_candidate.restype = integer
    lib.best_candidate.argtypes = [
        *[integer] * 3,  # rows, width, depth
        *[pointer] * 5,  # tokens, expected, survivals, survival_lengths, held
        *[integer] * 2,  # caps, gammas
        pointer,  # model_sums
        pointer,  # from_model
        integer,  # from_depth
        integer,  # draining
        real,  # to_limit
        pointer,  # leads
        *[real] * 2,  # draft_time, catch_up
        integer,  # remaining
        *[real] * 2,  # best_rate, per_token
        integer,  # pack
        PASS_SECONDS,
        pointer,  # out_chosen
        pointer,  # out_cap_gamma
        pointer,  # out_rate
    ]
    return lib


def lay_out(
    lib: ctypes.CDLL,
    copies: _Copies,
    places: list[int],
    chances: list[float],
    known: list[int],
) -> None:
    """Fills `copies`' arrays (allocated, unfilled) from its offers' `places` (row, column,
    group, drafts: four numbers an offer) and its groups' `chances` (`known` of each group's
    `depth` read, in one flat list), as `_Copies`' numpy does."""
    places_array = np.array(places, dtype=np.int64)
    chances_array = np.array(chances, dtype=np.float64)
    known_array = np.array(known, dtype=np.int64)
    rows, width, depth = copies.expected.shape
    lib.lay_out(
        rows,
        width,
        depth,
        len(places) // 4,
        places_array.ctypes.data,
        len(known),
        chances_array.ctypes.data,
        known_array.ctypes.data,
        *(
            a.ctypes.data
            for a in (copies.tokens, copies.expected, copies.survivals, copies.survival_lengths, copies.held)
        ),
    )


def best_candidate(
    lib: ctypes.CDLL,
    copies: _Copies,
    caps: int,
    gammas: int,
    from_model: np.ndarray,
    model_sums: np.ndarray,
    leads: np.ndarray | None,
    to_limit: float,
    draft_time: float,
    catch_up: float,
    remaining: int,
    best_rate: float,
    per_token: float,
    pack: bool,
    pass_tokens: Callable[[list[int]], int],
    pass_seconds: Callable[[int], float | None],
) -> tuple[int, int, list[int], float] | None:
    """The candidate `_Candidates.first_better` would settle on from `best_rate` (caps
    0..caps-1, each with gammas 0..gammas-1): its cap, gamma, each row's choice (0 plain,
    1 the draft model, 2 + c the copy in column c) and its rate; None where none beats it. `leads`: each
    row's tokens ahead of the row furthest behind in a drain (None: not draining). A pass is
    priced by `pass_seconds` of its cost as the target's runner counts it (`pass_tokens`,
    `BatchedLM.pass_tokens`): packed, its tokens; else its rows at its widest row's length,
    which a static runner counts as every slot at the graph width holding it."""
    rows = copies.tokens.shape[0]
    draining = leads is not None
    leads = np.zeros(rows, dtype=np.int64) if leads is None else leads
    chosen = np.zeros(rows, dtype=np.int64)
    cap_gamma, rate = np.zeros(2, dtype=np.int64), np.zeros(1)

    def priced(key: int) -> float:  # None in a ctypes callback reads as 0.0, the cheapest: never
        seconds = pass_seconds(key if pack else pass_tokens([key] * rows))
        return math.inf if seconds is None else seconds

    seconds = PASS_SECONDS(priced)
    arrays = (copies.tokens, copies.expected, copies.survivals, copies.survival_lengths, copies.held)
    assert all(a.flags.c_contiguous for a in arrays)
    found = lib.best_candidate(
        rows,
        copies.width,
        copies.expected.shape[2],
        *(a.ctypes.data for a in arrays),
        caps,
        gammas,
        model_sums.ctypes.data,
        from_model.ctypes.data,
        len(from_model),
        draining,
        to_limit,
        leads.ctypes.data,
        draft_time,
        catch_up,
        remaining,
        best_rate,
        per_token,
        pack,
        seconds,
        chosen.ctypes.data,
        cap_gamma.ctypes.data,
        rate.ctypes.data,
    )
    if not found:
        return None
    return int(cap_gamma[0]), int(cap_gamma[1]), chosen.tolist(), float(rate[0])
