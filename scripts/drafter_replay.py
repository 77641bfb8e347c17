"""Replay the free drafters against the target's greedy outputs: tokens per target pass at a
fixed verify width, with no model pass and no timing.

    python scripts/drafter_replay.py [--task summarize] [--docs 8] [--warm-docs 8]
        [--max-new-tokens 128] [--widths 4,8,16] [--cache outputs.json]

Greedy verification accepts the longest prefix of a draft that equals the target's own
continuation, so once the target's outputs are known each drafter's rounds replay exactly: a
round proposes up to W tokens, keeps their common prefix with the output, and adds the target's
next token. The outputs are decoded once (Hugging Face `generate` with its prompt lookup, batch
1) and kept in `--cache`. Drafters start cold, or warm from the outputs of the `--warm-docs`
documents after the measured ones. This isolates a drafter's quality from the policy and the
machine: it is how the suffix drafter's reflowed prompt was found and weighed. `pipeline bench`
measures the engine as it runs. Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch

from pipeline.bench import hf_generate, task_prompts
from pipeline.decode.drafters import PromptLookupDrafter
from pipeline.decode.sampling import SamplingParams
from pipeline.decode.suffix import Reflow, SuffixDrafter
from pipeline.job.worker import eos_ids, pad_id
from pipeline.models.loading import load_pair, resolve_pair


def target_outputs(pair_name: str, task: str, count: int, max_new: int) -> dict:
    """Prompts and the target's greedy outputs for the first `count` license sections."""
    pair = load_pair(*resolve_pair(pair_name), dtype="auto", device="auto")
    tok = pair.tokenizer
    prompts = task_prompts(tok, task, count, 384, "licenses")
    eos, pad = eos_ids(tok, pair.target), pad_id(tok, pair.target)
    outputs, _ = hf_generate(pair.target, prompts, max_new, eos, pad, prompt_lookup_num_tokens=10)
    return {"prompts": prompts, "outputs": outputs, "tokenizer": pair.target_ref.path}


def replay(drafter, prompts, outputs, width: int, warm: list[list[int]]) -> tuple[float, float, float]:
    """(tokens per pass, tokens accepted per round that drafted, share of rounds that drafted)."""
    if isinstance(drafter, SuffixDrafter):
        for output in warm:
            drafter.corpus.add(output)
    greedy, generator = SamplingParams(), torch.Generator()
    tokens = passes = drafted = accepted = 0
    for prompt, output in zip(prompts, outputs):
        drafter.start([prompt])
        at = 0
        while at < len(output):
            limit = min(width, len(output) - at - 1)
            draft = drafter.propose([prompt + output[:at]], limit, greedy, generator).tokens[0]
            kept = next((i for i, (d, t) in enumerate(zip(draft, output[at:])) if d != t), len(draft))
            drafted, accepted = drafted + bool(draft), accepted + kept
            at, passes = at + kept + 1, passes + 1
        tokens += len(output)
        drafter.evict([], [output])  # finished: the suffix drafter's corpus takes it
    return tokens / passes, accepted / max(drafted, 1), drafted / passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", default="qwen2.5-coder")
    parser.add_argument("--task", default="summarize", choices=["summarize", "translate"])
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--warm-docs", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--widths", default="4,8,16")
    parser.add_argument("--cache", help="JSON of the target's outputs: read if it exists, else written")
    args = parser.parse_args()
    cache = Path(args.cache) if args.cache else None
    if cache and cache.exists():
        data = json.loads(cache.read_text())
    else:
        data = target_outputs(args.pair, args.task, args.docs + args.warm_docs, args.max_new_tokens)
        if cache:
            cache.write_text(json.dumps(data))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(data["tokenizer"])
    reflow = Reflow(partial(tok.encode, add_special_tokens=False), tok.decode)
    outputs = [o[: args.max_new_tokens] for o in data["outputs"]]  # greedy: a prefix is the shorter run
    measured = (data["prompts"][: args.docs], outputs[: args.docs])
    warm = outputs[args.docs : args.docs + args.warm_docs]
    drafters = {
        "prompt lookup": PromptLookupDrafter,
        "suffix": partial(SuffixDrafter, reflow=reflow),
        "suffix, prompt as it stands": SuffixDrafter,
    }
    print(f"{args.task}, {args.docs} license sections, {args.max_new_tokens} new tokens\n")
    print("| drafter | corpus | W | tokens per pass | accepted per drafted round | rounds drafted |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for width in map(int, args.widths.split(",")):
        for name, make in drafters.items():
            for corpus in ("cold", "warm") if name != "prompt lookup" and warm else ("cold",):
                tau, per_round, share = replay(make(), *measured, width, warm if corpus == "warm" else [])
                print(f"| {name} | {corpus} | {width} | {tau:.2f} | {per_round:.2f} | {share:.2f} |")


if __name__ == "__main__":
    main()
