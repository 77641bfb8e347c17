"""`pipeline report` on a real job's output, rendered in a real headless Chromium.

The job runs the tiny pair on a local Ray over a corpus with a reference column, a bad row and
an unreadable shard, so every figure (errors and quality included) has something to draw.
"""

from __future__ import annotations

import os
import shutil

import pyarrow as pa
import pytest
from click.testing import CliRunner
from pipeline_helpers import DOCS, job_dict

from pipeline.cli import main
from pipeline.job.executor import run_job
from pipeline.report.quality import score
from pipeline.spec import spec_from_dict
from pipeline.storage import Storage

ALL_FIGURES = [
    "acceptance",
    "acceptance_by_position",
    "speedup",
    "row_alpha",
    "throughput",
    "gamma",
    "errors",
    "quality",
]
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def job_output(tiny_pair_dirs, tmp_path_factory, ray_local) -> str:
    root = tmp_path_factory.mktemp("report")
    source = Storage(str(root / "in"))
    for i in range(2):
        docs = DOCS[3 * i : 3 * i + 3]
        source.write_parquet(
            f"part-{i}.parquet",
            pa.table({"id": [f"d{i}{j}" for j in range(len(docs))], "text": docs, "reference": docs}),
        )
    source.write_parquet("part-2.parquet", pa.table({"id": ["e0"], "text": [" "], "reference": ["x"]}))
    source.write_bytes("part-3.parquet", b"PAR1 not parquet")
    data = job_dict(tiny_pair_dirs, str(root / "in"), str(root / "out"))
    data["input"]["keep_columns"] = ["reference"]
    assert run_job(spec_from_dict(data), progress=False).ok
    return str(root / "out")


def render(page_url: str, screenshot: str) -> dict:
    """Open the page in headless Chromium and read back what a reader would see."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        chromium = None
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install Chromium (apt-get install chromium) and playwright")
        pytest.skip("needs Chromium (apt-get install chromium) and playwright")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        page.goto(page_url)
        seen = page.evaluate(
            """() => ({
                images: Array.from(document.images).map(i => ({
                    src: i.getAttribute('src'), loaded: i.complete && i.naturalWidth > 0,
                    width: i.naturalWidth, height: i.naturalHeight})),
                figures: Array.from(document.querySelectorAll('figure')).map(f => f.id),
                headings: Array.from(document.querySelectorAll('h2')).map(h => h.textContent),
                text: document.body.innerText,
            })"""
        )
        page.screenshot(path=screenshot, full_page=True)
        browser.close()
    return seen


def test_report_renders_every_figure_in_a_browser(job_output, tmp_path):
    result = CliRunner().invoke(main, ["report", job_output, "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    assert f"({len(ALL_FIGURES)} figures: {', '.join(ALL_FIGURES)})" in result.output

    seen = render((tmp_path / "rep" / "report.html").as_uri(), str(tmp_path / "shot.png"))
    assert seen["figures"] == [f"fig-{name}" for name in ALL_FIGURES]
    assert [i["src"] for i in seen["images"]] == [f"figures/{name}.png" for name in ALL_FIGURES]
    for image in seen["images"]:
        assert image["loaded"] and image["width"] >= 600 and image["height"] >= 200, image
    assert seen["headings"] == ["Summary", "Figures", "Shards", "Errors", "Quality against references"]
    text = seen["text"]
    assert "complete" in text and "rows in / out / error\t7 / 6 / 1" in text
    for reason in ("empty_text", "unreadable_shard"):
        assert reason in text
    assert "ROUGE-L" in text and "rows scored\t6" in text
    assert (tmp_path / "shot.png").stat().st_size > 10_000


def test_report_defaults_next_to_results_and_explains_missing_references(job_output):
    result = CliRunner().invoke(main, ["report", job_output, "--reference-column", "summary"])
    assert result.exit_code == 0, result.output
    page = Storage(job_output).read_bytes("report/report.html").decode()
    assert "No reference column in the outputs" in page
    assert 'id="fig-quality"' not in page and 'id="fig-errors"' in page
    assert Storage(job_output).exists("report/figures/acceptance.png")


def test_report_without_stats_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == 1
    assert "no stats under" in result.output and "Traceback" not in result.output


def test_quality_scores_are_the_standard_metrics():
    same = score("summarize", ["the cat sat on the mat"], ["the cat sat on the mat"])
    assert same.metrics == {"ROUGE-1": 100.0, "ROUGE-2": 100.0, "ROUGE-L": 100.0}
    partial = score("summarize", ["the cat sat"], ["the cat sat on the mat"])
    assert partial.metrics["ROUGE-1"] == pytest.approx(100 * 2 * 1.0 * 0.5 / 1.5)
    translation = score("translate", ["le chat est noir", "bonjour"], ["le chat est noir", "salut"])
    assert set(translation.metrics) == {"chrF", "BLEU"} and 0 < translation.metrics["chrF"] < 100
    assert translation.per_row[0] == pytest.approx(100.0) and translation.rows == 2
    assert "chrF nrefs:1" in translation.signature and "tok:13a" in translation.signature
    with pytest.raises(ValueError, match="no row has a non-empty reference"):
        score("translate", ["x"], [""])


def test_the_shard_table_says_where_the_models_ran():
    from pipeline.report.results import _where_line

    gpu = {"device": "cuda", "gpu": "NVIDIA H200", "dtype": "bfloat16", "static_passes": True}
    cpu = {"device": "cpu", "gpu": None, "dtype": "float32", "static_passes": False}
    stats = [{"models": {**gpu, "compiled_passes": True}}, {"models": {**gpu, "compiled_passes": True}}]
    assert _where_line(stats) == "models on cuda (NVIDIA H200), bfloat16, compiled static passes"
    assert _where_line([*stats, {"models": cpu}]).endswith("; cpu, float32")  # actors on two kinds
    assert _where_line([{"status": "failed"}]) is None  # nothing decoded yet
