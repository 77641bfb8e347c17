"""Replay the free drafters against the target's greedy outputs: tokens per target pass at a
fixed verify width, with no model pass and no timing.

    python scripts/drafter_replay.py [--task summarize] [--docs 8] [--warm-docs 8]
        [--max-new-tokens 128] [--widths 4,8,16] [--cache outputs.json] [--calibration CAL.json]

Greedy verification accepts the longest prefix of a draft that equals the target's own
continuation, so once the target's outputs are known each drafter's rounds replay exactly: a
round proposes up to W tokens, keeps their common prefix with the output, and adds the target's
next token. The outputs are decoded once (Hugging Face `generate` with its prompt lookup, batch
1) and kept in `--cache`. Drafters start cold, or warm from the outputs of the `--warm-docs`
documents after the measured ones. This isolates a drafter's quality from the policy and the
machine: it is how the suffix drafter's reflowed prompt was found and weighed. `pipeline bench`
measures the engine as it runs. Prints Markdown.

With `--calibration` (a `pipeline calibrate` JSON: one machine's pass costs at batch 1) it also
replays the draft model and prices every round, to bound what routing among the drafters can
reach on that machine. A greedy draft chain from a position is accepted exactly as far as the
draft's greedy tokens given the target's output so far equal that output, and one draft pass
over each output gives all of them (teacher forcing). A clairvoyant router then takes, each
round, whichever choice makes the most tokens per second knowing the outcome: plain decoding, a
draft-model chain of any length up to W, a copy from an allowed free drafter, or (`+ext`) a
whole chain followed by the suffix drafter's continuation. No real policy knows the outcome, so
its ratios of one source set to another are a ceiling for what adding a drafter can give there.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch

from pipeline.decode.calibration import interpolate
from pipeline.decode.drafters import PromptLookupDrafter
from pipeline.decode.sampling import SamplingParams
from pipeline.decode.settings import DRAFT_MODEL, PROMPT_LOOKUP, SUFFIX
from pipeline.decode.suffix import Reflow, SuffixDrafter
from pipeline.lab.bench import hf_generate, task_prompts
from pipeline.models.loading import eos_ids, load_pair, pad_id, resolve_pair


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
    tokens = passes = drafting_rounds = accepted = 0
    for prompt, output in zip(prompts, outputs):
        drafter.start([prompt])
        at = 0
        while at < len(output):
            limit = min(width, len(output) - at - 1)
            draft = drafter.propose([prompt + output[:at]], limit, greedy, generator).tokens[0]
            kept = next((i for i, (d, t) in enumerate(zip(draft, output[at:])) if d != t), len(draft))
            drafting_rounds, accepted = drafting_rounds + bool(draft), accepted + kept
            at, passes = at + kept + 1, passes + 1
        tokens += len(output)
        drafter.evict([], [output])  # finished: the suffix drafter's corpus takes it
    return tokens / passes, accepted / max(drafting_rounds, 1), drafting_rounds / passes


def draft_predictions(pair_name: str, prompts, outputs) -> list[list[int]]:
    """The draft's greedy token at each output position given the target's output before it."""
    draft = load_pair(*resolve_pair(pair_name), dtype="auto", device="auto").draft
    predicted = []
    with torch.inference_mode():
        for prompt, output in zip(prompts, outputs):
            logits = draft(torch.tensor([prompt + output])).logits[0]
            predicted.append(logits[len(prompt) - 1 : -1].argmax(-1).tolist())
    return predicted


def _accepted(draft: list[int], output: list[int], at: int) -> int:
    return next((i for i, (d, t) in enumerate(zip(draft, output[at:])) if d != t), len(draft))


def clairvoyant(sources: set[str], prompts, outputs, predicted, costs, width: int, warm, reflow):
    """(tokens per second over target-only, rounds taken per choice) of the clairvoyant router
    over `sources` (draft_model, prompt_lookup, suffix, +ext); see the module's docstring."""

    def target(tokens: int) -> float:
        return interpolate(costs["target"], min(tokens, max(costs["target"])))

    def draft(tokens: int) -> float:
        return interpolate(costs["draft"], min(tokens, max(costs["draft"])))

    greedy, generator = SamplingParams(), torch.Generator()
    suffix, lookup = SuffixDrafter(reflow=reflow), PromptLookupDrafter()
    for output in warm:
        suffix.corpus.add(output)
    seconds, tokens, taken = 0.0, 0, {}
    for prompt, output, guesses in zip(prompts, outputs, predicted):
        # each free drafter's copy at every position, asked in order as the engine asks
        copies = {}
        for name, drafter in ((PROMPT_LOOKUP, lookup), (SUFFIX, suffix)):
            drafter.start([prompt])
            at_each = range(len(output))
            copies[name] = [
                drafter.propose([prompt + output[:q]], width, greedy, generator).tokens[0] for q in at_each
            ]
        at, behind = 1, 1  # the prefill's token; tokens the draft model has not fed yet
        seconds += target(1)
        while at < len(output):
            limit = min(width, len(output) - at - 1)
            choices = [("plain", 1, target(1), behind + 1)]  # (name, tokens, seconds, then behind)
            for name in (PROMPT_LOOKUP, SUFFIX):
                copy = copies[name][at][:limit]
                if name in sources and copy:
                    kept = _accepted(copy, output, at) + 1
                    choices.append((name, kept, target(1 + len(copy)), behind + kept))
            for k in range(1, limit + 1) if DRAFT_MODEL in sources else ():
                chain = guesses[at : at + k]
                kept = _accepted(chain, output, at)
                passes = draft(behind) + (k - 1) * draft(1)
                # the draft fed all but its last draft: one token behind, two if all were kept
                choices.append((DRAFT_MODEL, kept + 1, passes + target(1 + k), 1 + (kept == k)))
                if "+ext" in sources and kept == k < limit:
                    ext = copies[SUFFIX][at + k][: limit - k]
                    more = _accepted(ext, output, at + k)
                    seconds_ext = passes + target(1 + k + len(ext))
                    choices.append((DRAFT_MODEL + "+ext", k + more + 1, seconds_ext, 2 + more))
            name, kept, cost, behind = max(choices, key=lambda c: c[1] / c[2])
            taken[name] = taken.get(name, 0) + 1
            seconds, at = seconds + cost, at + kept
        tokens += len(output)
        suffix.evict([], [output])
    return tokens / seconds * target(1), taken


