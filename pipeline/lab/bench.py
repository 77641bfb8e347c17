"""The benchmark: target-only vs our speculative engine vs Hugging Face's assisted generation.

Same model pair, same documents, same process and same run, so the ratios are comparable
even on a noisy machine. Every configuration is run `runs` times and the median wall time is
reported; speedups are against target-only decoding at the same batch size. Every output is
compared token for token with its own target-only decoding (ours for our engine: same
kernels, so they must be equal) and with Hugging Face greedy `generate` of the target alone
(where our kernels differ from the stock ones, a near-tie may round the other way).
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch

from pipeline.decode.costs import predicted_speedup
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.settings import EngineConfig
from pipeline.decode.stats import BatchStats
from pipeline.demo_data import CORPORA
from pipeline.job.prompts import PromptBuilder
from pipeline.lab.record import command_line, write_record
from pipeline.models.draft_int8 import loaded_weights
from pipeline.models.loading import LoadedPair, eos_ids, pad_id
from pipeline.spec import TaskSpec


@dataclass
class Row:
    task: str
    method: str
    batch: int
    tokens_per_second: float
    speedup: float | None
    # our engine's columns from here on cover all runs (counters summed), not just the last
    predicted: float | None  # Leviathan's speedup from this row's tau, draft steps and cost ratio
    predicted_job: float | None  # the same carried to the whole job: both prefills added back
    alpha: float | None
    tau: float | None
    mean_gamma: float | None
    target_passes_per_token: float | None
    identical: bool  # to the target-only decoding it is timed against (ours, HF's or llama.cpp's)
    identical_to_hf: bool | None  # to Hugging Face's target-only decoding with stock kernels (None: not run)
    seconds_median: float
    seconds_runs: list[float]
    target_share: float | None  # of our engine's wall time: target passes (prefill + verify)
    prefill_share: float | None  # of which the target's prefills
    draft_share: float | None  # draft model passes
    other_share: float | None  # everything else: lookup, cache bookkeeping, sampling, Python
    # of which asking the drafters: lookups, automata, the policy's choice (BatchStats.asking_seconds)
    asking_share: float | None
    # milliseconds a round that asked the drafters spent asking (BatchStats.asked_rounds)
    asking_ms: float | None
    tokens: int
    peak_rss_mb: float
    # our engine's rows: by drafter, the share of rounds drafting at least k tokens whose k-th
    # was accepted (`DrafterRounds.by_position`), over all runs
    acceptance_by_position: dict[str, list[float]] = field(default_factory=dict)
    # tokens/s over llama.cpp target-only's on the same documents (None: no llama.cpp rows)
    vs_llama_cpp: float | None = None
    # the GPU memory torch had allocated at most by the end of this row's runs (None: no GPU)
    peak_gpu_mb: float | None = None
    # how far the outputs follow ours target-only at batch 1: the mean share of each output's
    # tokens before the first difference (1.0: identical)
    agreement: float | None = None


@dataclass
class Benchmark:
    rows: list[Row]
    costs: dict[str, dict]  # each of our engines' measured cost model, by drafter (CostModel.profile)


def task_prompts(
    tokenizer, task: str, count: int, max_input_tokens: int, corpus: str = "docstrings"
) -> list[list[int]]:
    """Chat-templated prompts over the first `count` documents of a corpus (see CORPORA)."""
    if task == "summarize":
        spec = TaskSpec(kind="summarize", max_input_tokens=max_input_tokens)
    else:
        spec = TaskSpec(
            kind="translate",
            source_language="English",
            target_language="French",
            max_input_tokens=max_input_tokens,
        )
    builder = PromptBuilder(tokenizer, spec)
    docs = CORPORA[corpus]()[:count]
    if len(docs) < count:
        raise ValueError(f"only {len(docs)} {corpus} documents on this machine, {count} asked for")
    return [builder.build(d["text"]).ids for d in docs]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _peak_gpu_mb() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def describe_gpu_memory(rows: list[Row]) -> str | None:
    """The GPU memory the bench took at most (the static path's slots and captured graphs
    included), beside the card's: what decides the batch a GPU can hold."""
    peak = max((r.peak_gpu_mb for r in rows if r.peak_gpu_mb is not None), default=None)
    if peak is None:
        return None
    total = torch.cuda.get_device_properties(0).total_memory / 2**20
    return f"GPU memory allocated at most {peak:,.0f} MB of the card's {total:,.0f} MB"


