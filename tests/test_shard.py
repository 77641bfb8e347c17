"""One shard end to end (pipeline.job.shard, built as a model actor builds it): a batch that
does not fit in memory is halved, a shard missing a column is an unreadable shard naming them.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from pipeline_helpers import DOCS, clean_corpus, expected_text, job_dict

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