def ceilings(measured, predicted, warm: list, width: int, calibration: Path, reflow) -> None:
    """Print the clairvoyant router's speedups with each set of sources, cold and warm."""
    calibrated = json.loads(calibration.read_text())
    keys = {"target": "target_pass_seconds_by_batch", "draft": "draft_step_seconds_by_batch"}
    costs = {role: {int(w): s for w, s in calibrated[key]["1"].items()} for role, key in keys.items()}
    print(f"\nClairvoyant router, W = {width}, batch-1 costs of {calibration.name}\n")
    print("| sources | corpus | speedup over target-only | rounds taken |")
    print("| --- | --- | ---: | --- |")
    sets = [
        (DRAFT_MODEL,),
        (DRAFT_MODEL, PROMPT_LOOKUP),
        (DRAFT_MODEL, PROMPT_LOOKUP, SUFFIX),
        (DRAFT_MODEL, PROMPT_LOOKUP, SUFFIX, "+ext"),
    ]
    for corpus in ("cold", "warm") if warm else ("cold",):
        for sources in sets:
            earlier = warm if corpus == "warm" else []
            args = (*measured, predicted, costs, width, earlier, reflow)
            speedup, taken = clairvoyant(set(sources), *args)
            rounds = ", ".join(f"{k} {v}" for k, v in sorted(taken.items()))
            print(f"| {' + '.join(sources)} | {corpus} | {speedup:.2f}x | {rounds} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", default="qwen2.5-coder")
    parser.add_argument("--task", default="summarize", choices=["summarize", "translate"])
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--warm-docs", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--widths", default="4,8,16")
    parser.add_argument("--cache", help="JSON of the target's outputs: read if it exists, else written")
    parser.add_argument("--calibration", type=Path, help="a `pipeline calibrate` JSON: also bound routing")
    args = parser.parse_args()
    cache = Path(args.cache) if args.cache else None
    if cache and cache.exists():
        data = json.loads(cache.read_text())
    else:
        data = target_outputs(args.pair, args.task, args.docs + args.warm_docs, args.max_new_tokens)
    if args.calibration and "draft_predictions" not in data:
        data["draft_predictions"] = draft_predictions(args.pair, data["prompts"], data["outputs"])
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
    if args.calibration:
        width = max(map(int, args.widths.split(",")))
        ceilings(measured, data["draft_predictions"], warm, width, args.calibration, reflow)


if __name__ == "__main__":
    main()
