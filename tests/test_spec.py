"""Job spec loading and validation: shipped jobs, rendering, overrides and readable errors."""

from __future__ import annotations

import json
import pickle
import re
import textwrap
import types
from pathlib import Path

import pytest

import pipeline.models.pairs
from pipeline.spec import (
    JobSpec,
    SpecError,
    check_models_reachable,
    load_spec,
    new_run_id,
    parse_overrides,
    spec_from_dict,
)

ROOT = Path(__file__).resolve().parents[1]
JOBS = sorted((ROOT / "jobs").glob("*.yaml"))

VALID = """\
name: t1
input:
  url: s3://corpus/docs/{date}/
task:
  kind: summarize
models:
  pair: tiny
output:
  url: s3://results/{name}/{date}/{run_id}
"""


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def errors_of(path: Path, **kwargs) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_spec(path, **kwargs)
    err = info.value
    assert err.errors, "SpecError without error lines"
    assert all("\n" not in line for line in err.errors)
    # str() prefixes every line with the spec file name
    assert all(line.startswith(str(path) + ": ") for line in str(err).splitlines())
    return err.errors


# --------------------------------------------------------------------------------------------
# valid specs


def test_jobs_are_shipped():
    assert {p.name for p in JOBS} >= {"demo.yaml", "summarize.yaml", "translate.yaml"}


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_shipped_jobs_load(path: Path):
    spec = load_spec(path, run_id="r42", date="2026-01-02")
    assert "{" not in spec.input.url and "{" not in spec.output.url
    assert spec.run_id == "r42" and spec.date == "2026-01-02"
    assert spec.source == str(path)
    json.dumps(spec.to_dict())  # manifests need plain JSON


def test_demo_job_settings():
    spec = load_spec(ROOT / "jobs" / "demo.yaml", run_id="r1")
    assert spec.input.url == "./data/demo"
    assert spec.output.url == "./out/demo/r1"
    assert spec.task.kind == "summarize" and spec.task.max_input_tokens == 256
    assert spec.models.pair == "qwen2.5-coder" and spec.drafter.kind == "auto"
    assert spec.generation.max_new_tokens == 32 and spec.generation.greedy
    assert (spec.execution.batch_size, spec.execution.num_actors, spec.execution.num_cpus) == (4, 1, 2)
    # two of a shard's 6 demo rows in pairs, and no more pairs than half the decoding costs
    assert spec.execution.speedup_sample == 0.3 and spec.execution.speedup_sample_tokens == 0
    assert spec.execution.speedup_sample_budget == 0.5


def test_placeholders_rendered(tmp_path: Path):
    spec = load_spec(write(tmp_path, VALID), run_id="20260101T000000Z", date="2026-03-04")
    assert spec.input.url == "s3://corpus/docs/2026-03-04/"
    assert spec.output.url == "s3://results/t1/2026-03-04/20260101T000000Z"


def test_default_date_and_run_id(tmp_path: Path):
    spec = load_spec(write(tmp_path, VALID))
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", spec.date)
    assert re.fullmatch(r"\d{8}T\d{6}Z", spec.run_id)
    assert spec.output.url == f"s3://results/t1/{spec.date}/{spec.run_id}"
    assert re.fullmatch(r"\d{8}T\d{6}Z", new_run_id())


def test_defaults(tmp_path: Path):
    spec = load_spec(write(tmp_path, VALID))
    assert spec.input.text_column == "text" and spec.input.id_column == "id"
    assert spec.task.overlong == "truncate" and spec.task.max_input_tokens == 2048
    assert spec.generation.max_new_tokens == 128 and spec.generation.greedy
    assert spec.models.dtype == "auto" and spec.models.device == "auto"
    assert spec.drafter.kind == "auto" and spec.drafter.gamma_max == 8
    assert spec.execution.batch_size == 8 and spec.execution.threads is None
    assert spec.output.overwrite is False


def test_auto_without_the_draft_model_needs_no_draft(tmp_path: Path):
    text = VALID.replace("  pair: tiny", "  target: org/big")
    text += "drafter: {auto_sources: [prompt_lookup, suffix]}\n"
    spec = load_spec(write(tmp_path, text))
    assert spec.models.draft is None and spec.drafter.auto_sources == ["prompt_lookup", "suffix"]


