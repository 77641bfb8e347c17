"""One shard end to end: read rows, check them, decode in batches, write outputs, errors, stats.

This is the unit of work (and of retry) of a job. It runs inside a model actor, but depends
only on an engine and a tokenizer, so tests can call it directly. Its three writes follow a
fixed order: outputs, then errors, then stats. The stats file is the commit record: a shard
is complete only when its stats exist, and a re-run redoes any shard without them.
"""

from __future__ import annotations

import gc
import itertools
import os
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa
import torch

from pipeline.decode.engine import RowOutput, SpeculativeEngine
from pipeline.decode.sampling import SamplingParams
from pipeline.decode.stats import BatchStats
from pipeline.job.ids import id_key
from pipeline.job.layout import shard_paths
from pipeline.job.prompts import OverlongDocument, PromptBuilder
from pipeline.job.speedup import StandDown, sample_chunks
from pipeline.job.stats import UNREADABLE, ShardStats, SpeedupSample
from pipeline.spec import JobSpec
from pipeline.storage import ShardReadError, Storage, StorageError, open_shard

ERROR_SCHEMA = pa.schema(
    [("id", pa.string()), ("row", pa.int64()), ("reason", pa.string()), ("detail", pa.string())]
)


# Prompt tokens a path's warm-up decode feeds per row (with 2 new tokens): enough to run every
# kernel of the path once, a fraction of a real prefill.
WARM_TOKENS = 16

# What every outputs/ record holds after the id and the kept input columns.
GENERATED_FIELDS = [
    ("generated", pa.string()),
    ("prompt_tokens", pa.int64()),
    ("new_tokens", pa.int64()),
    ("finish_reason", pa.string()),
    ("truncated", pa.bool_()),
    ("alpha", pa.float64()),
    ("tau", pa.float64()),
    ("rounds", pa.int64()),
    ("drafted", pa.int64()),
    ("accepted", pa.int64()),
    ("drafter", pa.string()),
    ("latency_s", pa.float64()),
    # the target's tokens as decoded (EOS or stop included): what `pipeline distill` learns from,
    # exactly, where `generated` tokenized again may split the text otherwise
    ("generated_ids", pa.list_(pa.int32())),
]


def output_schema(spec: JobSpec, input_schema: pa.Schema | None) -> pa.Schema:
    """The outputs/ schema: id and kept columns typed as in `input_schema` (string where it has
    no such column, or is unknown), then GENERATED_FIELDS. Types are written out, never
    inferred from the rows, so an empty shard's file matches a full one's."""
    carried = []
    for column in (spec.input.id_column, *spec.input.keep_columns):
        known = input_schema is not None and column in input_schema.names
        carried.append(pa.field(column, input_schema.field(column).type if known else pa.string()))
    return pa.schema([*carried, *GENERATED_FIELDS])


@dataclass
class _Row:
    index: int
    id: object
    text: str
    keep: dict


