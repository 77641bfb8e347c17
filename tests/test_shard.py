"""One shard end to end (pipeline.job.shard, built as a model actor builds it): a batch that
does not fit in memory is halved, a shard missing a column is an unreadable shard naming them.
"""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
import torch
from click.testing import CliRunner
from pipeline_helpers import DOCS, clean_corpus, expected_text, job_dict

from pipeline.cli import main
from pipeline.decode.engine import RowOutput
from pipeline.decode.policy import DraftingGate
from pipeline.decode.stats import BatchStats, RowStats
from pipeline.job.shard import ShardProcessor
from pipeline.job.stats import job_totals
from pipeline.job.worker import build_processor
from pipeline.spec import spec_from_dict
from pipeline.storage import Storage


@pytest.fixture(scope="module")
def processor(tiny_pair_dirs, tmp_path_factory):
    """A shard processor for the tiny pair, as a model actor builds it, and its input dir."""
    root = tmp_path_factory.mktemp("processor")
    clean_corpus(Storage(str(root / "in")), shards=1, rows=5)
    data = job_dict(tiny_pair_dirs, str(root / "in"), str(root / "out"), batch_size=4)
    data["input"]["keep_columns"] = []
    return build_processor(spec_from_dict(data).with_absolute_paths()), root


def test_out_of_memory_halves_the_batch(tiny_models, processor, monkeypatch):
    """A batch that does not fit is split in halves; outputs stay those of target-only."""
    processor, root = processor
    generate = processor.engine.generate
    sizes: list[int] = []

    def generate_within_memory(prompts, *args, batch_size, **kwargs):
        # The allocator's own exception type, raised where a real device would run out.
        sizes.append(batch_size)
        if batch_size > 1 and batch_size * max(map(len, prompts)) > 120:
            raise torch.OutOfMemoryError("CUDA out of memory (injected: batch too large)")
        return generate(prompts, *args, batch_size=batch_size, **kwargs)

    monkeypatch.setattr(processor.engine, "generate", generate_within_memory)
    stats = processor.process(str(root / "in" / "part-000.parquet"), "part-000")
    assert stats["oom_splits"] >= 1 and stats["rows_out"] == 5
    assert sizes[:2] == [4, 2] and sizes[-1] < 4  # halved until it fit, then the speedup sample
    table = Storage(str(root / "out")).read_parquet("outputs/part-000.parquet")
    for row_id, text in zip(table.column("id").to_pylist(), table.column("generated").to_pylist()):
        doc = DOCS[int(row_id[-1]) % 5]
        assert text == expected_text(tiny_models, processor.spec, doc)

    def never_fits(prompts, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(processor.engine, "generate", never_fits)
    with pytest.raises(torch.OutOfMemoryError):  # one row that does not fit fails the attempt
        processor.process(str(root / "in" / "part-000.parquet"), "part-000")


def test_missing_column_is_a_shard_error_naming_the_columns(processor):
    processor, root = processor
    Storage(str(root / "in")).write_parquet("renamed.parquet", pa.table({"id": ["x"], "body": ["text"]}))
    stats = processor.process(str(root / "in" / "renamed.parquet"), "renamed")
    assert stats["status"] == "unreadable"
    assert "missing column(s) ['text']" in stats["error"] and "['id', 'body']" in stats["error"]
    errors = Storage(str(root / "out")).read_parquet("errors/renamed.parquet").to_pylist()
    assert [e["reason"] for e in errors] == ["unreadable_shard"] and "body" in errors[0]["detail"]


class ClockedEngine:
    """An engine on a fake clock: every row decodes to the same 8 tokens, and each call takes
    the next scripted number of seconds. Records which drafter each call asked for."""

    def __init__(self, seconds: list[float]):
        self.seconds = list(seconds)
        self.drafters: list[str | None] = []
        self.gate = DraftingGate()

    def static_record(self) -> None:
        return None

    def generate(self, prompts, max_new_tokens, sampling, *, drafter=None, **kwargs):
        self.drafters.append(drafter)
        rows = [
            RowOutput([5] * 8, "length", len(p), 0, RowStats(new_tokens=8, target_passes=8)) for p in prompts
        ]
        stats = BatchStats(
            rows=len(prompts),
            new_tokens=8 * len(prompts),
            row_passes=8 * len(prompts),
            wall_seconds=self.seconds.pop(0),
            prefill_seconds=1.0,
            priced_seconds=5.0,
            priced_plain_seconds=6.0,
        )
        return rows, stats


@pytest.mark.parametrize(
    "execution, pairs",
    [
        ({}, 3),  # the token floor: 2 pairs of 2 rows x 8 tokens make 32 < 40, a third makes 48
        ({"speedup_sample_budget": 0.5}, 2),  # 2 pairs took 8 s, over 0.5 x 10 s: stop short of 40
        ({"speedup_sample": 1.0, "speedup_sample_budget": 0.0}, 3),  # the row floor: 5 rows
    ],
)
def test_the_speedup_sample_pairs_both_modes_and_its_interval_is_the_ratio_of_means(
    tiny_pair_dirs, tiny_models, tmp_path, execution, pairs
):
    clean_corpus(Storage(str(tmp_path / "in")), shards=1, rows=5)
    data = job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out"), batch_size=2)
    data["input"]["keep_columns"] = []
    data["execution"].update(speedup_sample=0.5, speedup_sample_tokens=40, speedup_sample_budget=3.0)
    data["execution"].update(execution)
    # the shard decodes in 10 s; then (speculative, target-only) seconds (1, 2), (2, 3), (2, 4)
    engine = ClockedEngine([10.0, 1.0, 2.0, 3.0, 2.0, 2.0, 4.0])
    processor = ShardProcessor(spec_from_dict(data), engine, tiny_models[2])
    processor.warm_paths.add(("none", 2))  # an earlier shard ran target-only at 2 rows
    speedup = processor.process(str(tmp_path / "in" / "part-000.parquet"), "part-000")["speedup"]

    # alternating order: speculative first in even pairs, target-only first in odd ones
    assert engine.drafters == [None, None, "none", "none", None, None, "none"][: 1 + 2 * pairs]
    assert speedup["pairs"] == pairs and speedup["sample_rows"] == 2 * pairs
    assert speedup["sample_tokens"] == 16 * pairs and speedup["identical_rows"] == 2 * pairs
    assert speedup["predicted"] == pytest.approx((6.0 + 1.0) / (5.0 + 1.0))
    if pairs == 2:  # (1, 2), (2, 3): R = 5/3; residuals 2 - R = 1/3, 3 - 2R = -1/3; t(1) = 12.706
        half = 12.706 * math.sqrt((2 / 9) / 2) / 1.5
        assert speedup["measured"] == pytest.approx(5 / 3)
        assert speedup["ci95"] == pytest.approx([0.0, 5 / 3 + half], abs=1e-3)  # cut at 0
        assert speedup["verdict"] == "no measurable difference"
    else:  # R = 9/5 = 1.8; residuals 0.2, -0.6, 0.4; se = sqrt(0.56 / 6) / (5/3); t(2) = 4.303
        half = 4.3027 * math.sqrt(0.56 / 6) / (5 / 3)
        assert speedup["measured"] == pytest.approx(1.8)
        assert speedup["ci95"] == pytest.approx([1.8 - half, 1.8 + half], abs=1e-3)
        assert speedup["verdict"] == "faster"
    assert speedup["pair_seconds"] == [[1.0, 2.0], [2.0, 3.0], [2.0, 4.0]][:pairs]
    assert speedup["cold_pairs"] == 0


def test_a_pair_timed_on_a_cold_path_is_left_out_and_replaced(tiny_pair_dirs, tiny_models, tmp_path):
    """The actor's first target-only decode at this batch size runs cold (110 s against 26 s
    for its twin in a demo shard): that pair is counted apart, and two warm pairs are measured."""
    clean_corpus(Storage(str(tmp_path / "in")), shards=1, rows=4)
    data = job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out"), batch_size=2)
    data["input"]["keep_columns"] = []
    data["execution"].update(speedup_sample=0.5, speedup_sample_tokens=0, speedup_sample_budget=0.0)
    # the shard in 10 s; a cold pair (1, 9); then warm pairs (2, 3) and (2, 4)
    engine = ClockedEngine([10.0, 1.0, 9.0, 2.0, 3.0, 4.0, 2.0])
    processor = ShardProcessor(spec_from_dict(data), engine, tiny_models[2])
    speedup = processor.process(str(tmp_path / "in" / "part-000.parquet"), "part-000")["speedup"]
    assert speedup["cold_pairs"] == 1 and speedup["pairs"] == 2
    assert speedup["pair_seconds"] == [[2.0, 3.0], [2.0, 4.0]]
    assert speedup["median_pair_ratio"] == pytest.approx(1.75)
    assert speedup["sample_rows"] == 6 and speedup["identical_rows"] == 6  # cold rows are checked too


def test_a_shard_that_drafted_nothing_records_no_acceptance_rate(tiny_pair_dirs, tmp_path):
    """α is accepted / drafted: with nothing drafted it is null, not 0 (which reads as every draft
    rejected), in the rows, the shard's stats, the job's totals and the printed table."""
    clean_corpus(Storage(str(tmp_path / "in")), shards=1, rows=2)
    data = job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out"))
    data["input"]["keep_columns"], data["drafter"] = [], {"kind": "none"}
    stats = build_processor(spec_from_dict(data).with_absolute_paths()).process(
        str(tmp_path / "in" / "part-000.parquet"), "part-000"
    )
    assert stats["drafted"] == 0 and stats["alpha"] is None and stats["alpha_leviathan"] is None
    rows = Storage(str(tmp_path / "out")).read_parquet("outputs/part-000.parquet")
    assert rows.column("alpha").to_pylist() == [None, None]
    assert job_totals([stats])["alpha"] is None
    printed = CliRunner().invoke(main, ["stats", str(tmp_path / "out")])
    assert printed.exit_code == 1 and "incomplete" in printed.output  # (no _SUCCESS: no job ran)
    assert "no round drafted" in printed.output
    total = next(line for line in printed.output.splitlines() if line.startswith("TOTAL")).split()
    assert total[4] == "-", printed.output  # TOTAL rows err tokens alpha
