"""The pipeline end to end on a real local Ray, real Parquet files and a real S3 server.

Every output row is checked against the target model decoding the same prompt alone.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
import uuid

import pyarrow.parquet as pq
import ray
from click.testing import CliRunner
from pipeline_helpers import check_output, job_dict, write_corpus

from pipeline.cli import main
from pipeline.job.executor import run_job
from pipeline.spec import spec_from_dict
from pipeline.storage import Storage


def wait_for_metrics(*patterns: str, timeout: float = 60.0) -> None:
    """Wait until every regex pattern matches this node's Ray metrics endpoint.

    Counters from several actors reach the exporter at different times, so a scrape can hold a
    job's label before its final count: wait for the values, not just the names."""
    port = ray.nodes()[0]["MetricsExportPort"]
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            text = ""
        if all(re.search(p, text) for p in patterns):
            return
        time.sleep(2)
    raise AssertionError(f"metrics {patterns} not exported within {timeout}s:\n{text[-2000:]}")


def test_local_job_outputs_equal_target_only_and_rerun_skips(
    tiny_models, tiny_pair_dirs, tmp_path, ray_local
):
    rows_in = write_corpus(Storage(str(tmp_path / "in")))
    data = job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out"))
    data["name"] = f"metrics-{uuid.uuid4().hex[:8]}"  # metric counters add up over the session
    spec = spec_from_dict(data)
    result = run_job(spec, progress=False)
    assert result.ok and len(result.done) == 4 and result.shards_skipped == 0
    out = Storage(str(tmp_path / "out"))
    check_output(tiny_models, spec, out, rows_in)
    rows_out = sum(s["rows_out"] for s in result.done)
    job = f'pipeline_job="{spec.name}"'
    wait_for_metrics(
        rf"ray_pipeline_rows_total{{[^}}]*{job}[^}}]*}} {rows_out}(\.0)?\b",
        r'ray_pipeline_alpha{[^}]*shard="part-000"',
    )

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
    # and the report is written next to the results, in the bucket
    report = CliRunner().invoke(main, ["report", f"s3://{bucket}/results/r1"])
    assert report.exit_code == 0, report.output
    assert out.exists("report/report.html") and out.exists("report/figures/acceptance.png")


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


def test_the_suffix_drafter_starts_warm_from_an_earlier_runs_outputs(
    tiny_models, tiny_pair_dirs, tmp_path, ray_local
):
    """The nightly case: tonight's job drafts from last night's outputs. Here the same documents
    again, so the warm run finds its whole outputs in the corpus (the bench measures the honest
    case, other documents of the same kind); outputs stay the target's own either way."""
    rows_in = write_corpus(Storage(str(tmp_path / "in")))

    def run(name: str, **drafter):
        data = job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / name))
        data["drafter"].update(kind="suffix", **drafter)
        spec = spec_from_dict(data)
        result = run_job(spec, progress=False)
        assert result.ok
        out = Storage(str(tmp_path / name))
        check_output(tiny_models, spec, out, rows_in)
        stats = [out.read_json(n) for n in out.list("stats", suffix=".json")]
        stats = [s for s in stats if s["status"] == "ok"]  # (not the unreadable shard)
        accepted = sum(s["accepted_by"].get("suffix", 0) for s in stats)
        return accepted, [s["models"].get("suffix_warm_start") for s in stats]

    cold, starts = run("cold")
    assert starts == [None] * 3
    warm, starts = run("warm", suffix_warm_start=str(tmp_path / "cold"))
    produced = sum(
        1 for t in pq.read_table(tmp_path / "cold" / "outputs").column("generated").to_pylist() if t
    )
    assert starts[0]["outputs"] == produced and starts[0]["tokens"] > 0
    assert warm > cold
    # an unreadable warm start: the job runs cold and its stats say why
    _, starts = run("lost", suffix_warm_start=str(tmp_path / "nowhere"))
    assert "no Parquet file" in starts[0]["error"]