def hf_generate(target, prompts, max_new: int, eos: list[int], pad: int, **kwargs):
    """Hugging Face generate, batch 1, greedy: plain, assisted, or prompt lookup."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=target.device)
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
            **kwargs,
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs, None


class LlamaCpp:
    """llama.cpp, through llama-cpp-python, on the target's own GGUF file, as its users run it:
    greedy decoding, and its prompt lookup (`LlamaPromptLookupDecoding`), on the same token ids
    as our rows, batch 1, the same threads. Its numbers differ from ours: it multiplies by
    activations quantized to 8 bits, where ours stay float32 (docs/cpu-kernels.md)."""

    def __init__(self, gguf: str, threads: int, context: int, lookup_tokens: int = 10):
        try:
            import llama_cpp
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as exc:
            raise RuntimeError(
                "--llama-cpp needs llama-cpp-python: pip install -e '.[llama]' "
                "(it builds llama.cpp from source; CMAKE_ARGS=-DGGML_NATIVE=ON for this CPU)"
            ) from exc
        settings = dict(n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)
        self.version = llama_cpp.__version__
        self.build = _vector_features(llama_cpp.llama_print_system_info().decode())
        self.lookup_tokens = lookup_tokens
        self.plain = llama_cpp.Llama(model_path=gguf, **settings)
        # a draft model makes llama-cpp-python keep every position's logits: its own instance,
        # and logits_all given too (0.3.36 sizes its logits buffer by the argument alone)
        self.lookup = llama_cpp.Llama(
            model_path=gguf,
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens),
            logits_all=True,
            **settings,
        )

    def generate(self, prompts, max_new: int, eos: list[int], lookup: bool = False):
        llm = self.lookup if lookup else self.plain
        outputs = []
        for prompt in prompts:
            llm.reset()  # from an empty context, as our rows start (its prefix reuse overflowed it)
            tokens: list[int] = []
            for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
                if token in eos:
                    break
                tokens.append(int(token))
                if len(tokens) >= max_new:
                    break
            outputs.append(tokens)
        return outputs, None


def _vector_features(system_info: str) -> str:
    """The vector instruction sets llama.cpp was built with, from its system info ("CPU : SSE3 =
    1 | AVX = 1 | AVX2 = 1 | AVX512 = 0 | ..."): a build for AVX2 alone (GGML_NATIVE=OFF, say,
    loaded through LLAMA_CPP_LIB_PATH) runs other kernels than a native one on the same CPU."""
    found = [part.split("=")[0].strip() for part in system_info.split("|") if part.strip().endswith("= 1")]
    features = [name.split(":")[-1].strip() for name in found]
    return " ".join(f for f in features if f.startswith(("AVX", "AMX"))) or "no AVX"


def bench_config(kind: str, draft_vocab: int) -> EngineConfig:
    """The engine for a bench drafter: a drafter's name, or `auto:A+B` for `auto` choosing
    among drafters A and B only (`auto:draft_model+prompt_lookup` is auto without suffix,
    `auto:draft_model+prompt_lookup+suffix+head` auto with a draft head too)."""
    drafter, _, sources = kind.partition(":")
    if not sources:
        return EngineConfig(drafter=drafter, draft_vocab=draft_vocab)
    if drafter != "auto":
        raise ValueError(f"only auto takes a list of drafters, got {kind!r}")
    return EngineConfig(drafter="auto", draft_vocab=draft_vocab, auto_sources=tuple(sources.split("+")))


@dataclass
class EngineRun:
    """Our engine's counters over one run, or several added up (`add`): the engine's own
    `BatchStats`, whose properties give α, τ and mean γ, and the cost ratio (a draft step over a
    1-token target pass) it had measured, summed over the runs for their mean."""

    stats: BatchStats = field(default_factory=BatchStats)
    cost_ratio: float = 0.0
    runs: int = 0

    def add(self, other: EngineRun) -> None:
        self.stats.add(other.stats)
        self.cost_ratio += other.cost_ratio
        self.runs += other.runs


def ours(
    engine: SpeculativeEngine, prompts, max_new: int, batch: int, drafter: str, warm: list | None = None
) -> tuple[list[list[int]], EngineRun]:
    """Our engine over `prompts`; `warm`: earlier outputs its suffix drafter starts from."""
    engine.forget_outputs()  # each run decodes the same documents: not from its last run's outputs
    engine.remember_outputs(warm or [])
    rows, total = engine.generate(prompts, max_new, drafter=drafter, batch_size=batch)
    return [r.tokens for r in rows], EngineRun(total, engine.cost_ratio(batch) or 0.0, runs=1)


@dataclass
class _Decoding:
    """What every configuration of a benchmark decodes with: the token limit, the ids that end
    a reply and pad, and the models HF's and llama.cpp's rows run."""

    max_new_tokens: int
    eos: list[int]
    pad: int
    hf_target: object
    hf_draft: object
    llama_cpp: LlamaCpp | None
    dense_target: object = None  # the target on its dense weights (`dense_reference`), or None


def run_benchmark(
    pair: LoadedPair,
    *,
    tasks: tuple[str, ...] = ("summarize", "translate"),
    docs: int = 4,
    batches: tuple[int, ...] = (1, 4),
    max_new_tokens: int = 48,
    max_input_tokens: int = 384,
    corpus: str = "docstrings",
    runs: int = 3,
    hf_assistant_tokens: tuple[int, ...] = (3, 5),
    hf_lookup_tokens: tuple[int, ...] = (3, 10),
    drafters: tuple[str, ...] = ("draft_model", "prompt_lookup", "auto"),
    draft_vocab: int = EngineConfig.draft_vocab,
    warm_docs: int = 0,
    hf_models: tuple | None = None,
    llama_cpp: LlamaCpp | None = None,
    dense_target=None,
    head=None,
    hf: bool = True,
    log: Callable[[str], None] = print,
) -> Benchmark:
    """`hf_models`: the target and draft as `transformers` loads them, for the HF rows, where
    our loader changed their kernels (streamed Linear layers); None: HF runs the pair's. The
    "int8" assisted rows run HF's loop with our draft as the engine runs it. `warm_docs`: the
    drafters that draft from earlier outputs (suffix, auto) also run warm, their corpus holding
    our target-only outputs of that many *other* documents of the task, as a nightly job given
    last night's outputs (`drafter.suffix_warm_start`). `llama_cpp`: also llama.cpp's rows, and
    every row's tokens/s against its target-only. `dense_target`: the target on its dense weights
    where `pair`'s runs on GGUF blocks, for a row whose outputs' agreement with the block path is
    the point (`DENSE_ROW`). `head`: the draft head (`DraftHead`) the `head` drafter drafts
    with. `hf=False` leaves out HF's rows (batch 1
    only, they would take hours beside a large batch of a fast path). Every row's outputs are
    compared with its own target-only's (`Row.identical`) and with HF's target-only where it ran."""
    hf_target, hf_draft = hf_models if hf_models is not None else (pair.target, pair.draft)
    if pair.draft is None:  # a target-only pair: the drafters that need no model still run
        dropped = [d for d in drafters if d == "draft_model"]
        drafters = tuple(d for d in drafters if d != "draft_model")
        if dropped or hf_assistant_tokens:
            log("no draft model in this pair: the draft_model and hf assisted rows are left out")
        hf_assistant_tokens = ()
    tok = pair.tokenizer
    decoding = _Decoding(
        max_new_tokens,
        eos_ids(tok, pair.target),
        pad_id(tok, pair.target),
        hf_target,
        hf_draft,
        llama_cpp,
        dense_target,
    )
    engines = _engines(pair, drafters, draft_vocab, decoding, head)
    rows: list[Row] = []
    for task in tasks:
        prompts = task_prompts(tok, task, docs, max_input_tokens, corpus)
        # warm-up: first calls pay for allocations and (for our engine) cost calibration; the
        # static slots the measured batches need come first, so the warm-up's short prompts
        # leave them (and the graphs captured over them) as they are
        longest = max(map(len, prompts))
        for engine in engines.values():
            for batch in batches:
                engine.reserve(batch, longest, max_new_tokens)
            engine.generate(prompts[:1], 8, drafter=engine.config.drafter)
        warm = None
        if warm_docs:  # the documents after the measured ones; decoded once, not timed
            others = task_prompts(tok, task, docs + warm_docs, max_input_tokens, corpus)[docs:]
            warm = [r.tokens for r in engines["none"].generate(others, max_new_tokens, drafter="none")[0]]
        bench = TaskBench(task)
        # HF's rows, then llama.cpp's, then ours: each family timed against its own target-only
        if hf:
            _add_hf_rows(bench, prompts, decoding, hf_assistant_tokens, hf_lookup_tokens, pair)
        if llama_cpp is not None:
            _add_llama_cpp_rows(bench, prompts, decoding)
        _add_our_rows(bench, prompts, decoding, engines, drafters, batches, warm)
        rows += bench.run(runs, log)
    return Benchmark(rows, {kind: engine.costs.profile() for kind, engine in engines.items()})


def _engines(
    pair: LoadedPair, drafters, draft_vocab: int, decoding: _Decoding, head=None
) -> dict[str, SpeculativeEngine]:
    """One engine of ours per drafter, and target-only's (`none`) and `auto`'s whatever is asked."""
    tok = pair.tokenizer

    def engine(target, draft, kind: str) -> SpeculativeEngine:
        return SpeculativeEngine(
            target,
            draft,
            eos_token_ids=decoding.eos,
            pad_token_id=decoding.pad,
            decode_text=tok.decode,
            encode_text=partial(tok.encode, add_special_tokens=False),
            vocab_size=pair.vocab_size,
            config=bench_config(kind, draft_vocab),
            head=head if target is pair.target else None,
        )

    engines = {
        kind: engine(pair.target, pair.draft, kind) for kind in dict.fromkeys(("none", "auto", *drafters))
    }
    if decoding.dense_target is not None:
        engines[DENSE_ROW] = engine(decoding.dense_target, None, "none")
    return engines


def _add_hf_rows(
    bench: TaskBench, prompts, decoding: _Decoding, assistant_tokens, lookup_tokens, pair
) -> None:
    """HF target-only greedy, the reference, then HF's assisted generation as its users run it:
    the draft as loaded; and, where our engine's draft steps use int8 weights, also with those,
    the same draft as ours; then HF's prompt lookup. All at batch 1."""
    d = decoding
    bench.add(
        "hf target-only", 1, lambda p=prompts: hf_generate(d.hf_target, p, d.max_new_tokens, d.eos, d.pad)
    )
    assisted = [(k, False) for k in assistant_tokens] + [
        (k, True) for k in assistant_tokens if pair.draft_int8
    ]
    for k, int8 in assisted:
        bench.add(
            f"hf assisted k={k}" + (" int8" if int8 else ""),
            1,
            lambda k=k, i=int8, p=prompts: hf_assisted(
                d.hf_target, pair.draft if i else d.hf_draft, p, d.max_new_tokens, d.eos, d.pad, k, i
            ),
            base="hf target-only",
        )
    for k in lookup_tokens:
        bench.add(
            f"hf prompt lookup k={k}",
            1,
            lambda k=k, p=prompts: hf_generate(
                d.hf_target, p, d.max_new_tokens, d.eos, d.pad, prompt_lookup_num_tokens=k
            ),
            base="hf target-only",
        )


