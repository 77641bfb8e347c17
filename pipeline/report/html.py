"""`pipeline report`: one HTML page and its PNG figures from what a job wrote.

The report is built only from the job's own output (stats, manifest, per-row records), so it
can be made any time later, on any machine that can read the bucket, and re-made while a job
is still running. It is written next to the results (OUTPUT/report/ by default) as plain
files, a page plus figures/*.png, so it opens from a laptop, a static bucket website or a
CI artifact alike.
"""

from __future__ import annotations

import datetime as dt

import jinja2

from pipeline.job.layout import REPORT_DIR
from pipeline.job.speedup import verdict
from pipeline.report.figures import RUN_FIGURES, Figure, error_counts
from pipeline.report.figures import quality as quality_figure
from pipeline.report.quality import QualityScores, score
from pipeline.report.results import RunData, load_run
from pipeline.storage import Storage


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("pipeline", "templates"),
        autoescape=jinja2.select_autoescape(["html", "j2"]),
        undefined=jinja2.StrictUndefined,
    )


def quality_scores(run: RunData) -> tuple[QualityScores | None, str]:
    """Scores against the reference column, or None and the reason there are none."""
    if run.reference_column is None:
        return None, (
            "No reference column in the outputs. To score quality, keep one from the input "
            "(input.keep_columns: [reference]) and pass --reference-column if it has another name."
        )
    if "generated" not in run.rows.column_names or run.rows.num_rows == 0:
        return None, "No output rows to score."
    try:
        scores = score(
            run.task_kind or "custom",
            run.rows.column("generated").to_pylist(),
            [str(r) if r is not None else "" for r in run.rows.column(run.reference_column).to_pylist()],
        )
    except ValueError as exc:
        return None, f"Quality not scored: {exc}."
    return scores, ""


def _when(timestamp: float | None) -> str:
    if not timestamp:
        return "-"
    return dt.datetime.fromtimestamp(timestamp, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def write_report(
    output_url: str,
    report_url: str | None = None,
    storage_options: dict | None = None,
    reference_column: str = "reference",
) -> tuple[str, list[Figure]]:
    """Write report.html and figures/*.png; returns the page's URL and the figures drawn."""
    run = load_run(output_url, storage_options, reference_column)
    if not run.stats:
        raise ValueError(f"no stats under {output_url}: nothing to report yet")
    scores, quality_note = quality_scores(run)
    figures = [f for f in (draw(run) for draw in RUN_FIGURES) if f is not None]
    if (q := quality_figure(scores)) is not None:
        figures.append(q)
    if report_url:
        out = Storage(report_url, storage_options)
    else:
        out = Storage(output_url, storage_options).child(REPORT_DIR)
    for figure in figures:
        out.write_bytes(f"figures/{figure.name}.png", figure.png)
    manifest = run.manifest or {}
    page = (
        _environment()
        .get_template("report.html.j2")
        .render(
            title=f"{manifest.get('job', 'job')} · {manifest.get('run_id', '')}",
            output_url=output_url,
            manifest=manifest,
            complete=run.complete,
            started=_when(manifest.get("started")),
            finished=_when(manifest.get("finished")),
            totals=run.totals,
            stats=run.stats,
            figures=figures,
            errors=sorted(error_counts(run).items(), key=lambda kv: -kv[1]),
            failed=manifest.get("failed") or [],
            scores=scores,
            quality_note=quality_note,
            verdict=verdict,
        )
    )
    return out.write_bytes("report.html", page.encode()), figures