def test_auto_chooses_among_a_head_only_where_its_sources_name_it(tmp_path: Path):
    spec = load_spec(write(tmp_path, VALID + "drafter: {head: heads/mine}\n"))
    assert "head" not in spec.drafter.auto_sources
    spec = load_spec(write(tmp_path, VALID + "drafter: {head: heads/mine, auto_sources: [suffix, head]}\n"))
    assert spec.drafter.auto_sources == ["suffix", "head"]


def test_a_learning_head_needs_no_head_to_start_from(tmp_path: Path):
    spec = load_spec(write(tmp_path, VALID + "drafter: {kind: head, head_online: true}\n"))
    assert spec.drafter.head is None and spec.drafter.head_online_share == 0.25
    spec = load_spec(write(tmp_path, VALID + "drafter: {head_online: true, auto_sources: [suffix, head]}\n"))
    assert spec.drafter.head is None


def test_overrides(tmp_path: Path):
    spec = load_spec(
        write(tmp_path, VALID),
        run_id="r1",
        overrides={
            "output.url": "memory://elsewhere/{run_id}",
            "generation.max_new_tokens": 7,
            "drafter.kind": "prompt_lookup",
        },
    )
    assert spec.output.url == "memory://elsewhere/r1"
    assert spec.generation.max_new_tokens == 7
    assert spec.drafter.kind == "prompt_lookup"


def test_bad_override_is_reported(tmp_path: Path):
    errors = errors_of(write(tmp_path, VALID), overrides={"generation.max_new_tokens": "lots"})
    assert errors == ["generation.max_new_tokens: expected an integer >= 1 and <= 8192, got 'lots'"]
    errors = errors_of(write(tmp_path, VALID), overrides={"models.pair.x": 1})
    assert errors[0].startswith("models.pair: ")


def test_parse_overrides():
    parsed = parse_overrides(
        ["generation.max_new_tokens=64", "generation.greedy=false", "output.url=s3://b/x", "a.b=2026-01-02"]
    )
    assert parsed == {
        "generation.max_new_tokens": 64,
        "generation.greedy": False,
        "output.url": "s3://b/x",
        "a.b": "2026-01-02",
    }
    with pytest.raises(SpecError):
        parse_overrides(["no-equals-sign"])


def test_model_shorthand_and_target_only(tmp_path: Path):
    data = {
        "name": "t",
        "input": {"url": "./in"},
        "task": {"kind": "translate", "source_language": "English", "target_language": "German"},
        "models": {"target": "org/big"},
        "drafter": {"kind": "prompt_lookup"},
        "output": {"url": "./out/{name}"},
    }
    spec = spec_from_dict(data)
    assert spec.models.target.path == "org/big" and spec.models.draft is None
    assert "German" in spec.task.format_prompt("hello") and "hello" in spec.task.format_prompt("hello")


def test_custom_template_and_literal_braces():
    data = {
        "name": "t",
        "input": {"url": "memory://in"},
        "task": {"kind": "custom", "template": 'Answer as JSON {{"k": 1}}: {text}'},
        "models": {"pair": "p"},
        "output": {"url": "memory://out"},
    }
    spec = spec_from_dict(data)
    assert spec.task.format_prompt("doc") == 'Answer as JSON {"k": 1}: doc'


def test_to_dict_round_trips_and_has_no_secrets(tmp_path: Path):
    text = VALID + "  storage_options: {endpoint_url: 'http://minio:9000', anon: false, profile: batch}\n"
    spec = load_spec(write(tmp_path, text), run_id="r1", date="2026-01-01")
    dumped = spec.to_dict()
    assert dumped["output"]["storage_options"]["endpoint_url"] == "http://minio:9000"
    again = spec_from_dict(json.loads(json.dumps(dumped)))
    assert again.to_dict() == dumped
    blob = json.dumps(dumped).lower()
    assert "secret" not in blob and "password" not in blob


