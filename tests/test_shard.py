"""One shard end to end (pipeline.job.shard, built as a model actor builds it): a batch that
does not fit in memory is halved, a shard missing a column is an unreadable shard naming them.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pyarrow as pa
import pytest
import torch
from click.testing import CliRunner
from pipeline_helpers import DOCS, clean_corpus, expected_text, job_dict

from pipeline.cli import main
from pipeline.decode.engine import RowOutput
from pipeline.decode.policy import CopierPrices, DraftingGate
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
    released = []  # the static runners' slots freed before each smaller retry
    monkeypatch.setattr(processor.engine, "release_memory", lambda: released.append(1))
    stats = processor.process(str(root / "in" / "part-000.parquet"), "part-000")
    assert stats["oom_splits"] >= 1 and stats["rows_out"] == 5
    assert len(released) == stats["oom_splits"]
    first = sizes.index(4)  # the rows outside the speedup sample's pairs, at the job's batch
    assert sizes[first + 1] == 2  # halved until it fit
    table = Storage(str(root / "out")).read_parquet("outputs/part-000.parquet")
    for row_id, text in zip(table.column("id").to_pylist(), table.column("generated").to_pylist()):
        doc = DOCS[int(row_id[-1]) % 5]
        assert text == expected_text(tiny_models, processor.spec, doc)

    def never_fits(prompts, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(processor.engine, "generate", never_fits)
    with pytest.raises(torch.OutOfMemoryError):  # one row that does not fit fails the attempt
        processor.process(str(root / "in" / "part-000.parquet"), "part-000")


def test_a_warm_up_that_does_not_fit_is_skipped_not_the_shard(processor, monkeypatch):
    """Reserving a pair's rows captures their slots' graphs on a GPU, which may not fit: the
    warm-up is skipped and its memory freed, and the shard's decodes halve their batches where
    they must, as before the static path raised a capture's out-of-memory (it ran eagerly)."""
    processor, root = processor
    reserve = processor.engine.reserve
    refused = []

    def first_does_not_fit(*args, **kwargs):
        if not refused:
            refused.append(args)
            raise torch.OutOfMemoryError("CUDA out of memory (injected: capturing the slots' graphs)")
        return reserve(*args, **kwargs)

    released = []
    monkeypatch.setattr(processor.engine, "reserve", first_does_not_fit)
    monkeypatch.setattr(processor.engine, "release_memory", lambda: released.append(1))
    monkeypatch.setattr(processor, "warm_paths", set())  # every path to warm again
    stats = processor.process(str(root / "in" / "part-000.parquet"), "part-000")
    assert refused and released and stats["rows_out"] == 5 and stats["status"] == "ok"


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
    the next scripted number of seconds (a path's 2-token warm-up takes none). Records each
    call's drafter and rows."""

    def __init__(self, seconds: list[float]):
        self.seconds = list(seconds)
        self.calls: list[tuple[str | None, int]] = []
        self.warmups: list[tuple[str | None, int]] = []
        self.gate = DraftingGate()
        self.policy = SimpleNamespace(copiers=CopierPrices())  # what the shard's stats read of it
        self.learner = None  # no learning head

    def static_record(self) -> None:
        return None

    def refine_head(self) -> None:
        return None

    def reserve(self, rows, prompt_tokens, max_new_tokens, drafter=None) -> None:
        pass

    def generate(self, prompts, max_new_tokens, sampling, *, drafter=None, **kwargs):
        warmup = max_new_tokens == 2
        (self.warmups if warmup else self.calls).append((drafter, len(prompts)))
        rows = [
            RowOutput([5] * 8, "length", len(p), 0, RowStats(new_tokens=8, target_passes=8)) for p in prompts
        ]
        stats = BatchStats(
            rows=len(prompts),
            new_tokens=8 * len(prompts),
            row_passes=8 * len(prompts),
            wall_seconds=0.0 if warmup else self.seconds.pop(0),
            prefill_seconds=1.0,
            priced_seconds=5.0,
            priced_plain_seconds=6.0,
        )
        return rows, stats


def _sampled(tiny_pair_dirs, tiny_models, tmp_path, seconds, rows=5, **execution):
    clean_corpus(Storage(str(tmp_path / "in")), shards=1, rows=rows)
    data = job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out"), batch_size=2)
    data["input"]["keep_columns"] = []
    data["execution"].update(execution)
    engine = ClockedEngine(seconds)
    processor = ShardProcessor(spec_from_dict(data), engine, tiny_models[2])
    stats = processor.process(str(tmp_path / "in" / "part-000.parquet"), "part-000")
    return engine, stats


def test_the_sampled_rows_are_decoded_in_pairs_and_only_the_target_only_halves_cost(
    tiny_pair_dirs, tiny_models, tmp_path
):
    # 5 rows, a share of 0.5: rows 0, 1 and 3 in chunks [0, 1] and [3]; rows 2 and 4 decoded after
    # (speculative, target-only) seconds (1, 2), then (3, 2) target-only first; the rest 4 s
    engine, stats = _sampled(
        tiny_pair_dirs,
        tiny_models,
        tmp_path,
        [1.0, 2.0, 3.0, 2.0, 4.0],
        speedup_sample=0.5,
        speedup_sample_tokens=0,
        speedup_sample_budget=0.0,
    )
    speedup = stats["speedup"]
    assert engine.calls == [(None, 2), ("none", 2), ("none", 1), (None, 1), (None, 2)]
    assert engine.warmups == [(None, 2), ("none", 2), ("none", 1), (None, 1)]  # each path once
    assert speedup["pair_seconds"] == [[1.0, 2.0], [2.0, 3.0]] and speedup["rows_per_pair"] == 2
    assert speedup["sample_rows"] == 3 and speedup["identical_rows"] == 3
    # the target-only halves (and the warm-ups, real time here): the speculative halves are outputs
    assert speedup["seconds"] == pytest.approx(5.0, abs=0.05)
    assert stats["decode_seconds"] == 1.0 + 2.0 + 4.0 and stats["rows_out"] == 5
    assert speedup["measured"] == pytest.approx(5 / 3) and speedup["median_pair_ratio"] == 1.75
    assert speedup["predicted"] == pytest.approx((6.0 * 3 + 1.0 * 3) / (5.0 * 3 + 1.0 * 3))
    half = 12.706 * math.sqrt((2 / 9) / 2) / 1.5  # residuals 2 - R = 1/3, 3 - 2R = -1/3; t(1)
    assert speedup["ci95"] == pytest.approx([0.0, 5 / 3 + half], abs=1e-3)  # cut at 0
    assert speedup["verdict"] == "no measurable difference"


@pytest.mark.parametrize(
    "execution, again",
    [
        ({"speedup_sample_tokens": 40, "speedup_sample_budget": 3.0}, 1),  # 24 tokens < 40: one more
        ({"speedup_sample_tokens": 40, "speedup_sample_budget": 1.0}, 0),  # 4 s + 3 s > 1 x 7 s: none
        ({"speedup_sample_tokens": 0, "speedup_sample_budget": 0.0}, 0),  # two pairs suffice
    ],
)
def test_pairs_are_decoded_again_for_the_token_floor_within_the_budget(
    tiny_pair_dirs, tiny_models, tmp_path, execution, again
):
    engine, stats = _sampled(
        tiny_pair_dirs,
        tiny_models,
        tmp_path,
        [1.0, 2.0, 3.0, 2.0, 4.0, 2.0, 2.0],
        speedup_sample=0.5,
        **execution,
    )
    speedup = stats["speedup"]
    assert speedup["pairs"] == 2 + again
    if again:  # the first chunk again, both halves now the sample's cost; 3 pairs make 40 tokens
        assert engine.calls[-2:] == [(None, 2), ("none", 2)]
        assert speedup["seconds"] == pytest.approx(5.0 + 4.0, abs=0.05) and speedup["identical_rows"] == 5
    assert stats["decode_seconds"] == 7.0  # the shard's own decoding, whatever was sampled


def test_one_sampled_row_makes_one_pair_and_the_budget_decides_a_second(
    tiny_pair_dirs, tiny_models, tmp_path
):
    """A share that samples one row makes one pair; a second (that row again, both ways) only
    within the budget: no interval rather than a measurement that costs more than the work."""
    engine, stats = _sampled(
        tiny_pair_dirs,
        tiny_models,
        tmp_path,
        [1.0, 2.0, 6.0],
        rows=4,
        speedup_sample=0.25,
        speedup_sample_tokens=0,
        speedup_sample_budget=0.5,
    )
    assert stats["speedup"]["pairs"] == 1 and stats["speedup"]["ci95"] is None
    assert engine.calls == [(None, 1), ("none", 1), (None, 3)]  # 2 + 3 s > 0.5 x 7 s: no second pair


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


class DrafterClockedEngine(ClockedEngine):
    """A ClockedEngine whose speculative decodes take `speculative` seconds (a hundredth more
    each time: pairs that agree without being equal) and target-only ones `target_only`;
    records whether the gate was resting at each call."""

    def __init__(self, speculative: float, target_only: float):
        super().__init__([])
        self.times = {None: speculative, "none": target_only}
        self.resting: list[bool] = []

    def generate(self, prompts, max_new_tokens, sampling, *, drafter=None, **kwargs):
        self.seconds = [self.times[drafter] * (1 + 0.01 * len(self.calls))]
        self.resting.append(self.gate.resting)
        return super().generate(prompts, max_new_tokens, sampling, drafter=drafter, **kwargs)


@pytest.mark.parametrize("adaptive", [True, False])
def test_an_actor_whose_pairs_measure_drafting_slower_stands_down_for_its_next_shards(
    tiny_pair_dirs, tiny_models, tmp_path, adaptive
):
    """Drafting at 0.8x target-only: after the 2nd shard (two pairs, the first interval) the actor
    decodes 2 shards without asking the drafters, then drafts again; each shard's stats and the
    job's totals say which. A fixed gamma is the user's call: it never stands down."""
    clean_corpus(Storage(str(tmp_path / "in")), shards=5, rows=4)
    data = job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out"), batch_size=4)
    data["input"]["keep_columns"] = []
    data["drafter"]["adaptive"] = adaptive
    data["execution"].update(speedup_sample=0.25, speedup_sample_tokens=0, speedup_sample_budget=0.0)
    engine = DrafterClockedEngine(speculative=1.0, target_only=0.8)
    processor = ShardProcessor(spec_from_dict(data), engine, tiny_models[2])
    records, resting = [], []
    for s in range(5):
        engine.resting = []
        records.append(processor.process(str(tmp_path / "in" / f"part-{s:03d}.parquet"), f"part-{s:03d}"))
        resting.append(set(engine.resting))
    if not adaptive:
        assert resting == [{False}] * 5 and all("stand_down" not in r for r in records)
        assert job_totals(records)["shards_stood_down"] == 0
        return
    assert resting == [{False}, {False}, {True}, {True}, {False}]  # every decode of a shard alike
    assert [r["stand_down"]["rested"] for r in records] == [False, False, True, True, False]
    second, last = records[1]["stand_down"], records[4]["stand_down"]
    assert second["pooled_ci95"][1] < 1 and second["rest_shards_left"] == 2
    assert last["stand_downs"] == 1 and last["rested_shards"] == 2
    assert job_totals(records)["shards_stood_down"] == 2
    printed = CliRunner().invoke(main, ["stats", str(tmp_path / "out")])
    assert "drafting stood down in 2 of 5 shards" in printed.output, printed.output
