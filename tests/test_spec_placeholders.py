"""Placeholders in drafter.suffix_warm_start: a nightly job warm-starts from the night before's
output, so {date}, {date-1} and {name} are filled as in the output URL, and any other is refused."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from pipeline.spec import SpecError, load_spec

ROOT = Path(__file__).resolve().parents[1]

NIGHTLY = """\
name: nightly
input:
  url: s3://corpus/docs/{date}/
task:
  kind: translate
  source_language: English
  target_language: French
models:
  pair: tiny
drafter:
  suffix_warm_start: WARM
output:
  url: s3://results/{name}/{date}/nightly-{date}/
"""


def load_with_warm_start(tmp_path: Path, warm: str, **context):
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(NIGHTLY).replace("WARM", warm), encoding="utf-8")
    return load_spec(path, **context)


def test_warm_start_filled_with_the_night_before(tmp_path: Path):
    spec = load_with_warm_start(
        tmp_path, "s3://results/{name}/{date-1}/nightly-{date-1}/", run_id="r1", date="2026-03-01"
    )
    # across a month's end, and the same layout as the night before's output.url
    assert spec.drafter.suffix_warm_start == "s3://results/nightly/2026-02-28/nightly-2026-02-28/"
    assert spec.output.url == "s3://results/nightly/2026-03-01/nightly-2026-03-01/"


def test_warm_start_date_is_the_runs_date(tmp_path: Path):
    spec = load_with_warm_start(tmp_path, "s3://results/{name}/{date}/", date="2026-01-01")
    assert spec.drafter.suffix_warm_start == "s3://results/nightly/2026-01-01/"
    spec = load_with_warm_start(tmp_path, "s3://results/{date-1}/", date="2026-01-01")
    assert spec.drafter.suffix_warm_start == "s3://results/2025-12-31/"


@pytest.mark.parametrize(
    ("warm", "message"),
    [
        ("s3://results/{run_id}/", "unknown placeholder {run_id} (supported: {date}, {date-1}, {name})"),
        ("s3://results/{date-2}/", "unknown placeholder {date-2}"),
        ("s3://results/{yesterday}/", "unknown placeholder {yesterday}"),
    ],
)
def test_unknown_warm_start_placeholder_refused(tmp_path: Path, warm: str, message: str):
    with pytest.raises(SpecError) as info:
        load_with_warm_start(tmp_path, warm, date="2026-03-01")
    lines = info.value.errors
    assert any(line.startswith("drafter.suffix_warm_start: ") and message in line for line in lines)


def test_shipped_nightly_translation_warm_starts_from_the_night_before():
    spec = load_spec(ROOT / "jobs" / "translate.yaml", run_id="nightly-2026-11-22", date="2026-11-22")
    assert spec.drafter.suffix_warm_start == (
        "s3://example-results/translate-en-fr-nightly/2026-11-21/nightly-2026-11-21/"
    )
    assert spec.output.url == "s3://example-results/translate-en-fr-nightly/2026-11-22/nightly-2026-11-22/"
    assert spec.drafter.draft_vocab == 0  # French output: the whole vocabulary
