"""README keeps step with the code: its example output has the shape the demo prints today, its
speed tables are the ones their reports render, and it stays short enough to read."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from pipeline.job.speedup import FASTER, NO_DIFFERENCE, SLOWER
from pipeline.report.results import load_stats, print_shard_table

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the stats files of a real demo run (2026-11-27, AVX2-only AMD EPYC, float32): what
# `pipeline run jobs/demo.yaml` prints its table from
DEMO_RUN = Path(__file__).parent / "data" / "demo-run"
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_VERDICT = re.compile("|".join(re.escape(v) for v in (NO_DIFFERENCE, FASTER, SLOWER)))


def readme_example_output() -> list[str]:
    """The fenced block in README that begins with the shard table's header."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)
    tables = [b for b in blocks if b.startswith("shard ")]
    assert len(tables) == 1, "README should show the demo's shard table once"
    return tables[0].splitlines()


def printed_table(capsys) -> list[str]:
    capsys.readouterr()
    assert print_shard_table(load_stats(str(DEMO_RUN)))
    return capsys.readouterr().out.splitlines()


def line_kinds(lines: list[str]) -> list[str]:
    """Each line with its figures and verdicts masked and its spacing collapsed, consecutive
    repeats merged: a shard table's shape, whatever its figures and its number of shards."""
    kinds: list[str] = []
    for line in lines:
        kind = " ".join(_VERDICT.sub("VERDICT", _NUMBER.sub("N", line)).split())
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    return kinds


def test_readme_example_output_has_the_printed_columns(capsys):
    printed, shown = printed_table(capsys), readme_example_output()
    assert shown[0].split() == printed[0].split(), "README's header differs from the printer's: update README"


def test_readme_example_output_has_the_printed_lines_in_order(capsys):
    printed, shown = printed_table(capsys), readme_example_output()
    assert line_kinds(shown) == line_kinds(printed), (
        "README's example output has other lines than `pipeline run` prints: paste a fresh demo's table"
    )


def test_line_kinds_tell_a_new_column_and_a_missing_line():
    table = ["shard rows alpha", "part-00000 2 0.36", "part-00001 2 0.33", "TOTAL 4 0.35", "check: 16/16"]
    assert line_kinds(table) == ["shard rows alpha", "part-N N N", "TOTAL N N", "check: N/N"]
    assert line_kinds([*table[:3], "TOTAL 4 0.35 0.40", table[4]]) != line_kinds(table)
    assert line_kinds(table[:4]) != line_kinds(table)


def test_readme_speed_tables_match_their_reports():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "readme_tables.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr


def _check_edited(tmp_path: Path, edited: str) -> subprocess.CompletedProcess:
    """`readme_tables.py --check` on an edited copy of the README (which must differ)."""
    assert edited != README.read_text(encoding="utf-8")
    (tmp_path / "README.md").write_text(edited, encoding="utf-8")
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "readme_tables.py"), "--check", "--readme", "README.md"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )


def test_readme_tables_check_fails_on_an_edited_figure(tmp_path: Path):
    result = _check_edited(tmp_path, README.read_text(encoding="utf-8").replace("| 1.00× |", "| 1.01× |", 1))
    assert result.returncode == 1 and "stale tables" in result.stderr


def test_readme_is_short():
    assert len(README.read_bytes()) <= 15 * 1024, "README over 15 KiB: move detail to docs/"


def test_readme_llama_cpp_sentence_check_fails_on_an_edited_ratio(tmp_path: Path):
    text = README.read_text(encoding="utf-8")
    edited = re.sub(r"(<!-- figure:llama-cpp -->[^<]*?)\d\.\d\d×", r"\g<1>9.99×", text, count=1)
    result = _check_edited(tmp_path, edited)
    assert result.returncode == 1 and "llama-cpp" in result.stderr


def test_the_llama_cpp_sentence_says_where_auto_stands_per_task():
    """Ahead from 1.1x, behind under 0.9x, level between, named per task where they differ: a
    1.05x run is not called ahead."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from readme_tables import _standing
    finally:
        sys.path.remove(str(ROOT / "scripts"))

    def rows(summaries: float, translations: float) -> dict:
        return {
            ("summarize", "ours auto"): {"vs_llama_cpp": summaries},
            ("translate", "ours auto"): {"vs_llama_cpp": translations},
        }

    tasks = ["summarize", "translate"]
    assert _standing(rows(1.35, 1.05), tasks) == "ahead on summaries and level on translations"
    assert _standing(rows(0.89, 0.75), tasks) == "behind on both tasks"
    assert _standing(rows(1.1, 1.2), tasks) == "ahead on both tasks"
    assert _standing(rows(0.9, 1.09), tasks) == "level on both tasks"
    assert (
        _standing({("summarize", "ours auto"): {"vs_llama_cpp": 1.2}}, ["summarize"]) == "ahead on summaries"
    )
