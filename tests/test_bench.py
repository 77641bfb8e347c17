"""`pipeline bench` end to end on the tiny pair: every configuration runs, every output is checked
against HF target-only greedy, and the JSON carries the columns the table prints.

Timings of tiny models mean nothing; this proves the harness, not a speedup.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from click.testing import CliRunner
from pipeline_helpers import write_models_config

from pipeline.cli import main
from pipeline.decode.stats import BatchStats
from pipeline.lab.bench import (
    HEADER,
    Benchmark,
    Row,
    describe_gpu_memory,
    job_prediction,
    markdown_table,
    write_report,
)
from pipeline.machine import describe_machine
from pipeline.models.loading import resolve_dtype


def test_bench_runs_every_configuration_and_checks_outputs(tiny_pair_dirs, tmp_path, monkeypatch):
    config = write_models_config(tmp_path / "cfg", tiny=tiny_pair_dirs)
    monkeypatch.setenv("PIPELINE_CONFIG_DIR", config)
    markdown = tmp_path / "docs" / "benchmarks" / "tiny-run.md"
    args = ["bench", "--pair", "tiny", "--docs", "2", "--batches", "1,2", "--runs", "2"]
    args += ["--max-new-tokens", "6", "--hf-assistant-tokens", "2", "--hf-lookup-tokens", "2"]
    args += ["--threads", "1", "--warm-docs", "2", "--report", str(markdown)]
    args += ["--drafters", "draft_model,prompt_lookup,auto,auto:draft_model+prompt_lookup"]
    monkeypatch.setattr("sys.argv", ["/venv/bin/pipeline", *args])
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert HEADER in result.output

    # without --out the JSON goes beside the Markdown report, which names it and the command
    report = json.loads(markdown.with_suffix(".json").read_text())
    text = markdown.read_text()
    assert "[tiny-run.json](tiny-run.json)" in text
    assert "```bash\npipeline bench --pair tiny --docs 2 --batches 1,2 --runs 2 --max-new-tokens 6" in text
    assert text.count("| ours auto | 2 | ") == 2  # a table per task, every configuration in it
    # --dtype auto: float32 on an AVX2 CPU, bfloat16 where the CPU has bf16 instructions
    auto_dtype = str(resolve_dtype("auto", "cpu")).removeprefix("torch.")
    assert report["meta"]["machine"]["threads"] == 1 and report["meta"]["machine"]["dtype"] == auto_dtype
    assert report["meta"]["runs"] == 2 and report["meta"]["docs"] == 2
    rows = report["rows"]
    # auto also runs warm: its suffix corpus holds our outputs of 2 other documents; auto
    # without suffix does not
    ours = ["ours target-only", "ours draft_model", "ours prompt_lookup", "ours auto", "ours auto warm"]
    ours += ["ours auto:draft_model+prompt_lookup"]
    # on CPU the draft's steps run on int8 weights; HF's assisted generation runs with the draft
    # as loaded and with those
    hf = ["hf target-only", "hf assisted k=2", "hf assisted k=2 int8", "hf prompt lookup k=2"]
    for task in ("summarize", "translate"):
        got = {(r["method"], r["batch"]) for r in rows if r["task"] == task}
        assert got == {(m, 1) for m in hf} | {(m, b) for m in ours for b in (1, 2)}
    for r in rows:
        assert r["identical"], r  # lossless: every configuration reproduces its own target-only
        assert isinstance(r["identical_to_hf"], bool)  # reported; other kernels may round a near-tie
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
    assert set(costs) == {"none", "draft_model", "prompt_lookup", "auto", "auto:draft_model+prompt_lookup"}
    for profile in costs.values():
        assert {"1", "2"} <= set(profile["target_pass_seconds"])
        assert profile["prefill_seconds_per_token"]["target"] > 0
    assert "measured by the auto engine, seconds: target pass by tokens 1: " in result.output


def test_the_job_prediction_speeds_up_only_the_decoding_and_adds_the_prefills_back():
    # target-only: 10 s, of which 2 s prefill; speculative: the same prefill plus 1 s of draft
    # prefill, and decoding predicted 2x faster: 2 + 1 + 8 / 2 = 7 s, so 10 / 7
    base = BatchStats(wall_seconds=10.0, prefill_seconds=2.0, draft_prefill_seconds=0.0)
    spec = BatchStats(wall_seconds=6.5, prefill_seconds=2.0, draft_prefill_seconds=1.0)
    assert abs(job_prediction(spec, base, 2.0) - 10 / 7) < 1e-12
    assert job_prediction(spec, None, 2.0) is None and job_prediction(spec, base, None) is None
    assert job_prediction(spec, BatchStats(), 2.0) is None  # a baseline that measured nothing


def _row(task: str, method: str, batch: int, speedup: float, alpha: float | None) -> Row:
    return Row(
        task=task,
        method=method,
        batch=batch,
        tokens_per_second=12.345,
        speedup=speedup,
        predicted=None if alpha is None else 1.5,
        predicted_job=None,
        alpha=alpha,
        tau=None if alpha is None else 2.25,
        mean_gamma=None if alpha is None else 3.0,
        target_passes_per_token=0.5,
        identical=alpha is None or alpha > 0.5,
        identical_to_hf=alpha is None,
        seconds_median=2.0,
        seconds_runs=[2.0, 2.1],
        target_share=0.6,
        prefill_share=0.25,
        draft_share=0.3,
        other_share=0.1,
        asking_share=0.04,
        asking_ms=0.52,
        tokens=24,
        peak_rss_mb=512.0,
    )


def test_the_gpu_memory_line_names_the_benchs_peak_beside_the_cards_memory(monkeypatch):
    rows = [_row("translate", "ours target-only", 1, 1.0, None), _row("translate", "ours auto", 1, 1.2, 0.7)]
    assert describe_gpu_memory(rows) is None  # no GPU: no line
    rows[0].peak_gpu_mb, rows[1].peak_gpu_mb = 5_000.0, 26_747.4
    card = SimpleNamespace(total_memory=140 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: card)
    assert describe_gpu_memory(rows) == "GPU memory allocated at most 26,747 MB of the card's 143,360 MB"


def test_the_report_records_command_machine_pair_settings_and_a_table_per_task(tmp_path):
    rows = [
        _row("summarize", "ours target-only", 1, 1.0, None),
        _row("summarize", "ours auto", 1, 1.6, 0.7),
        _row("translate", "ours auto", 4, 0.9, 0.4),
    ]
    assert markdown_table(rows[:2]).splitlines() == [
        "| method | batch | tok/s | speedup | pred | job | alpha | tau | gamma | pass/tok | tgt% | pre% "
        "| dft% | oth% | ask% | ask ms | same | =hf | agree | vs llama | rss MB |",
        "| --- |" + " ---: |" * 20,
        "| ours target-only | 1 | 12.35 | 1.00x | - | - | - | - | - | 0.50 | 60 | 25 | 30 | 10 | 4 | 0.52 "
        "| yes | yes | - | - | 512 |",
        "| ours auto | 1 | 12.35 | 1.60x | 1.50x | - | 0.70 | 2.25 | 3.0 | 0.50 | 60 | 25 | 30 | 10 | 4 "
        "| 0.52 | yes | no | - | - | 512 |",
    ]
    costs = {"target_pass_seconds": {1: 0.25}, "draft_pass_seconds": {1: 0.05}}
    costs["prefill_seconds_per_token"] = {}
    machine = {**describe_machine(), "dtype": "bfloat16", "device": "cpu"}
    machine["kernels"] = {"batch_invariant": True}
    meta = {
        "pair": "qwen2.5-coder",
        "models": {
            "target": {"id": "Qwen2.5-Coder-1.5B", "revision": "sha256:abc"},
            "draft": {"id": "Qwen2.5-Coder-0.5B", "revision": None},
        },
        "machine": machine,
        "command": "pipeline bench --docs 2 --report 'docs/benchmarks/a b.md'",
        "date": "2026-11-26 09:00 UTC",
        "tasks": ["summarize", "translate"],
        "batches": [1, 4],
        "runs": 3,
    }
    path = tmp_path / "report.md"
    write_report(str(path), Benchmark(rows, {"auto": costs}), meta, str(tmp_path / "data" / "report.json"))
    text = path.read_text()

    assert text.startswith("# Benchmark: qwen2.5-coder, summarize, translate, batch 1, 4\n")
    assert "Run 2026-11-26 09:00 UTC. Measurements: [report.json](data/report.json)." in text
    assert "```bash\npipeline bench --docs 2 --report 'docs/benchmarks/a b.md'\n```" in text
    for name, value in [
        ("CPU", machine["cpu_model"]),
        ("cores, threads", f"{machine['cores']}, {machine['threads']}"),
        ("dtype, device", "bfloat16, cpu"),
        ("kernels", "batch_invariant yes"),
        ("torch, transformers", f"{machine['torch']}, {machine['transformers']}"),
    ]:
        assert f"| {name} | {value} |" in text
    flags = "avx2 {}, avx512f {}, avx512_bf16 {}, amx_bf16 {}, fma {}".format(
        *("yes" if has else "no" for has in machine["cpu_flags"].values())
    )
    assert f"| CPU flags | {flags} |" in text
    assert f"| spec-pipeline | {machine['package']}, commit {machine['git_commit']}" in text
    assert "target `Qwen2.5-Coder-1.5B` (revision `sha256:abc`), draft `Qwen2.5-Coder-0.5B`." in text
    assert "| runs | 3 |" in text and "| batches | 1, 4 |" in text and "| docs |" not in text
    summarize, translate = text.split("### summarize\n")[1].split("### translate\n")
    assert markdown_table(rows[:2]) in summarize and markdown_table(rows[2:]) in translate
    assert "Measured by the auto engine, seconds: target pass by tokens 1: 0.25; draft pass by tokens" in text


def test_a_copied_tree_names_its_commit_whatever_git_says(monkeypatch):
    """A GPU machine's copy of the checkout once carried a stale .git: the commit the tree was
    copied from, when given, is the one a report names, and its cleanliness is unknown."""
    from pipeline.machine import git_state, machine_table

    monkeypatch.setenv("PIPELINE_SOURCE_COMMIT", "0123abc")
    assert git_state() == ("0123abc", None)
    machine = {**describe_machine(), "dtype": "bfloat16", "device": "cuda"}
    assert any("commit 0123abc (a copied tree)" in line for line in machine_table(machine))


class _FakeLlamaCpp:
    """Stands in for `LlamaCpp` (llama-cpp-python is an optional extra): HF greedy decoding of
    the tiny target, its lookup rows one token short, so that agreement is visibly below 1."""

    version, lookup_tokens, build = "fake", 3, "AVX AVX2"

    def __init__(self, target, pad: int):
        self.target, self.pad = target, pad

    def generate(self, prompts, max_new, eos, lookup=False):
        from pipeline.lab.bench import hf_generate

        outputs, _ = hf_generate(self.target, prompts, max_new, eos, self.pad)
        return ([o[:-1] + [o[-1] + 1] if o else o for o in outputs] if lookup else outputs), {}


def test_a_record_names_the_switches_that_chose_its_kernels(monkeypatch):
    """A run with the AVX-512 kernels switched off, or another llama.cpp library, is rerun only
    with the same environment: the record's command line carries it."""
    from pipeline.lab.record import SWITCHES, command_line

    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("sys.argv", ["/venv/bin/pipeline", "bench", "--corpus", "licenses", "--tasks", "a b"])
    assert command_line() == "pipeline bench --corpus licenses --tasks 'a b'"
    monkeypatch.setenv("PIPELINE_KERNEL_AVX512", "0")
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", "/tmp/llama build/bin")
    monkeypatch.setenv("PIPELINE_UNRELATED", "1")
    assert command_line() == (
        "PIPELINE_KERNEL_AVX512=0 LLAMA_CPP_LIB_PATH='/tmp/llama build/bin' "
        "pipeline bench --corpus licenses --tasks 'a b'"
    )


