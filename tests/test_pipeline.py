"""The pipeline end to end on a real local Ray, real Parquet files and a real S3 server.

Every output row is checked against the target model decoding the same prompt alone.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch
from click.testing import CliRunner

from pipeline.cli import main
from pipeline.executor import run_job
from pipeline.prompts import PromptBuilder
from pipeline.spec import spec_from_dict
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


@pytest.fixture(scope="session")
def ray_local(s3_server):
    """One real local Ray for the module, started after the S3 env is set so workers inherit it."""
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


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
        "drafter": {"kind": "auto", "gamma_max": 4},
        "execution": {"batch_size": 3, "num_actors": 1, "num_cpus": 1, "speedup_sample": 0.5, **execution},
        "output": {"url": output_url},
    }


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
            assert 0 <= s["alpha"] <= 1 and s["tau"] >= 1
            assert s["speedup"]["identical_rows"] == s["speedup"]["sample_rows"] >= 1
            assert s["speedup"]["measured"] > 0 and s["speedup"]["predicted"] > 0
            assert s["tokens_per_second"] > 0
        else:
            assert "corrupt.parquet" in s["error"]
    manifest = out.read_json("manifest.json")
    assert manifest["totals"]["rows_out"] == outputs.num_rows
    assert manifest["models"]["target"]["path"] == spec.models.target.path
    assert out.exists("_SUCCESS")


def scrape_metrics(*needles: str, timeout: float = 60.0) -> str:
    """The Prometheus text of this node's Ray metrics endpoint, once it holds every needle."""
    port = ray.nodes()[0]["MetricsExportPort"]
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            text = ""
        if all(n in text for n in needles):
            return text
        time.sleep(2)
    raise AssertionError(f"metrics {needles} not exported within {timeout}s")


def test_local_job_outputs_equal_target_only_and_rerun_skips(
    tiny_models, tiny_pair_dirs, tmp_path, ray_local
):
    rows_in = write_corpus(Storage(str(tmp_path / "in")))
    spec = spec_from_dict(job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out")))
    result = run_job(spec, progress=False)
    assert result.ok and len(result.done) == 4 and result.shards_skipped == 0
    out = Storage(str(tmp_path / "out"))
    check_output(tiny_models, spec, out, rows_in)
    rows_out = sum(s["rows_out"] for s in result.done)
    text = scrape_metrics("ray_pipeline_rows_total{", f'pipeline_job="{spec.name}"')
    job = f'pipeline_job="{spec.name}"'
    assert re.search(rf"ray_pipeline_rows_total{{[^}}]*{job}[^}}]*}} {rows_out}(\.0)?\b", text)
    assert re.search(r'ray_pipeline_alpha{[^}]*shard="part-000"', text)

    before = {n: out.read_bytes(n) for n in out.list("outputs")}
    again = run_job(spec, progress=False)
    assert again.shards_skipped == 4 and not again.done
    assert {n: out.read_bytes(n) for n in out.list("outputs")} == before

    # a shard whose stats (the commit record) are missing is redone, and only that one
    out.delete("stats/part-001.json")
    third = run_job(spec, progress=False)
    assert [s["shard"] for s in third.done] == ["part-001"] and third.shards_skipped == 3
    check_output(tiny_models, spec, out, rows_in)


def test_s3_round_trip(tiny_models, tiny_pair_dirs, s3_server, ray_local):
    bucket = s3_server.make_bucket("corpus")
    input_store = Storage(f"s3://{bucket}/docs", s3_server.storage_options)
    rows_in = write_corpus(input_store)
    data = job_dict(tiny_pair_dirs, f"s3://{bucket}/docs/", f"s3://{bucket}/results/{{run_id}}", num_actors=2)
    spec = spec_from_dict(data, run_id="r1")
    result = run_job(spec, progress=False)
    assert result.ok and len(result.done) == 4
    out = Storage(f"s3://{bucket}/results/r1", s3_server.storage_options)
    check_output(tiny_models, spec, out, rows_in)
    # read back with plain pyarrow too, as a downstream user would
    table = pq.read_table(f"{bucket}/results/r1/outputs/part-000.parquet", filesystem=out.fs)
    assert table.num_rows == 5


def test_cli_run_stats_and_validate(tiny_pair_dirs, tmp_path, ray_local):
    write_corpus(Storage(str(tmp_path / "in")))
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(json.dumps(job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out"))))
    runner = CliRunner()
    ok = runner.invoke(main, ["validate", str(spec_path)])
    assert ok.exit_code == 0, ok.output
    result = runner.invoke(main, ["run", str(spec_path), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "TOTAL" in result.output and "part-000" in result.output
    stats = runner.invoke(main, ["stats", str(tmp_path / "out"), "--json"])
    assert stats.exit_code == 0 and json.loads(stats.output)["rows_out"] == 8

    broken = tmp_path / "broken.yaml"
    broken.write_text(
        json.dumps({**json.loads(spec_path.read_text()), "generation": {"max_new_tokens": "many"}})
    )
    bad = runner.invoke(main, ["validate", str(broken)])
    assert bad.exit_code == 2 and "generation.max_new_tokens" in bad.output
    bad_run = runner.invoke(main, ["run", str(broken)])
    assert bad_run.exit_code == 2 and "generation.max_new_tokens" in bad_run.output