def _add_llama_cpp_rows(bench: TaskBench, prompts, decoding: _Decoding) -> None:
    """llama.cpp target-only and its prompt lookup, batch 1."""
    llama_cpp, max_new, eos = decoding.llama_cpp, decoding.max_new_tokens, decoding.eos
    bench.add("llama.cpp target-only", 1, partial(llama_cpp.generate, prompts, max_new, eos))
    bench.add(
        f"llama.cpp prompt lookup k={llama_cpp.lookup_tokens}",
        1,
        partial(llama_cpp.generate, prompts, max_new, eos, lookup=True),
        base="llama.cpp target-only",
    )


# The row of the target on its dense bf16 weights beside the block path's (`dense_reference`): its
# `agree` is how far the block path's numbers keep the bf16 path's outputs, its speedup the block
# path's time over its own.
DENSE_ROW = "ours target-only dense"


def _add_our_rows(bench: TaskBench, prompts, decoding: _Decoding, engines, drafters, batches, warm) -> None:
    """At every batch size: ours target-only, then every drafter; the drafters that draft from
    earlier outputs run cold, and also warm where `warm` outputs are given. At every batch
    size, the dense reference where there is one: which weights a batch should run on is
    `weights: auto`'s question (BLOCKS_MAX_BATCH), and one run answers it."""
    max_new = decoding.max_new_tokens
    for batch in batches:
        bench.add(
            "ours target-only", batch, lambda b=batch, p=prompts: ours(engines["none"], p, max_new, b, "none")
        )
        if DENSE_ROW in engines:
            bench.add(
                DENSE_ROW,
                batch,
                partial(ours, engines[DENSE_ROW], prompts, max_new, batch, "none"),
                base="ours target-only",
            )
        for kind in drafters:
            engine = engines[kind]
            suffix = "suffix" in engine.sources(engine.config.drafter)
            for earlier in (None, warm) if warm and suffix else (None,):
                bench.add(
                    f"ours {kind}" + (" warm" if earlier else ""),
                    batch,
                    partial(ours, engine, prompts, max_new, batch, engine.config.drafter, earlier),
                    base="ours target-only",
                )