class ShardProcessor:
    """Decodes shards for one job with one engine (one per model actor)."""

    def __init__(self, spec: JobSpec, engine: SpeculativeEngine, tokenizer, model_info: dict | None = None):
        self.spec = spec
        self.engine = engine
        self.tokenizer = tokenizer
        self.prompts = PromptBuilder(tokenizer, spec.task)
        self.sampling = SamplingParams(
            greedy=spec.generation.greedy,
            temperature=spec.generation.temperature,
            top_k=spec.generation.top_k,
            top_p=spec.generation.top_p,
            seed=spec.generation.seed,
        )
        self.model_info = model_info or {}
        self.output = Storage(spec.output.url, spec.output.storage_options)
        self.oom_splits = 0  # batches halved after an out-of-memory error (reported per shard)
        # (drafter, rows) this actor has decoded with before: a pair's half that ran a path for
        # the first time (kernels built, pages read, graphs captured) would be timed cold
        self.warm_paths: set[tuple[str | None, int]] = set()
        # pairs this actor has timed: which half goes first alternates over all of them, not
        # within a shard, or a job of one-pair shards would time the same half first every time
        self.pairs = 0
        # whether the actor drafts at all, judged after each shard by the pairs it measured;
        # a fixed gamma (`drafter.adaptive: false`) is the user's call, as for the gate
        self.stand_down = StandDown() if spec.drafter.adaptive and spec.drafter.kind != "none" else None

    # -- the unit of work ---------------------------------------------------------------------

    def process(
        self,
        shard_url: str,
        name: str,
        attempt: int = 1,
        input_schema: pa.Schema | None = None,
        duplicates: dict[str, str] | None = None,
    ) -> dict:
        """Decode one shard and write its outputs, errors and stats; return the stats.

        `input_schema` is the job's (the executor's `job_input_schema`): the id and kept columns
        get its types, so every outputs file of a job has one schema. Without it the shard's
        own types are used. `duplicates` maps the ids (as text) that earlier shards hold to
        the shard holding each (pipeline.job.ids): those rows are `duplicate_id` errors here.
        """
        started = time.time()
        self.oom_splits = 0
        errors: list[dict] = []
        schema = output_schema(self.spec, input_schema)
        try:
            rows, schema = self._read(shard_url, errors, input_schema, duplicates or {})
        except _Unreadable as exc:
            return self._write_failed_read(shard_url, name, exc, started, attempt, schema)

        prompts, good = [], []
        truncated = 0
        tokens_in = 0
        for row, prompt in zip(rows, self.prompts.build_many([row.text for row in rows])):
            if isinstance(prompt, OverlongDocument):
                errors.append(_error(row.id, row.index, "overlong", str(prompt)))
                continue
            truncated += prompt.truncated
            tokens_in += len(prompt.ids)
            prompts.append(prompt)
            good.append(row)

        # a learning head trains on the rows of the shards before this one (`refine_head`)
        refined = self.engine.refine_head()
        rested = self.engine.gate.resting = bool(self.stand_down and self.stand_down.resting)
        decoded, totals, sample = self._decode_measured([p.ids for p in prompts])
        if self.stand_down:
            self.stand_down.after_shard(sample.pair_seconds)

        out_rows = []
        for row, prompt, (output, latency) in zip(good, prompts, decoded):
            text = self.tokenizer.decode(output.tokens, skip_special_tokens=True)
            text = _cut_at_stop(text, self.spec.generation.stop)
            s = output.stats
            record = {self.spec.input.id_column: row.id, **row.keep}
            record.update(
                generated=text,
                prompt_tokens=output.prompt_tokens,
                new_tokens=s.new_tokens,
                finish_reason=output.finish_reason,
                truncated=prompt.truncated,
                alpha=s.alpha,
                tau=s.tau,
                rounds=s.target_passes,
                drafted=s.drafted,
                accepted=s.accepted,
                drafter=max(s.drafted_by, key=s.drafted_by.get) if s.drafted_by else "none",
                latency_s=latency,
                generated_ids=output.tokens,
            )
            out_rows.append(record)

        paths = shard_paths(name)
        self.output.write_parquet(paths["outputs"], pa.Table.from_pylist(out_rows, schema=schema))
        self.output.write_parquet(paths["errors"], pa.Table.from_pylist(errors, schema=ERROR_SCHEMA))
        stats = self._stats(shard_url, name, rows, errors, totals, truncated, tokens_in, sample)
        if self.stand_down:
            stats.context["stand_down"] = self.stand_down.record(rested)
        if self.engine.learner:
            stats.context["head_online"] = refined
        stats.context.update(attempt=attempt, started=started, finished=time.time())
        record = stats.to_json()
        self.output.write_json(paths["stats"], record)
        return record

    # -- reading and checking rows ------------------------------------------------------------

    def _read(
        self, shard_url: str, errors: list[dict], input_schema: pa.Schema | None, duplicates: dict[str, str]
    ) -> tuple[list[_Row], pa.Schema]:
        """The shard's decodable rows (the others go to `errors`) and its output schema."""
        id_col, text_col = self.spec.input.id_column, self.spec.input.text_column
        parent, _, base = shard_url.rpartition("/")
        try:
            table = Storage(parent, self.spec.input.storage_options).read_parquet(base)
        except ShardReadError as exc:
            raise _Unreadable(str(exc), self._row_count(shard_url)) from None
        missing = [
            c for c in (id_col, text_col, *self.spec.input.keep_columns) if c not in table.column_names
        ]
        if missing:
            raise _Unreadable(
                f"missing column(s) {missing}; columns found: {table.column_names}", table.num_rows
            )
        schema = output_schema(self.spec, input_schema or table.schema)
        carried = [id_col, *self.spec.input.keep_columns]
        try:
            carried_table = table.select(carried).cast(pa.schema([schema.field(c) for c in carried]))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            differing = ", ".join(
                f"{c} is {table.schema.field(c).type} where the job's first shard has {schema.field(c).type}"
                for c in carried
                if table.schema.field(c).type != schema.field(c).type
            )
            reason = f"column types differ from the job's: {differing} ({exc})"
            raise _Unreadable(reason, table.num_rows) from None
        ids = carried_table.column(id_col).to_pylist()
        texts = table.column(text_col)
        keep = {c: carried_table.column(c).to_pylist() for c in self.spec.input.keep_columns}
        not_text = None if _is_text_type(texts.type) else f"{text_col} is {texts.type}, not a string"
        seen: set = set()
        rows = []
        for i, (row_id, text) in enumerate(zip(ids, _texts(texts))):
            reason = None
            if row_id is None:
                reason = ("missing_id", f"{id_col} is null")
            elif row_id in seen:
                reason = ("duplicate_id", f"{id_col} {row_id!r} already appeared in this shard")
            elif id_key(row_id) in duplicates:
                held = duplicates[id_key(row_id)]
                reason = ("duplicate_id", f"{id_col} {row_id!r} is already in shard {held}")
            elif not_text and text is not None:
                reason = ("text_not_string", not_text)
            elif isinstance(text, bytes):
                reason = ("invalid_utf8", f"{text_col} is not valid UTF-8")
            elif text is None:
                reason = ("null_text", f"{text_col} is null")
            elif not text.strip():
                reason = ("empty_text", f"{text_col} is empty or whitespace only")
            if row_id is not None:
                seen.add(row_id)
            if reason:
                errors.append(_error(row_id, i, *reason))
            else:
                rows.append(_Row(i, row_id, text, {c: keep[c][i] for c in keep}))
        return rows, schema

    def _row_count(self, shard_url: str) -> int:
        """Rows of a shard whose data cannot be read, from its footer; 0 when that is gone too."""
        try:
            return open_shard(shard_url, self.spec.input.storage_options).metadata.num_rows
        except (StorageError, pa.ArrowException, OSError, ValueError):
            return 0

    def _write_failed_read(
        self,
        shard_url: str,
        name: str,
        unreadable: _Unreadable,
        started: float,
        attempt: int,
        schema: pa.Schema,
    ) -> dict:
        """An unreadable shard is a shard-level error: record it and let the job go on.

        Its rows (as many as its footer or its readable columns tell) count in rows_in, so the
        manifest's input total is the corpus's; the one error record stands for all of them.
        """
        paths = shard_paths(name)
        reason = str(unreadable)
        self.output.write_parquet(paths["outputs"], schema.empty_table())
        error = _error(None, -1, "unreadable_shard", reason)
        self.output.write_parquet(paths["errors"], pa.Table.from_pylist([error], schema=ERROR_SCHEMA))
        stats = ShardStats(
            shard=name,
            input_url=shard_url,
            status=UNREADABLE,
            error=reason,
            rows_in=unreadable.rows,
            errors_by_reason={"unreadable_shard": 1},
            context={"started": started, "finished": time.time(), "attempt": attempt},
        )
        record = stats.to_json()
        self.output.write_json(paths["stats"], record)
        return record

    # -- decoding -------------------------------------------------------------------------------

    def _decode_sorted(
        self, prompts: list[list[int]], drafter: str | None = None, corpus: bool = True
    ) -> tuple[list[tuple[RowOutput, float]], BatchStats]:
        """Decode every prompt, `batch_size` rows at a time, longest first.

        One engine call for all of them: as rows finish, waiting ones take their places
        (continuous batching). Longest first, so that a batch too big for the device fails
        before any work is done rather than at the end of the shard.
        Returns (output, latency) per prompt in input order, and the summed counters.
        """
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        results: list = [None] * len(prompts)
        outputs, totals = self._generate_fitting([prompts[i] for i in order], drafter, corpus)
        for i, out in zip(order, outputs):
            results[i] = (out, out.stats.seconds)
        return results, totals

    def _generate_fitting(
        self, prompts: list[list[int]], drafter: str | None, corpus: bool, size: int | None = None
    ):
        """Decode at the job's batch size; on out-of-memory, halve it and start again.

        Long documents make some batches much bigger than the rest; halving keeps the shard
        going instead of failing it. Only a batch of a single row that still does not fit
        fails the attempt (the executor then retries the shard, then records it as failed).
        """
        size = size or self.spec.execution.batch_size
        try:
            return self.engine.generate(
                prompts,
                self.spec.generation.max_new_tokens,
                self.sampling,
                stop_strings=self.spec.generation.stop,
                drafter=drafter,
                overlong="truncate",
                batch_size=size,
                corpus=corpus,
            )
        except torch.OutOfMemoryError:
            if size == 1:
                raise
        # retried out of the handler: its traceback holds the failed batch's frames, and their
        # tensors, for as long as it runs
        self._free_memory()
        self.oom_splits += 1
        return self._generate_fitting(prompts, drafter, corpus, size // 2)

    def _free_memory(self) -> None:
        """After a batch ran out of memory: the static runners' slots of every size
        (`SpeculativeEngine.release_memory`, else those of the size that did not fit stay), the
        garbage the failed batch left, the allocator's cache."""
        self.engine.release_memory()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _decode_measured(self, prompts: list[list[int]]) -> tuple[list, BatchStats, SpeedupSample]:
        """Decode every row, the speedup sample's rows in matched pairs; return (output, latency)
        per row in input order, the shard's counters and the sample.

        The sampled rows (`speedup.sample_chunks`) are decoded chunk by chunk speculatively, as
        their outputs, and target-only back to back, which half goes first alternating from
        pair to pair over the actor's shards, so that drift in the machine's speed hits both
        alike; only the target-only halves are the measurement's cost. The other rows are then
        decoded together. Where that made fewer than two pairs, or fewer than
        `speedup_sample_tokens` speculative tokens, sampled chunks are decoded again both ways
        while the measurement's cost stays within `speedup_sample_budget` times the shard's
        decode time. For greedy decoding the pairs double as a losslessness check: both halves'
        outputs must be identical.
        """
        execution = self.spec.execution
        measuring = bool(prompts) and self.spec.drafter.kind != "none"
        chunks = (
            sample_chunks(len(prompts), execution.speedup_sample, execution.batch_size) if measuring else []
        )
        results: list = [None] * len(prompts)
        totals, sample = BatchStats(), SpeedupSample()
        for chunk in chunks:
            speculative, spec_stats = self._pair([prompts[i] for i in chunk], sample)
            totals.add(spec_stats)
            for i, out in zip(chunk, speculative):
                results[i] = out
        rest = [i for i in range(len(prompts)) if results[i] is None]
        if rest:
            decoded, stats = self._decode_sorted([prompts[i] for i in rest])
            totals.add(stats)
            for i, out in zip(rest, decoded):
                results[i] = out
        for k in itertools.count(len(chunks)) if chunks else ():
            if len(sample.pair_seconds) >= 2 and sample.sample_tokens >= execution.speedup_sample_tokens:
                break
            per_pair = (sample.speculative_seconds + sample.target_only_seconds) / len(sample.pair_seconds)
            if sample.seconds + per_pair > execution.speedup_sample_budget * totals.wall_seconds:
                break
            chunk = chunks[k % len(chunks)]
            self._pair([prompts[i] for i in chunk], sample, known=[results[i] for i in chunk])
        sample.predicted = totals.predicted_speedup
        return results, totals, sample

    def _pair(
        self, prompts: list[list[int]], sample: SpeedupSample, known: list | None = None
    ) -> tuple[list, BatchStats]:
        """Decode `prompts` both ways back to back (target-only first in every other pair the
        actor times, `pairs`) and add the pair to `sample`; return the speculative half's
        outputs and counters. A path this actor has not run yet is warmed first by a short
        decode, so that no half is timed cold.
        `known`: the rows' outputs from an earlier decode, which both halves must equal; both
        halves are then the measurement's cost, and the speculative half drafts without the
        suffix drafter's corpus, which holds those outputs now and would draft them back."""
        began = time.perf_counter()
        modes = (None, "none") if self.pairs % 2 == 0 else ("none", None)
        self.pairs += 1
        for mode in modes:
            self._warm(mode, prompts)
        sample.seconds += time.perf_counter() - began
        # only a first speculative half's outputs join the suffix drafter's corpus, as the rows' own
        corpus = known is None
        runs = {mode: self._decode_sorted(prompts, mode, corpus and mode is None) for mode in modes}
        (spec_out, spec_stats), (base_out, base_stats) = runs[None], runs["none"]
        expected = [out.tokens for out, _ in known or spec_out]
        identical = sum(b.tokens == s.tokens == e for (b, _), (s, _), e in zip(base_out, spec_out, expected))
        sample.add_pair(spec_stats, base_stats, identical if self.sampling.greedy else None)
        sample.seconds += base_stats.wall_seconds + (spec_stats.wall_seconds if known else 0.0)
        sample.repeated_pairs += known is not None
        return spec_out, spec_stats

    def _warm(self, mode: str | None, prompts: list[list[int]]) -> None:
        """Run the path (drafter, rows) once on a short piece of each prompt, if this actor has
        not run it: its first run pays one-time costs a pair must not time."""
        path = (mode, len(prompts))
        if path in self.warm_paths:
            return
        self.warm_paths.add(path)
        # the slots the real pair needs first: a warm-up on short heads must not size them
        longest = max(map(len, prompts))
        try:
            self.engine.reserve(len(prompts), longest, self.spec.generation.max_new_tokens, mode)
            heads = [p[:WARM_TOKENS] for p in prompts]
            rows = len(heads)
            self.engine.generate(
                heads, 2, self.sampling, drafter=mode, overlong="truncate", batch_size=rows, corpus=False
            )
            return
        except torch.OutOfMemoryError:
            pass
        # rows that do not fit (a capture of their slots' graphs): no warm-up; the decode that
        # follows halves its batch where it must (`_generate_fitting`)
        self._free_memory()

    # -- statistics -----------------------------------------------------------------------------

    def _stats(
        self, shard_url, name, rows, errors, totals: BatchStats, truncated, tokens_in, sample: SpeedupSample
    ) -> ShardStats:
        """The shard's record (`pipeline.job.stats`; each figure is explained in docs/stats.md)."""
        return ShardStats(
            shard=name,
            input_url=shard_url,
            rows_in=len(rows) + len(errors),
            rows_out=totals.rows,
            rows_error=len(errors),
            errors_by_reason=dict(Counter(e["reason"] for e in errors)),
            truncated=truncated,
            oom_splits=self.oom_splits,
            tokens_in=tokens_in,
            decoded=totals,
            gamma_max=self.spec.drafter.gamma_max,
            drafter=self.spec.drafter.kind,
            batch_size=self.spec.execution.batch_size,
            speedup=sample,
            context={
                "drafting_gate": self.engine.gate.record(),
                "copiers": self.engine.policy.copiers.record(),
                "static_passes": self.engine.static_record(),
                "models": self.model_info,
                "worker": {"host": socket.gethostname(), "pid": os.getpid(), "node": _ray_node()},
            },
        )


def _ray_node() -> str | None:
    """The id of the Ray node this actor runs on (None outside Ray): on a cluster of one
    machine's nodes the host does not tell them apart, and a lost node is named by it."""
    ray = sys.modules.get("ray")  # imported by the actor's runtime, never by this module
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


class _Unreadable(Exception):
    """A shard whose rows cannot be decoded (corrupt file, missing column); `rows` as far as known."""

    def __init__(self, reason: str, rows: int):
        super().__init__(reason)
        self.rows = rows


def _is_text_type(t: pa.DataType) -> bool:
    """Types whose values `_texts` turns into text (binary: to report non-UTF-8 per row)."""
    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or (pa.types.is_large_binary(t) or pa.types.is_null(t))
    )


def _error(row_id, row: int, reason: str, detail: str) -> dict:
    return {"id": None if row_id is None else str(row_id), "row": row, "reason": reason, "detail": detail}


def _texts(column: pa.ChunkedArray) -> list:
    """Texts as str, None for nulls, and the raw bytes where a value is not valid UTF-8.

    A column of another type (int64, ...) gives its values unchanged: each row becomes a
    `text_not_string` error record, where a cast would fail the whole shard.
    """
    if not _is_text_type(column.type):
        return column.to_pylist()
    values = []
    for raw in column.cast(pa.binary()).to_pylist() if column.type != pa.null() else [None] * len(column):
        if raw is None:
            values.append(None)
            continue
        try:
            values.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            values.append(raw)
    return values


def _cut_at_stop(text: str, stops: list[str]) -> str:
    """Drop a stop string and what follows it (the engine stops right after it appears)."""
    cuts = [text.find(s) for s in stops if s in text]
    return text[: min(cuts)] if cuts else text
