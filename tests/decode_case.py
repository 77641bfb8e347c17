"""What the decoding tests share: prompts, the target's own greedy outputs, measured costs."""

from __future__ import annotations

import os
from importlib import metadata

import pytest
import torch

from pipeline.decode.costs import CostModel
from pipeline.models import fixed_attention

TEXTS = [
    "The quick brown fox jumps",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one. "
    "Summaries copy phrases from their input documents, translations rarely do. Summaries copy",
    "Data",
    "Le renard brun saute par-dessus le chien paresseux. The quick brown fox jumps over the lazy dog.",
    "Parquet shards are read from object storage and written back with statistics. Parquet shards",
    "Data teams run batch jobs every night on a cluster of machines. Every night",
    "fox",
    "The lazy dog. The lazy dog. The lazy",
]
MAX_NEW = 24
# Where the decoding tests put their models: `PIPELINE_TEST_DEVICE=cuda pytest ...` runs the
# engine's tests on a GPU (scripts/gpu-check.sh); CPU everywhere else.
DEVICE = os.environ.get("PIPELINE_TEST_DEVICE", "cpu")
# The Triton kernels' tests (fixed-order attention and products): on CPUs in Triton's interpreter,
# which tests/conftest.py chooses before Triton is first imported.
TRITON_KERNELS = [
    pytest.mark.skipif(not fixed_attention.available(), reason="Triton is not installed (Linux x86_64 only)"),
    pytest.mark.skipif(
        DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
        reason="Triton's interpreter must be chosen before Triton is imported (tests/conftest.py)",
    ),
]


def _triton_version() -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in metadata.version("triton").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return (0,)


# Triton 3.6's interpreter (torch 2.11's) cannot run a loop whose bound is a reduction
# (`attention_kernel.merge_chunks`: "only 0-dimensional arrays can be converted to Python
# scalars"); 3.7 on can, and compiled Triton 3.6 builds it (tests/test_kernel_programs.py).
if DEVICE == "cpu" and fixed_attention.available():
    TRITON_KERNELS.append(
        pytest.mark.skipif(
            _triton_version() < (3, 7), reason="Triton's interpreter before 3.7 cannot run the kernels"
        )
    )


def reference(model, prompt: list[int], max_new: int, eos: list[int]) -> list[int]:
    """The target decoding alone: Hugging Face greedy generate, batch 1, no padding."""
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


# Seconds per target pass by tokens in the pass (rows × width), and per draft pass, as measured
# on the 1.5B/0.5B pair on a 2-core CPU in float32 (the benchmark machine), and as they look on
# a GPU (a wider pass nearly free).
CPU_COSTS = ({1: 0.40, 2: 0.83, 5: 1.23}, 0.22)
GPU_COSTS = ({1: 0.020, 2: 0.021, 5: 0.022}, 0.004)
# Batch 8, 400-token prompts (tools: a per-pass timing of the engine on the benchmark machine).
BATCH8_TARGET = {8: 1.61, 16: 1.82, 24: 2.05, 40: 2.32, 72: 2.90}
BATCH8_DRAFT = {8: 0.50, 16: 0.64}
PREFILL_PER_TOKEN = {"target": 72.9 / (8 * 396), "draft": 22.3 / (8 * 396)}
# Prefill on a GPU: thousands of prompt tokens a second for the target, the draft about 3× faster.
GPU_PREFILL_PER_TOKEN = {"target": 1e-4, "draft": 3e-5}


def measured_costs(target: dict, draft: dict, prefill: dict | None = None) -> CostModel:
    """A cost model that measured these tables (each size twice: confirmed, see PassCosts.time)."""
    model = CostModel()
    for _ in range(2):
        for tokens, seconds in target.items():
            model.observe_target(tokens, seconds)
        for tokens, seconds in draft.items():
            model.observe_draft(tokens, seconds)
    for name, rate in (prefill or {}).items():
        model.observe_prefill(name, 1000, rate * 1000)
    return model


def assert_widths_alike(model, batch: int, widths: tuple[int, ...]) -> None:
    """Row 0 verifies each of `widths` tokens beside batch - 1 rows of other lengths: its logits
    must be those of feeding the same tokens one pass at a time (a kernel's paths by width)."""
    from pipeline.decode.batched_lm import BatchedLM

    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(3, 300, (batch, 60), generator=gen).tolist()
    lm = BatchedLM(model, pad_token_id=0)
    lm.reset(1)
    lm.forward([prompts[0][:40]], [1])
    alone = torch.cat([lm.forward([[t]], [1])[0] for t in prompts[0][40:56]])
    for width in widths:
        lm.reset(batch)
        lm.forward([p[: 40 - i] for i, p in enumerate(prompts)], [1] * batch)
        blocks = [prompts[0][40 : 40 + width]] + [
            p[40 - i : 40 - i + 1 + i % 3] for i, p in enumerate(prompts)
        ][1:]
        got = lm.forward(blocks, [width] + [1] * (batch - 1))[0]
        assert torch.equal(got, alone[:width]), width


def engine_outputs(
    pair, drafter: str, batch_size: int, max_new: int = 12, gamma_max: int = 4
) -> list[list[int]]:
    """Greedy outputs of an engine over a loaded pair (`load_pair`) for the first three TEXTS,
    `batch_size` rows at a time (EOS 1, pad 0): what the kernels' exactness tests compare."""
    from pipeline.decode.engine import SpeculativeEngine
    from pipeline.decode.settings import EngineConfig

    prompts = [pair.tokenizer(t).input_ids for t in TEXTS[:3]]
    config = EngineConfig(drafter=drafter, gamma_max=gamma_max)
    engine = SpeculativeEngine(pair.target, pair.draft, eos_token_ids=[1], pad_token_id=0, config=config)
    done, _ = engine.generate(prompts, max_new, batch_size=batch_size)
    return [o.tokens for o in done]


def feed_ragged(runner, seqs: list[list[int]], fed: list[list[int]], widths: list[list[int]]) -> list[list]:
    """Prefill `seqs` into `runner` (a StaticLM or BatchedLM), then feed each row its `fed` tokens
    in passes of the given widths per row (`widths[row][step]`): the logits after each fed token,
    per row. What the kernels' tests compare with each row fed alone, one token a pass."""
    runner.reset(len(seqs))
    runner.forward([list(s) for s in seqs], [1] * len(seqs))
    logits: list[list] = [[] for _ in seqs]
    done = [0] * len(seqs)
    for step in range(len(widths[0])):
        blocks = [f[d : d + w[step]] for f, d, w in zip(fed, done, widths)]
        out = runner.forward(blocks, [len(b) for b in blocks])
        for row, (block, rows) in enumerate(zip(blocks, out)):
            logits[row] += list(rows)
            done[row] += len(block)
    return logits
