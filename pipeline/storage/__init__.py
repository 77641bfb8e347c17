"""Storage: the only layer that touches files and object stores. `filesystem` (Storage: a root
URL, retried operations, atomic and conditional writes, errors), `shards` (listing and opening
input shards), `urls` (schemes, globs), `secrets` (the one credential-key list and redaction)."""

from pipeline.storage.filesystem import (
    PermanentStorageError,
    ShardReadError,
    Storage,
    StorageError,
    StorageNotFoundError,
    TransientStorageError,
    Versioned,
    is_transient,
)
from pipeline.storage.secrets import redact
from pipeline.storage.shards import list_shards, open_shard

__all__ = [
    "PermanentStorageError",
    "ShardReadError",
    "Storage",
    "StorageError",
    "StorageNotFoundError",
    "TransientStorageError",
    "Versioned",
    "is_transient",
    "list_shards",
    "open_shard",
    "redact",
]
