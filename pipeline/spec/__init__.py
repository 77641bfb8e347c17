"""The job spec: what to run. `schema` (the pydantic models and their rules), `loading` (YAML,
overrides, readable errors, slower checks), `errors` (SpecError), `reference` (generates
docs/spec-reference.md from the schema)."""

from pipeline.spec.errors import SpecError
from pipeline.spec.loading import (
    check_context_length,
    check_models_reachable,
    load_spec,
    parse_overrides,
    spec_from_dict,
)
from pipeline.spec.schema import (
    DEFAULT_TEMPLATES,
    DrafterSpec,
    ExecutionSpec,
    GenerationSpec,
    InputSpec,
    JobSpec,
    ModelRefSpec,
    ModelsSpec,
    OutputSpec,
    TaskSpec,
    new_run_id,
    today_utc,
)

__all__ = [
    "SpecError",
    "JobSpec",
    "InputSpec",
    "TaskSpec",
    "GenerationSpec",
    "ModelRefSpec",
    "ModelsSpec",
    "DrafterSpec",
    "ExecutionSpec",
    "OutputSpec",
    "DEFAULT_TEMPLATES",
    "load_spec",
    "spec_from_dict",
    "parse_overrides",
    "check_models_reachable",
    "check_context_length",
    "new_run_id",
    "today_utc",
]