def _assistant(draft, k: int):
    """The draft set up for HF assisted generation with a constant `k` tokens per round.

    HF reads these from the assistant's generation_config; passing them to `generate()`
    does not reach it.
    """
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    return draft


def hf_assisted(target, draft, prompts, max_new: int, eos, pad, k: int, int8: bool):
    """HF assisted generation with the draft on its int8 decode steps, or as loaded."""
    with nullcontext() if int8 else loaded_weights(draft):
        return hf_generate(target, prompts, max_new, eos, pad, assistant_model=_assistant(draft, k))


@dataclass
class _Config:
    method: str
    batch: int
    fn: Callable[[], tuple[list[list[int]], EngineRun | None]]
    base: str | None  # method whose time at the same batch size is this one's 1.0x
    times: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    stats: EngineRun | None = None  # our engine's counters, added up over the runs


@dataclass
class TaskBench:
    """Times every configuration of one task in interleaved rounds.

    Round r runs each configuration once, in order, before round r+1 starts: a slow spell of
    a noisy machine then hits every configuration alike instead of whichever ran during it,
    and the median over rounds drops the outliers.
    """

    task: str
    configs: list[_Config] = field(default_factory=list)

    def add(self, method: str, batch: int, fn, base: str | None = None) -> None:
        self.configs.append(_Config(method, batch, fn, base))

    def run(self, runs: int, log: Callable[[str], None]) -> list[Row]:
        for run in range(runs):
            for c in self.configs:
                began = time.perf_counter()
                c.outputs, counted = c.fn()
                c.times.append(time.perf_counter() - began)
                log(f"  {self.task}, {c.method}, batch {c.batch}, run {run + 1}/{runs}: {c.times[-1]:.2f} s")
                if counted:  # our engine's rows
                    c.stats = c.stats or EngineRun()
                    c.stats.add(counted)
        hf = next((c.outputs for c in self.configs if c.method == "hf target-only"), None)
        medians = {(c.method, c.batch): statistics.median(c.times) for c in self.configs}
        stats = {(c.method, c.batch): c.stats for c in self.configs}
        outputs = {(c.method, c.batch): c.outputs for c in self.configs}
        rows = []
        for c in self.configs:
            seconds = medians[(c.method, c.batch)]
            base = medians.get((c.base, c.batch)) if c.base else None
            base_stats = stats.get((c.base, c.batch)) if c.base else None
            # each row against its own target-only (a target-only row is its own)
            own = outputs[(c.base, c.batch)] if c.base else c.outputs
            same = (c.outputs == own, None if hf is None else c.outputs == hf)
            rows.append(_row(self.task, c, seconds, base, base_stats, same))
        ours = outputs.get(("ours target-only", 1))
        llama = next((r for r in rows if r.method == "llama.cpp target-only"), None)
        for row, c in zip(rows, self.configs):
            row.agreement = _agreement(c.outputs, ours) if ours is not None else None
            row.vs_llama_cpp = row.tokens_per_second / llama.tokens_per_second if llama else None
            log(_format_row(row))
        return rows


