"""The job spec's schema: pydantic models with strict types, where unknown keys are errors.

A job spec describes one batch run: where the Parquet shards come from, what to ask the model,
how to decode, which target/draft models to use, how to spread the work over Ray actors and
where to write the results. Cross-field rules (placeholders, overlapping input and output,
credentials) are checked here too; loading a spec from YAML and turning validation errors into
readable lines is `pipeline.spec.loading`.
"""

from __future__ import annotations

import datetime as dt
import os
import posixpath
import re
import string
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pipeline.decode.settings import AUTO_CHOICES, AUTO_SOURCES, DRAFTERS, field_bounds
from pipeline.spec.errors import rule_error
from pipeline.storage.secrets import CREDENTIALS_HINT, find_credentials, has_userinfo, redact_options
from pipeline.storage.urls import GLOB_CHARS, split_scheme

# --------------------------------------------------------------------------------------------
# helpers: run ids, dates, URLs

SUPPORTED_SCHEMES = ("s3", "file", "memory")
_PLACEHOLDER_RE = re.compile(r"\{([^{}]*)\}")
_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$"
_NAME_RE = re.compile(_NAME_PATTERN)
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")

INPUT_PLACEHOLDERS = ("date", "run_id")
OUTPUT_PLACEHOLDERS = ("date", "run_id", "name")
# a nightly job warm-starts from the night before's output: {date-1} is the day before {date}; no
# {run_id}, which names this run, whose output is not written yet
WARM_START_PLACEHOLDERS = ("date", "date-1", "name")


def new_run_id(now: dt.datetime | None = None) -> str:
    """A timestamp-based run id such as ``20261123T081500Z`` (UTC, second resolution)."""
    now = now or dt.datetime.now(dt.timezone.utc)
    return now.astimezone(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def today_utc() -> str:
    """Today's date in UTC as ``YYYY-MM-DD``."""
    return dt.datetime.now(dt.timezone.utc).date().isoformat()


def _check_placeholders_rendered(url: str, supported: tuple[str, ...]) -> None:
    leftovers = _PLACEHOLDER_RE.findall(url)
    if "name" in supported and "name" in leftovers:
        raise ValueError("placeholder {name} could not be rendered because 'name' is missing or invalid")
    if leftovers:
        names = ", ".join("{" + p + "}" for p in leftovers)
        allowed = ", ".join("{" + p + "}" for p in supported)
        raise ValueError(f"unknown placeholder {names} (supported: {allowed})")
    if "{" in url or "}" in url:
        raise ValueError(f"unbalanced '{{' or '}}' in {url!r} (braces are only allowed around placeholders)")


def _check_url(url: str) -> None:
    """Scheme and shape checks shared by input.url and output.url (after rendering)."""
    if url != url.strip():
        raise ValueError(f"must not start or end with whitespace, got {url!r}")
    scheme, rest = split_scheme(url)
    if scheme is not None and scheme not in SUPPORTED_SCHEMES:
        raise ValueError(
            f"unsupported URL scheme {scheme!r} (expected s3://, file://, memory:// or a local path)"
        )
    if has_userinfo(url):
        raise ValueError(f"credentials must not be embedded in URLs; {CREDENTIALS_HINT}")
    if scheme in ("s3", "memory") and not rest.split("/", 1)[0]:
        what = "a bucket" if scheme == "s3" else "a path"
        raise ValueError(f"expected {what} after {scheme}://, got {url!r}")
    if scheme == "file" and not rest:
        raise ValueError(f"expected a path after file://, got {url!r}")


def _path_segments(url: str) -> list[str]:
    _, rest = split_scheme(url)
    return re.split(r"[/\\]+", rest)


def _normalized_location(url: str) -> tuple[str, str]:
    """(scheme, absolute normalized path) used to compare input and output locations.

    Local paths (plain, relative or file://) are resolved through symlinks: a link to the
    input directory is the input directory, and writing through it would replace the corpus.
    """
    scheme, rest = split_scheme(url)
    if scheme in (None, "file"):
        return "file", os.path.realpath(os.path.expanduser(rest))
    return scheme, posixpath.normpath("/" + rest.strip("/"))


def _input_base(url: str) -> str:
    """The directory an input URL covers: the URL itself, or for a glob the folder before it."""
    cut = min((url.find(c) for c in GLOB_CHARS if c in url), default=-1)
    if cut < 0:
        return url
    head = url[:cut]
    if head.endswith("/"):
        return head
    scheme, rest = split_scheme(head)
    parent = posixpath.dirname(rest)
    return f"{scheme}://{parent}" if scheme else (parent or ".")


def _is_inside(inner: str, outer: str) -> bool:
    s_in, p_in = _normalized_location(inner)
    s_out, p_out = _normalized_location(outer)
    if s_in != s_out:
        return False
    return p_in == p_out or p_in.startswith(p_out.rstrip("/") + "/")


def _overlaps(a: str, b: str) -> bool:
    """True when one location is the other or lies inside it."""
    return _is_inside(a, b) or _is_inside(b, a)


def _is_local_model_path(path: str) -> bool:
    """True for file:// URLs, explicit local paths and relative paths that exist as directories."""
    if path.startswith("file://"):
        return True
    if path.startswith(("/", "./", "../", "~")) or path in (".", ".."):
        return True
    return os.path.isdir(path)


def _local_model_dir(path: str) -> Path | None:
    """The local directory for a model path if it exists, else None (hub ids, missing dirs)."""
    p = path[len("file://") :] if path.startswith("file://") else path
    p = os.path.expanduser(p)
    return Path(p) if os.path.isdir(p) else None


# --------------------------------------------------------------------------------------------
# schema


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=False)


