"""Where decoding's time goes, pass by pass: what `gpu-check.sh probe` runs on a GPU.

    python3 scripts/gpu_profile.py PAIR OUT [--batch 1] [--docs 2] [--new 64] [--drafter none]
        [--static-passes] [--split-only] [--always-ask]
        [--plain-steps 1,4 | --lookup-steps 1,4 [--runs 5]]

Target-only decoding (or `--drafter`'s) of license translations through the job's own loading
(on a GPU: static, compiled, captured passes), after a warm-up run that captures the graphs:

- OUT/profile-batchN.txt: the engine's own split of one run (wall, target passes, prefills,
  asking the drafters, the rest, per token), the host's parts of a round with every place
  taken (median milliseconds: asking the drafters, of it each copying drafter and the policy's
  choice, rolling the cache back, accepting), then the Python functions by their own time
  (cProfile) in a second run, then PyTorch's profiler over a third: operators by self CPU time
  and by device time, and where the host waited for the device (cudaStreamSynchronize, copies).
  `--split-only` stops after the split. `--always-ask`: the drafting gate never stops asking
  (`DraftingGate.margin` infinite), so that the split times every round's drafters, not only
  the gate's first rounds and probes, which pay the deferred work of the rounds between.

`--plain-steps A,B` instead alternates runs with `EngineConfig.plain_steps` A and B in one process
(OUT/profile-batchN[-drafter]-plain-steps-A-B.txt): what passes back to back save.
`--lookup-steps A,B` the same with `EngineConfig.lookup_steps` (with `--drafter prompt_lookup`):
prompt lookup's rounds on the host (1) against rounds on the device back to back.

A bench row says how fast; this says which part of a round to make cheaper.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

from pipeline.lab.bench import bench_config, task_prompts
from pipeline.machine import describe_machine
from pipeline.models.loading import eos_ids, load_pair, pad_id
from pipeline.models.pairs import resolve_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pair")
    parser.add_argument("out", type=Path)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--docs", type=int, default=2)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--drafter", default="none")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--static-passes", action="store_true", help="the static path on a CPU too")
    parser.add_argument("--split-only", action="store_true", help="no cProfile, no PyTorch profiler")
    parser.add_argument("--always-ask", action="store_true", help="the drafting gate never stops asking")
    parser.add_argument(
        "--plain-steps",
        default=None,
        help="A,B: instead, runs with EngineConfig.plain_steps A and B alternated (--runs each)",
    )
    parser.add_argument(
        "--lookup-steps",
        default=None,
        help="A,B: instead, runs with EngineConfig.lookup_steps A and B alternated (--runs each)",
    )
    parser.add_argument("--runs", type=int, default=5)
    o = parser.parse_args()
    if o.threads:
        torch.set_num_threads(o.threads)
    o.out.mkdir(parents=True, exist_ok=True)
    target, draft = resolve_pair(o.pair)
    loaded = load_pair(target, draft, batch=o.batch, static_passes=o.static_passes or None)
    prompts = task_prompts(loaded.tokenizer, "translate", o.docs, 384, corpus="licenses")
    from pipeline.decode.engine import SpeculativeEngine

    def make(**config):
        return SpeculativeEngine(
            loaded.target,
            loaded.draft,
            eos_token_ids=eos_ids(loaded.tokenizer, loaded.target),
            pad_token_id=pad_id(loaded.tokenizer, loaded.target),
            vocab_size=loaded.vocab_size,
            config=replace(bench_config(o.drafter, 32768), **config),
        )

    engine = make()
    if o.always_ask:
        engine.gate.margin = float("inf")
    cuda = loaded.device.startswith("cuda")
    for setting in ("plain_steps", "lookup_steps"):
        values = getattr(o, setting)
        if values:
            numbers = [int(v) for v in values.split(",")]
            lines = compare_setting(o, loaded, prompts, make, cuda, setting, numbers)
            write(o, lines, f"{setting.replace('_', '-')}-{values.replace(',', '-')}")
            return

    def run():
        seconds, done, stats = timed(engine, prompts, o, cuda)
        return seconds, sum(len(d.tokens) for d in done), stats

    run()  # graphs captured, layers compiled, caches sized
    parts = host_parts(engine, o.batch)
    wall, tokens, s = run()
    lines = [
        *header(o, loaded),
        f"prompt tokens {sum(map(len, prompts))}, new tokens {tokens}, wall {wall:.3f} s, "
        f"{tokens / wall:.1f} tok/s",
        "per new token, ms: "
        + ", ".join(
            f"{name} {1e3 * seconds / tokens:.3f}"
            for name, seconds in (
                ("wall", wall),
                ("target (with prefills)", s.target_seconds),
                ("target prefills", s.prefill_seconds),
                ("draft", s.draft_seconds),
                ("asking the drafters", s.asking_seconds),
                ("rest, asking included", wall - s.target_seconds - s.draft_seconds),
            )
        ),
        f"target passes {s.target_passes}: "
        f"{1e3 * (s.target_seconds - s.prefill_seconds) / max(s.target_passes, 1):.3f} ms each (no prefills)",
        f"a round of {o.batch} rows on the host, median ms: "
        + (
            ", ".join(f"{name} {1e3 * statistics.median(t):.3f} ({len(t)})" for name, t in parts.items())
            or "-"
        ),
        f"rounds that asked the drafters {s.asked_rounds}; the copiers' prices (CopierPrices): "
        + ", ".join(f"{k} {v}" for k, v in engine.policy.copiers.record().items()),
        "",
    ]
    if o.split_only:
        write(o, lines)
        return
    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    lines += ["## Python, by own time (cProfile, one run)", text.getvalue(), ""]
    kinds = torch.profiler.ProfilerActivity
    activities = [kinds.CPU, kinds.CUDA] if cuda else [kinds.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        run()
    averages = prof.key_averages()
    lines += ["## PyTorch operators by self CPU time (one run)"]
    lines += [averages.table(sort_by="self_cpu_time_total", row_limit=30)]
    if cuda:
        lines += ["## by device time", averages.table(sort_by="self_cuda_time_total", row_limit=30)]
    write(o, lines)


def timed(engine, prompts, o: argparse.Namespace, cuda: bool):
    """One `generate` of every prompt, timed to the device's end: (seconds, outputs, stats)."""
    if cuda:
        torch.cuda.synchronize()
    began = time.perf_counter()
    done, stats = engine.generate(prompts, o.new, batch_size=o.batch)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - began, done, stats