def test_the_llama_cpp_build_is_named_by_its_vector_instructions():
    """A report says which kernels llama.cpp ran: a build for AVX2 alone (GGML_NATIVE=OFF,
    loaded through LLAMA_CPP_LIB_PATH) on an AVX-512 CPU is another comparison."""
    from pipeline.lab.bench import _vector_features

    native = "CPU : SSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | FMA = 1 | AVX512 = 1 | "
    native += "AVX512_BF16 = 1 | OPENMP = 1 | "
    assert _vector_features(native) == "AVX AVX_VNNI AVX2 AVX512 AVX512_BF16"
    assert _vector_features("CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 0 | REPACK = 1 | ") == "AVX AVX2"
    assert _vector_features("CPU : SSE3 = 1 | ") == "no AVX"


def test_llama_cpp_rows_and_every_rows_speed_against_them(tiny_pair_dirs):
    from pipeline.lab.bench import run_benchmark
    from pipeline.models.loading import ModelRef, load_pair

    loaded = load_pair(*(ModelRef(str(d)) for d in tiny_pair_dirs), dtype="float32", device="cpu")
    result = run_benchmark(
        loaded,
        tasks=("summarize",),
        docs=2,
        batches=(1,),
        max_new_tokens=6,
        runs=1,
        hf_assistant_tokens=(),
        hf_lookup_tokens=(),
        drafters=("prompt_lookup",),
        llama_cpp=_FakeLlamaCpp(loaded.target, 0),
        log=lambda line: None,
    )
    rows = {r.method: r for r in result.rows}
    assert {"llama.cpp target-only", "llama.cpp prompt lookup k=3"} <= set(rows)
    llama = rows["llama.cpp target-only"]
    assert llama.vs_llama_cpp == 1.0 and llama.speedup == 1.0
    for r in result.rows:
        assert abs(r.vs_llama_cpp - r.tokens_per_second / llama.tokens_per_second) < 1e-9
    assert rows["ours target-only"].agreement == 1.0 and rows["ours prompt_lookup"].agreement == 1.0
    assert rows["llama.cpp prompt lookup k=3"].agreement < 1.0  # its last token differs
    assert not rows["llama.cpp prompt lookup k=3"].identical  # against llama.cpp target-only
    assert "vs llama" in markdown_table(result.rows) and "| llama.cpp target-only | 1 |" in markdown_table(
        result.rows
    )


