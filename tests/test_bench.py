"""`pipeline bench` end to end on the tiny pair: every configuration runs, every output is checked
against HF target-only greedy, and the JSON carries the columns the table prints.

Timings of tiny models mean nothing; this proves the harness, not a speedup.
"""

from __future__ import annotations

import json
import textwrap

from click.testing import CliRunner

from pipeline.bench import HEADER, job_prediction
from pipeline.cli import main


def test_bench_runs_every_configuration_and_checks_outputs(tiny_pair_dirs, tmp_path, monkeypatch):
    target_dir, draft_dir = tiny_pair_dirs
    config = tmp_path / "cfg"
    config.mkdir()
    (config / "models.yaml").write_text(
        textwrap.dedent(
            f"""
            pairs:
              tiny:
                target: {target_dir}
                draft: {draft_dir}
            """
        )
    )
    monkeypatch.setenv("PIPELINE_CONFIG_DIR", str(config))
    out = tmp_path / "bench.json"
    args = ["bench", "--pair", "tiny", "--docs", "2", "--batches", "1,2", "--runs", "2"]
    args += ["--max-new-tokens", "6", "--hf-assistant-tokens", "2", "--hf-lookup-tokens", "2"]
    args += ["--threads", "1", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert HEADER in result.output

    report = json.loads(out.read_text())
    assert report["meta"]["runs"] == 2 and report["meta"]["docs"] == 2
    rows = report["rows"]
    ours = ["ours target-only", "ours draft_model", "ours prompt_lookup", "ours auto"]
    # on CPU the draft's steps run on int8 weights; HF's assisted generation runs with the draft
    # as loaded and with those
    hf = ["hf target-only", "hf assisted k=2", "hf assisted k=2 int8", "hf prompt lookup k=2"]
    for task in ("summarize", "translate"):
        got = {(r["method"], r["batch"]) for r in rows if r["task"] == task}
        assert got == {(m, 1) for m in hf} | {(m, b) for m in ours for b in (1, 2)}
    for r in rows:
        assert r["identical"], r  # lossless: every configuration reproduces HF greedy
        assert len(r["seconds_runs"]) == 2 and r["seconds_median"] > 0
        assert 0 < r["tokens"] <= 2 * 6  # two documents, at most 6 new tokens each
        assert r["tokens_per_second"] > 0 and r["peak_rss_mb"] > 0
        if r["method"].endswith("target-only"):
            assert r["speedup"] == 1.0
        if r["method"].startswith("hf"):
            assert r["alpha"] is None and r["predicted"] is None
            continue
        # our engine reports where its time went and what Leviathan's formula predicts
        shares = r["target_share"] + r["draft_share"] + r["other_share"]
        assert abs(shares - 1.0) < 1e-6 and r["target_share"] > 0
        assert r["target_passes_per_token"] > 0 and r["tau"] >= 1.0
        assert r["predicted"] > 0
        if r["method"] == "ours target-only":
            assert r["predicted"] == 1.0 and r["draft_share"] == 0
            assert r["predicted_job"] is None  # it is the baseline
        else:
            assert r["predicted_job"] > 0

    # the measured costs behind the engine's choices come with the table: 1-token target
    # passes at batch 1 and 2 (1 and 2 tokens processed) and the target's prefill rate
    costs = report["costs"]
    assert set(costs) == {"none", "draft_model", "prompt_lookup", "auto"}
    for profile in costs.values():
        assert {"1", "2"} <= set(profile["target_pass_seconds"])
        assert profile["prefill_seconds_per_token"]["target"] > 0
    assert "measured by the auto engine, seconds: target pass by tokens 1: " in result.output


def test_the_job_prediction_speeds_up_only_the_decoding_and_adds_the_prefills_back():
    # target-only: 10 s, of which 2 s prefill; speculative: the same prefill plus 1 s of draft
    # prefill, and decoding predicted 2x faster: 2 + 1 + 8 / 2 = 7 s, so 10 / 7
    base = {"wall_seconds": 10.0, "prefill_seconds": 2.0, "draft_prefill_seconds": 0.0}
    spec = {"wall_seconds": 6.5, "prefill_seconds": 2.0, "draft_prefill_seconds": 1.0}
    assert abs(job_prediction(spec, base, 2.0) - 10 / 7) < 1e-12
    assert job_prediction(spec, {}, 2.0) is None and job_prediction(spec, base, None) is None
