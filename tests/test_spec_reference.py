"""The job spec reference in docs/spec-reference.md is generated from the schema and must match it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from pipeline.spec import JobSpec
from pipeline.spec.reference import END, START, main, render_spec_reference

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "spec-reference.md"


def _leaves(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """(dotted name, field info) of every non-model field, descending into nested models."""
    for key, info in model.model_fields.items():
        args = (info.annotation, *get_args(info.annotation))
        nested = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if nested:
            yield from _leaves(nested[0], f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", info


def _cells(text: str, name: str) -> list[str]:
    """The cells of the table row for ``name`` (split on unescaped pipes)."""
    rows = [line for line in text.splitlines() if line.startswith(f"| `{name}` |")]
    assert len(rows) == 1, f"expected one row for {name}, found {len(rows)}"
    return [c.strip() for c in re.split(r"(?<!\\)\|", rows[0])[1:-1]]


def test_reference_is_up_to_date() -> None:
    text = REFERENCE.read_text(encoding="utf-8")
    assert START in text and END in text, f"docs/spec-reference.md lacks the markers {START} / {END}"
    section = text.split(START, 1)[1].split(END, 1)[0]
    assert section == "\n" + render_spec_reference(), (
        "docs/spec-reference.md is out of date: "
        "run `python -m pipeline.spec.reference --write docs/spec-reference.md`"
    )


def test_every_leaf_field_is_documented() -> None:
    text = render_spec_reference()
    leaves = list(_leaves(JobSpec))
    assert len(leaves) > 20
    for name, info in leaves:
        cells = _cells(text, name)
        assert len(cells) == 4 and (cells[3] or not info.description), cells


def test_required_and_literal_fields() -> None:
    text = render_spec_reference()
    leaves = dict(_leaves(JobSpec))
    required = [n for n, i in leaves.items() if i.is_required()]
    optional = [n for n, i in leaves.items() if not i.is_required()]
    literals = {
        n: get_args(a)
        for n, i in leaves.items()
        for a in (i.annotation, *get_args(i.annotation))
        if get_origin(a) is Literal
    }
    assert required and optional and literals
    for name in required:
        assert _cells(text, name)[2] == "required", name
    for name in optional:
        assert _cells(text, name)[2] != "required", name
    for name, choices in literals.items():
        type_cell = _cells(text, name)[1]
        assert all(str(c) in type_cell for c in choices), (name, type_cell)


def test_write_without_markers_fails(tmp_path: Path, capsys) -> None:
    target = tmp_path / "spec-reference.md"
    target.write_text("# no markers here\n", encoding="utf-8")
    assert main(["--write", str(target)]) == 1
    assert "markers" in capsys.readouterr().err
    assert target.read_text(encoding="utf-8") == "# no markers here\n"