def _agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """The mean share of each output's tokens before its first difference from the reference's."""
    shares = []
    for out, ref in zip(outputs, reference):
        same = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        shares.append(same / max(len(out), len(ref), 1))
    return sum(shares) / max(len(shares), 1)


def job_prediction(
    spec: BatchStats | None, base: BatchStats | None, decode_speedup: float | None
) -> float | None:
    """Leviathan's decode-only speedup carried to the whole job.

    His formula covers the decoding rounds; a job also pays the target's prefill (the same with
    or without speculation) and, with a draft model, the draft's own prefill. Target-only time
    is split into prefill and decoding as measured; the prediction speeds up only the decoding
    and adds the speculative run's measured prefills back. Counters are sums over the same runs.
    """
    if not (spec and base and decode_speedup and base.wall_seconds):
        return None
    base_decode = base.wall_seconds - base.prefill_seconds
    prefills = spec.prefill_seconds + spec.draft_prefill_seconds
    return base.wall_seconds / (prefills + base_decode / decode_speedup)


def _engine_columns(run: EngineRun | None, base: EngineRun | None) -> dict:
    """Row's columns from our engine's counters over all runs (None for HF and llama.cpp rows):
    α, τ and mean γ as `BatchStats` computes them, Leviathan's prediction from the runs' τ, draft
    steps per target pass and mean cost ratio, and where the wall time went."""
    if run is None:
        none = ("predicted", "predicted_job", "alpha", "tau", "mean_gamma", "target_passes_per_token")
        shares = ("target_share", "prefill_share", "draft_share", "other_share", "asking_share", "asking_ms")
        return dict.fromkeys(none + shares) | {"acceptance_by_position": {}}
    s, wall = run.stats, run.stats.wall_seconds
    predicted = predicted_speedup(s.tau, s.draft_passes / max(s.target_passes, 1), run.cost_ratio / run.runs)
    return {
        "predicted": predicted,
        "predicted_job": job_prediction(s, base.stats if base else None, predicted),
        "alpha": s.alpha,
        "tau": s.tau,
        "mean_gamma": s.mean_gamma,
        "target_passes_per_token": s.target_passes / s.new_tokens,
        "target_share": s.target_seconds / wall if wall else None,
        "prefill_share": s.prefill_seconds / wall if wall else None,
        "draft_share": s.draft_seconds / wall if wall else None,
        "other_share": (1 - (s.target_seconds + s.draft_seconds) / wall) if wall else None,
        "asking_share": s.asking_seconds / wall if wall else None,
        "asking_ms": 1e3 * s.asking_seconds / s.asked_rounds if s.asked_rounds else None,
        "acceptance_by_position": {name: d.by_position() for name, d in sorted(s.rounds.by_drafter.items())},
    }


def _row(
    task: str,
    c: _Config,
    seconds: float,
    base: float | None,
    base_stats: EngineRun | None,
    same: tuple[bool, bool | None],
) -> Row:
    tokens = sum(len(o) for o in c.outputs)
    return Row(
        task=task,
        method=c.method,
        batch=c.batch,
        tokens_per_second=tokens / seconds,
        speedup=base / seconds if base else 1.0,
        identical=same[0],
        identical_to_hf=same[1],
        seconds_median=seconds,
        seconds_runs=c.times,
        tokens=tokens,
        peak_rss_mb=_peak_rss_mb(),
        peak_gpu_mb=_peak_gpu_mb(),
        **_engine_columns(c.stats, base_stats),
    )


