"""What a target pass and a draft step cost on this machine, measured as a job would run them.

Whether speculation pays is decided by measured costs (see docs/engine.md, the cost model):
how much more a target pass of γ+1 tokens costs than a 1-token pass, and what a draft step
costs beside it. Those numbers differ by 2x and more between CPUs (AVX512-BF16 or AVX2 only),
dtypes, thread counts and batch sizes, and the engine otherwise learns them only from a job's
first rounds. `measure` times them directly with the engine's own runner (`BatchedLM`, so the
packing and kernels are those a job uses): the seconds of a pass where each of b rows feeds w
new tokens over `context` cached tokens, for every batch size b and width w, and each model's
prefill seconds per token, with what Leviathan et al.'s formula predicts from them. A model
actor seeds its cost model (`costs.CostModel.seed`) from them at start-up, cached under a key
of everything they depend on (`calibration_key`); `pipeline calibrate` (`pipeline.lab.calibrate`)
measures them at length and prints and records them.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from pipeline.decode import static_lm
from pipeline.decode.batched_lm import BatchedLM
from pipeline.decode.settings import EngineConfig
from pipeline.machine import CPU_FLAGS, cpu_info, describe_machine
from pipeline.models import streamed
from pipeline.models.loading import LoadedPair, pad_id
from pipeline.models.pairs import cache_dir

# Bumped when what `measure` records, or how, changes: older cache entries are then ignored.
CALIBRATION_FORMAT = 2  # 2: the widths timed in turn (`_pass_seconds`)
# Acceptance rates the predictions are given for: a weak draft and a good one.
ALPHAS = (0.6, 0.8)


class _SyntheticTokens:
    """Random token ids for prompts and fed blocks.

    Prompts are random so that no two share a start: a shared start would become a template
    whose keys and values a prefill copies instead of computing (`BatchedLM.reusable`). Each
    block's first token differs from the last block's, so that `BatchedLM.sync` rolls the
    cache back to the prompt and the next pass feeds the whole block again.
    """

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab = vocab
        self.generator = torch.Generator().manual_seed(seed)
        self.first = -1

    def ids(self, count: int) -> list[int]:
        return torch.randint(self.vocab, (count,), generator=self.generator).tolist()

    def block(self, width: int) -> list[int]:
        block = self.ids(width)
        if block[0] == self.first:
            block[0] = (block[0] + 1) % self.vocab
        self.first = block[0]
        return block


def _prefill(lm: BatchedLM, prompts: list[list[int]], widest: int) -> tuple[float, int]:
    """Prefill `prompts` into a fresh cache as the engine admits a batch, with room for passes
    of up to `widest` tokens; (seconds, tokens)."""
    lm.reset(0)
    lm.reserve(len(prompts), max(map(len, prompts)) + widest + 1)
    before = lm.forward_seconds
    lm.admit(prompts, [1] * len(prompts))
    return lm.forward_seconds - before, lm.fed_tokens


def _pass_seconds(
    lm: BatchedLM, prompts: list[list[int]], widths: tuple[int, ...], runs: int, tokens: _SyntheticTokens
) -> dict[str, float]:
    """Median seconds of a pass feeding each width's new tokens per row over the prompts' cache,
    the widths in turn: one pass of each a round, `runs` rounds after an untimed one.

    Taken in turn, the widths share the machine's slow and fast spells, so their ratios, what
    the policy prices a draft's verify tokens by, hold on a machine whose speed drifts; one
    width after another, a slow spell can fall on one width alone and price it far off for as
    long as the calibration is cached (docs/cpu-kernels.md). Each pass is rolled back to the
    prompts (`sync`), its slots masked as a rejected draft's are, so every pass attends over the
    prompts alone and appends to the cache as decoding does. Squeezing the holes out (`compact`)
    would make the next pass copy every layer's whole cache into new buffers (`_Room`), which
    decoding does only when rows finish: 3.5 of a 39 ms pass of the 1.5B target at 400 cached
    tokens."""
    times: dict[int, list[float]] = {width: [] for width in widths}
    for _ in range(runs + 1):
        for width in widths:
            block = tokens.block(width)
            unfed = lm.sync([prompt + block for prompt in prompts])
            assert all(len(fed) == width for fed in unfed), "the cache was not rolled back to the prompts"
            before = lm.forward_seconds
            lm.forward(unfed, [width] * len(prompts))
            times[width].append(lm.forward_seconds - before)
    return {str(width): statistics.median(taken[1:]) for width, taken in times.items()}


def _runner(loaded: LoadedPair, role: str, draft_vocab: int) -> BatchedLM:
    """The engine's runner for the target or the draft, the draft with the output layer its
    proposals use (ids below `draft_vocab`, see `DraftModelDrafter`)."""
    model = loaded.target if role == "target" else loaded.draft
    lm = static_lm.runner(model, pad_id(loaded.tokenizer, loaded.target), loaded.vocab_size)
    if role == "draft" and 0 < draft_vocab < lm.vocab_size:
        lm.restrict_head(torch.arange(draft_vocab))
    return lm


def interpolate(points: dict[int, float], x: int) -> float:
    """The value at `x` on the straight lines between the nearest measured points around it."""
    if x in points:
        return points[x]
    below = max(n for n in points if n < x)
    above = min(n for n in points if n > x)
    return points[below] + (points[above] - points[below]) * (x - below) / (above - below)


def leviathan_speedup(alpha: float, gamma: int, target_seconds: dict[int, float], draft_step: float) -> float:
    """Leviathan et al.'s speedup of γ drafts per round with acceptance α, from measured costs:
    expected tokens per round, (1 - α^(γ+1)) / (1 - α), over what a round costs in 1-token
    target passes, γ draft steps plus one target pass of γ+1 tokens.

    The paper assumes the verify pass costs what a 1-token pass does; on a CPU it costs more,
    so the pass of γ+1 tokens is priced at its own measured (or interpolated) width.
    """
    tokens = (1 - alpha ** (gamma + 1)) / (1 - alpha)
    round_seconds = gamma * draft_step + interpolate(target_seconds, gamma + 1)
    return tokens * target_seconds[1] / round_seconds


def best_gamma(alpha: float, target_seconds: dict[int, float], draft_step: float) -> dict[str, float]:
    """The γ in 1..(widest measured pass - 1) with the highest predicted speedup, and that speedup."""
    gammas = range(1, max(target_seconds))
    speedups = {g: leviathan_speedup(alpha, g, target_seconds, draft_step) for g in gammas}
    gamma = max(speedups, key=speedups.get)
    return {"gamma": gamma, "speedup": speedups[gamma]}


def predictions(target_seconds: dict[str, float], draft_seconds: dict[str, float]) -> dict[str, dict]:
    """`best_gamma` for each of ALPHAS, from one batch size's passes by width (string keys)."""
    target = {int(w): s for w, s in target_seconds.items()}
    return {str(alpha): best_gamma(alpha, target, draft_seconds["1"]) for alpha in ALPHAS}


