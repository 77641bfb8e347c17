"""scripts/gpu_acceptance.py reads issue 37's lines off a GPU check's reports: each figure
beside its bar, a line without its report named missing."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("gpu_acceptance", ROOT / "scripts" / "gpu_acceptance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench(batch: int, methods: dict[str, tuple[float, float]]) -> dict:
    return {
        "meta": {"machine": {"gpu": "NVIDIA H200", "git_commit": "abc1234"}},
        "rows": [
            {"method": m, "batch": batch, "tokens_per_second": rate, "speedup": speedup, "identical": True}
            for m, (rate, speedup) in methods.items()
        ],
    }


def _write(directory: Path, name: str, record: dict) -> None:
    (directory / name).write_text(json.dumps(record))


def test_each_line_beside_its_bar(tmp_path):
    pair, machine = "qwen2.5-coder-shaped-random", {"gpu": "NVIDIA H200", "git_commit": "abc1234"}
    passes = {"1": {"1": 0.0011, "8": 0.00118, "16": 0.0012}}
    _write(
        tmp_path,
        f"2026-12-06-calibrate-h200-bf16-{pair}-batch1.json",
        {
            "machine": machine,
            "target_pass_seconds_by_batch": passes,
            "draft_step_seconds_by_batch": {"1": {"1": 0.0006}},
            "bandwidth_gb_s": {"target": 2800.0},
            "read_bandwidth_gb_s": 4200.0,
        },
    )
    # an older report of the same name is passed over for the newest
    _write(tmp_path, f"2026-12-04-calibrate-h200-bf16-{pair}-batch1.json", {"machine": machine})
    _write(
        tmp_path,
        f"2026-12-06-calibrate-h200-bf16-{pair}-stock-kernels.json",
        {"machine": machine, "target_pass_seconds_by_batch": {"1": {"1": 0.001}}},
    )
    _write(
        tmp_path,
        f"2026-12-06-bench-h200-bf16-{pair}-batch1.json",
        _bench(1, {"ours target-only": (700.0, 1.0)}),
    )
    _write(
        tmp_path,
        f"2026-12-06-bench-h200-bf16-{pair}-batch64.json",
        _bench(64, {"ours target-only": (14000.0, 1.0)}),
    )
    smol64 = {
        "ours target-only": (9000.0, 1.0),
        "ours prompt_lookup": (9900.0, 1.1),
        "ours auto": (11700.0, 1.3),
    }
    _write(tmp_path, "2026-12-06-bench-h200-bf16-smollm2-licenses-batch64.json", _bench(64, smol64))
    lines = _script().check(tmp_path)
    assert lines[0] == f"issue 37 from {tmp_path}: NVIDIA H200, commit abc1234"
    assert lines[1:] == [
        f"holds    {pair}, batch 1, target-only: 700 tok/s (bar: >= 600)",
        "holds    bandwidth of a width-1 target pass: 2,800 GB/s, 67% of the 4,200 GB/s a large read "
        "reaches (bar: >= 40% of the card's; here of the read, below its rated figure)",
        "holds    target pass at widths 1, 8, 16, batch 1: w=1 1.10 ms, w=8 1.18 ms, w=16 1.20 ms: "
        "1.09x apart (bar: <= 1.15x)",
        "FAILS    draft step / target pass: 0.55 (bar: <= 0.4)",
        "holds    price of exactness (invariant / stock, width 1): 1.10x (bar: <= 1.2x)",
        f"FAILS    {pair}, batch 64, target-only: 14,000 tok/s (bar: >= 15,000)",
        "missing  SmolLM2 batch 1: ours prompt lookup / HF's (k=3): no report (bar: >= 3x)",
        "holds    SmolLM2 batch 64: every drafter / target-only, auto: prompt_lookup 1.10x, auto 1.30x "
        "(bar: >= 0.97x each, auto >= 1.2x)",
        "holds    speculative outputs identical to our target-only: 5/5 rows (bar: all)",
        "missing  a pipeline run job on a GPU actor: no report (bar: succeeds, names the GPU)",
    ]
