"""The corpora the demo and the benchmark read: texts from the running system, never committed."""

from __future__ import annotations

import pyarrow.parquet as pq

from pipeline.demo_data import docstrings, license_sections, write_demo_data


def test_demo_data_writes_docstring_shards(tmp_path):
    paths = write_demo_data(str(tmp_path), shards=2, rows_per_shard=3)
    tables = [pq.read_table(p) for p in paths]
    assert [t.num_rows for t in tables] == [3, 3]
    ids = [i for t in tables for i in t.column("id").to_pylist()]
    assert ids == [d["id"] for d in docstrings()[:6]]  # a stable order, no document twice
    assert all(300 <= len(text) <= 2500 for t in tables for text in t.column("text").to_pylist())


def test_license_sections_join_paragraphs_drop_overshoots_and_read_symlinks_once(tmp_path):
    short = "word " * 30  # 150 characters
    text = "\n\n".join([short] * 5 + ["x" * 3000] + [short] * 6)
    original = tmp_path / "GPL-3"
    original.write_text(text)
    (tmp_path / "GPL").symlink_to(original)
    docs = license_sections([str(tmp_path / "GPL"), str(original)], min_chars=500, max_chars=1000)
    # 4 short paragraphs reach 500 characters; the 5th and the 3000-character one overshoot
    # together and are dropped; the 6 short ones after it give one more section and a remainder
    assert len(docs) == 2
    assert all(500 <= len(d["text"]) <= 1000 for d in docs)
    assert docs[0]["text"] == "\n\n".join([short.strip()] * 4)
    assert [d["title"] for d in docs] == ["GPL", "GPL"]
    assert len({d["id"] for d in docs}) == 2
