"""The spec fields that decide what a job's outputs hold, and checking a resume against them.

A resume (`--run-id` of an existing run) skips the shards already complete. Were the spec
changed in between (another max_new_tokens, another target model), the skipped shards would
keep the old spec's outputs next to new ones, and manifest.json would describe neither. So
manifest.json records these fields and their hash, written before the first shard runs (a
killed run is checked too), and a resume whose fields differ is refused unless it overwrites.

Storage options, the output location and the execution fields that only place and retry work
(actors, CPUs, GPUs, threads, retries) are left out: changing them changes no output.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pipeline.spec import JobSpec, SpecError

# Dotted spec fields whose every leaf is part of the fingerprint.
FINGERPRINT_FIELDS = (
    "input.url",
    "input.text_column",
    "input.id_column",
    "input.keep_columns",
    "task",
    "generation",
    "models",
    "drafter",
    "execution.batch_size",
    "execution.speedup_sample",
    "execution.speedup_sample_tokens",
    "execution.speedup_sample_budget",
)


def _leaves(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        found: dict[str, Any] = {}
        for key, item in value.items():
            found.update(_leaves(item, f"{prefix}.{key}"))
        return found
    return {prefix: value}


def fingerprint_fields(spec_dict: dict) -> dict[str, Any]:
    """The fingerprinted fields of a spec as dumped by JobSpec.to_dict (a manifest's `spec`)."""
    fields: dict[str, Any] = {}
    for dotted in FINGERPRINT_FIELDS:
        value: Any = spec_dict
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        fields.update(_leaves(value, dotted))
    return fields


def fingerprint(spec: JobSpec) -> dict[str, Any]:
    """{"sha256": hash of the fields, "fields": {dotted field: value}} for manifest.json."""
    fields = fingerprint_fields(spec.to_dict())
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return {"sha256": digest, "fields": fields}


def check_resume(spec: JobSpec, manifest: dict) -> None:
    """Raise SpecError naming every differing field when `manifest` was written by another spec.

    Manifests written before fingerprints existed are compared through their `spec`.
    """
    old = (manifest.get("fingerprint") or {}).get("fields") or fingerprint_fields(manifest.get("spec") or {})
    new = fingerprint(spec)["fields"]
    differing = [
        f"{key}: {json.dumps(old.get(key))} -> {json.dumps(new.get(key))}"
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key)
    ]
    if differing:
        raise SpecError(
            [
                f"output.url: resume refused: run {manifest.get('run_id')!r} under {spec.output.url} was "
                "written with another spec, and its complete shards would keep their old outputs. "
                "Differing fields:",
                *(f"  {line}" for line in differing),
                "Use another --run-id, the same spec, or --overwrite to redo every shard.",
            ],
            spec.source,
        )
