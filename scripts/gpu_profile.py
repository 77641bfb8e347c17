"""Where decoding's time goes, pass by pass: what `gpu-check.sh probe` runs on a GPU.

    python3 scripts/gpu_profile.py PAIR OUT [--batch 1] [--docs 2] [--new 64] [--drafter none]
        [--static-passes]

Target-only decoding (or `--drafter`'s) of license translations through the job's own loading
(on a GPU: static, compiled, captured passes), after a warm-up run that captures the graphs:

- OUT/profile-batchN.txt: the engine's own split of one run (wall, target passes, prefills,
  asking the drafters, the rest, per token), then the Python functions by their own time
  (cProfile) in a second run, then PyTorch's profiler over a third: operators by self CPU time
  and by device time, and where the host waited for the device (cudaStreamSynchronize, copies).

A bench row says how fast; this says which part of a round to make cheaper.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from pipeline.lab.bench import bench_config, task_prompts
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
    o = parser.parse_args()
    if o.threads:
        torch.set_num_threads(o.threads)
    o.out.mkdir(parents=True, exist_ok=True)
    target, draft = resolve_pair(o.pair)
    loaded = load_pair(target, draft, batch=o.batch, static_passes=o.static_passes or None)
    prompts = task_prompts(loaded.tokenizer, "translate", o.docs, 384, corpus="licenses")
    from pipeline.decode.engine import SpeculativeEngine

    engine = SpeculativeEngine(
        loaded.target,
        loaded.draft,
        eos_token_ids=eos_ids(loaded.tokenizer, loaded.target),
        pad_token_id=pad_id(loaded.tokenizer, loaded.target),
        vocab_size=loaded.vocab_size,
        config=bench_config(o.drafter, 32768),
    )
    cuda = loaded.device.startswith("cuda")

    def run():
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        done, stats = engine.generate(prompts, o.new, batch_size=o.batch)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - began, sum(len(d.tokens) for d in done), stats

    run()  # graphs captured, layers compiled, caches sized
    wall, tokens, s = run()
    lines = [
        f"{o.pair}, {loaded.device}, {loaded.dtype}, batch {o.batch}, {o.docs} docs, {o.new} new tokens, "
        f"drafter {o.drafter}, static {loaded.static_passes}, compiled {loaded.compiled_passes}",
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
        "",
    ]
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
    path = o.out / f"profile-batch{o.batch}{'' if o.drafter == 'none' else '-' + o.drafter}.txt"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:5]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