# The printed table's columns: title and format alignment/width (the Markdown report's too).
_COLUMNS = (
    ("task", "<10"),
    ("method", "<24"),
    ("batch", ">5"),
    ("tok/s", ">7"),
    ("speedup", ">8"),
    ("pred", ">6"),
    ("job", ">6"),
    ("alpha", ">6"),
    ("tau", ">5"),
    ("gamma", ">5"),
    ("pass/tok", ">8"),
    ("tgt%", ">5"),
    ("pre%", ">5"),
    ("dft%", ">5"),
    ("oth%", ">5"),
    ("ask%", ">5"),
    ("ask ms", ">6"),
    ("same", ">5"),
    ("=hf", ">4"),
    ("agree", ">5"),
    ("vs llama", ">8"),
    ("rss MB", ">7"),
)
HEADER = " ".join(f"{title:{align}}" for title, align in _COLUMNS)


def _cells(r: Row) -> list[str]:
    """A row's values as the table shows them, one per column of _COLUMNS."""

    def f(v, spec=".2f"):
        return "-" if v is None else format(v, spec)

    def pct(v):
        return "-" if v is None else f"{100 * v:.0f}"

    def times(v):
        return "-" if v is None else f"{v:.2f}x"

    return [
        r.task,
        r.method,
        str(r.batch),
        f"{r.tokens_per_second:.2f}",
        times(r.speedup),
        times(r.predicted),
        times(r.predicted_job),
        f(r.alpha),
        f(r.tau),
        f(r.mean_gamma, ".1f"),
        f(r.target_passes_per_token),
        pct(r.target_share),
        pct(r.prefill_share),
        pct(r.draft_share),
        pct(r.other_share),
        pct(r.asking_share),
        f(r.asking_ms),
        "yes" if r.identical else "NO",
        "-" if r.identical_to_hf is None else "yes" if r.identical_to_hf else "no",
        f(r.agreement),
        times(r.vs_llama_cpp),
        f"{r.peak_rss_mb:.0f}",
    ]


def _format_row(r: Row) -> str:
    return " ".join(f"{cell:{align}}" for cell, (_, align) in zip(_cells(r), _COLUMNS))


def markdown_table(rows: list[Row]) -> str:
    """The printed table as Markdown, without the task column (a report has a table per task)."""
    columns = _COLUMNS[1:]
    lines = [
        "| " + " | ".join(title for title, _ in columns) + " |",
        "| " + " | ".join("---:" if align.startswith(">") else "---" for _, align in columns) + " |",
    ]
    lines += ["| " + " | ".join(_cells(r)[1:]) + " |" for r in rows]
    return "\n".join(lines)


def describe_costs(costs: dict[str, dict]) -> str:
    """One engine's measured cost model (`CostModel.profile`) in a line."""

    def seconds(points: dict, spec: str = ".2f") -> str:
        return ", ".join(f"{k}: {v:{spec}}" for k, v in points.items()) or "-"

    return (
        "target pass by tokens "
        + seconds(costs["target_pass_seconds"])
        + "; draft pass by tokens "
        + seconds(costs["draft_pass_seconds"])
        + "; prefill per token "
        + seconds(costs["prefill_seconds_per_token"], ".4f")
    )


def write_json(result: Benchmark, path: str, meta: dict) -> None:
    with open(path, "w") as fh:
        rows = [asdict(r) for r in result.rows]
        json.dump({"meta": meta, "rows": rows, "costs": result.costs}, fh, indent=2)


# The run's settings a report lists, as recorded in the JSON's meta.
SETTINGS = (
    "tasks",
    "corpus",
    "docs",
    "batches",
    "max_new_tokens",
    "runs",
    "drafters",
    "draft_vocab",
    "warm_docs",
    "hf_assistant_tokens",
    "hf_lookup_tokens",
    "weights",
    "block_activations",
    "llama_cpp",
)


def _model(model: dict | None) -> str:
    if not model:
        return "none"
    return f"`{model['id']}`" + (f" (revision `{model['revision']}`)" if model["revision"] else "")


