"""The spec fields that decide what a job's outputs hold, and checking a resume against them.

A resume (`--run-id` of an existing run) skips the shards already complete. Were the spec
changed in between (another max_new_tokens, another target model), the skipped shards would
keep the old spec's outputs next to new ones, and manifest.json would describe neither. So
manifest.json records these fields and their hash, written before the first shard runs (a
killed run is checked too), and a resume whose fields differ is refused unless it overwrites.

The outputs' columns are this version's, not the spec's: a resume also reads the columns of one
complete shard's outputs and refuses a version that would write others beside them, since
reading the run's outputs/ as one data set then drops or nulls columns.

Storage options, the output location and the execution fields that only place and retry work
(actors, CPUs, GPUs, threads, retries) are left out: changing them changes no output.

A field that a newer version added is absent from an older run's manifest. Left at its
default it is what that run decoded with (fields are added with the old behaviour as their
default), so a resume across the upgrade goes on; set to anything else, it differs.
"""

from __future__ import annotations

import hashlib
import json
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined, to_jsonable_python

from pipeline.job.layout import shard_paths, shards_with_stats
from pipeline.job.shard import GENERATED_FIELDS
from pipeline.spec import JobSpec, SpecError
from pipeline.storage import Storage, open_shard

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


_ABSENT = object()  # a field the spec does not have, unlike one set to null


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
            value = value.get(part, _ABSENT) if isinstance(value, dict) else _ABSENT
        if value is not _ABSENT:
            fields.update(_leaves(value, dotted))
    return fields


def schema_default(dotted: str) -> Any:
    """The JSON value of a spec field (a leaf as `fingerprint_fields` names it) that a spec
    leaves out, or _ABSENT when the field is required or unknown."""
    model: type[BaseModel] | None = JobSpec
    value: Any = _ABSENT
    for part in dotted.split("."):
        if value is not _ABSENT:  # inside a default: a section's or a mapping's
            value = value.get(part, _ABSENT) if isinstance(value, dict) else _ABSENT
        elif model is not None and part in model.model_fields:
            info = model.model_fields[part]
            annotation = info.annotation
            sections = [a for a in (annotation, *typing.get_args(annotation)) if isinstance(a, type)]
            section = next((a for a in sections if issubclass(a, BaseModel)), None)
            if section is not None:  # a section, or an optional one: its fields' own defaults
                model = section
                continue
            default = info.get_default(call_default_factory=True)
            value = _ABSENT if default is PydanticUndefined else to_jsonable_python(default)
            model = None
        else:
            return _ABSENT
    return value


def fingerprint(spec: JobSpec) -> dict[str, Any]:
    """{"sha256": hash of the fields, "fields": {dotted field: value}} for manifest.json."""
    fields = fingerprint_fields(spec.to_dict())
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return {"sha256": digest, "fields": fields}


def check_resume(spec: JobSpec, manifest: dict) -> None:
    """Raise SpecError naming every differing field when `manifest` was written by another spec.

    Manifests written before fingerprints existed are compared through their `spec`. A field
    the old run's version did not have counts as its schema default.
    """
    old = (manifest.get("fingerprint") or {}).get("fields") or fingerprint_fields(manifest.get("spec") or {})
    new = fingerprint(spec)["fields"]

    def shown(fields: dict[str, Any], key: str) -> str:
        return json.dumps(fields[key]) if key in fields else "(absent)"

    differing = [
        f"{key}: {shown(old, key)} -> {shown(new, key)}"
        for key in sorted(old.keys() | new.keys())
        if (old[key] if key in old else schema_default(key)) != new.get(key, _ABSENT)
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


def check_resume_outputs(spec: JobSpec, out: Storage, manifest: dict) -> None:
    """Raise SpecError when the run's complete shards hold other generated columns than this
    version writes (GENERATED_FIELDS), naming them and the version that wrote them."""
    committed = (shard_paths(name)["outputs"] for name in shards_with_stats(out))
    outputs = next((path for path in committed if out.exists(path)), None)  # a complete shard's
    if outputs is None:
        return  # nothing complete yet: nothing to mix with
    carried = 1 + len(spec.input.keep_columns)
    schema = open_shard(out.url_for(outputs), out.storage_options).schema_arrow
    written = [(f.name, f.type) for f in schema][carried:]
    if written == GENERATED_FIELDS:  # (types compare as types: a list's item name aside)
        return
    version = manifest.get("package_version", "an unknown version")
    raise SpecError(
        [
            f"output.url: resume refused: run {manifest.get('run_id')!r} under {spec.output.url} was "
            f"written by spec-pipeline {version}, whose outputs have other columns than this version's; "
            "resumed, the run's outputs/ would mix two schemas.",
            f"  {outputs}: {', '.join(f'{n} ({t})' for n, t in written)}",
            f"  this version: {', '.join(f'{n} ({t})' for n, t in GENERATED_FIELDS)}",
            "Use another --run-id, or --overwrite to redo every shard.",
        ],
        spec.source,
    )