def check_settings(batches: tuple[int, ...], widths: tuple[int, ...], context: int, runs: int) -> None:
    """Raise ValueError for settings `measure` cannot run: before minutes of model loading."""
    if 1 not in widths or len(set(widths)) < 2:
        raise ValueError(f"widths must include 1 and a wider pass, got {','.join(map(str, widths))}")
    if min(batches, default=1) < 1 or min(widths) < 1 or context < 1 or runs < 1:
        raise ValueError("batch sizes, widths, context and runs must be at least 1")


def measure(
    loaded: LoadedPair,
    batches: tuple[int, ...] = (1,),
    widths: tuple[int, ...] = (1, 2, 4, 8),
    context: int = 128,
    runs: int = 1,
    *,
    draft_vocab: int = EngineConfig.draft_vocab,
    pair_name: str | None = None,
    head: bool = False,
    head_vocab: int | None = None,
) -> dict[str, Any]:
    """Time target and draft passes of every width at every batch size over `context` cached
    tokens (median of `runs` after a warm-up, the widths in turn: `_pass_seconds`), and each
    model's prefill per token; with `head`, a draft head's step beside them
    (`pipeline.decode.head.step_seconds`).

    Batch 1 is always measured: the headline costs and predictions are a lone row's. The
    defaults are cheap enough for an actor's start-up (a few seconds on the 1.5B target).
    Every mapping is keyed by strings (batch sizes, widths, α), as it reads back from JSON.
    """
    check_settings(batches, widths, context, runs)
    batches = tuple(sorted(set(batches) | {1}))
    widths = tuple(sorted(set(widths)))
    limit = getattr(loaded.target.config, "max_position_embeddings", None)
    if limit and context + widths[-1] > limit:
        raise ValueError(f"context {context} + width {widths[-1]} exceeds the target's {limit} positions")
    began = time.perf_counter()
    roles = ("target", "draft") if loaded.draft is not None else ("target",)
    passes: dict[str, dict[str, dict[str, float]]] = {role: {} for role in roles}
    prefill: dict[str, float | None] = {"target": None, "draft": None}
    tokens = _SyntheticTokens(loaded.vocab_size)
    graphs: dict[str, dict] = {}  # what capturing the static path's graphs cost
    for role in roles:
        lm = _runner(loaded, role, draft_vocab)
        warm_up = [tokens.ids(context)]  # first calls pay for allocations
        _prefill(lm, warm_up, widths[-1])
        _pass_seconds(lm, warm_up, (1,), 1, tokens)
        seconds, fed = 0.0, 0
        for batch in batches:
            prompts = [tokens.ids(context) for _ in range(batch)]
            took, computed = _prefill(lm, prompts, widths[-1])
            seconds, fed = seconds + took, fed + computed
            passes[role][str(batch)] = _pass_seconds(lm, prompts, widths, runs, tokens)
        prefill[role] = seconds / fed
        if isinstance(lm, static_lm.StaticLM):
            graphs[role] = lm.graph_record()
        lm.reset(0)  # the caches' memory back before the next model's
    result = summary(
        loaded, passes, prefill, context=context, runs=runs, draft_vocab=draft_vocab, pair_name=pair_name
    )
    if head:
        from pipeline.decode.head import step_seconds

        step = step_seconds(loaded.target, head_vocab or draft_vocab, context, max(runs, 3))
        step["share_of_target_pass"] = step["step_seconds"] / passes["target"]["1"]["1"]
        result["head"] = step
    result["read_bandwidth_gb_s"] = read_bandwidth(loaded.device)
    result["seconds"] = time.perf_counter() - began
    if graphs:
        result["static_passes"] = graphs
    return result