def test_with_absolute_paths(tmp_path: Path):
    spec = spec_from_dict(
        {
            "name": "t",
            "input": {"url": "./in"},
            "task": {"kind": "summarize"},
            "models": {"target": "./models/t", "draft": "org/draft"},
            "output": {"url": "file://out/x"},
        }
    )
    fixed = spec.with_absolute_paths(tmp_path)
    assert fixed.input.url == str(tmp_path / "in")
    assert fixed.output.url == "file://" + str(tmp_path / "out" / "x")
    assert fixed.models.target.path == str(tmp_path / "models" / "t")
    assert fixed.models.draft.path == "org/draft"


def test_schema_documents_every_field():
    schema = JobSpec.model_json_schema()
    missing = []
    for name, model in [("JobSpec", schema), *schema["$defs"].items()]:
        for field, prop in model.get("properties", {}).items():
            if not prop.get("description"):
                missing.append(f"{name}.{field}")
    assert not missing
    assert schema["additionalProperties"] is False


def test_spec_error_pickles():
    err = SpecError(["a: b", "c: d"], "x.yaml")
    again = pickle.loads(pickle.dumps(err))
    assert again.errors == err.errors and str(again) == str(err)


# --------------------------------------------------------------------------------------------
# broken specs: (id, yaml text, substrings that must appear in the error message)

