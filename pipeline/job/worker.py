"""The model actor: loads the target and its draft once, then decodes shard after shard.

Target and draft live in the same process (one GPU, or CPU cores) because speculation
alternates between them every few milliseconds; splitting them over actors would put a
network hop inside the decoding loop.
"""

from __future__ import annotations

import gc
import logging
import math
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.decode.settings import HEAD, MODEL_FREE
from pipeline.spec import JobSpec

if TYPE_CHECKING:  # the driver imports this module for ModelWorker: torch loads in the actor only
    from pipeline.decode.engine import SpeculativeEngine
    from pipeline.job.shard import ShardProcessor
    from pipeline.models.pairs import ModelRef

log = logging.getLogger(__name__)

# The start-up calibration: passes of 1 to 16 tokens over a few hundred cached ones (a few
# seconds for the 1.5B target on 2 cores); wider passes are learned as the job runs.
STARTUP_WIDTHS = (1, 2, 4, 8, 16)
STARTUP_CONTEXT = 256
# rounds of every width's pass (`calibration._pass_seconds`): one lets a brief slow spell price a
# width for as long as the calibration is cached; three cost an actor's start a few seconds more
STARTUP_RUNS = 3


def model_refs(spec: JobSpec) -> tuple[ModelRef, ModelRef | None]:
    """The target and (when the drafter needs one) the draft model a spec asks for."""
    from pipeline.models.pairs import ModelRef, resolve_pair

    models = spec.models
    if models.pair:
        target, draft = resolve_pair(models.pair)
    else:
        target = ModelRef(path=models.target.path, revision=models.target.revision)
        draft = ModelRef(path=models.draft.path, revision=models.draft.revision) if models.draft else None
    if spec.drafter.kind in MODEL_FREE:
        draft = None
    return target, draft


def build_processor(spec: JobSpec) -> ShardProcessor:
    """Load the models a spec names and wire them into an engine and a shard processor."""
    import transformers

    from pipeline.decode.engine import SpeculativeEngine
    from pipeline.decode.settings import EngineConfig
    from pipeline.job.shard import ShardProcessor
    from pipeline.models.loading import eos_ids, load_pair, pad_id

    target_ref, draft_ref = model_refs(spec)
    # Load bars, one line per refresh per actor, would drown the driver's own progress.
    transformers.utils.logging.disable_progress_bar()
    pair = load_pair(
        target_ref,
        draft_ref,
        dtype=spec.models.dtype,
        device=spec.models.device,
        trust_remote_code=spec.models.trust_remote_code,
        batch_invariant=spec.models.batch_invariant,
        draft_int8=spec.models.draft_int8,
        weights=spec.models.weights,
        block_activations=spec.models.block_activations,
        static_passes=spec.models.static_passes,
        compiled_passes=spec.models.compiled_passes,
        batch=spec.execution.batch_size,
    )
    tokenizer = pair.tokenizer
    drafter = spec.drafter.kind
    head = None
    if drafter == HEAD or (drafter == "auto" and HEAD in spec.drafter.auto_sources):
        from pipeline.decode.head import DraftHead

        if spec.drafter.head:
            head = DraftHead.load(head_directory(spec.drafter.head, spec.output.storage_options), pair.target)
        else:  # head_online: grown from a new head
            head = DraftHead.from_target(pair.target, spec.drafter.draft_vocab)
        if not spec.drafter.head_online:  # a learning head is packed by the engine, as a copy
            head = head.pack()
    engine = SpeculativeEngine(
        pair.target,
        pair.draft,
        eos_token_ids=eos_ids(tokenizer, pair.target),
        pad_token_id=pad_id(tokenizer, pair.target),
        decode_text=tokenizer.decode,
        encode_text=partial(tokenizer.encode, add_special_tokens=False),
        vocab_size=pair.vocab_size,
        config=EngineConfig.from_spec(spec.drafter, drafter),
        head=head,
    )
    info = pair.manifest()
    info["load_seconds"] = pair.load_seconds
    if head is not None:  # where the head came from: a head's drafts are only as good as its past
        info["head"] = {"from": spec.drafter.head or "new", "vocab_rows": len(head.vocab_rows)}
        info["head"]["digest"] = head.digest()
    if spec.drafter.suffix_warm_start and "suffix" in engine.sources(drafter):
        info["suffix_warm_start"] = warm_suffix(
            engine, tokenizer, spec.drafter.suffix_warm_start, spec.output.storage_options
        )
    if drafter != "none":
        info["calibration"] = seed_costs(engine, pair, spec.drafter.draft_vocab)
    # The models, tokenizer and libraries loaded so far live as long as the actor: out of the
    # collector's sight, a full collection no longer walks them all, a pause that otherwise
    # lands inside some timed speedup half (docs/stats.md, "Pairs")
    gc.collect()  # what loading left unreachable goes first, not into the frozen generation
    gc.freeze()
    return ShardProcessor(spec, engine, tokenizer, info)


