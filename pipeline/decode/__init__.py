"""Speculative decoding engine: drafters, batched verification, cost-aware gamma."""