def write_report(path: str, result: Benchmark, meta: dict, json_path: str) -> None:
    """A Markdown record of one benchmark run for docs/benchmarks/: what ran (the command, the
    commit, the machine, the pair, the settings) beside what it measured, so that a number can
    be compared with another run's, or rerun, without asking anyone how it was made."""
    models = meta["models"]
    body = [
        "## Pair",
        "",
        f"`{meta['pair']}`: target {_model(models['target'])}, draft {_model(models['draft'])}.",
        "",
        "## Settings",
        "",
        "| | |",
        "| --- | --- |",
        *[f"| {name} | {_setting(meta[name])} |" for name in SETTINGS if name in meta],
        "",
        "## Results",
        "",
        "Columns as `pipeline bench` prints them: tokens/s, the speedup over target-only at the "
        "same batch size (HF's rows over HF target-only, ours over ours), `pred` Leviathan's "
        "prediction for the decoding and `job` that prediction carried to the whole job, α, τ, "
        "mean γ, target passes per token, the shares of our engine's time in target passes (`pre%` "
        "of it in the target's prefills), draft passes and the rest (`ask%` of it in asking the "
        "drafters: lookups, automata, the policy's choice; `ask ms` that per round that asked), "
        "whether every output equals "
        "its own target-only decoding (`same`) and HF target-only greedy (`=hf`), `agree` the mean "
        "share of each output's tokens before its "
        "first difference from ours target-only at batch 1, `vs llama` tokens/s over llama.cpp "
        "target-only's (where llama.cpp ran), and peak RSS."
        + (
            f" `{DENSE_ROW}`: the target on its dense bf16 weights, timed against the block path's "
            "target-only (its `speedup` is the block path's time over its own), its `same` and "
            "`agree` comparing its outputs with the block path's."
            if any(r.method == DENSE_ROW for r in result.rows)
            else ""
        ),
    ]
    for task in dict.fromkeys(r.task for r in result.rows):
        body += ["", f"### {task}", "", markdown_table([r for r in result.rows if r.task == task])]
    body += ["", "Measured by the auto engine, seconds: " + describe_costs(result.costs["auto"]) + "."]
    memory = describe_gpu_memory(result.rows)
    body += [f"{memory}."] if memory else []
    title = f"Benchmark: {meta['pair']}, {_setting(meta['tasks'])}, batch {_setting(meta['batches'])}"
    write_record(
        path,
        title,
        date=meta["date"],
        command=meta["command"],
        machine=meta["machine"],
        json_path=json_path,
        body=body,
    )


def _setting(value) -> str:
    return ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


# --------------------------------------------------------------------------------------------
# the command


@dataclass(frozen=True)
class BenchOptions:
    """`pipeline bench`'s options, parsed (comma lists as tuples)."""

    pair: str
    tasks: tuple[str, ...]
    docs: int
    corpus: str
    batches: tuple[int, ...]
    max_new_tokens: int
    runs: int
    dtype: str
    threads: int | None
    batch_invariant: bool | None
    static_passes: bool | None
    compiled_passes: bool | None
    fused_projections: bool
    float64_attention: bool
    block_linears: bool
    draft_int8: bool | None
    hf_assistant_tokens: tuple[int, ...]
    hf_lookup_tokens: tuple[int, ...]
    hf: bool
    drafters: tuple[str, ...]
    draft_vocab: int
    warm_docs: int
    weights: str
    block_activations: str
    llama_cpp: bool
    llama_cpp_gguf: str | None
    dense_reference: bool
    head_path: str | None
    out_path: str | None
    report_path: str | None


def _gguf(options: BenchOptions, target) -> str | None:
    """The GGUF file llama.cpp's rows run, checked before minutes of model loading (None: no
    llama.cpp rows); click.UsageError where it is missing."""
    if not options.llama_cpp:
        return None
    gguf = options.llama_cpp_gguf or str(Path(target.path).parent / "target.gguf")
    if not Path(gguf).is_file():
        import click

        raise click.UsageError(
            f"--llama-cpp: no GGUF file at {gguf}; give --llama-cpp-gguf, or install the pair "
            f"again keeping it: pipeline models install {options.pair} --force --keep-gguf"
        )
    return gguf


def _describe_loaded(pair: str, loaded: LoadedPair) -> str:
    """The pair as loaded, in a line: models, dtype, device, threads and kernels."""
    return (
        f"{pair}: {loaded.target_id} + {loaded.draft_id}, {loaded.dtype}, {loaded.device}, "
        f"{torch.get_num_threads()} threads, "
        + ("batch-invariant target" if loaded.batch_invariant else "stock kernels")
        + (", int8 draft steps" if loaded.draft_int8 else "")
        + (", streamed linears" if loaded.streamed else "")
        + (
            f", target on its GGUF blocks ({loaded.block_activations} activations)"
            if loaded.weights == "gguf-blocks"
            else ""
        )
        + (", static passes" if loaded.static_passes else "")
        + (", compiled" if loaded.compiled_passes else "")
        + (f", fused projections ({'+'.join(loaded.fused_projections)})" if loaded.fused_projections else "")
        + (", fixed-order attention" if loaded.fixed_attention else "")
        + (", fixed-order products" if loaded.fixed_linears else "")
    )