def head_directory(url: str, storage_options: dict) -> str:
    """A local directory holding the head at `url`: the path itself, or for a URL (an earlier
    job's `head/actor-<k>/`, say on S3) a temporary copy of its files, read with the output's
    storage options. The copy lives as long as the actor."""
    from pipeline.decode.head import HEAD_CONFIG, HEAD_FILE
    from pipeline.storage import Storage
    from pipeline.storage.urls import split_scheme

    scheme, path = split_scheme(url)
    if scheme in (None, "file"):
        return path
    storage, local = Storage(url, storage_options), Path(tempfile.mkdtemp(prefix="head-"))
    for name in (HEAD_CONFIG, HEAD_FILE):
        (local / name).write_bytes(storage.read_bytes(name))
    return str(local)


def warm_suffix(engine, tokenizer, url: str, storage_options: dict) -> dict:
    """Read the `generated` texts under `url` (an earlier run's output, or a directory of Parquet
    files) into the engine's suffix corpus. A nightly job's outputs recur from night to night
    (terms, phrasing), so drafting from them pays from the first shard. Unreadable: a log line,
    the reason in the stats, and the job goes on cold, since drafts never change outputs."""
    from pipeline.job.layout import warm_start_outputs
    from pipeline.storage import Storage, StorageError

    began = time.perf_counter()
    try:
        storage = warm_start_outputs(Storage(url, storage_options))
        texts = []
        for name in storage.list(suffix=".parquet"):
            table = storage.read_parquet(name)
            if "generated" in table.column_names:
                texts += [t for t in table.column("generated").to_pylist() if t]
        if not texts:
            raise ValueError("no Parquet file there has a non-empty `generated` column")
    except (StorageError, OSError, ValueError) as exc:
        log.warning("suffix warm start from %s failed, starting cold: %s", url, exc)
        return {"url": url, "error": str(exc)}
    kept = engine.remember_outputs(tokenizer(texts, add_special_tokens=False).input_ids)
    return {
        "url": url,
        "outputs": kept,
        "tokens": engine.suffix.corpus.tokens,
        "seconds": round(time.perf_counter() - began, 3),
    }


def seed_costs(engine: SpeculativeEngine, pair, draft_vocab: int) -> dict:
    """Give the engine measured pass costs before its first shard: from the cache when this
    machine, pair, dtype, thread count and kernels were calibrated before (`pipeline calibrate`
    or an earlier actor), else measured now with a cheap calibration and cached."""
    import torch

    from pipeline.decode import calibration

    began = time.perf_counter()
    key = calibration.calibration_key(pair, torch.get_num_threads(), draft_vocab)
    data = calibration.load_cached(key)
    cached = data is not None
    if data is None:
        data = calibration.measure(
            pair, widths=STARTUP_WIDTHS, context=STARTUP_CONTEXT, runs=STARTUP_RUNS, draft_vocab=draft_vocab
        )
        calibration.save_cached(key, data)
    engine.costs.seed(data)
    return {
        "key": key,
        "cached": cached,
        "seconds": round(time.perf_counter() - began, 3),
        "target_pass_seconds": data["target_pass_seconds"],
    }


class ModelWorker:
    """Ray actor body (wrapped with `ray.remote` by the executor, so this module imports no Ray)."""

    def __init__(self, spec: JobSpec):
        import torch

        threads = spec.execution.threads or max(1, math.ceil(spec.execution.num_cpus))
        torch.set_num_threads(threads)
        began = time.perf_counter()
        self.spec = spec
        self.processor = build_processor(spec)
        self.load_seconds = time.perf_counter() - began

    def save_head(self, url: str) -> dict | None:
        """Write the head this actor learned (`drafter.head_online`) under `url`, where a later
        job's `drafter.head` can name it, with its training steps over every run it learned in;
        None when it learned nothing in this one."""
        from pipeline.decode.head import HEAD_CONFIG, HEAD_FILE
        from pipeline.storage import Storage

        learner = self.processor.engine.learner
        if learner is None or not learner.steps:
            return None
        storage = Storage(url, self.spec.output.storage_options)
        steps = learner.head.steps_before + learner.steps  # over every night it has learned
        with tempfile.TemporaryDirectory() as local:
            learner.head.save(local, steps=steps)
            # the config last, as the commit record: a save cut short leaves the last whole
            # config beside weights of the same shapes, never a config without weights
            for name in (HEAD_FILE, HEAD_CONFIG):
                storage.write_bytes(name, (Path(local) / name).read_bytes())
        return {"url": url, "steps": steps, "digest": learner.head.digest()}

    def info(self) -> dict:
        return {**self.processor.model_info, "actor_load_seconds": self.load_seconds}

    def process(self, shard_url: str, name: str, attempt: int, input_schema=None, duplicates=None) -> dict:
        return self.processor.process(shard_url, name, attempt, input_schema, duplicates)
