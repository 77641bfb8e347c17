"""Shared by the end-to-end tests: a small corpus with every kind of bad input, a job spec
for the tiny pair, the row-by-row check of a job's output against target-only decoding, clean
corpora with every row accounted for once, and a killer of model actors."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pyarrow as pa
import torch

from pipeline.job.prompts import PromptBuilder
from pipeline.storage import Storage

DOCS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "Summaries copy phrases from their input documents, translations rarely do. Summaries copy phrases.",
    "Parquet shards are read from object storage and written back with statistics.",
    "Data teams run batch jobs every night on a cluster of machines.",
    "Le renard brun saute par-dessus le chien paresseux.",
    "fox",
]


def corpus_shards() -> dict[str, pa.Table]:
    """Three shards: clean rows, rows with every kind of bad input, and a long-document shard."""
    clean = pa.table(
        {"id": [f"a{i}" for i in range(5)], "text": DOCS[:5], "title": [f"t{i}" for i in range(5)]}
    )
    messy = pa.table(
        {
            "id": ["b0", "b1", "b2", "b3", "b0", None, "b6"],
            "text": pa.array(
                [DOCS[5], None, "", "   \n ", "duplicate id", "no id", b"\xff\xfe not utf-8"], pa.binary()
            ),
            "title": ["x"] * 7,
        }
    )
    long = pa.table({"id": ["c0", "c1"], "text": [DOCS[0] * 30, DOCS[6]], "title": ["l0", "l1"]})
    return {"part-000.parquet": clean, "part-001.parquet": messy, "nested/part-002.parquet": long}


def job_dict(tiny_pair_dirs, input_url: str, output_url: str, **execution) -> dict:
    target, draft = tiny_pair_dirs
    return {
        "name": "test-job",
        "input": {"url": input_url, "keep_columns": ["title"]},
        "task": {"kind": "summarize", "max_input_tokens": 48, "overlong": "truncate"},
        "generation": {"max_new_tokens": 12},
        "models": {"target": str(target), "draft": str(draft), "dtype": "float32", "device": "cpu"},
        # fixed gamma: every round drafts, so outputs prove the speculative path lossless (adaptive
        # rounds on the tiny pair, a draft costing what its target does, would decode target-only)
        "drafter": {"kind": "auto", "gamma_max": 4, "adaptive": False},
        "execution": {"batch_size": 3, "num_actors": 1, "num_cpus": 1, "speedup_sample": 0.5, **execution},
        "output": {"url": output_url},
    }


def write_models_config(directory, **pairs: tuple) -> str:
    """A configs/ directory whose models.yaml names each pair (target dir, draft dir); its path,
    for PIPELINE_CONFIG_DIR."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = "".join(f"  {name}:\n    target: {t}\n    draft: {d}\n" for name, (t, d) in pairs.items())
    (directory / "models.yaml").write_text("pairs:\n" + entries)
    return str(directory)


def write_corpus(store: Storage) -> int:
    rows = 0
    for name, table in corpus_shards().items():
        store.write_parquet(name, table)
        rows += table.num_rows
    store.write_bytes("corrupt.parquet", b"PAR1 this is not a parquet file")
    return rows


def expected_text(tiny_models, spec, text: str) -> str:
    """What the target alone generates for this document (HF greedy generate, batch 1)."""
    target, _, tokenizer = tiny_models
    prompt = PromptBuilder(tokenizer, spec.task).build(text).ids
    out = target.generate(
        torch.tensor([prompt]),
        max_new_tokens=spec.generation.max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True)


