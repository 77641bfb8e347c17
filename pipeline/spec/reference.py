"""The job spec reference in docs/spec-reference.md, generated from :mod:`pipeline.spec.schema`.

Names, types, constraints, defaults and descriptions come from ``JobSpec.model_fields``, so the
reference cannot drift from what the loader accepts and a new field shows up once declared.
``python -m pipeline.spec.reference`` prints it; ``--write docs/spec-reference.md`` replaces the text
between the START and END markers there, and ``tests/test_spec_reference.py`` fails while that file is
out of date.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from pipeline.spec.schema import JobSpec

__all__ = ["START", "END", "render_spec_reference", "splice_reference"]

START = "<!-- spec-reference:start -->"
END = "<!-- spec-reference:end -->"

_NAMES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_BOUNDS = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}
_HEADER = "| field | type | default | description |\n| --- | --- | --- | --- |"


def _constraints(metadata: list[Any]) -> tuple[str, list[str]]:
    """A prefix ("non-empty ") and the readable bounds/length/pattern parts of the constraints."""
    prefix, parts = "", []
    for m in metadata:
        parts += [f"{sym} {getattr(m, k)}" for k, sym in _BOUNDS.items() if getattr(m, k, None) is not None]
        if getattr(m, "min_length", None) == 1:
            prefix = "non-empty "
        elif getattr(m, "min_length", None) is not None:
            parts.append(f"length ≥ {m.min_length}")
        if getattr(m, "max_length", None) is not None:
            parts.append(f"length ≤ {m.max_length}")
        if getattr(m, "pattern", None) is not None:
            parts.insert(0, f"matching `{m.pattern}`")
    return prefix, parts


def _type(ann: Any, metadata: list[Any], plural: bool = False) -> str:
    """A readable type such as ``integer ≥ 1, ≤ 8192``, ``string or null`` or ``list of strings``."""
    origin, args = get_origin(ann), get_args(ann)
    if origin is Annotated:
        inner = [c for m in args[1:] for c in (m.metadata if isinstance(m, FieldInfo) else [m])]
        return _type(args[0], inner + metadata, plural)
    if origin in (Union, types.UnionType):
        return " or ".join(_type(a, [] if a is type(None) else metadata, plural) for a in args)
    if origin is Literal:
        return "one of: " + ", ".join(str(a) for a in args)
    if origin is list:
        return "list of " + _type(args[0], [], plural=True)
    if ann is type(None):
        return "null"
    if origin is dict or (isinstance(ann, type) and issubclass(ann, BaseModel)):
        noun = "mapping"
    else:
        noun = _NAMES.get(ann, getattr(ann, "__name__", str(ann)))
    prefix, parts = _constraints(metadata)
    return f"{prefix}{noun}{'s' if plural else ''}" + (" " + ", ".join(parts) if parts else "")


def _model(ann: Any) -> type[BaseModel] | None:
    """The pydantic model class in ``ann`` (also inside ``X | None``), else None."""
    for a in (ann, *get_args(ann)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    return f"`{json.dumps(to_jsonable_python(value), ensure_ascii=False)}`"


def _cell(text: str) -> str:
    """One table cell: newlines collapsed, ``|`` escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _description(info: FieldInfo) -> str:
    """The field's description (``*`` escaped: it is prose, not emphasis) and its examples."""
    text = (info.description or "").replace("*", "\\*")
    if info.examples:
        label = "Examples" if len(info.examples) > 1 else "Example"
        text += f" {label}: " + ", ".join(f"`{e}`" for e in info.examples) + "."
    return _cell(text)


def _rows(fields: Mapping[str, FieldInfo], prefix: str) -> list[str]:
    """Table rows for ``fields``; a nested model adds dotted rows for its own fields."""
    rows = []
    for key, info in fields.items():
        name = prefix + key
        kind = _cell(_type(info.annotation, info.metadata))
        rows.append(f"| `{name}` | {kind} | {_default(info)} | {_description(info)} |")
        nested = _model(info.annotation)
        if nested is not None:
            rows += _rows(nested.model_fields, name + ".")
    return rows


def _summary(model: type[BaseModel]) -> str:
    """The first paragraph of a model's docstring, on one line."""
    return " ".join((model.__doc__ or "").strip().split("\n\n")[0].split())


def render_spec_reference() -> str:
    """Markdown reference of every JobSpec field: top-level fields, then one table per section."""
    top = {k: i for k, i in JobSpec.model_fields.items() if _model(i.annotation) is None}
    blocks = []
    if top:
        blocks.append(f"### top level\n\n{_summary(JobSpec)}\n\n{_HEADER}\n" + "\n".join(_rows(top, "")))
    for key, info in JobSpec.model_fields.items():
        section = _model(info.annotation)
        if section is None:
            continue
        note = "Required section." if info.is_required() else "Optional section."
        rows = "\n".join(_rows(section.model_fields, key + "."))
        blocks.append(f"### {key}\n\n{_summary(section)} {note}\n\n{_HEADER}\n{rows}")
    return "\n\n".join(blocks) + "\n"


def splice_reference(text: str, reference: str) -> str:
    """``text`` with everything between the START and END markers replaced by ``reference``."""
    head, sep, rest = text.partition(START)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise ValueError(f"markers {START} and {END} not found (in that order)")
    return f"{head}{START}\n{reference}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.spec.reference", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--write", metavar="FILE", type=Path, help="update the marked section of FILE")
    args = parser.parse_args(argv)
    reference = render_spec_reference()
    if args.write is None:
        sys.stdout.write(reference)
        return 0
    text = args.write.read_text(encoding="utf-8")
    try:
        new = splice_reference(text, reference)
    except ValueError as exc:
        print(f"{args.write}: {exc}; add them where the reference belongs", file=sys.stderr)
        return 1
    args.write.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
