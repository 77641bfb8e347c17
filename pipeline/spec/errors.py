"""What a bad job spec raises: SpecError, one readable line per problem."""

from __future__ import annotations

from pydantic_core import PydanticCustomError


class SpecError(Exception):
    """An invalid job spec. ``errors`` holds one line per problem: ``<field.path>: <message>``."""

    def __init__(self, errors: list[str] | str, source: str | None = None):
        if isinstance(errors, str):
            errors = [errors]
        self.errors: list[str] = list(errors)
        self.source: str = source if source is not None else "<dict>"
        # keep args picklable (Ray ships exceptions between processes)
        super().__init__(self.errors, self.source)

    def __str__(self) -> str:
        if not self.errors:
            return f"{self.source}: invalid job spec"
        return "\n".join(f"{self.source}: {line}" for line in self.errors)


def rule_error(field: str, message: str) -> PydanticCustomError:
    """A validation error attributed to an explicit dotted field path (for cross-field rules)."""
    return PydanticCustomError("spec_rule", "{message}", {"field": field, "message": message})