StorageOptions = dict[str, Any]
_STORAGE_DESCRIPTION = (
    "Extra fsspec/s3fs options, e.g. endpoint_url, profile, region_name, anon, client_kwargs, "
    "config_kwargs. Credential keys (key, secret, token, password, aws_*_key*, ...) are rejected: "
    + CREDENTIALS_HINT
    + "."
)


def _validate_storage_options(value: dict[str, Any]) -> dict[str, Any]:
    found = find_credentials(value)
    if found:
        keys = ", ".join(repr(k) for k in found)
        raise ValueError(f"credential keys are not allowed (found {keys}); {CREDENTIALS_HINT}")
    return value


class InputSpec(_Section):
    """Where the documents come from: Parquet shards under a prefix or matching a glob."""

    url: str = Field(
        min_length=1,
        description=(
            "Prefix (directory) or glob of .parquet shards: s3://bucket/prefix/, file:///abs/dir, "
            "memory://dir or a local path (relative to the working directory). Placeholders "
            "{date} and {run_id} are rendered at load time."
        ),
        examples=["s3://my-bucket/corpus/{date}/", "./data/demo", "s3://b/docs/part-*.parquet"],
    )
    text_column: str = Field("text", min_length=1, description="Column holding the document text.")
    id_column: str = Field("id", min_length=1, description="Column holding a unique document id.")
    keep_columns: list[typing.Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list, description="Input columns copied unchanged to the output records."
    )
    storage_options: StorageOptions = Field(default_factory=dict, description=_STORAGE_DESCRIPTION)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        _check_placeholders_rendered(v, INPUT_PLACEHOLDERS)
        _check_url(v)
        return v

    @field_validator("storage_options")
    @classmethod
    def _storage(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _validate_storage_options(v)

    @property
    def is_glob(self) -> bool:
        """True when ``url`` is a glob pattern rather than a prefix."""
        return any(c in self.url for c in GLOB_CHARS)


DEFAULT_TEMPLATES: dict[str, str] = {
    "summarize": "Summarize the following document in a few sentences.\n\n{text}",
    "translate": (
        "Translate the following text from {source_language} to {target_language}. "
        "Reply with the translation only.\n\n{text}"
    ),
}
_TEMPLATE_FIELDS = {"text", "source_language", "target_language"}


class TaskSpec(_Section):
    """What to ask the model for each document."""

    kind: Literal["summarize", "translate", "custom"] = Field(
        description="summarize, translate (needs source_language and target_language) or custom "
        "(needs template)."
    )
    source_language: str | None = Field(
        None, min_length=1, description="Language of the input documents (translate only, required)."
    )
    target_language: str | None = Field(
        None, min_length=1, description="Language to translate into (translate only, required)."
    )
    template: str | None = Field(
        None,
        min_length=1,
        description=(
            "Prompt template; must contain {text}. Required for kind custom, optional override of "
            "the built-in template otherwise. translate templates may also use {source_language} "
            "and {target_language}. Write {{ and }} for literal braces."
        ),
    )
    system_prompt: str | None = Field(
        None, description="Optional system message (used when the chat template is applied)."
    )
    chat_template: bool = Field(
        True, description="Wrap the prompt in the tokenizer's chat template when it has one."
    )
    max_input_tokens: int = Field(
        2048, ge=1, le=1_048_576, description="Documents longer than this many tokens are overlong."
    )
    overlong: Literal["truncate", "reject"] = Field(
        "truncate",
        description="truncate: cut overlong documents and flag the record; reject: write them to "
        "the error records instead of generating.",
    )

    @field_validator("source_language", "target_language")
    @classmethod
    def _languages_only_for_translate(cls, v: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("kind")
        if v is not None and kind is not None and kind != "translate":
            raise ValueError(f"only allowed when task.kind is 'translate' (task.kind is {kind!r})")
        return v

    @field_validator("template")
    @classmethod
    def _template(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(v) if f is not None]
        except ValueError as exc:
            raise ValueError(f"invalid template ({exc}); write {{{{ and }}}} for literal braces") from None
        unknown = sorted({f for f in fields if f not in _TEMPLATE_FIELDS})
        if unknown:
            raise ValueError(
                "unknown placeholder "
                + ", ".join("{" + f + "}" for f in unknown)
                + " (supported: {text}, {source_language}, {target_language})"
            )
        if "text" not in fields:
            raise ValueError("must contain the {text} placeholder")
        kind = info.data.get("kind")
        languages = {"source_language", "target_language"} & set(fields)
        if kind is not None and kind != "translate" and languages:
            raise ValueError(
                "{source_language}/{target_language} are only available when task.kind is 'translate'"
            )
        return v

    @model_validator(mode="after")
    def _kind_requirements(self) -> TaskSpec:
        if self.kind == "translate":
            missing = [f for f in ("source_language", "target_language") if getattr(self, f) is None]
            if missing:
                raise rule_error(f"task.{missing[0]}", "required when task.kind is 'translate'")
        if self.kind == "custom" and self.template is None:
            raise rule_error("task.template", "required when task.kind is 'custom' (must contain {text})")
        return self

    def prompt_template(self) -> str:
        """The effective template: the explicit one or the built-in one for this kind."""
        return self.template if self.template is not None else DEFAULT_TEMPLATES[self.kind]

    def format_prompt(self, text: str) -> str:
        """The user prompt for one document (before any chat template)."""
        return self.prompt_template().format(
            text=text, source_language=self.source_language, target_language=self.target_language
        )


class GenerationSpec(_Section):
    """Decoding settings, identical for the speculative and the target-only (reference) runs."""

    max_new_tokens: int = Field(128, ge=1, le=8192, description="Maximum tokens generated per document.")
    greedy: bool = Field(
        True, description="Greedy decoding; when false, temperature/top_p/top_k/seed apply (sampling)."
    )
    temperature: float = Field(1.0, gt=0, le=100, description="Sampling temperature (sampling only).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass in (0, 1]; 1 = off.")
    top_k: int = Field(0, ge=0, description="Keep only the k most likely tokens; 0 = off.")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Random seed for sampling.")
    stop: list[typing.Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list, description="Stop strings; generation ends after any of them appears."
    )


class ModelRefSpec(_Section):
    """One model: a Hugging Face hub id, a local directory or a file:// directory."""

    path: str = Field(
        min_length=1,
        description="Hub id (Qwen/Qwen2.5-0.5B-Instruct), local directory or file:// directory.",
    )
    revision: str | None = Field(None, min_length=1, description="Hub revision (branch, tag or commit).")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        # `target: Qwen/Qwen2.5-7B-Instruct` is accepted as `target: {path: ...}`
        return {"path": data} if isinstance(data, str) else data

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        scheme, rest = split_scheme(v)
        if scheme is not None and scheme != "file":
            raise ValueError(
                f"unsupported model location scheme {scheme!r} "
                "(expected a hub id, a local directory or a file:// directory)"
            )
        if scheme == "file" and not rest:
            raise ValueError("expected a directory after file://")
        return v

    @property
    def is_local(self) -> bool:
        """True if ``path`` refers to a local directory rather than a hub id."""
        return _is_local_model_path(self.path)

    def local_dir(self) -> Path | None:
        """The existing local directory of this model, or None (hub id or missing directory)."""
        return _local_model_dir(self.path)


class ModelsSpec(_Section):
    """Target and draft models: a named pair, or explicit target (+ draft)."""

    pair: str | None = Field(
        None,
        pattern=_NAME_PATTERN,
        description="Name of a model pair in configs/models.yaml; excludes target and draft.",
        examples=["qwen2.5-coder"],
    )
    target: ModelRefSpec | None = Field(
        None,
        description="The model whose output is produced. A bare string is shorthand for {path: ...}.",
    )
    draft: ModelRefSpec | None = Field(
        None,
        description="The small draft model; must share the target's tokenizer. Required unless a pair is "
        "given or drafter.kind is prompt_lookup, suffix or none.",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Weights dtype. auto: float32 where the target's GGUF blocks are streamed (see "
        "weights), else bfloat16 on GPU or on CPUs with avx512_bf16, else float32 (decided at load time).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: cuda when the actor has a GPU, else cpu."
    )
    batch_invariant: bool | None = Field(
        None,
        description="Target numerics that do not depend on how many tokens or rows share a pass, so "
        "speculative output is bitwise the target's own (on a CPU 1-row matrix products run as 2 "
        "rows, on a GPU Linear and RMSNorm inputs run in fixed blocks of rows; attention in float64, "
        "or for float32 and bfloat16 on a CPU in the streamed kernel, one fixed chain per query). "
        "Default (null): on for bfloat16/float16 on CPU and for every dtype on GPU, off otherwise.",
    )
    draft_int8: bool | None = Field(
        None,
        description="Draft decode steps read int8 copies of the draft's weights (one scale per "
        "output row): half the bytes of a memory-bound step, at some cost in acceptance; the "
        "output cannot change, the target checks every token. Default (null): on for CPU, off "
        "on GPU.",
    )
    weights: Literal["auto", "gguf-blocks", "dense"] = Field(
        "auto",
        description="The target's weights on a CPU. gguf-blocks: the GGUF blocks its install kept "
        "(Q4_K, Q6_K), streamed by the CPU kernel with float32 activations (dtype auto becomes float32): "
        "about a third of the bytes of bf16 weights per pass; decoding passes compute with the blocks' "
        "exact values (see block_activations), prefills with their bf16 rounding against bf16-rounded "
        "activations on CPUs with AVX512-BF16, and elsewhere with the blocks' integer codes against "
        "activations rounded to int8 (block_activations int8; float32: the installed bf16 weights). "
        "dense: the installed weights. auto: gguf-blocks where the target keeps blocks, the dtype is "
        "float32 on a CPU with AVX2 (dtype auto picks float32 there, also on CPUs with AVX512-BF16 but "
        "without AMX: a whole job ran faster on the blocks than on bf16) and execution.batch_size is at "
        "most 16 on CPUs with AVX512-BF16, 32 on others (2 with block_activations float32 there, whose "
        "prefills then cost as much as dense ones), else dense.",
    )
    block_activations: Literal["int8", "float32"] = Field(
        "int8",
        description="With gguf-blocks: what the blocks' decoding passes multiply them with. "
        "int8: each token's activations rounded to 8 bits per 256 values (one scale each, as "
        "llama.cpp's Q8_K), then integer products: a third of the instructions a weight, about "
        "as close to the float32 product as llama.cpp's own. float32: the activations as they "
        "are. Either way every pass computes a token the same way, so speculative output stays "
        "the target-only output bit for bit. int8 also rounds prefills' activations on CPUs "
        "without AVX512-BF16 (2.4x faster prefills in AVX2 code); those with it prefill bf16 rows.",
    )
    static_passes: bool | None = Field(
        None,
        description="Decode and verify passes through a KV cache of fixed slots written by position "
        "and a few fixed pass shapes, each replayed as one captured CUDA graph on a GPU (a GPU pass "
        "is otherwise bound by kernel launches); outputs are the same. Default (null): on for GPUs "
        "where the model is a plain decoder stack (Llama, Qwen2, Qwen3, Mistral without sliding "
        "windows), off on CPUs.",
    )
    compiled_passes: bool | None = Field(
        None,
        description="The static passes' decoder layers compiled with torch.compile before their "
        "graphs are captured: a few fused kernels per layer instead of about forty (a pass of the "
        "1.5B shape on an H200: 3.1 ms against 6.1 ms), for tens of seconds of compiling when an "
        "actor starts; outputs are the same. Needs static_passes. Default (null): on wherever "
        "static passes run on a GPU, off on CPUs.",
    )
    trust_remote_code: bool = Field(
        False, description="Allow custom modelling/tokenizer code from the model repository."
    )

    @model_validator(mode="after")
    def _pair_xor_paths(self) -> ModelsSpec:
        if self.pair is not None and (self.target is not None or self.draft is not None):
            raise rule_error("models", "give either 'pair' or 'target'/'draft', not both")
        if self.pair is None and self.target is None:
            if self.draft is not None:
                raise rule_error("models.target", "required when 'draft' is given (or use 'pair')")
            raise rule_error(
                "models",
                "expected either 'pair' (a named pair from configs/models.yaml) or 'target' and 'draft'",
            )
        return self


class DrafterSpec(_Section):
    """How draft tokens are proposed."""

    kind: Literal[DRAFTERS] = Field(
        "auto",
        description="draft_model: the draft model; prompt_lookup: n-grams copied from the prompt; "
        "suffix: the most frequent continuation of the text's longest matched suffix, in the row's own "
        "text and in the outputs this actor produced before; auto: choose per row by measured acceptance "
        "and cost; head: a draft head trained on the target's own features (drafter.head); none: "
        "target-only decoding.",
    )
    head: str | None = Field(
        None,
        description="A directory holding a draft head trained on this target's features (`pipeline distill "
        "--head`), or an earlier job's head/actor-<k>/ URL (head_online), read with output.storage_options; "
        "required when kind is head, unless head_online grows one. A head trained on another target is "
        "refused when the actors load it.",
    )
    head_online: bool = Field(
        False,
        description="Each actor's head goes on learning between shards from the rows it decoded (their "
        "prompts, the target's outputs and the target's features, which its passes computed anyway), "
        "for head_online_share of their decoding time; the shard stats record each refinement. With no "
        "drafter.head, the actors start from a new head (its layer a copy of the target's last one, "
        "proposing token ids below draft_vocab). At the end each actor writes its head under the output's "
        "head/actor-<k>/, where the next job's drafter.head can go on from it.",
    )
    head_online_share: float = Field(
        0.25,
        **field_bounds("head_online_share"),
        description="Seconds a learning head trains per second of decoding with it (head_online).",
    )
    gamma_max: int = Field(
        8, **field_bounds("gamma_max"), description="Maximum tokens drafted per verification step (0: none)."
    )
    adaptive: bool = Field(
        True, description="Adapt the number of drafted tokens to the measured acceptance and cost."
    )
    ngram_max: int = Field(
        4, **field_bounds("ngram_max"), description="Largest n-gram size tried by prompt lookup."
    )
    ngram_min: int = Field(
        1, **field_bounds("ngram_min"), description="Smallest n-gram size tried by prompt lookup."
    )
    draft_vocab: int = Field(
        32768,
        **field_bounds("draft_vocab"),
        description="The draft model proposes only token ids below this, plus the batch's prompt tokens "
        "and EOS: a cheaper output layer for the draft (lossless either way; 0 = the whole vocabulary). "
        "Raise it, or use 0, for output languages whose tokens have high ids.",
    )
    guess_tokens: int = Field(
        3,
        **field_bounds("guess_tokens"),
        description="A lone row's draft model checks up to this many tokens of a prompt-lookup copy in one "
        "pass, as a guess at its own next drafts: the same drafts in fewer passes where they follow the "
        "copy (0: one pass per draft).",
    )

    suffix_max_tokens: int = Field(
        1 << 20,
        **field_bounds("suffix_max_tokens"),
        description="The suffix drafter keeps at most this many tokens of the actor's earlier outputs, the "
        "oldest dropped first (0: only the row's own text). Memory grows with it: see docs/engine.md.",
    )
    suffix_min_match: int = Field(
        1,
        **field_bounds("suffix_min_match"),
        description="The suffix drafter proposes nothing where no suffix of the text this long matches "
        "(1, as prompt lookup: a short match's acceptance is measured apart and prices its drafts).",
    )
    plain_steps: int | None = Field(
        None,
        **field_bounds("plain_steps"),
        description="A greedy round that drafts nothing makes this many target passes back to back, each "
        "row fed its own last choice on the device without the host in between (the same tokens). "
        "Unset: 4 where passes are captured CUDA graphs (models.static_passes on a GPU), 1 elsewhere, "
        "where a pass costs far more than the round around it: see docs/engine.md.",
    )
    auto_sources: list[Literal[AUTO_CHOICES]] = Field(
        list(AUTO_SOURCES),
        min_length=1,
        description="The drafters `auto` chooses among per row (leave one out to measure what it adds). "
        "head (which needs drafter.head) is not among them unless named: see docs/choosing-a-draft.md "
        "for why.",
    )
    suffix_warm_start: str | None = Field(
        None,
        description="URL of an earlier run's output (its outputs/ Parquet files, or any directory of "
        "Parquet files with a `generated` column), read with output.storage_options: each actor's "
        "suffix drafter starts from those outputs, e.g. last night's translations, instead of empty "
        "(up to suffix_max_tokens). If it cannot be read, the job runs cold and its stats say why. "
        "Placeholders {date}, {date-1} (the day before {date}) and {name} are rendered at load time.",
        examples=["s3://my-bucket/{name}/{date-1}/nightly-{date-1}/"],
    )

    @field_validator("suffix_warm_start")
    @classmethod
    def _warm_start_rendered(cls, v: str | None) -> str | None:
        if v is not None:
            _check_placeholders_rendered(v, WARM_START_PLACEHOLDERS)
        return v

    @model_validator(mode="after")
    def _head_given(self) -> DrafterSpec:
        drafts = self.kind == "head" or (self.kind == "auto" and "head" in self.auto_sources)
        if self.head_online and not drafts:
            needs = "needs the head among the drafters (kind head, or head in auto_sources)"
            raise rule_error("drafter.head_online", needs)
        if self.head_online:
            return self  # grown from a new head where none is given
        if self.kind == "head" and not self.head:
            raise rule_error(
                "drafter.head",
                "required when drafter.kind is 'head' (a head for the target), unless head_online grows one",
            )
        if "head" in self.auto_sources and not self.head:
            raise rule_error("drafter.head", "required when auto_sources names head, unless head_online")
        return self

    @field_validator("ngram_min")
    @classmethod
    def _ngram_order(cls, v: int, info: ValidationInfo) -> int:
        hi = info.data.get("ngram_max")
        if hi is not None and v > hi:
            raise ValueError(f"must be <= drafter.ngram_max ({hi}), got {v}")
        return v


class ExecutionSpec(_Section):
    """How the work is spread over Ray actors."""

    batch_size: int = Field(
        8,
        ge=1,
        le=512,
        description="Documents decoding at once per actor; as one finishes, the next waiting "
        "document takes its place (continuous batching).",
    )
    num_actors: int = Field(1, ge=1, le=10_000, description="Number of decoding actors.")
    num_cpus: float = Field(1, gt=0, description="CPUs reserved per actor.")
    num_gpus: float = Field(0, ge=0, description="GPUs reserved per actor (fractions allowed).")
    placement: Literal["spread", "pack"] = Field(
        "spread",
        description="How model actors go over a cluster's nodes: `spread` on as many nodes as "
        "have room (Ray's SPREAD strategy), so that a lost node takes the fewest actors and "
        "shards in flight with it; `pack` as Ray places by default, filling fewer nodes.",
    )
    threads: int | None = Field(
        None, ge=1, description="torch threads per actor; null = num_cpus (rounded up)."
    )
    max_retries: int = Field(2, ge=0, le=100, description="Retries per shard after a failure.")
    speedup_sample: float = Field(
        0.05,
        gt=0,
        le=1,
        description="Fraction of each shard's rows (at least one) decoded in matched pairs, speculatively "
        "(their outputs) and target-only back to back, to measure the speedup; in chunks of up to "
        "batch_size rows, two chunks wherever two rows or more are sampled.",
    )
    speedup_sample_tokens: int = Field(
        256,
        ge=0,
        description="Token floor of the speedup sample: where its pairs made fewer speculative tokens (or "
        "fewer than two pairs), sampled chunks are decoded again both ways, within "
        "speedup_sample_budget. Fewer tokens give a wider interval (speedup.ci95 in the stats).",
    )
    speedup_sample_budget: float = Field(
        1.0,
        ge=0,
        description="Most that measuring may cost, as a multiple of the shard's decode time: the pairs' "
        "target-only halves, and both halves of chunks decoded again, which stop at it (the first pairs "
        "are decoded regardless).",
    )


class OutputSpec(_Section):
    """Where results, error records and statistics are written."""

    url: str = Field(
        min_length=1,
        description=(
            "Output prefix (directory): s3://, file://, memory:// or a local path. Placeholders "
            "{name}, {date} and {run_id} are rendered at load time. Must neither be, contain nor be "
            "inside the input location (input.url, or a glob's directory), and must not contain '..' "
            "segments. One driver at a time writes it (the _LEASE.json lease)."
        ),
        examples=["s3://my-bucket/summaries/{date}/{run_id}/", "./out/{name}/{run_id}"],
    )
    storage_options: StorageOptions = Field(default_factory=dict, description=_STORAGE_DESCRIPTION)
    overwrite: bool = Field(False, description="Replace existing output at url instead of failing.")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        _check_placeholders_rendered(v, OUTPUT_PLACEHOLDERS)
        _check_url(v)
        if ".." in _path_segments(v):
            raise ValueError(f"must not contain '..' path segments, got {v!r}")
        if any(c in v for c in GLOB_CHARS):
            raise ValueError(f"must be a prefix, not a glob, got {v!r}")
        return v

    @field_validator("storage_options")
    @classmethod
    def _storage(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _validate_storage_options(v)


class JobSpec(_Section):
    """A batch speculative-decoding job over Parquet shards."""

    name: str = Field(
        pattern=_NAME_PATTERN,
        max_length=128,
        description="Job name: letters, digits, '_', '.', '-' (not starting with '.' or '-').",
        examples=["summarize-nightly"],
    )
    input: InputSpec = Field(description="Input shards.")
    task: TaskSpec = Field(description="Prompting.")
    generation: GenerationSpec = Field(default_factory=GenerationSpec, description="Decoding settings.")
    models: ModelsSpec = Field(description="Target and draft models.")
    # validate_default: the cross-section rules below must also run when the section is omitted
    drafter: DrafterSpec = Field(
        default_factory=DrafterSpec, validate_default=True, description="Draft token proposer."
    )
    execution: ExecutionSpec = Field(
        default_factory=ExecutionSpec, validate_default=True, description="Ray execution settings."
    )
    output: OutputSpec = Field(description="Output location.")

    _run_id: str = PrivateAttr(default="")
    _date: str = PrivateAttr(default="")
    _source: str = PrivateAttr(default="<dict>")

    @model_validator(mode="wrap")
    @classmethod
    def _render(cls, data: Any, handler: Any, info: ValidationInfo) -> JobSpec:
        ctx = info.context if isinstance(info.context, Mapping) else {}
        run_id = ctx.get("run_id") or new_run_id()
        date = ctx.get("date") or today_utc()
        if isinstance(data, Mapping):
            data = _render_urls(data, run_id=run_id, date=date)
        spec = handler(data)
        if isinstance(spec, JobSpec):
            spec._run_id = run_id
            spec._date = date
            spec._source = ctx.get("source") or spec._source
        return spec

    @field_validator("drafter")
    @classmethod
    def _drafter_needs_draft(cls, v: DrafterSpec, info: ValidationInfo) -> DrafterSpec:
        models = info.data.get("models")
        if models is not None and models.pair is None and models.draft is None:
            if v.kind == "draft_model" or (v.kind == "auto" and "draft_model" in v.auto_sources):
                raise rule_error(
                    "models.draft",
                    f"required when drafter.kind is {v.kind!r} (give models.draft or models.pair, "
                    "set drafter.kind to prompt_lookup, suffix or none, or leave draft_model out of "
                    "drafter.auto_sources)",
                )
        return v

    @field_validator("execution")
    @classmethod
    def _gpu_for_cuda(cls, v: ExecutionSpec, info: ValidationInfo) -> ExecutionSpec:
        models = info.data.get("models")
        if models is not None and models.device == "cuda" and v.num_gpus == 0:
            raise rule_error(
                "execution.num_gpus",
                "must be > 0 when models.device is 'cuda' (Ray only gives GPUs to actors that request them)",
            )
        return v

    @field_validator("output")
    @classmethod
    def _output_apart_from_input(cls, v: OutputSpec, info: ValidationInfo) -> OutputSpec:
        """Output inside the input would be read back as input; input inside the output (or both
        the same place) would have its shards replaced by output records, or deleted by
        --overwrite. Both directions are refused, after resolving symlinks and relative paths."""
        inp = info.data.get("input")
        if inp is not None and _overlaps(v.url, _input_base(inp.url)):
            raise rule_error(
                "output.url",
                f"must not be, contain or be inside the input location {inp.url!r}: the job would "
                "read its own outputs as input or overwrite the input shards",
            )
        return v

    # -- accessors ---------------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        """The run id rendered into the URLs."""
        return self._run_id

    @property
    def date(self) -> str:
        """The date (YYYY-MM-DD) rendered into the URLs."""
        return self._date

    @property
    def source(self) -> str:
        """Where the spec came from (file path or ``<dict>``)."""
        return self._source

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable dump (URLs rendered) for manifests; loadable again with spec_from_dict.

        Credentials are rejected at validation, and credential-looking keys are redacted here as
        a second line of defence.
        """
        data = self.model_dump(mode="json")
        for section in ("input", "output"):
            data[section]["storage_options"] = redact_options(data[section]["storage_options"])
        return data

    def with_absolute_paths(self, cwd: str | os.PathLike | None = None) -> JobSpec:
        """A copy with local input/output paths and local model directories made absolute.

        Useful before shipping the spec to Ray actors, whose working directory may differ.
        """
        base = os.fspath(cwd) if cwd is not None else os.getcwd()

        def absolute(path: str) -> str:
            p = os.path.expanduser(path)
            return p if os.path.isabs(p) else os.path.normpath(os.path.join(base, p))

        def fix_url(url: str) -> str:
            scheme, rest = split_scheme(url)
            if scheme is None:
                return absolute(rest) + ("/" if url.endswith("/") else "")
            if scheme == "file":
                return "file://" + absolute(rest) + ("/" if url.endswith("/") else "")
            return url

        def fix_model(ref: ModelRefSpec | None) -> ModelRefSpec | None:
            if ref is None:
                return None
            scheme, rest = split_scheme(ref.path)
            if scheme == "file":
                return ref.model_copy(update={"path": "file://" + absolute(rest)})
            if ref.path.startswith(("/", "./", "../", "~")) or os.path.isdir(os.path.join(base, ref.path)):
                return ref.model_copy(update={"path": absolute(ref.path)})
            return ref

        head = self.drafter.head
        new = self.model_copy(
            update={
                "drafter": self.drafter.model_copy(update={"head": fix_url(head) if head else None}),
                "input": self.input.model_copy(update={"url": fix_url(self.input.url)}),
                "output": self.output.model_copy(update={"url": fix_url(self.output.url)}),
                "models": self.models.model_copy(
                    update={"target": fix_model(self.models.target), "draft": fix_model(self.models.draft)}
                ),
            }
        )
        return new


# --------------------------------------------------------------------------------------------
# rendering


_RENDERED_FIELDS = (
    ("input", "url", INPUT_PLACEHOLDERS),
    ("output", "url", OUTPUT_PLACEHOLDERS),
    ("drafter", "suffix_warm_start", WARM_START_PLACEHOLDERS),
)


def _day_before(date: str) -> str | None:
    """The ISO date before `date`, or None where `date` is not one (loading reports that)."""
    try:
        return (dt.date.fromisoformat(date) - dt.timedelta(days=1)).isoformat()
    except (TypeError, ValueError):
        return None


def _render_urls(data: Mapping[str, Any], *, run_id: str, date: str) -> dict[str, Any]:
    """Render the placeholders each URL field supports (`_RENDERED_FIELDS`); any other is left
    in place, so that the field's validator names it in its error."""
    data = dict(data)
    name = data.get("name")
    known = {"date": date, "date-1": _day_before(date), "run_id": run_id}
    if isinstance(name, str) and _NAME_RE.match(name):
        known["name"] = name
    for section, field, allowed in _RENDERED_FIELDS:
        sec = data.get(section)
        if not isinstance(sec, Mapping) or not isinstance(sec.get(field), str):
            continue
        values = {k: v for k, v in known.items() if k in allowed and v is not None}

        def sub(m: re.Match[str], values: dict[str, str] = values) -> str:
            return values.get(m.group(1), m.group(0))

        data[section] = {**sec, field: _PLACEHOLDER_RE.sub(sub, sec[field])}
    return data
