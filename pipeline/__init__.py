"""Batch speculative-decoding pipeline: Parquet shards in, generations and per-shard stats out."""

__version__ = "0.1.0"