def read_bandwidth(device: str, runs: int = 5) -> float:
    """The memory's pace as a pass meets it: GB/s of reading a tensor far larger than the caches
    on `device` once (a float32 sum: one stream, read once, next to no arithmetic), median of
    `runs` after one to warm up, with the threads torch uses here.

    Why: a pass's bandwidth achieved (its weights' bytes over its seconds) says how far from the
    limit the machine runs only beside that limit. Reading is what a pass does with its weights;
    measured here, with this machine's threads and GPU, where a spec sheet's figure is neither
    (a copy's bytes read and written came out a tenth lower on the Zen 3 EPYC, 2 threads)."""
    size = (1 << 30) if device.startswith("cuda") else (256 << 20)
    values = torch.ones(size // 4, dtype=torch.float32, device=device)
    seconds = []
    for _ in range(runs + 1):
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        values.sum()
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - began)
    return size / statistics.median(seconds[1:]) / 1e9


def summary(
    loaded: LoadedPair,
    passes: dict[str, dict[str, dict[str, float]]],
    prefill: dict[str, float | None],
    *,
    context: int,
    runs: int,
    draft_vocab: int,
    pair_name: str | None,
) -> dict[str, Any]:
    """A calibration's record from its measured passes and prefill rates: what they predict,
    the bandwidth they achieved, and the pair and machine they hold for."""
    target, draft = passes["target"], passes.get("draft")
    roles = [role for role in ("target", "draft") if passes.get(role)]
    weight_bytes = {role: streamed.weight_bytes(getattr(loaded, role)) for role in roles}
    first = {"target": target, "draft": draft}
    batches = sorted(target, key=int)
    widths = sorted(target["1"], key=int)
    return {
        "format": CALIBRATION_FORMAT,
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "pair": {
            "name": pair_name,
            "target": loaded.target_id,
            "target_path": loaded.target_ref.path,
            "target_revision": loaded.target_revision,
            "draft": loaded.draft_id,
            "draft_path": loaded.draft_ref.path if loaded.draft_ref else None,
            "draft_revision": loaded.draft_revision,
        },
        "context": context,
        "runs": runs,
        "batches": [int(b) for b in batches],
        "widths": [int(w) for w in widths],
        "draft_vocab": draft_vocab,
        "target_pass_seconds": target["1"],
        "target_pass_seconds_by_batch": target,
        "draft_step_seconds_by_batch": draft,
        "prefill_seconds_per_token": prefill,
        # what a pass reads and how fast it read it at width 1, batch 1 (as gpt-fast's
        # "bandwidth achieved"): weight bytes over the pass's seconds
        "weights": getattr(loaded, "weights", "dense"),
        "block_activations": getattr(loaded, "block_activations", None),
        "weight_bytes": weight_bytes,
        "bandwidth_gb_s": {role: weight_bytes[role] / first[role]["1"]["1"] / 1e9 for role in roles},
        "predicted_speedup": predictions(target["1"], draft["1"]) if draft else None,
        "predicted_speedup_by_batch": (
            {batch: predictions(target[batch], draft[batch]) for batch in target} if draft else None
        ),
        "machine": describe_machine(loaded),
    }