def test_agreement_is_the_share_of_tokens_before_the_first_difference():
    from pipeline.lab.bench import _agreement

    assert _agreement([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == 1.0
    assert _agreement([[1, 2, 9, 4], [5]], [[1, 2, 3, 4], [5, 6]]) == (0.5 + 0.5) / 2
    assert _agreement([[]], [[]]) == 0.0


def test_the_dense_reference_row_runs_at_every_batch_against_the_block_paths_target_only(tiny_pair_dirs):
    """`--dense-reference`: one more target-only row at every batch size, on another model of the
    target (here the tiny draft stands in for the dense weights, so that its outputs differ),
    timed and compared against ours target-only at the same batch size: `agree` is how far the
    two paths' outputs go together."""
    from pipeline.lab.bench import DENSE_ROW, run_benchmark
    from pipeline.models.loading import ModelRef, load_pair

    loaded = load_pair(*(ModelRef(str(d)) for d in tiny_pair_dirs), dtype="float32", device="cpu")
    result = run_benchmark(
        loaded,
        tasks=("summarize",),
        docs=2,
        batches=(1, 2),
        max_new_tokens=6,
        runs=1,
        hf_assistant_tokens=(),
        hf_lookup_tokens=(),
        drafters=(),
        dense_target=loaded.draft,
        hf=False,
        log=lambda line: None,
    )
    rows = {(r.method, r.batch): r for r in result.rows}
    assert set(rows) == {(method, b) for method in ("ours target-only", DENSE_ROW) for b in (1, 2)}
    for batch in (1, 2):
        dense, blocks = rows[(DENSE_ROW, batch)], rows[("ours target-only", batch)]
        assert not dense.identical and dense.agreement < 1.0 and blocks.agreement == 1.0
        assert abs(dense.speedup - blocks.seconds_median / dense.seconds_median) < 1e-9


def test_the_dense_reference_needs_a_target_on_gguf_blocks(tiny_pair_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_CONFIG_DIR", write_models_config(tmp_path / "cfg", tiny=tiny_pair_dirs))
    args = ["bench", "--pair", "tiny", "--docs", "1", "--batches", "1", "--runs", "1", "--no-hf"]
    args += ["--drafters", "", "--threads", "1", "--dense-reference", "--out", str(tmp_path / "b.json")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "--dense-reference compares the GGUF block path" in result.output


def test_more_documents_than_the_corpus_holds_is_said_before_the_models_load(tmp_path, monkeypatch):
    from pipeline.lab.bench import CORPORA

    available = len(CORPORA["docstrings"]())
    monkeypatch.setenv(
        "PIPELINE_CONFIG_DIR", write_models_config(tmp_path / "cfg", tiny=("/nowhere", "/nowhere"))
    )
    args = [
        "bench",
        "--pair",
        "tiny",
        "--docs",
        str(available + 1),
        "--no-hf",
        "--out",
        str(tmp_path / "b.json"),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and f"only {available} docstrings documents on this machine" in result.output
    assert "Traceback" not in result.output


def test_the_head_drafter_runs_with_a_saved_head_and_needs_one(tiny_pair_dirs, tmp_path, monkeypatch):
    """`--head DIR --drafters head`: a row drafting with a saved head (an untrained one here: the
    harness, not its acceptance), its outputs its target-only's; without --head, a usage error."""
    import torch

    from pipeline.decode.head import DraftHead
    from pipeline.models.loading import ModelRef, load_model

    monkeypatch.setenv("PIPELINE_CONFIG_DIR", write_models_config(tmp_path / "cfg", tiny=tiny_pair_dirs))
    dense = load_model(ModelRef(str(tiny_pair_dirs[0])), dtype=torch.float32, device="cpu")
    DraftHead.from_target(dense).save(tmp_path / "head")
    args = ["bench", "--pair", "tiny", "--docs", "2", "--batches", "1", "--runs", "1", "--no-hf"]
    args += ["--max-new-tokens", "6", "--threads", "1", "--dtype", "float32"]
    args += ["--drafters", "head,auto:prompt_lookup+suffix+head"]
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, [*args, "--out", str(out)])
    assert result.exit_code == 2 and "the head drafter needs --head DIR" in result.output
    result = CliRunner().invoke(main, [*args, "--head", str(tmp_path / "head"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["meta"]["head"] == str(tmp_path / "head")
    rows = {(r["task"], r["method"]): r for r in report["rows"]}
    for task in ("summarize", "translate"):  # and auto choosing among the head and the copies
        assert rows[(task, "ours head")]["identical"]
        assert rows[(task, "ours auto:prompt_lookup+suffix+head")]["identical"]