BROKEN = [
    ("unknown-top-key", VALID + "colour: blue\n", ["(top level): unknown key 'colour'"]),
    (
        "unknown-nested-key",
        VALID.replace("  pair: tiny", "  pair: tiny\n  targte: x"),
        ["models: unknown key 'targte' (did you mean 'target'?)"],
    ),
    (
        "wrong-type-int",
        VALID + "generation:\n  max_new_tokens: abc\n",
        ["generation.max_new_tokens: expected an integer >= 1 and <= 8192, got 'abc'"],
    ),
    (
        "wrong-type-bool",
        VALID + "generation:\n  greedy: 'maybe'\n",
        ["generation.greedy: expected a boolean (true or false), got 'maybe'"],
    ),
    (
        "out-of-range",
        VALID + "generation:\n  top_p: 0\n",
        ["generation.top_p: expected a number > 0 and <= 1"],
    ),
    ("bad-literal", VALID + "drafter:\n  kind: magic\n", ["drafter.kind: expected one of 'auto'"]),
    (
        "bad-auto-source",
        VALID + "drafter:\n  auto_sources: [suffix, beam]\n",
        [
            "drafter.auto_sources[1]: expected one of 'draft_model', 'prompt_lookup', 'suffix' or 'head', "
            "got 'beam'"
        ],
    ),
    ("no-auto-source", VALID + "drafter:\n  auto_sources: []\n", ["drafter.auto_sources: "]),
    (
        "auto-head-without-head",
        VALID + "drafter:\n  auto_sources: [suffix, head]\n",
        ["drafter.head: required when auto_sources names head, unless head_online"],
    ),
    (
        "learning-head-not-drafting",
        VALID + "drafter:\n  kind: suffix\n  head_online: true\n",
        ["drafter.head_online: needs the head among the drafters (kind head, or head in auto_sources)"],
    ),
    (
        "learning-share-out-of-range",
        VALID + "drafter:\n  kind: head\n  head_online: true\n  head_online_share: 9\n",
        ["drafter.head_online_share: expected a number >= 0 and <= 4"],
    ),
    ("section-not-mapping", VALID + "execution: 3\n", ["execution: expected a mapping, got 3"]),
    ("missing-required-name", VALID.replace("name: t1\n", ""), ["name: required field is missing"]),
    (
        "missing-required-task-kind",
        VALID.replace("  kind: summarize\n", "  chat_template: true\n"),
        ["task.kind: required field is missing"],
    ),
    ("missing-output", VALID.split("output:")[0], ["output: required field is missing"]),
    ("bad-name", VALID.replace("name: t1", "name: 'my job'"), ["name: expected letters, digits"]),
    (
        "bad-scheme",
        VALID.replace("s3://corpus/docs/{date}/", "ftp://host/docs/"),
        ["input.url: unsupported URL scheme 'ftp' (expected s3://, file://, memory:// or a local path)"],
    ),
    (
        "unknown-placeholder",
        VALID.replace("{run_id}", "{hour}"),
        ["output.url: unknown placeholder {hour}"],
    ),
    (
        "credentials-in-storage-options",
        VALID.replace("docs/{date}/", "docs/{date}/\n  storage_options: {key: AKIA, secret: shh}"),
        ["input.storage_options: credential keys are not allowed", "environment"],
    ),
    (
        "nested-credentials",
        VALID + "  storage_options: {client_kwargs: {aws_session_token: x}}\n",
        ["output.storage_options: credential keys are not allowed", "client_kwargs.aws_session_token"],
    ),
    (
        "credentials-in-url",
        VALID.replace("s3://results/", "s3://user:pw@results/"),
        ["output.url: credentials must not be embedded"],
    ),
    (
        "missing-draft",
        VALID.replace("  pair: tiny", "  target: org/big"),
        ["models.draft: required when drafter.kind is 'auto'"],
    ),
    (
        "missing-draft-auto-with-draft-model",
        VALID.replace("  pair: tiny", "  target: org/big") + "drafter: {auto_sources: [draft_model]}\n",
        ["models.draft: required when drafter.kind is 'auto'"],
    ),
    (
        "missing-draft-explicit-drafter",
        VALID.replace("  pair: tiny", "  target: org/big") + "drafter: {kind: draft_model}\n",
        ["models.draft: required when drafter.kind is 'draft_model'"],
    ),
    (
        "pair-and-target",
        VALID.replace("  pair: tiny", "  pair: tiny\n  target: org/big"),
        ["models: give either 'pair' or 'target'/'draft', not both"],
    ),
    ("no-models", VALID.replace("  pair: tiny", "  dtype: auto"), ["models: expected either 'pair'"]),
    (
        "translate-without-languages",
        VALID.replace("kind: summarize", "kind: translate"),
        ["task.source_language: required when task.kind is 'translate'"],
    ),
    (
        "translate-without-target-language",
        VALID.replace("kind: summarize", "kind: translate\n  source_language: English"),
        ["task.target_language: required when task.kind is 'translate'"],
    ),
    (
        "language-on-summarize",
        VALID.replace("kind: summarize", "kind: summarize\n  target_language: French"),
        ["task.target_language: only allowed when task.kind is 'translate'"],
    ),
    (
        "custom-template-without-text",
        VALID.replace("kind: summarize", "kind: custom\n  template: 'Summarize this'"),
        ["task.template: must contain the {text} placeholder"],
    ),
    (
        "custom-without-template",
        VALID.replace("kind: summarize", "kind: custom"),
        ["task.template: required when task.kind is 'custom'"],
    ),
    (
        "output-inside-input",
        VALID.replace("s3://results/{name}/{date}/{run_id}", "s3://corpus/docs/{date}/out"),
        ["output.url: must not be, contain or be inside the input location"],
    ),
    (
        "output-equals-input",
        VALID.replace("s3://results/{name}/{date}/{run_id}", "s3://corpus/docs/{date}"),
        ["output.url: must not be, contain or be inside the input location"],
    ),
    (
        "output-path-traversal",
        VALID.replace("s3://results/{name}/{date}/{run_id}", "./out/../../etc"),
        ["output.url: must not contain '..' path segments"],
    ),
    (
        "ngram-order",
        VALID + "drafter:\n  ngram_min: 5\n  ngram_max: 2\n",
        ["drafter.ngram_min: must be <= drafter.ngram_max (2)"],
    ),
    (
        "cuda-without-gpus",
        VALID.replace("  pair: tiny", "  pair: tiny\n  device: cuda"),
        ["execution.num_gpus: must be > 0 when models.device is 'cuda'"],
    ),
    ("list-item", VALID + "generation:\n  stop: ['', 3]\n", ["generation.stop[0]: must not be empty"]),
    ("yaml-syntax-error", "name: t1\ninput:\n  url: [unclosed\n", ["(yaml): syntax error at line"]),
    ("non-mapping", "- name: t1\n- input: x\n", ["(top level): expected a mapping", "got a list"]),
    ("empty-file", "", ["(top level): expected a mapping", "empty document"]),
]


