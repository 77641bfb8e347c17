"""Ids unique per job: which rows repeat an id that an earlier shard already holds.

The rule: an id belongs to the first shard, in the sorted input listing, that has it (as
read from the id column, whatever that row's fate). The same id in a later shard is a
`duplicate_id` error record there, naming the shard that holds it. The listing decides, not
the order in which actors finish, so a re-run or a resume finds the same duplicates.

Shards are decoded in parallel, so this is settled before decoding, in two passes of Ray
tasks whose files live under OUTPUT/_ids/ (hidden from listings, deleted by --overwrite; their
paths are pipeline.job.layout's):

* map, one task per shard: its ids and a 32-bit hash of each -> `_ids/map/<shard>.parquet`;
* reduce, one task per hash partition: the ids of one partition from every map file, the first
  shard of each, and the later rows -> `_ids/dups/p-<n>.parquet` (shard, id, kept_in).

No process holds more than one partition's ids: PARTITION_ROWS ids each, so 1e8 ids are 25
reduce tasks. The driver then holds the duplicates only, which a sane corpus has few of.
Map files of shards already indexed are reused by a resume.
"""

from __future__ import annotations

import math
import zlib

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.job.layout import DUPLICATES_DIR, duplicates_path, id_map_path
from pipeline.storage import ShardReadError, Storage

PARTITION_ROWS = 4_000_000
DUPS_SCHEMA = pa.schema([("shard", pa.string()), ("id", pa.string()), ("kept_in", pa.string())])


def id_key(value) -> str:
    """Ids compare by their text (2 and "2" are one id, as in the error records' `id`)."""
    return str(value)


def map_ids(shard_url: str, name: str, output: Storage, storage_options: dict, columns: list[str]) -> int:
    """Write one shard's ids (non-null, hashed) to `_ids/map/<name>.parquet`; return how many.

    A file an earlier run of the job wrote is reused.
    A shard that cannot be decoded (unreadable, a needed column missing) holds no id: its rows
    all go to errors/ anyway.
    """
    done = id_map_path(name)
    if output.exists(done):  # indexed by an earlier run of this job
        return output.read_parquet(done, columns=["id"]).num_rows
    parent, _, base = shard_url.rpartition("/")
    try:
        table = Storage(parent, storage_options).read_parquet(base, columns=columns)
        ids = [id_key(v) for v in table.column(columns[0]).to_pylist() if v is not None]
    except ShardReadError:
        ids = []
    hashes = [zlib.crc32(i.encode()) for i in ids]
    output.write_parquet(
        done,
        pa.table(
            {
                "hash": pa.array(hashes, pa.uint32()),
                "id": pa.array(ids, pa.string()),
            }
        ),
    )
    return len(ids)


def partitions(total_ids: int) -> int:
    return max(1, math.ceil(total_ids / PARTITION_ROWS))


def reduce_ids(part: int, parts: int, names: list[str], output: Storage) -> int:
    """Find the ids of hash partition `part` that an earlier shard holds; write and count them."""
    tables = []
    for ordinal, name in enumerate(names):  # the listing's order, which decides who keeps an id
        table = output.read_parquet(id_map_path(name))
        mine = table.filter(pa.array([h % parts == part for h in table["hash"].to_pylist()], pa.bool_()))
        ordinals = pa.array([ordinal] * len(mine), pa.int32())
        tables.append(mine.select(["id"]).append_column("ordinal", ordinals))
    ids = pa.concat_tables(tables)
    first = ids.group_by("id").aggregate([("ordinal", "min")]).rename_columns(["id", "first"])
    joined = ids.join(first, "id")
    later = joined.filter(pc.greater(joined["ordinal"], joined["first"]))
    dups = pa.table(
        {
            "shard": pa.array([names[o] for o in later["ordinal"].to_pylist()], pa.string()),
            "id": later["id"].cast(pa.string()),
            "kept_in": pa.array([names[o] for o in later["first"].to_pylist()], pa.string()),
        },
        schema=DUPS_SCHEMA,
    )
    output.write_parquet(duplicates_path(part), dups)
    return dups.num_rows


def clear_duplicates(output: Storage) -> None:
    """Delete the reduce files of an earlier run (which may have used more partitions)."""
    output.delete_prefix(DUPLICATES_DIR)


def read_duplicates(output: Storage) -> dict[str, dict[str, str]]:
    """{shard: {id: shard holding it}} from the reduce files."""
    duplicates: dict[str, dict[str, str]] = {}
    for file in output.list(DUPLICATES_DIR, suffix=".parquet"):
        for row in output.read_parquet(file).to_pylist():
            duplicates.setdefault(row["shard"], {})[row["id"]] = row["kept_in"]
    return duplicates
