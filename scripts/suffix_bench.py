"""Measure the suffix drafter's structure: memory after N outputs, and lookup time per round.

    python scripts/suffix_bench.py [--outputs 10000] [--tokens 128] [--tokenizer DIR] [--python]
        [--batches 1,8,64]

Outputs are stand-ins: consecutive 128-token pieces of distinct docstrings of the Python
standard library and the installed packages, tokenized with the installed pair's tokenizer, so
their token ids and repetition are real English text's (model outputs repeat themselves more:
this is the harder case for memory). Rows for the lookup timing are other docstrings: their
first 400 tokens as the prompt (and, as in a job, the prompt reflowed), growing by their next 2
tokens a round (a typical tau), while `SuffixDrafter.propose` drafts up to 8 tokens for each
row. Prints Markdown. The corpus and lookups run in C++ where `lookups.cpp` builds (its memory
is what the automata hold, `SuffixCorpus.nbytes`), `--python` in Python (its memory traced).
"""

from __future__ import annotations

import argparse
import ast
import gc
import statistics
import sys
import sysconfig
import time
import tracemalloc
from functools import partial
from pathlib import Path

import torch
from transformers import AutoTokenizer

from pipeline.decode import lookups
from pipeline.decode.sampling import SamplingParams
from pipeline.decode.settings import EngineConfig
from pipeline.decode.suffix import Reflow, SuffixCorpus, SuffixDrafter
from pipeline.machine import describe_machine, machine_table
from pipeline.models.pairs import cache_dir


def documents(tokenizer, tokens: int) -> list[list[int]]:
    """Distinct docstrings of 200 characters or more, tokenized, until they hold `tokens` tokens."""
    roots = [Path(sysconfig.get_paths()[key]) for key in ("stdlib", "purelib")]
    seen: set[str] = set()
    docs, total = [], 0
    for path in (p for root in roots for p in sorted(root.rglob("*.py"))):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text and len(text) >= 200 and text not in seen:
                    seen.add(text)
                    docs.append(tokenizer(text).input_ids)
                    total += len(docs[-1])
        if total >= tokens:
            return docs
    return docs


def pieces(docs: list[list[int]], count: int, size: int) -> tuple[list[list[int]], int]:
    """`count` outputs of `size` tokens: consecutive pieces of the documents, cycling if short."""
    every = [doc[i : i + size] for doc in docs for i in range(0, len(doc) - size + 1, size)]
    return [every[k % len(every)] for k in range(count)], len(every)


def corpus_memory(outputs: list[list[int]], max_tokens: int, native: bool) -> dict:
    gc.collect()
    tracemalloc.start()
    corpus = SuffixCorpus(max_tokens, native)
    began = time.perf_counter()
    for output in outputs:
        corpus.add(output)
    seconds = time.perf_counter() - began
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    held = corpus.nbytes() if native else held  # tracemalloc sees no C++ allocation
    states = sum(b.states for b in corpus.blocks)
    return {
        "corpus": corpus,
        "mb": held / 1e6,
        "tokens": corpus.tokens,
        "states": states,
        "add_ms": seconds / len(outputs) * 1e3,
    }


def lookup_times(
    corpus: SuffixCorpus,
    reflow: Reflow,
    prompts: list[list[int]],
    continuations: list[list[int]],
    batch: int,
    rounds: int,
):
    """Seconds per propose call (one round) for `batch` rows, over `rounds` rounds."""
    drafter = SuffixDrafter(
        EngineConfig.suffix_max_tokens, EngineConfig.suffix_min_match, reflow, corpus.native
    )
    drafter.corpus = corpus
    greedy, generator = SamplingParams(), torch.Generator()
    seqs = [list(p) for p in prompts[:batch]]
    first = time.perf_counter()
    drafter.start(seqs)  # each row's automaton over its prompt reflowed, as a job's engine does
    drafter.propose(seqs, 8, greedy, generator)  # and over its prompt
    first = time.perf_counter() - first
    times, drafted = [], 0
    for r in range(rounds):
        for seq, more in zip(seqs, continuations):
            seq.extend(more[2 * r : 2 * r + 2])
        began = time.perf_counter()
        proposal = drafter.propose(seqs, 8, greedy, generator)
        times.append(time.perf_counter() - began)
        drafted += sum(map(len, proposal.tokens))
    return first, times, drafted / (rounds * batch)


def row(*cells) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--outputs", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--tokenizer", default=str(cache_dir() / "qwen2.5-coder" / "target"))
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--python", action="store_true", help="the Python corpus and lookups, not the C++")
    parser.add_argument("--batches", default="1,8", help="rows a round, comma-separated")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    native = not args.python and lookups.library() is not None
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    docs = documents(tokenizer, 2 * args.outputs * args.tokens)
    held_out = [d for d in docs if len(d) >= 400 + 2 * args.rounds][: max(batches)]
    docs = [d for d in docs if not any(d is h for h in held_out)]
    outputs, unique = pieces(docs, args.outputs, args.tokens)
    if len(held_out) < max(batches):  # a batch of fewer rows would be reported as this one
        parser.error(
            f"{len(held_out)} held-out documents of {400 + 2 * args.rounds}+ tokens for {max(batches)} rows"
        )
    print(f"`python scripts/suffix_bench.py {' '.join(sys.argv[1:])}`\n")
    print("\n".join(machine_table(describe_machine())) + "\n")
    print(
        f"{args.outputs} outputs of {args.tokens} tokens ({unique:,} distinct pieces of {len(docs):,}"
        f" docstrings), {'C++' if native else 'Python'}\n"
    )
    print(
        row(
            "corpus cap (tokens)",
            "tokens held",
            "states",
            "memory (MB)",
            "bytes per token",
            "add (ms/output)",
        )
    )
    print(row(*["---"] * 6))
    caps = (EngineConfig.suffix_max_tokens, 4 * args.outputs * args.tokens)
    full = None
    for cap in caps:
        m = corpus_memory(outputs, cap, native)
        full = full or m["corpus"]
        per_token = m["mb"] * 1e6 / m["tokens"]
        print(
            row(
                f"{cap:,}",
                f"{m['tokens']:,}",
                f"{m['states']:,}",
                f"{m['mb']:.1f}",
                f"{per_token:.0f}",
                f"{m['add_ms']:.2f}",
            )
        )
    reflow = Reflow(partial(tokenizer.encode, add_special_tokens=False), tokenizer.decode)
    prompts = [d[:400] for d in held_out]
    continuations = [d[400:] for d in held_out]
    print()
    print(
        row(
            "batch",
            "first round (builds the rows' automata), ms",
            "per round, mean ms",
            "p95 ms",
            "drafted/row/round",
        )
    )
    print(row(*["---"] * 5))
    for batch in batches:
        first, times, drafted = lookup_times(full, reflow, prompts, continuations, batch, args.rounds)
        p95 = sorted(times)[int(0.95 * len(times))]
        print(
            row(
                batch,
                f"{first * 1e3:.1f}",
                f"{statistics.mean(times) * 1e3:.2f}",
                f"{p95 * 1e3:.2f}",
                f"{drafted:.1f}",
            )
        )


if __name__ == "__main__":
    main()
