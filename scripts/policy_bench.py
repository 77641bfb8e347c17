"""Time the policy's own work in a round at many rows: what the host spends deciding while a
captured GPU pass of a few milliseconds waits (issue 37, items 5 and 6).

    python scripts/policy_bench.py [--rows 64,256] [--repeats 300] [--seed 0]

Synthetic rounds, the same for every commit: each of ROWS rows offered a prompt-lookup copy
(6 rows in 10) and a suffix copy (8 in 10) of 1 to 8 tokens at match depths 1 to 4, the draft
model usable, gamma_cap 8; passes priced as a static runner prices them (`StaticLM.pass_tokens`:
every slot at the graph width holding the widest row), from a cost model that measured each
graph width at ROWS slots (3 ms a pass at width 1, 4% more a token; a draft step 1 ms). Timed,
the median of `--repeats` calls each, in milliseconds: `Policy.choose` while prompts wait and
while the batch drains (each row 1 to 64 tokens left), and one draft step's keep rule of the
draft model (`Policy.draft_length`) and of a draft head (`Policy.head_length`), every row
drafting, at a round's first step (every row one draft long) and with rows 1 to 4 drafts long.
Prints Markdown, the machine first. Times the `pipeline` package the path finds first: run
from another worktree with `PYTHONPATH=<it>` for an A/B.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from pipeline.decode.costs import CostModel
from pipeline.decode.policy import Offer, Policy, RoundOptions
from pipeline.decode.settings import DRAFT_MODEL, PROMPT_LOOKUP, SUFFIX, EngineConfig
from pipeline.decode.static_lm import WIDTHS, StaticLM
from pipeline.machine import describe_machine, machine_table


class Slots:
    """A static runner's pricing of a pass (its own rule, `StaticLM.pass_tokens`), no model."""

    pack = False
    pass_tokens = StaticLM.pass_tokens

    def __init__(self, capacity: int):
        self.capacity = capacity


def policy_for(rows: int) -> Policy:
    costs = CostModel()
    for _ in range(2):  # each size measured twice: confirmed (`PassCosts.time`)
        for width in WIDTHS:
            costs.observe_target(rows * width, 0.003 * (1 + 0.04 * width))
        costs.observe_draft(rows, 0.001)
    costs.observe_round(rows, 0.004)  # what a token has cost lately
    runner = Slots(rows)
    return Policy(EngineConfig(), costs, runner, draft=runner)


def round_for(rows: int, rng: random.Random, draining: bool) -> RoundOptions:
    offers = []
    for _ in range(rows):
        row = []
        if rng.random() < 0.6:
            row.append(Offer(PROMPT_LOOKUP, rng.randint(1, 8), rng.randint(1, 4)))
        if rng.random() < 0.8:
            row.append(Offer(SUFFIX, rng.randint(1, 8), rng.randint(1, 4)))
        offers.append(row)
    budgets = [rng.randint(1, 64) for _ in range(rows)] if draining else None
    return RoundOptions(offers, True, 8, rows * 40, 0.0, budgets)


def median_ms(call, repeats: int) -> float:
    call()
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - began)
    return 1e3 * statistics.median(seconds)


def figures(rows: int, seed: int, repeats: int) -> tuple[float, ...]:
    """The four timings at `rows` rows (see the module docstring)."""
    rng = random.Random(seed)
    policy = policy_for(rows)
    waiting, draining = round_for(rows, rng, False), round_for(rows, rng, True)
    seconds = {PROMPT_LOOKUP: 1e-4, SUFFIX: 1e-4}
    chances = [rng.random() for _ in range(rows)]
    drafted = [rng.randint(1, 4) for _ in range(rows)]
    _, keep = policy.draft_length(waiting, 0, 4, [DRAFT_MODEL] * rows)
    rule = policy.head_length(0.0005)
    return (
        median_ms(lambda: policy.choose(waiting, copier_seconds=seconds), repeats),
        median_ms(lambda: policy.choose(draining, copier_seconds=seconds), repeats),
        median_ms(lambda: keep(chances, [1] * rows), repeats),
        median_ms(lambda: keep(chances, drafted), repeats),
        median_ms(lambda: rule(chances, [1] * rows), repeats),
        median_ms(lambda: rule(chances, drafted), repeats),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="64,256")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    o = parser.parse_args()
    print(f"`python scripts/policy_bench.py {' '.join(sys.argv[1:])}`\n")
    print("\n".join(machine_table(describe_machine())) + "\n")
    print(f"Median ms of {o.repeats} calls each, one synthetic round per row count (seed {o.seed}).\n")
    columns = (
        "choose, prompts waiting",
        "choose, draining",
        "draft model's rule, first step",
        "draft model's rule, 1-4 drafts",
        "head's rule, first step",
        "head's rule, 1-4 drafts",
    )
    print("| rows | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for rows in (int(r) for r in o.rows.split(",")):
        print(f"| {rows} | " + " | ".join(f"{f:.3f}" for f in figures(rows, o.seed, o.repeats)) + " |")


if __name__ == "__main__":
    main()