def check_output(tiny_models, spec, out: Storage, rows_in: int) -> None:
    """Every input row is in outputs or errors exactly once; every output equals target-only."""
    outputs = pa.concat_tables([out.read_parquet(n) for n in out.list("outputs")], promote_options="default")
    errors = pa.concat_tables([out.read_parquet(n) for n in out.list("errors")])
    assert outputs.num_rows + errors.num_rows - 1 == rows_in  # -1: the corrupt shard's record
    ids = outputs.column("id").to_pylist()
    assert len(ids) == len(set(ids))
    texts = {**dict(zip(corpus_shards()["part-000.parquet"]["id"].to_pylist(), DOCS[:5]))}
    texts.update({"b0": DOCS[5], "c0": DOCS[0] * 30, "c1": DOCS[6]})
    assert set(ids) == set(texts)
    for record in outputs.to_pylist():
        assert record["generated"] == expected_text(tiny_models, spec, texts[record["id"]]), record["id"]
        assert record["new_tokens"] >= 1 and record["finish_reason"] in ("eos", "length")
        assert record["title"] is not None
        doc_tokens = len(tiny_models[2](texts[record["id"]], add_special_tokens=False).input_ids)
        assert record["truncated"] == (doc_tokens > spec.task.max_input_tokens)
    assert outputs.column("truncated").to_pylist().count(True) >= 1  # c0 at least
    reasons = sorted(zip(errors.column("id").to_pylist(), errors.column("reason").to_pylist()), key=str)
    assert reasons == sorted(
        [
            ("b1", "null_text"),
            ("b2", "empty_text"),
            ("b3", "empty_text"),
            ("b0", "duplicate_id"),
            (None, "missing_id"),
            ("b6", "invalid_utf8"),
            (None, "unreadable_shard"),
        ],
        key=str,
    )
    stats = [out.read_json(n) for n in out.list("stats")]
    assert len(stats) == 4
    for s in stats:
        if s["status"] == "ok":
            assert s["rows_in"] == s["rows_out"] + s["rows_error"]
            assert (s["alpha"] is None) == (s["drafted"] == 0) and s["tau"] >= 1  # (null: none drafted)
            assert s["alpha"] is None or 0 <= s["alpha"] <= 1
            speedup = s["speedup"]
            assert speedup["identical_rows"] == speedup["sample_rows"] >= 1
            assert speedup["measured"] > 0 and speedup["predicted"] > 0
            # one sampled row makes one pair; a second only where the budget allows (no interval then)
            assert speedup["pairs"] == len(speedup["pair_seconds"]) >= 1 and speedup["sample_tokens"] > 0
            if speedup["pairs"] > 1:
                assert speedup["ci95"][0] <= speedup["measured"] <= speedup["ci95"][1]
            else:
                assert speedup["ci95"] is None
            # measuring costs the target-only halves, never the shard's own (speculative) decoding
            assert 0 < speedup["seconds"] and speedup["sample_rows"] <= s["rows_out"] * speedup["pairs"]
            # τ over drafting rounds leaves out the prefills' single tokens and undrafted rounds;
            # with the draft model at a fixed gamma every round drafts
            assert s["tau_drafted_rounds"] >= s["tau"] or s["undrafted_share"] == 1  # (then 0)
            if spec.drafter.kind in ("auto", "draft_model") and not spec.drafter.adaptive:
                assert s["undrafted_rounds"] == 0
            assert all(0 <= a <= 1 for rates in s["acceptance_by_position"].values() for a in rates)
            assert s["tokens_per_second"] > 0
            assert 0 < s["prefill_seconds"] <= s["target_seconds"] and s["prefill_tokens"] > 0
        else:
            assert "corrupt.parquet" in s["error"]
    manifest = out.read_json("manifest.json")
    assert manifest["totals"]["rows_out"] == outputs.num_rows
    pooled = manifest["totals"]
    assert pooled["speedup_ci95"][0] <= pooled["speedup"] <= pooled["speedup_ci95"][1]
    assert pooled["speedup_pairs"] == sum(s["speedup"]["pairs"] for s in stats if s["status"] == "ok")
    assert manifest["models"]["target"]["path"] == spec.models.target.path
    assert out.exists("_SUCCESS")


def clean_corpus(store: Storage, shards: int, rows: int) -> set[str]:
    """`shards` shards of `rows` good documents each; returns every id written."""
    ids = set()
    for s in range(shards):
        shard_ids = [f"s{s}r{r}" for r in range(rows)]
        texts = [DOCS[(s + r) % 5] for r in range(rows)]
        store.write_parquet(f"part-{s:03d}.parquet", pa.table({"id": shard_ids, "text": texts}))
        ids.update(shard_ids)
    return ids


def ids_in(out: Storage, sub: str) -> list:
    """Every id under outputs/ or errors/, duplicates kept (so the caller can count them)."""
    return [i for n in out.list(sub) for i in out.read_parquet(n).column("id").to_pylist()]


def assert_exactly_once(out: Storage, expected: set[str]) -> None:
    seen = ids_in(out, "outputs") + [i for i in ids_in(out, "errors") if i is not None]
    assert len(seen) == len(set(seen)), "a row appears twice"
    assert set(seen) == expected, f"missing rows: {sorted(expected - set(seen))}"


class ActorKiller(threading.Thread):
    """SIGKILLs model actor processes while they decode a shard (up to `kills` times), each
    `delays[i]` seconds (default 0.2) after it was seen in a shard.

    Ray titles an actor process `ray::ModelWorker.process` while that method runs, so the kill
    lands mid-shard, never while the actor is idle or loading. Only this process's descendants
    are candidates: under pytest-xdist another worker's Ray runs actors that are not ours.
    """

    def __init__(self, kills: int, delays: list[float] | None = None):
        super().__init__(daemon=True)
        self.delays = delays or [0.2] * kills
        self.killed: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() and len(self.killed) < len(self.delays):
            for proc in psutil.Process().children(recursive=True):
                try:
                    decoding = "ray::ModelWorker.process" in " ".join(proc.cmdline())
                except psutil.Error:  # gone since it was listed
                    continue
                if decoding and proc.pid not in self.killed:
                    time.sleep(self.delays[len(self.killed)])  # let it get into the shard
                    try:
                        os.kill(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    self.killed.append(proc.pid)
                    break
            self.stop.wait(0.05)
