"""`pipeline calibrate` on the tiny pair: every batch size and width is measured and reads back
from JSON as written, the predictions follow Leviathan's formula on the measured widths, and
the cache key changes with what a pass's cost depends on.

Timings of tiny models mean nothing; this proves the measurement's shape, not its numbers.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner
from pipeline_helpers import write_models_config

from pipeline import machine
from pipeline.cli import main
from pipeline.decode import calibration
from pipeline.decode.calibration import (
    CALIBRATION_FORMAT,
    best_gamma,
    cache_path,
    calibration_key,
    leviathan_speedup,
    load_cached,
    measure,
    predictions,
    save_cached,
)
from pipeline.machine import CPU_FLAGS
from pipeline.models import streamed as streamed_kernel
from pipeline.models.loading import ModelRef, load_pair


@pytest.fixture(scope="module")
def tiny_loaded(tiny_pair_dirs):
    torch.set_num_threads(1)
    target_dir, draft_dir = tiny_pair_dirs
    return load_pair(ModelRef(str(target_dir)), ModelRef(str(draft_dir)), dtype="float32", device="cpu")


def _check_grid(by_batch: dict, batches: list[str], widths: list[str]) -> None:
    assert list(by_batch) == batches
    for by_width in by_batch.values():
        assert list(by_width) == widths
        assert all(isinstance(s, float) and s > 0 for s in by_width.values())


def test_measure_times_every_batch_and_width_and_reads_back_from_json(tiny_loaded):
    result = measure(tiny_loaded, batches=(2,), widths=(1, 2, 4), context=16, runs=1, pair_name="tiny")
    assert json.loads(json.dumps(result)) == result  # string keys throughout: a cache reads back equal
    assert result["batches"] == [1, 2]  # batch 1 always: the headline costs are a lone row's
    assert result["widths"] == [1, 2, 4] and result["context"] == 16 and result["runs"] == 1
    _check_grid(result["target_pass_seconds_by_batch"], ["1", "2"], ["1", "2", "4"])
    _check_grid(result["draft_step_seconds_by_batch"], ["1", "2"], ["1", "2", "4"])
    assert result["target_pass_seconds"] == result["target_pass_seconds_by_batch"]["1"]
    assert all(result["prefill_seconds_per_token"][role] > 0 for role in ("target", "draft"))
    for by_alpha in [result["predicted_speedup"], *result["predicted_speedup_by_batch"].values()]:
        assert list(by_alpha) == ["0.6", "0.8"]
        for prediction in by_alpha.values():
            assert prediction["gamma"] in (1, 2, 3) and prediction["speedup"] > 0
    assert result["pair"] == {
        "name": "tiny",
        "target": tiny_loaded.target_id,
        "target_path": tiny_loaded.target_ref.path,
        "target_revision": None,
        "draft": tiny_loaded.draft_id,
        "draft_path": tiny_loaded.draft_ref.path,
        "draft_revision": None,
    }
    machine = result["machine"]
    assert set(machine["cpu_flags"]) == set(CPU_FLAGS) and machine["cpu_model"]
    assert machine["threads"] == 1 and machine["dtype"] == "float32" and machine["device"] == "cpu"
    streamed = streamed_kernel.library() is not None  # float32 on a CPU with AVX2 and a compiler
    assert machine["kernels"] == {
        "batch_invariant": streamed,
        "draft_int8": True,
        "streamed": streamed,
        "gguf_blocks": False,
        "block_activations": None,  # no block layers
        "block_prefill": None,
        "kernel_isa": streamed_kernel.instruction_set() if streamed else None,  # avx512 or avx2
        "static_passes": False,
        "compiled_passes": False,
        "fused_projections": False,
    }
    # what a pass reads, and how fast at width 1 (gpt-fast's "bandwidth achieved")
    assert result["weights"] == "dense" and set(result["weight_bytes"]) == {"target", "draft"}
    for role in ("target", "draft"):
        seconds = result[
            f"{role}_pass_seconds_by_batch" if role == "target" else "draft_step_seconds_by_batch"
        ]
        assert result["weight_bytes"][role] > 0
        assert result["bandwidth_gb_s"][role] == pytest.approx(
            result["weight_bytes"][role] / seconds["1"]["1"] / 1e9
        )
    assert machine["torch"] == torch.__version__ and machine["package"]
    assert "git_commit" in machine and "git_dirty" in machine


def test_measure_without_a_draft_predicts_nothing(tiny_loaded):
    target_only = dataclasses.replace(tiny_loaded, draft=None, draft_ref=None)
    result = measure(target_only, widths=(1, 2), context=8, runs=1)
    _check_grid(result["target_pass_seconds_by_batch"], ["1"], ["1", "2"])
    assert result["draft_step_seconds_by_batch"] is None and result["predicted_speedup"] is None
    assert result["prefill_seconds_per_token"]["draft"] is None


def test_leviathan_prediction_prices_each_gamma_at_its_own_pass_width():
    # 1-token pass 100 ms, 2 tokens 120 ms, 4 tokens 160 ms (3 tokens interpolated: 140 ms);
    # a draft step 20 ms; alpha 0.8:
    #   gamma 1: 1.8 tokens for 20 + 120 ms      -> 1.8 * 100 / 140  = 1.2857
    #   gamma 2: 2.44 tokens for 40 + 140 ms     -> 2.44 * 100 / 180 = 1.3556 (best)
    #   gamma 3: 2.952 tokens for 60 + 160 ms    -> 2.952 * 100 / 220 = 1.3418
    target = {1: 0.100, 2: 0.120, 4: 0.160}
    assert leviathan_speedup(0.8, 1, target, 0.02) == pytest.approx(1.8 * 0.1 / 0.14)
    assert leviathan_speedup(0.8, 3, target, 0.02) == pytest.approx(2.952 * 0.1 / 0.22)
    assert best_gamma(0.8, target, 0.02) == {"gamma": 2, "speedup": pytest.approx(2.44 * 0.1 / 0.18)}
    # at alpha 0.6 the second draft is worth less than its cost: 1.6 / 1.4 against 1.96 / 1.8
    assert best_gamma(0.6, target, 0.02) == {"gamma": 1, "speedup": pytest.approx(1.6 / 1.4)}
    # the same from the JSON form, keyed by strings
    by_alpha = predictions({"1": 0.100, "2": 0.120, "4": 0.160}, {"1": 0.02, "2": 0.03, "4": 0.05})
    assert by_alpha["0.8"]["gamma"] == 2 and by_alpha["0.6"]["gamma"] == 1


def test_the_cache_reads_back_what_was_saved_under_a_key_of_the_settings(tiny_loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    key = calibration_key(tiny_loaded, threads=1)
    assert load_cached(key) is None
    data = {"format": CALIBRATION_FORMAT, "target_pass_seconds": {"1": 0.25, "2": 0.5}}
    path = save_cached(key, data)
    assert path == cache_path(key) == tmp_path / "home" / "models" / "calibration" / f"{key}.json"
    assert load_cached(key) == data
    assert list(path.parent.iterdir()) == [path]  # no partial file left beside it
    save_cached(key, {**data, "format": CALIBRATION_FORMAT - 1})
    assert load_cached(key) is None  # another format's measurements are not used

    assert calibration_key(tiny_loaded, threads=1) == key
    static_path = dataclasses.replace(tiny_loaded, static_passes=True)
    compiled_path = dataclasses.replace(static_path, compiled_passes=True)
    others = [
        calibration_key(tiny_loaded, threads=2),
        calibration_key(dataclasses.replace(tiny_loaded, dtype=torch.bfloat16), threads=1),
        calibration_key(
            dataclasses.replace(tiny_loaded, batch_invariant=not tiny_loaded.batch_invariant), threads=1
        ),
        calibration_key(dataclasses.replace(tiny_loaded, draft_ref=ModelRef("/elsewhere")), threads=1),
        calibration_key(tiny_loaded, threads=1, draft_vocab=64),
        *(calibration_key(static, threads=1) for static in (static_path, compiled_path)),
        calibration_key(dataclasses.replace(tiny_loaded, fused_projections=("target",)), threads=1),
    ]
    assert len({key, *others}) == len(others) + 1


def test_pass_widths_are_timed_in_turn_so_a_drifting_machine_keeps_their_ratios():
    """A machine that slows down spell after spell (a neighbour starting work, over seconds:
    about one round of every width's pass) must not price the widths timed last as dearer: each
    round times every width once, so a width's median sits in the same spells as the others'
    and their ratios, what the policy prices verify tokens by, come out as the passes' own."""

    class DriftingLM:
        def __init__(self):
            self.forward_seconds, self.passes, self.prompt = 0.0, 0, 0

        def sync(self, rows):
            return [row[self.prompt :] for row in rows]

        def forward(self, unfed, widths):
            spell = self.passes // 3  # three passes a spell: one round of the widths below
            self.passes += 1
            self.forward_seconds += widths[0] * (1.0 + 0.5 * spell)

    lm = DriftingLM()
    tokens = calibration._SyntheticTokens(100)
    prompts = [tokens.ids(lm.prompt)]
    seconds = calibration._pass_seconds(lm, prompts, (1, 2, 4), 5, tokens)
    assert lm.passes == 3 * 6  # an untimed round, then 5
    ratios = [seconds[w] / seconds["1"] for w in ("2", "4")]
    assert ratios == pytest.approx([2.0, 4.0])


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: {family}
model\t\t: {model}
model name\t: AMD EPYC
flags\t\t: fpu avx2 fma

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 99
model\t\t: 99
model name\t: other
"""


@pytest.mark.parametrize(
    "family, model, named",
    [
        (23, 1, "Zen"),
        (23, 49, "Zen 2"),
        (25, 1, "Zen 3"),
        (25, 17, "Zen 4"),
        (25, 0x61, "Zen 4"),
        (25, 0xA0, "Zen 4"),
    ]
    + [(25, 0x21, "Zen 3"), (26, 2, "Zen 5")],
)
def test_a_cpu_is_named_by_its_family_and_model(family, model, named):
    """Virtual machines show AMD's cores as "AMD EPYC" alone, and two such hosts with the same
    flags can be generations apart: the first processor's family and model name them."""
    name, flags = machine.parse_cpuinfo(CPUINFO.format(family=family, model=model))
    assert name == f"AMD EPYC ({named}, family {family} model {model})"
    assert flags == {"fpu", "avx2", "fma"}


def test_a_cpu_without_a_known_core_keeps_its_numbers_or_its_name():
    intel = "vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
    intel += "model name\t: Intel Xeon\nflags\t: avx2\n"
    assert machine.parse_cpuinfo(intel) == ("Intel Xeon (family 6 model 143)", {"avx2"})
    assert machine.parse_cpuinfo("model name\t: Some CPU\nflags\t: sse2\n") == ("Some CPU", {"sse2"})


def test_a_calibration_measured_on_one_cpu_generation_is_not_applied_on_another(tiny_loaded, monkeypatch):
    keys = set()
    for number in (1, 49):
        info = machine.parse_cpuinfo(CPUINFO.format(family=23, model=number))
        monkeypatch.setattr("pipeline.decode.calibration.cpu_info", lambda info=info: info)
        keys.add(calibration_key(tiny_loaded, threads=1))
    assert len(keys) == 2


def test_calibrate_command_prints_json_and_caches_it(tiny_pair_dirs, tmp_path, monkeypatch):
    config = write_models_config(tmp_path / "cfg", tiny=tiny_pair_dirs)
    monkeypatch.setenv("PIPELINE_CONFIG_DIR", config)
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    out = tmp_path / "calibration.json"
    args = ["calibrate", "--pair", "tiny", "--batch", "1,2", "--widths", "1,2,3", "--context", "12"]
    args += ["--runs", "1", "--threads", "1", "--json", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output

    printed = json.loads(result.stdout)
    assert json.loads(out.read_text()) == printed
    assert printed["pair"]["name"] == "tiny" and printed["machine"]["threads"] == 1
    _check_grid(printed["target_pass_seconds_by_batch"], ["1", "2"], ["1", "2", "3"])
    _check_grid(printed["draft_step_seconds_by_batch"], ["1", "2"], ["1", "2", "3"])
    assert load_cached(printed["key"]) == printed  # an actor on this machine can reuse it

    report = tmp_path / "docs" / "calibrate-tiny.md"
    args = ["calibrate", "--pair", "tiny", "--batch", "1", "--widths", "1,2", "--context", "12"]
    args += ["--runs", "1", "--head", "--head-vocab", "40", "--report", str(report)]
    monkeypatch.setattr("sys.argv", ["pipeline", *args])  # the command the report records
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    text = report.read_text()
    written = json.loads((tmp_path / "docs" / "calibrate-tiny.json").read_text())  # beside the report
    assert "pipeline calibrate --pair tiny" in text and "[calibrate-tiny.json](calibrate-tiny.json)" in text
    assert "| CPU flags | avx2 " in text and "target pass" in text and written["pair"]["name"] == "tiny"
    head = written["head"]  # a draft head's step beside the target's pass (--head)
    assert head["step_seconds"] > 0 and head["parameters"] > 0 and head["context"] == 12
    assert head["vocab_rows"] == 40  # --head-vocab: the output layer's rows, as a distilled head has
    width_one = written["target_pass_seconds_by_batch"]["1"]["1"]
    assert head["share_of_target_pass"] == head["step_seconds"] / width_one
    assert "draft head step" in text and "of a width-1 target pass" in text
    assert "head" not in printed  # only when asked
    # how far from the limit: the pass's bandwidth beside the memory's own pace, measured here
    roof = written["read_bandwidth_gb_s"]
    share = written["bandwidth_gb_s"]["target"] / roof
    assert roof > 0.5 and f"reading far more than the caches hold: {roof:.1f} GB/s" in text
    assert f"reads its weights at {share:.0%} of it" in text

    bad = CliRunner().invoke(main, ["calibrate", "--pair", "tiny", "--widths", "2,4"])
    assert bad.exit_code == 2 and "widths must include 1" in bad.output


def test_calibrate_against_other_weights_alternates_and_prints_the_ratio(
    tiny_pair_dirs, tmp_path, monkeypatch
):
    config = write_models_config(tmp_path / "cfg", tiny=tiny_pair_dirs)
    monkeypatch.setenv("PIPELINE_CONFIG_DIR", config)
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    out = tmp_path / "against.json"
    args = [
        "calibrate",
        "--pair",
        "tiny",
        "--batch",
        "1",
        "--widths",
        "1,2",
        "--context",
        "12",
        "--threads",
        "1",
    ]
    args += ["--weights", "dense", "--against", "dense", "--runs", "2", "--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    against = record["against"]
    assert against["weights"] == "dense" and against["weight_bytes"] > 0 and against["bandwidth_gb_s"] > 0
    _check_grid(against["target_pass_seconds_by_batch"], ["1"], ["1", "2"])
    for width, ratio in against["target_pass_ratio_by_batch"]["1"].items():
        mine = record["target_pass_seconds_by_batch"]["1"][width]
        assert ratio == pytest.approx(mine / against["target_pass_seconds_by_batch"]["1"][width])
    assert against["prefill_ratio"] > 0 and record["runs"] == 2
    assert "ours / dense" in result.output and "target (dense)" in result.output
