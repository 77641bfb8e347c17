"""The output layout (pipeline.job.layout): where a shard's files go."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.job.layout import shard_name, shard_paths
from pipeline.storage import Storage


@pytest.mark.parametrize(
    "shard_url",
    ["/in/../../etc/passwd.parquet", "/in/..parquet", "/in/a/../../../b.parquet", "/in/nested/x.parquet"],
)
def test_shard_names_cannot_leave_the_output_prefix(shard_url, tmp_path):
    """Output names come from input names; whatever those are, every write stays under OUTPUT/."""
    out = Storage(str(tmp_path / "out"))
    name = shard_name(shard_url, "/in")
    for rel in shard_paths(name).values():
        target = Path(out.url_for(rel).removeprefix("file://")).resolve()
        assert target.is_relative_to((tmp_path / "out").resolve()), (shard_url, rel)
        assert "/" not in name
