"""Loading a job spec: YAML, ``KEY=VALUE`` overrides, validation errors as readable lines,
and the optional slower checks (tokenizers, context length).

Entry points: :func:`load_spec` (a YAML file), :func:`spec_from_dict` (an already parsed
mapping), :func:`parse_overrides` (``KEY=VALUE`` strings from the command line) and
:func:`check_models_reachable` (an optional, slower check that loads tokenizers). Every problem
is reported as one line ``<dotted.field.path>: <what is wrong>``.
"""

from __future__ import annotations

import copy
import datetime as dt
import difflib
import json
import os
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import annotated_types
import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)
from pydantic.fields import FieldInfo

from pipeline.decode.settings import MODEL_FREE
from pipeline.spec.errors import SpecError
from pipeline.spec.schema import (
    _DATE_RE,
    _NAME_PATTERN,
    _RUN_ID_RE,
    JobSpec,
    _local_model_dir,
    new_run_id,
    today_utc,
)

# --------------------------------------------------------------------------------------------
# overrides


def _apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> list[str]:
    """Set dotted keys in data (in place); returns error lines for paths that cannot be set."""
    errors: list[str] = []
    for dotted, value in overrides.items():
        parts = str(dotted).split(".")
        if not all(parts):
            errors.append(f"{dotted}: invalid override key (expected dotted.field.path)")
            continue
        node: Any = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                errors.append(f"{'.'.join(parts[: i + 1])}: cannot apply override {dotted!r}: not a mapping")
                break
            node = child
        else:
            node[parts[-1]] = copy.deepcopy(value)
    return errors


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Parse ``KEY=VALUE`` strings (e.g. from ``--set``) into an overrides dict for load_spec.

    VALUE is read as a YAML scalar/flow value (``64`` -> int, ``false`` -> bool, ``[a, b]`` -> list,
    ``null`` -> None); dates and timestamps stay strings. Raises SpecError on malformed items.
    """
    out: dict[str, Any] = {}
    errors: list[str] = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            errors.append(f"{item or '<empty>'}: expected KEY=VALUE (e.g. generation.max_new_tokens=64)")
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, (dt.date, dt.datetime)):
            value = raw.strip()
        out[key] = value
    if errors:
        raise SpecError(errors, "<overrides>")
    return out


# --------------------------------------------------------------------------------------------
# error formatting


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        m = _model_of(arg)
        if m is not None:
            return m
    return None


def _resolve(loc: tuple[Any, ...]) -> tuple[type[BaseModel] | None, FieldInfo | None]:
    """The model class at loc (if loc names a section) and the FieldInfo of its last part."""
    model: type[BaseModel] | None = JobSpec
    info: FieldInfo | None = None
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None, None
        info = model.model_fields[part]
        model = _model_of(info.annotation)
    return model, info


def _format_loc(loc: Iterable[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bounds(info: FieldInfo | None) -> str:
    if info is None:
        return ""
    parts = []
    for meta in info.metadata:
        for attr, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            value = getattr(meta, attr, None)
            if isinstance(meta, annotated_types.BaseMetadata) and value is not None:
                parts.append(f"{op} {value}")
    return (" " + " and ".join(parts)) if parts else ""


def _is_int_field(info: FieldInfo | None) -> bool:
    if info is None:
        return False
    ann = info.annotation
    return ann is int or int in typing.get_args(ann)


_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "bool_type": "a boolean (true or false)",
    "bool_parsing": "a boolean (true or false)",
    "string_type": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "list_type": "a list",
}
_PATTERN_WORDS = {
    _NAME_PATTERN: "letters, digits, '_', '.' or '-' (not starting with '.' or '-')",
}
_BOUND_TYPES = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of"}


def _describe(err: Mapping[str, Any]) -> str:
    loc = tuple(err.get("loc", ()))
    typ = err.get("type", "")
    ctx = err.get("ctx") or {}
    value = err.get("input")
    path = _format_loc(loc)

    if typ == "spec_rule":
        return f"{ctx.get('field') or path or '(top level)'}: {ctx.get('message', err.get('msg', ''))}"
    if typ == "extra_forbidden":
        parent = loc[:-1]
        key = str(loc[-1]) if loc else "?"
        model, _ = _resolve(parent) if parent else (JobSpec, None)
        msg = f"unknown key {key!r}"
        if model is not None:
            allowed = list(model.model_fields)
            close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
            msg += f" (did you mean {close[0]!r}?)" if close else f" (expected one of: {', '.join(allowed)})"
        return f"{_format_loc(parent) or '(top level)'}: {msg}"
    if typ == "missing":
        return f"{path}: required field is missing"

    _, info = _resolve(loc)
    if typ in _TYPE_WORDS:
        what = _TYPE_WORDS[typ]
        if typ.startswith(("int_", "float_")) or typ == "finite_number":
            what += _bounds(info)
        return f"{path}: expected {what}, got {_show(value)}"
    if typ in _BOUND_TYPES:
        what = "an integer" if _is_int_field(info) else "a number"
        return f"{path}: expected {what}{_bounds(info)}, got {_show(value)}"
    if typ == "literal_error":
        return f"{path}: expected one of {ctx.get('expected')}, got {_show(value)}"
    if typ == "string_too_short":
        return f"{path}: must not be empty"
    if typ == "string_too_long":
        return f"{path}: expected at most {ctx.get('max_length')} characters"
    if typ == "string_pattern_mismatch":
        pattern = ctx.get("pattern")
        what = _PATTERN_WORDS.get(pattern, f"a string matching {pattern}")
        return f"{path}: expected {what}, got {_show(value)}"
    if typ in ("value_error", "assertion_error") and "error" in ctx:
        return f"{path}: {ctx['error']}"
    msg = str(err.get("msg", "invalid value"))
    return f"{path or '(top level)'}: {msg[:1].lower() + msg[1:]}"


def _format_errors(exc: ValidationError) -> list[str]:
    lines: list[str] = []
    for err in exc.errors(include_url=False):
        line = _describe(err)
        if line not in lines:
            lines.append(line)
    return lines


# --------------------------------------------------------------------------------------------
# loading


def _check_context(run_id: str | None, date: str | dt.date | None) -> tuple[str, str, list[str]]:
    errors: list[str] = []
    if isinstance(date, dt.datetime):
        date = date.date()
    if isinstance(date, dt.date):
        date = date.isoformat()
    if date is None:
        date = today_utc()
    elif not (isinstance(date, str) and _DATE_RE.match(date)):
        errors.append(f"date: expected YYYY-MM-DD, got {_show(date)}")
    else:
        try:
            dt.date.fromisoformat(date)
        except ValueError:
            errors.append(f"date: not a valid calendar date, got {date!r}")
    if run_id is None:
        run_id = new_run_id()
    elif not (isinstance(run_id, str) and _RUN_ID_RE.match(run_id)):
        errors.append(
            f"run_id: expected 1-128 letters, digits, '_', '.' or '-' (not starting with '.' or '-'), "
            f"got {_show(run_id)}"
        )
    return str(run_id), str(date), errors


def spec_from_dict(
    data: Any,
    *,
    source: str = "<dict>",
    run_id: str | None = None,
    date: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> JobSpec:
    """Validate a parsed spec mapping; render placeholders; raise SpecError listing every problem."""
    run_id, date, errors = _check_context(run_id, date)
    if errors:
        raise SpecError(errors, source)
    if not isinstance(data, Mapping):
        got = "an empty document" if data is None else _show(data)
        sections = ", ".join(JobSpec.model_fields)
        raise SpecError([f"(top level): expected a mapping with keys {sections}; got {got}"], source)
    data = copy.deepcopy(dict(data))
    if overrides:
        errors = _apply_overrides(data, overrides)
        if errors:
            raise SpecError(errors, source)
    try:
        return JobSpec.model_validate(data, context={"run_id": run_id, "date": date, "source": source})
    except ValidationError as exc:
        raise SpecError(_format_errors(exc), source) from None


def load_spec(
    path: str | os.PathLike[str],
    *,
    run_id: str | None = None,
    date: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> JobSpec:
    """Read a YAML job spec (yaml.safe_load), apply dotted overrides, render, validate.

    Placeholders {date} (default: today, UTC) and {run_id} (default: a new timestamp id) are
    rendered in input.url and output.url; output.url also supports {name}. Any problem (unreadable
    file, YAML syntax, schema) raises SpecError with one line per problem.
    """
    source = os.fspath(path)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([f"(file): cannot read spec: {exc}"], source) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "unknown position"
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        detail = f"{context}, {problem}" if context else problem
        raise SpecError([f"(yaml): syntax error at {where}: {detail}"], source) from None
    return spec_from_dict(data, source=source, run_id=run_id, date=date, overrides=overrides)


# --------------------------------------------------------------------------------------------
# optional slow check


def check_models_reachable(spec: JobSpec) -> list[str]:
    """Check that local target and draft share a tokenizer; returns error lines ([] when fine).

    Only pairs where both models are existing local directories are checked (hub ids, missing
    directories and unknown named pairs are skipped). Loads tokenizers, not weights.
    """
    if spec.drafter.kind in MODEL_FREE:
        return []
    pair = False
    if spec.models.pair is not None:
        try:
            from pipeline.models.pairs import resolve_pair

            target_ref, draft_ref = resolve_pair(spec.models.pair)
        except (ImportError, KeyError, OSError, ValueError):
            # unknown pair, not installed, loader not available: nothing local to compare
            return []
        if target_ref is None or draft_ref is None:
            return []
        target_path, draft_path = str(target_ref.path), str(draft_ref.path)
        pair = True
    elif spec.models.target is not None and spec.models.draft is not None:
        target_path, draft_path = spec.models.target.path, spec.models.draft.path
    else:
        return []
    target_dir, draft_dir = _local_model_dir(target_path), _local_model_dir(draft_path)
    if target_dir is None or draft_dir is None:
        return []

    from transformers import AutoTokenizer

    vocabs: dict[str, dict[str, int]] = {}
    for role, d in (("target", target_dir), ("draft", draft_dir)):
        try:
            tok = AutoTokenizer.from_pretrained(str(d), trust_remote_code=spec.models.trust_remote_code)
            vocabs[role] = dict(tok.get_vocab())
        except Exception as exc:  # noqa: BLE001 - any loading failure is reported, not raised
            where = "models.pair" if pair else f"models.{role}"
            return [f"{where}: cannot load the {role} tokenizer from {d}: {type(exc).__name__}: {exc}"]
    t, d = vocabs["target"], vocabs["draft"]
    if t == d:
        return []
    differing = sum(1 for k in t.keys() | d.keys() if t.get(k) != d.get(k))
    return [
        f"models.draft: tokenizer of {draft_path} does not match target {target_path} "
        f"(vocab sizes {len(d)} vs {len(t)}, {differing} differing tokens)"
    ]


def check_context_length(spec: JobSpec) -> list[str]:
    """generation.max_new_tokens against the target's context window; error lines ([] when fine).

    The engine keeps max_new_tokens free in the context and cuts the prompt to the rest, so a
    max_new_tokens that leaves no room for a single prompt token fails every row of every shard,
    after the retries. It is read from the target's config.json (no weights loaded); targets
    without a local config (hub ids, GGUF files, pairs not installed) are not checked.
    """
    target_path = spec.models.target.path if spec.models.target is not None else None
    if spec.models.pair is not None:
        try:
            from pipeline.models.pairs import resolve_pair

            target_path = str(resolve_pair(spec.models.pair)[0].path)
        except (ImportError, KeyError, OSError, ValueError):
            return []
    target_dir = _local_model_dir(target_path) if target_path else None
    config_file = target_dir / "config.json" if target_dir is not None else None
    if config_file is None or not config_file.is_file():
        return []
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return []  # the loader reports a broken config with its own error
    context = config.get("max_position_embeddings") if isinstance(config, dict) else None
    wanted = spec.generation.max_new_tokens
    if not isinstance(context, int) or wanted < context:
        return []
    return [
        f"generation.max_new_tokens: {wanted} does not fit the target's context of {context} tokens "
        f"({config_file}: max_position_embeddings), which must also hold the prompt; at most {context - 1}"
    ]