def _meta(options: BenchOptions, loaded: LoadedPair, started: dict, runner: LlamaCpp | None, gguf) -> dict:
    """The JSON's `meta`: the pair, the machine, the command and every setting of the run.
    `started`: the machine, the command and the date as the run started."""
    o = options
    return {
        "pair": o.pair,
        "models": loaded.manifest(),
        "machine": started["machine"],
        "command": started["command"],
        "date": started["date"],
        "tasks": list(o.tasks),
        "corpus": o.corpus,
        "docs": o.docs,
        "batches": list(o.batches),
        "max_new_tokens": o.max_new_tokens,
        "runs": o.runs,
        "drafters": list(o.drafters),
        "draft_vocab": o.draft_vocab,
        "warm_docs": o.warm_docs,
        "hf_assistant_tokens": list(o.hf_assistant_tokens),
        "hf_lookup_tokens": list(o.hf_lookup_tokens),
        "weights": loaded.weights,
        "block_activations": loaded.block_activations,
        "llama_cpp": f"llama-cpp-python {runner.version} ({runner.build}), {Path(gguf).name}"
        if runner
        else "no",
        "dense_reference": o.dense_reference,
        "head": o.head_path,
    }


def bench(options: BenchOptions, echo: Callable[[str], None]) -> None:
    """The command: load the pair as a job would, run the benchmark, print its table, and write
    the JSON and, where asked, the Markdown record."""
    from pipeline.machine import describe_machine
    from pipeline.models.loading import load_model, load_pair, resolve_pair

    o = options
    command = command_line()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out_path = o.out_path or (
        str(Path(o.report_path).with_suffix(".json")) if o.report_path else "bench.json"
    )
    available = len(CORPORA[o.corpus]())
    if o.docs + o.warm_docs > available:  # said before the models load, not after
        import click

        raise click.UsageError(
            f"--docs {o.docs}{f' and --warm-docs {o.warm_docs}' if o.warm_docs else ''}: only "
            f"{available} {o.corpus} documents on this machine"
        )
    if o.threads:
        torch.set_num_threads(o.threads)
    target, draft = resolve_pair(o.pair)
    gguf = _gguf(o, target)
    kernels = {
        "batch_invariant": o.batch_invariant,
        "draft_int8": o.draft_int8,
        "static_passes": o.static_passes,
        "compiled_passes": o.compiled_passes,
        "fused_projections": o.fused_projections,
        "float64_attention": o.float64_attention,
        "block_linears": o.block_linears,
    }
    loaded = load_pair(
        target,
        draft,
        dtype=o.dtype,
        device="auto",
        weights=o.weights,
        block_activations=o.block_activations,
        **kernels,
    )
    echo(_describe_loaded(o.pair, loaded))
    dense = None
    if o.dense_reference:
        if loaded.weights != "gguf-blocks":
            import click

            raise click.UsageError(
                "--dense-reference compares the GGUF block path with the dense one: "
                "the target here runs on its dense weights already"
            )
        dense = load_pair(target, None, dtype=o.dtype, device="auto", weights="dense", **kernels)
        echo("dense reference: " + _describe_loaded(o.pair, dense))
    head = None
    if "head" in o.drafters or o.head_path:
        import click

        from pipeline.decode.head import DraftHead, HeadError

        if not o.head_path:
            raise click.UsageError("the head drafter needs --head DIR (from `pipeline distill --head`)")
        try:
            head = DraftHead.load(o.head_path, loaded.target).pack()
        except HeadError as e:
            raise click.UsageError(str(e)) from None
    runner = LlamaCpp(gguf, torch.get_num_threads(), context=2048) if gguf else None
    # HF's rows run the models as `transformers` loads them, not on our kernels (none: no rows)
    hf_models = None
    if loaded.streamed and o.hf:
        hf_models = tuple(
            load_model(r, dtype=loaded.dtype, device=loaded.device) if r else None for r in (target, draft)
        )
    # now: the commit that runs, whatever the tree becomes during the run
    started = {"machine": describe_machine(loaded), "command": command, "date": date}
    echo(HEADER)
    result = run_benchmark(
        loaded,
        tasks=o.tasks,
        docs=o.docs,
        corpus=o.corpus,
        batches=o.batches,
        max_new_tokens=o.max_new_tokens,
        runs=o.runs,
        hf_assistant_tokens=o.hf_assistant_tokens,
        hf_lookup_tokens=o.hf_lookup_tokens,
        drafters=o.drafters,
        draft_vocab=o.draft_vocab,
        warm_docs=o.warm_docs,
        hf_models=hf_models,
        llama_cpp=runner,
        dense_target=dense.target if dense else None,
        head=head,
        hf=o.hf,
        log=echo,
    )
    meta = _meta(o, loaded, started, runner, gguf)
    echo("measured by the auto engine, seconds: " + describe_costs(result.costs["auto"]))
    memory = describe_gpu_memory(result.rows)
    if memory:
        echo(memory)
    for path in (out_path, o.report_path or out_path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_json(result, out_path, meta)
    echo(f"wrote {out_path}")
    if o.report_path:
        write_report(o.report_path, result, meta, out_path)
        echo(f"wrote {o.report_path}")