@pytest.mark.parametrize("text, expected", [c[1:] for c in BROKEN], ids=[c[0] for c in BROKEN])
def test_broken_spec(tmp_path: Path, text: str, expected: list[str]):
    path = write(tmp_path, text)
    errors = errors_of(path, date="2026-01-01", run_id="r1")
    message = "\n".join(errors)
    for needle in expected:
        assert needle in message, f"{needle!r} not in:\n{message}"


def test_all_errors_reported_at_once(tmp_path: Path):
    text = """\
        name: t1
        input: {url: 'gs://x/'}
        task: {kind: summarize, max_input_tokens: 0}
        generation: {max_new_tokens: 0, temperature: -1}
        models: {pair: tiny, whatever: 1}
        execution: {batch_size: 1000}
        output: {url: 's3://r/{nope}'}
    """
    errors = errors_of(write(tmp_path, text))
    fields = [line.split(":", 1)[0] for line in errors]
    assert fields == [
        "input.url",
        "task.max_input_tokens",
        "generation.max_new_tokens",
        "generation.temperature",
        "models",
        "execution.batch_size",
        "output.url",
    ]


def test_bad_run_id_and_date(tmp_path: Path):
    path = write(tmp_path, VALID)
    assert errors_of(path, run_id="../x")[0].startswith("run_id: ")
    assert errors_of(path, date="yesterday")[0].startswith("date: expected YYYY-MM-DD")


def test_missing_file(tmp_path: Path):
    errors = errors_of(tmp_path / "nope.yaml")
    assert errors[0].startswith("(file): cannot read spec")


# --------------------------------------------------------------------------------------------
# check_models_reachable (tokenizers only, no weights)


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory) -> dict[str, Path]:
    from tiny_models import build_tokenizer

    root = tmp_path_factory.mktemp("toks")
    dirs = {}
    for name, size in (("a", 320), ("b", 320), ("c", 300)):
        dirs[name] = root / name
        build_tokenizer(vocab_size=size).save_pretrained(dirs[name])
    return dirs


def _spec_with(target: str, draft: str | None, drafter: str = "auto") -> JobSpec:
    models = {"target": target} if draft is None else {"target": target, "draft": draft}
    return spec_from_dict(
        {
            "name": "t",
            "input": {"url": "memory://in"},
            "task": {"kind": "summarize"},
            "models": models,
            "drafter": {"kind": drafter},
            "output": {"url": "memory://out"},
        }
    )


def test_tokenizers_match(tokenizer_dirs):
    assert check_models_reachable(_spec_with(str(tokenizer_dirs["a"]), str(tokenizer_dirs["b"]))) == []


def test_tokenizers_mismatch(tokenizer_dirs):
    target, draft = str(tokenizer_dirs["a"]), "file://" + str(tokenizer_dirs["c"])
    errors = check_models_reachable(_spec_with(target, draft))
    assert len(errors) == 1
    assert errors[0].startswith(f"models.draft: tokenizer of {draft} does not match target {target}")
    assert "vocab sizes 300 vs 320" in errors[0]


def test_unreachable_models_are_skipped(tokenizer_dirs, tmp_path: Path):
    assert check_models_reachable(_spec_with("org/big", "org/small")) == []
    assert check_models_reachable(_spec_with(str(tokenizer_dirs["a"]), str(tmp_path / "missing"))) == []
    assert check_models_reachable(_spec_with(str(tokenizer_dirs["a"]), None, "none")) == []


def test_pair_resolution(tokenizer_dirs, monkeypatch):
    ref = types.SimpleNamespace
    pairs = {"good": (ref(path=str(tokenizer_dirs["a"])), ref(path=str(tokenizer_dirs["c"])))}

    def resolve_pair(name: str):
        return pairs[name]  # KeyError for unknown pairs, like the real one

    monkeypatch.setattr(pipeline.models.pairs, "resolve_pair", resolve_pair)
    base = {
        "name": "t",
        "input": {"url": "memory://in"},
        "task": {"kind": "summarize"},
        "output": {"url": "memory://out"},
    }
    errors = check_models_reachable(spec_from_dict({**base, "models": {"pair": "good"}}))
    assert len(errors) == 1 and errors[0].startswith("models.draft: tokenizer of ")
    assert check_models_reachable(spec_from_dict({**base, "models": {"pair": "unknown"}})) == []