def compare_setting(
    o: argparse.Namespace, loaded, prompts, make, cuda: bool, setting: str, values: list[int]
) -> list[str]:
    """Tokens per second with each value of an `EngineConfig` setting (`--plain-steps`,
    `--lookup-steps`), their runs alternated in one process after a warm-up each (the same slots
    and graphs: they are the model's), and whether the outputs agree: what rounds back to back
    save, measured against one a round."""
    engines = {v: make(**{setting: v}) for v in values}
    seconds: dict[int, list[float]] = {v: [] for v in values}
    outputs = {}
    for run in range(o.runs + 1):  # the first: warm-up
        for v, engine in engines.items():
            took, done, _ = timed(engine, prompts, o, cuda)
            if run:
                seconds[v].append(took)
            outputs[v] = [d.tokens for d in done]
    tokens = sum(map(len, outputs[values[0]]))
    rates = {v: tokens / statistics.median(t) for v, t in seconds.items()}
    return [
        *header(o, loaded),
        f"{setting} {','.join(map(str, values))}, runs alternated, {o.runs} each after a warm-up: "
        + ", ".join(
            f"{v}: {rates[v]:.1f} tok/s (median; runs {', '.join(f'{tokens / t:.0f}' for t in seconds[v])})"
            for v in values
        ),
        f"ratio {values[-1]} / {values[0]}: {rates[values[-1]] / rates[values[0]]:.3f}; "
        f"outputs identical: {all(outputs[v] == outputs[values[0]] for v in values)}",
        "",
    ]


def header(o: argparse.Namespace, loaded) -> list[str]:
    """The machine and commit, then the run: the first two lines of every log this writes."""
    machine = describe_machine(loaded)
    dirty = " (uncommitted changes)" if machine["git_dirty"] else ""
    return [
        f"machine: {machine['gpu'] or machine['cpu_model']}, {machine['threads']} threads, "
        f"commit {(machine['git_commit'] or '?')[:7]}{dirty}",
        f"{o.pair}, {loaded.device}, {loaded.dtype}, batch {o.batch}, {o.docs} docs, {o.new} new tokens, "
        f"drafter {o.drafter}, static {loaded.static_passes}, compiled {loaded.compiled_passes}"
        + (", always asking" if o.always_ask else ""),
    ]


def write(o: argparse.Namespace, lines: list[str], kind: str = "") -> None:
    name = (
        f"profile-batch{o.batch}{'' if o.drafter == 'none' else '-' + o.drafter}{'-' + kind if kind else ''}"
    )
    path = o.out / f"{name}.txt"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:7]))
    print(f"wrote {path}")


def host_parts(engine, rows: int) -> dict[str, list[float]]:
    """Times the host's parts of every round of `rows` rows from now on: seconds per round, by
    part (the drafters' and the policy's methods wrapped on the instance; the round's own code
    runs unchanged), and the whole round besides its passes. Asking holds the drafters and the
    policy; `sync` rolls the target's cache back to the accepted tokens; verifying lays out and
    starts the pass (`sync` included, the pass not); accepting reads the pass's choices and keeps
    the drafts; evicting and filling frees finished rows' places and admits new rows (their
    prefill passes not counted)."""
    parts: dict[str, list[float]] = defaultdict(list)
    full = [False]
    round_ = engine._round

    def passes() -> float:  # seconds of the target's and the draft model's passes so far
        return engine.target.forward_seconds + engine._draft_seconds()

    def whole(batch):
        full[0] = len(batch.active) == rows
        began, before = time.perf_counter(), passes()
        result = round_(batch)
        if full[0]:  # the round's own time besides its passes (the target's, the draft model's)
            parts["round, no passes"].append(time.perf_counter() - began - (passes() - before))
        return result

    engine._round = whole
    timed = [
        ("asking", engine, "_draft"),
        ("prompt lookup", engine.lookup, "propose"),
        ("suffix", engine.suffix, "propose"),
        ("policy", engine.policy, "choose"),
        ("sync", engine.target, "sync"),
        ("verify, no pass", engine, "_verify"),
        ("accept", engine, "_accept"),
        ("evict", engine, "_evict"),
        ("fill, no prefills", engine, "_fill"),
    ]
    for name, owner, method in timed:
        inner = getattr(owner, method)

        def wrapped(*args, _inner=inner, _name=name, **kwargs):
            began, before = time.perf_counter(), passes()
            result = _inner(*args, **kwargs)
            if full[0]:
                parts[_name].append(time.perf_counter() - began - (passes() - before))
            return result

        setattr(owner, method, wrapped)
    return parts


if __name__ == "__main__":
    main()