def calibration_key(loaded: LoadedPair, threads: int, draft_vocab: int = EngineConfig.draft_vocab) -> str:
    """A name for the measurements of this pair on this machine: a hash of everything a pass's
    cost depends on (the CPU and its features, the GPU, the models and their revisions, dtype,
    device, threads, the kernels the loader chose, torch, the draft's output layer). Another
    machine, setting or model gives another key, so a cached calibration is never misapplied."""
    model, flags = cpu_info()
    fields = {
        "format": CALIBRATION_FORMAT,
        "cpu_model": model,
        "cpu_flags": sorted(flag for flag in CPU_FLAGS if flag in flags),
        "gpu": torch.cuda.get_device_name(loaded.device) if loaded.device.startswith("cuda") else None,
        "target": [loaded.target_ref.path, loaded.target_revision],
        "draft": [loaded.draft_ref.path, loaded.draft_revision] if loaded.draft_ref else None,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "device": loaded.device,
        "threads": threads,
        "batch_invariant": loaded.batch_invariant,
        "draft_int8": loaded.draft_int8,
        "streamed": bool(getattr(loaded, "streamed", False)),
        "weights": getattr(loaded, "weights", "dense"),
        **(
            {"block_activations": loaded.block_activations}
            if getattr(loaded, "block_activations", None)
            else {}
        ),
        **({"static_passes": True} if getattr(loaded, "static_passes", False) else {}),
        **({"compiled_passes": True} if getattr(loaded, "compiled_passes", False) else {}),
        # fused q/k/v and gate/up products (`--fused-projections`) cost otherwise than the parts
        **({"fused": list(loaded.fused_projections)} if getattr(loaded, "fused_projections", ()) else {}),
        # the fixed-order attention kernel (a GPU's default) and the float64 one cost otherwise
        **({"fixed_attention": True} if getattr(loaded, "fixed_attention", False) else {}),
        # so do the fixed-order products and the row blocks (`--block-linears`)
        **({"fixed_linears": True} if getattr(loaded, "fixed_linears", False) else {}),
        # a changed kernel source changes what a pass costs, and so does the prefill's chain
        "kernel": hashlib.sha256(streamed.SOURCE.read_bytes()).hexdigest()[:16]
        if loaded.streamed or getattr(loaded, "weights", "dense") == "gguf-blocks"
        else None,
        **(
            {"block_prefill": streamed.prefill_numbers(getattr(loaded, "block_activations", None) == "int8")}
            if getattr(loaded, "weights", "dense") == "gguf-blocks"
            else {}
        ),
        "torch": torch.__version__,
        "draft_vocab": draft_vocab if loaded.draft_ref else None,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]


def cache_path(key: str) -> Path:
    return cache_dir() / "calibration" / f"{key}.json"


def load_cached(key: str) -> dict[str, Any] | None:
    """The calibration saved under `key`, or None if there is none (or it is unreadable, or of
    another format)."""
    try:
        data = json.loads(cache_path(key).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == CALIBRATION_FORMAT else None


def save_cached(key: str, data: dict[str, Any]) -> Path:
    """Save a calibration under `key`, atomically: actors starting together may write at once."""
    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(data, indent=2))
    os.replace(partial, path)
    return path
