"""Loading a target/draft model pair that shares one tokenizer.

Public API (the engine and the pipeline use these names):

* `ModelRef`, `resolve_pair(name)`, `cache_dir()`
* `resolve_device(name)`, `resolve_dtype(name, device)`
* `load_tokenizer(ref)`, `load_model(ref, dtype=, device=)`
* `check_vocab_match(...)` / `VocabMismatchError`
* `eos_ids(tokenizer, model)`, `pad_id(tokenizer, model)`: the ids that end a reply, and padding
* `load_pair(target, draft, dtype=, device=)` -> `LoadedPair`; `load_draft` for a draft alone

Errors meant for users derive from `ModelError` (re-exported here) and carry a message that is
enough on its own: the CLI should print `str(e)` instead of a traceback.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import torch

from pipeline.decode import lookups, search

from . import draft_int8 as int8_draft
from . import fixed_attention, fixed_linear, fusion, gguf_blocks, invariant, streamed
from .architecture import static_support
from .pairs import (
    ConfigError,
    ModelError,
    ModelNotInstalledError,
    ModelRef,
    UnknownPairError,
    cache_dir,
    resolve_pair,
)

log = logging.getLogger(__name__)

__all__ = [
    "ConfigError",
    "LoadedPair",
    "InvalidOptionError",
    "ModelError",
    "ModelLoadError",
    "ModelNotInstalledError",
    "ModelRef",
    "UnknownPairError",
    "VocabMismatchError",
    "cache_dir",
    "check_vocab_match",
    "eos_ids",
    "load_draft",
    "load_model",
    "load_pair",
    "load_pair_tokenizer",
    "load_tokenizer",
    "pad_id",
    "resolve_device",
    "resolve_dtype",
    "resolve_pair",
]


class ModelLoadError(ModelError, OSError):
    """A model or tokenizer path that does not exist, is not a model, or could not be loaded."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class InvalidOptionError(ModelError, ValueError):
    """An unknown or unavailable device or dtype."""


class VocabMismatchError(ModelError, ValueError):
    """Target and draft tokenizers have different vocabularies."""


# --------------------------------------------------------------------------------------------
# device and dtype

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


@lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 math (AVX512-BF16 or AMX-BF16) according to /proc/cpuinfo."""
    flags = _cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(name: str = "auto") -> str:
    """`auto` -> `cuda` when a GPU is visible, else `cpu`. Explicit `cpu`, `cuda`, `cuda:N` are checked."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return "cpu"
    if re.fullmatch(r"cuda(:\d+)?", name):
        if not torch.cuda.is_available():
            raise ModelError(
                f"device {name!r} requested but CUDA is not available (use --device cpu or auto)"
            )
        if ":" in name and int(name.split(":")[1]) >= torch.cuda.device_count():
            raise ModelError(
                f"device {name!r} requested but only {torch.cuda.device_count()} GPU(s) are visible"
            )
        return name
    raise InvalidOptionError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N")


def resolve_dtype(name: str | torch.dtype, device: str) -> torch.dtype:
    """`auto` -> bfloat16 on a CUDA GPU with bf16 support (float16 on older GPUs), bfloat16 on a CPU
    with AVX512-BF16/AMX, float32 otherwise. Explicit names (`bf16`, `bfloat16`, `fp16`, `float16`,
    `fp32`, `float32`) map directly."""
    if isinstance(name, torch.dtype):
        return name
    key = (name or "auto").strip().lower()
    if key == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device == "cpu" and cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    if key in _DTYPES:
        return _DTYPES[key]
    raise InvalidOptionError(f"unknown dtype {name!r}; use auto, {', '.join(sorted(_DTYPES))}")


# --------------------------------------------------------------------------------------------
# loading

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _source(ref: ModelRef, what: str, required: tuple[str, ...]) -> tuple[str, bool]:
    """`(path_or_id, is_local)` for from_pretrained; raise ModelLoadError for bad local paths."""
    path = ref.path
    explicit_local = False
    if path.startswith("file://"):
        path = unquote(urlparse(path).path)
        explicit_local = True
    local = Path(path).expanduser()
    if local.exists() or explicit_local or path.startswith(("/", ".", "~")) or not _HUB_ID.fullmatch(path):
        if not local.exists():
            raise ModelLoadError(f"{what} path {ref.path!r} does not exist")
        if not local.is_dir():
            raise ModelLoadError(f"{what} path {ref.path!r} is not a directory")
        if not any((local / f).is_file() for f in required):
            raise ModelLoadError(
                f"{what} path {ref.path!r} is not a {what} directory (none of {', '.join(required)} in it)"
            )
        return str(local), True
    return path, False


def _hub_error(ref: ModelRef, what: str, e: Exception) -> ModelLoadError:
    first = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
    return ModelLoadError(
        f"could not load {what} {ref.path!r}"
        + (f" (revision {ref.revision})" if ref.revision else "")
        + f": {first}. It is neither a local directory nor reachable on the Hugging Face Hub "
        "(offline? set HF_HOME to a populated cache, or use a local/installed model)."
    )


def load_tokenizer(ref: ModelRef, trust_remote_code: bool = False):
    """The tokenizer of `ref` (local files only for local dirs)."""
    from transformers import AutoTokenizer

    src, is_local = _source(ref, "tokenizer", ("tokenizer.json", "tokenizer_config.json", "vocab.json"))
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if is_local:
        kwargs["local_files_only"] = True
    elif ref.revision:
        kwargs["revision"] = ref.revision
    try:
        return AutoTokenizer.from_pretrained(src, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        if is_local:
            raise ModelLoadError(f"could not load the tokenizer in {src}: {e}") from e
        raise _hub_error(ref, "tokenizer", e) from e


def load_model(ref: ModelRef, *, dtype: torch.dtype, device: str, trust_remote_code: bool = False):
    """`AutoModelForCausalLM` for `ref` in eval mode with `dtype`, on `device`.

    With device `cuda` and several GPUs visible the model is spread over them (`device_map="auto"`,
    accelerate); otherwise it is moved to `device`.
    """
    from transformers import AutoModelForCausalLM

    src, is_local = _source(ref, "model", ("config.json",))
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if is_local:
        kwargs["local_files_only"] = True
    elif ref.revision:
        kwargs["revision"] = ref.revision
    multi_gpu = device == "cuda" and torch.cuda.is_available() and torch.cuda.device_count() > 1
    if multi_gpu:
        kwargs["device_map"] = "auto"
    try:
        model = AutoModelForCausalLM.from_pretrained(src, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        if is_local:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelLoadError(f"could not load the model in {src}: {first}") from e
        raise _hub_error(ref, "model", e) from e
    if not multi_gpu:
        model.to(device)
    model.eval()
    return model


def _show(token: str) -> str:
    return repr(token) if len(token) <= 40 else repr(token[:37] + "...")


def check_vocab_match(target_tok, draft_tok, target_name: str, draft_name: str, *, examples: int = 5) -> None:
    """Raise `VocabMismatchError` unless both tokenizers map the same tokens to the same ids.

    Only the tokenizers are compared: a model's embedding matrix may be larger than its tokenizer
    (Qwen2.5: 151936 rows), which is fine.
    """
    tv = target_tok.get_vocab()
    dv = draft_tok.get_vocab()
    if tv == dv:
        return
    diffs: list[str] = []
    for tok, tid in sorted(tv.items(), key=lambda kv: kv[1]):
        did = dv.get(tok)
        if did is None:
            diffs.append(f"{_show(tok)} (id {tid}) only in target")
        elif did != tid:
            diffs.append(f"{_show(tok)} is id {tid} in target but {did} in draft")
        if len(diffs) >= examples:
            break
    if len(diffs) < examples:
        only_draft = sorted((tid, tok) for tok, tid in dv.items() if tok not in tv)
        diffs += [
            f"{_show(tok)} (id {tid}) only in draft" for tid, tok in only_draft[: examples - len(diffs)]
        ]
    raise VocabMismatchError(
        f"the draft model {draft_name!r} does not share the target model {target_name!r}'s tokenizer: "
        f"target vocab size {len(tv)}, draft vocab size {len(dv)}; e.g. "
        + "; ".join(diffs)
        + ". Speculative decoding needs a draft with the same vocabulary."
    )


@dataclass
class LoadedPair:
    """A loaded target (and optional draft) with the shared tokenizer, plus ids for manifests."""

    tokenizer: Any
    target: Any
    draft: Any | None
    dtype: torch.dtype
    device: str
    target_ref: ModelRef
    draft_ref: ModelRef | None = None
    batch_invariant: bool = False
    draft_int8: bool = False
    streamed: bool = False
    # "gguf-blocks" when the target's Linear layers read its GGUF blocks (`block_layers` of each
    # type), else "dense"
    weights: str = "dense"
    block_layers: dict[str, int] = field(default_factory=dict)
    # what the block layers' decoding passes multiply the blocks with (`models.block_activations`):
    # "int8" (rounded per super-block) or "float32"; None without block layers
    block_activations: str | None = None
    # passes through fixed slots and shapes, captured as CUDA graphs on a GPU (`static_lm`)
    static_passes: bool = False
    # the static passes' decoder layers compiled (`torch.compile`) before their graphs are captured
    compiled_passes: bool = False
    # q/k/v and gate/up each one matrix product (`fusion`), in the models named
    fused_projections: tuple[str, ...] = ()
    # the target's static decode and verify passes attend with `fixed_attention`'s kernel
    fixed_attention: bool = False
    # the target's decode and verify passes multiply in `fixed_linear`'s kernel, not in row blocks
    fixed_linears: bool = False
    load_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def target_id(self) -> str:
        return self.target_ref.display

    @property
    def target_revision(self) -> str | None:
        return self.target_ref.revision

    @property
    def draft_id(self) -> str | None:
        return self.draft_ref.display if self.draft_ref else None

    @property
    def draft_revision(self) -> str | None:
        return self.draft_ref.revision if self.draft_ref else None

    @property
    def vocab_size(self) -> int:
        """Number of tokens the tokenizer can produce (models' logits may be wider)."""
        return len(self.tokenizer)

    def manifest(self) -> dict[str, Any]:
        return {
            "target": {"id": self.target_id, "path": self.target_ref.path, "revision": self.target_revision},
            "draft": (
                {"id": self.draft_id, "path": self.draft_ref.path, "revision": self.draft_revision}
                if self.draft_ref
                else None
            ),
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": self.device,
            "gpu": torch.cuda.get_device_name(self.device) if self.device.startswith("cuda") else None,
            "batch_invariant": self.batch_invariant,
            "draft_int8": self.draft_int8,
            "streamed_linears": self.streamed,
            "native_lookups": lookups.library() is not None,  # the copying drafters' rounds in C++
            "native_search": search.library() is not None,  # the policy's search in C++
            "weights": self.weights,
            "block_layers": self.block_layers,
            "block_activations": self.block_activations,
            "static_passes": self.static_passes,
            "compiled_passes": self.compiled_passes,
            "fused_projections": list(self.fused_projections),
            "fixed_attention": self.fixed_attention,
            "fixed_linears": self.fixed_linears,
            "tokenizer_vocab_size": self.vocab_size,
        }


def _check_embeddings(model, tokenizer, ref: ModelRef, role: str) -> None:
    rows = model.get_input_embeddings().weight.shape[0]
    if rows < len(tokenizer):
        raise ModelError(
            f"{role} model {ref.display!r} has {rows} embedding rows, "
            f"but its tokenizer has {len(tokenizer)} tokens"
        )


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _same_tokenizer_files(a: ModelRef, b: ModelRef) -> bool:
    """True when both refs are local dirs with byte-identical tokenizer files (then the vocabularies
    match and loading the draft's tokenizer, ~3 s for Qwen, can be skipped)."""
    try:
        da, local_a = _source(a, "tokenizer", _TOKENIZER_FILES)
        db, local_b = _source(b, "tokenizer", _TOKENIZER_FILES)
    except ModelLoadError:
        return False
    if not (local_a and local_b):
        return False
    for name in _TOKENIZER_FILES:
        fa, fb = Path(da) / name, Path(db) / name
        if not (fa.is_file() and fb.is_file()) or fa.stat().st_size != fb.stat().st_size:
            return False
        if fa.read_bytes() != fb.read_bytes():
            return False
    return True


def load_pair_tokenizer(target: ModelRef, draft: ModelRef | None, trust_remote_code: bool = False):
    """The pair's one tokenizer (the target's), once the draft's is known to match it
    (`VocabMismatchError` otherwise); reads no weights, so a mismatch is told in seconds."""
    tokenizer = load_tokenizer(target, trust_remote_code=trust_remote_code)
    if draft is not None and not _same_tokenizer_files(target, draft):
        draft_tok = load_tokenizer(draft, trust_remote_code=trust_remote_code)
        check_vocab_match(tokenizer, draft_tok, target.display, draft.display)
    return tokenizer


def eos_ids(tokenizer, model) -> list[int]:
    """Every token that ends a reply: the tokenizer's EOS and the generation config's (chat models
    often end turns with a different token than the tokenizer's EOS)."""
    ids = set()
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return sorted(ids)


def pad_id(tokenizer, model) -> int:
    """Padding never reaches the model unmasked, so any id works; prefer the tokenizer's."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids(tokenizer, model)[0]


def _quantize(draft_model, dtype: torch.dtype, device: str, asked: bool | None) -> bool:
    """Give the draft's decode steps int8 weights where asked (None: where wanted); returns
    whether it did. A kernel that fails its check here leaves the draft as loaded."""
    if not (asked if asked is not None else int8_draft.wanted(device)):
        return False
    if device != "cpu" or not int8_draft.kernel_works(dtype):
        log.warning("no int8 draft weights here (%s, %s): the draft stays as loaded", device, dtype)
        return False
    return int8_draft.quantize_draft(draft_model) > 0


def load_draft(
    ref: ModelRef,
    tokenizer,
    *,
    dtype: torch.dtype,
    device: str,
    streamed_linears: bool,
    draft_int8: bool | None,
    trust_remote_code: bool = False,
) -> tuple[Any, bool]:
    """A draft model as `load_pair` loads one beside its target (whose `tokenizer` it must fit),
    with the kernels the target got; returns it and whether its decode steps use int8 weights.
    Also for swapping another draft in beside an already loaded target (`pipeline distill`)."""
    model = load_model(ref, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    _check_embeddings(model, tokenizer, ref, "draft")
    if streamed_linears:  # int8 (unless asked not to) in the streamed kernel, not torch's
        int8 = draft_int8 is not False
        streamed.stream_linears(model, output_layer=False, int8=int8)
        streamed.stream_layer_steps(model)
        return model, int8
    return model, _quantize(model, dtype, device, draft_int8)


WEIGHTS = ("auto", "gguf-blocks", "dense")
# `auto` streams blocks for jobs of at most this many rows at a time. A pass of 1 or 2 token rows
# is bound by reading the weights, and blocks cost 0.65x and 0.79x the dense pass; from 4 rows on
# it is bound by arithmetic, and decoding the blocks costs more than the bytes save (1.2-1.3x).
# Measured by `pipeline calibrate --against` (docs/benchmarks/, 2026-11-27, AVX2 float32).
BLOCKS_MAX_BATCH = 2
# ... and where block prefills are cheap (`streamed.prefill_numbers`), up to these many: a
# batch's time is mostly its prefills. Target-only summaries, one bench run each, medians of 3:
# bf16 rows (AVX512_BF16), blocks over bf16 dense 1.70x at batch 4, 1.34x at 8, 1.07x at 16,
# 1.03x at 32; int8 rows by the blocks' codes (in AVX2 code), blocks over float32 dense 2.05x at
# batch 4, 1.92x at 8, 1.86x at 16, 2.10x at 32 (docs/benchmarks/, 2026-11-29, the EPYC).
BLOCKS_MAX_BATCH_CHEAP_PREFILL = {"bf16": 16, "int8": 32}


def _auto_fits(batch: int | None, rounded: bool = True) -> bool:
    """Does `weights: auto` stream blocks for passes of `batch` rows (None: unknown), their
    decoding passes' rows `rounded` to int8 or not (`models.block_activations`)?"""
    most = BLOCKS_MAX_BATCH_CHEAP_PREFILL.get(streamed.prefill_numbers(rounded), BLOCKS_MAX_BATCH)
    return batch is None or batch <= most


def _keeps_blocks(target: ModelRef) -> bool:
    """Does the target's local directory hold the GGUF blocks its install kept? (Nothing read.)"""
    try:
        src, is_local = _source(target, "model", ("config.json",))
    except ModelLoadError:
        return False
    return is_local and (Path(src) / gguf_blocks.FILE).is_file()


def _blocks_decide_dtype(
    target: ModelRef, weights: str, device: str, batch: int | None, rounded: bool = True
) -> bool:
    """Does `dtype: auto` become float32 for the target's GGUF blocks? Where gguf-blocks is asked
    for on a CPU, and where `auto` would stream them: a CPU with the kernel, a target that keeps
    blocks, a batch small enough (`_auto_fits`). Also on CPUs with AVX512-BF16, where auto otherwise
    means bf16 dense: there the blocks' decoding passes cost a third of bf16's and a whole job
    ran faster, though their prefills cost more (docs/cpu-kernels.md). Not on CPUs with AMX,
    whose bf16 prefills are faster still and where the trade was never measured."""
    if device != "cpu" or weights == "dense":
        return False
    if weights == "gguf-blocks":
        return True
    measured = "amx_bf16" not in _cpu_flags()
    usable = _keeps_blocks(target) and streamed.library() is not None
    return weights == "auto" and _auto_fits(batch, rounded) and measured and usable


def _target_blocks(
    target: ModelRef, weights: str, dtype, device: str, batch: int | None, rounded: bool = True
) -> dict | None:
    """The target's GGUF blocks where `weights` asks for them and this machine can stream them
    (None: dense weights). `auto` takes them where the target keeps blocks, float32 runs on a CPU
    with the streamed kernel, and `batch` (the rows a pass decodes; None: unknown) is small enough
    (`_auto_fits`); `gguf-blocks` insists, with an error that says what is missing."""
    if weights not in WEIGHTS:
        raise InvalidOptionError(f"unknown weights {weights!r}; use {', '.join(WEIGHTS)}")
    if weights == "dense" or (weights == "auto" and not _auto_fits(batch, rounded)):
        return None
    try:
        src, is_local = _source(target, "model", ("config.json",))
    except ModelLoadError:
        src, is_local = "", False
    blocks = gguf_blocks.read_blocks(src) if is_local else None
    usable = device == "cpu" and dtype == torch.float32 and streamed.library() is not None
    if weights == "gguf-blocks":
        if not blocks:
            raise ModelError(
                f"models.weights is gguf-blocks, but {target.display!r} keeps no GGUF blocks "
                f"({gguf_blocks.FILE}): install it again with `pipeline models install NAME` "
                "(installs before this version did not keep them), or use weights: dense"
            )
        if not usable:
            raise ModelError(
                "models.weights gguf-blocks runs float32 activations on a CPU with AVX2 and a C++ "
                f"compiler; here: {device}, {str(dtype).removeprefix('torch.')}"
                + ("" if streamed.library() else ", no kernel")
            )
    return blocks if usable else None


@dataclass
class _TargetKernels:
    """The kernels the target gets: GGUF blocks to stream (None: dense weights), streamed Linear
    layers, batch-invariant numerics."""

    blocks: dict | None
    streamed_linears: bool
    batch_invariant: bool


def _target_kernels(
    target: ModelRef,
    weights: str,
    dtype: torch.dtype,
    device: str,
    batch: int | None,
    streamed_linears: bool | None,
    batch_invariant: bool | None,
    rounded: bool = True,
) -> _TargetKernels:
    """Choose the target's kernels as `load_pair` documents, before any weights are read."""
    blocks = _target_blocks(target, weights, dtype, device, batch, rounded)
    if streamed_linears is False and weights != "gguf-blocks":
        blocks = None  # blocks stream through the same kernel
    if streamed_linears is None:
        streamed_linears = streamed.wanted(dtype, device)
    elif streamed_linears and not (device == "cpu" and dtype == torch.float32 and streamed.library()):
        log.warning("streamed linears need float32 on a CPU with AVX2 and a C++ compiler: not used")
        streamed_linears = False
    if batch_invariant is None:
        batch_invariant = streamed_linears or invariant.wanted(dtype, device)
    return _TargetKernels(blocks, streamed_linears, batch_invariant)


def _apply_target_kernels(
    model,
    target: ModelRef,
    kernels: _TargetKernels,
    weights: str,
    dtype: torch.dtype,
    device: str,
    block_activations: str = "int8",
) -> dict[str, int]:
    """Give the loaded target its kernels: GGUF blocks, streamed Linear layers for the rest,
    batch invariance; the block layers used, by type."""
    rounded = block_activations == "int8"
    block_layers = streamed.use_blocks(model, kernels.blocks, rounded) if kernels.blocks else {}
    kernels.blocks = None  # the blocks' memory back once the layers hold them
    if weights == "gguf-blocks" and not block_layers:
        raise ModelError(
            f"models.weights is gguf-blocks, but none of {target.display!r}'s blocks could be used "
            "(types the kernel does not read, or a failed check: see the log above); use weights: dense"
        )
    if kernels.streamed_linears:
        streamed.stream_linears(model)  # the Linear layers the blocks did not replace
        streamed.stream_layer_steps(model)
    if kernels.batch_invariant:
        invariant.make_batch_invariant(model)
        if device == "cpu" and not kernels.streamed_linears and not invariant.linear_is_row_invariant(dtype):
            log.warning(
                "this CPU's %s matrix products round a row differently with the number of rows: "
                "speculative output may differ from target-only decoding at near-ties",
                str(dtype).removeprefix("torch."),
            )
    return block_layers


def _static_passes(asked: bool | None, device: str, target, draft) -> bool:
    """Mark the models whose passes go through `static_lm` (None: on GPUs); whether the target's
    do. Asked for a target it cannot run is an error; a draft it cannot run stays dynamic."""
    if not (asked if asked is not None else device.startswith("cuda")):
        return False
    problem = static_support(target)
    if problem and asked:
        raise ModelError(f"models.static_passes: {problem}")
    if problem:
        log.warning("static passes off: %s", problem)
        return False
    target._static_passes = True
    if draft is not None:
        problem = static_support(draft)
        if problem:
            log.warning("the draft's passes stay dynamic: %s", problem)
        draft._static_passes = problem is None
    return True


def _fuse(model, role: str, kernels=None) -> bool:
    """Fuse `model`'s projections (`fusion`) where its layers allow; whether it did. The target
    is fused before its kernels are applied, so that streamed layers (which cannot be fused)
    are not asked for and the row blocks of `invariant` wrap the fused products."""
    if kernels is not None and (kernels.streamed_linears or kernels.blocks):
        log.warning("fused projections: the %s's streamed or block layers cannot be fused", role)
        return False
    problem = fusion.fusable(model)
    if problem:
        log.warning("fused projections: the %s is left as loaded: %s", role, problem)
        return False
    fusion.fuse_projections(model)
    return True


def _compiled_passes(asked: bool | None, device: str, static_passes: bool) -> bool:
    """Whether the static passes' decoder layers go through `torch.compile` before their graphs
    are captured (None: on GPUs). On an H200 this halved a captured pass of the 1.5B shape
    (docs/gpu.md), for tens of seconds of compiling at an actor's start; on a CPU compiling buys
    little and needs a C++ compiler, so it is asked for there only explicitly (the tests)."""
    if asked is False or (asked is None and not device.startswith("cuda")):
        return False
    if not static_passes:
        if asked:
            raise ModelError("compiled passes need the static pass path (models.static_passes)")
        return False
    return True


def load_pair(
    target: ModelRef,
    draft: ModelRef | None,
    *,
    dtype: str | torch.dtype = "auto",
    device: str = "auto",
    trust_remote_code: bool = False,
    batch_invariant: bool | None = None,
    draft_int8: bool | None = None,
    streamed_linears: bool | None = None,
    weights: str = "auto",
    block_activations: str = "int8",
    batch: int | None = None,
    static_passes: bool | None = None,
    compiled_passes: bool | None = None,
    fused_projections: bool = False,
    float64_attention: bool = False,
    block_linears: bool = False,
) -> LoadedPair:
    """Load the tokenizer (once, from the target), check the draft's tokenizer matches it, then load
    both models in eval mode. Tokenizers are checked before any weights are read.

    `batch_invariant` (None: on for 16-bit dtypes on CPUs and on GPUs) gives the target numerics that do not
    depend on how many tokens or rows share a pass, so that speculative output is bitwise the
    target's own (see `pipeline.models.invariant`). The draft needs no such care: its
    proposals are checked. So `draft_int8` (None: on for CPU) may give its decode steps int8
    weights, which halves what a memory-bound step reads (see `pipeline.models.draft_int8`).
    `streamed_linears` (None: on for float32 on CPUs with AVX2) gives the target Linear layers
    whose cost hardly grows with the tokens in a pass, and which are row-invariant by
    construction, so that batch invariance comes with them (see `pipeline.models.streamed`);
    the draft gets them too, with int8 weights unless `draft_int8` is False.
    `weights` (`auto`, `gguf-blocks`, `dense`): whether the target's Linear layers stream the
    GGUF blocks its install kept (see `_target_blocks`, which `batch`, the rows a job decodes
    together, informs); dtype auto runs float32 wherever the blocks are streamed
    (`_blocks_decide_dtype`). `block_activations` (`int8`,
    `float32`): what the block layers' decoding passes multiply the blocks with (see
    `streamed.BlockLinear`).
    `static_passes` (None: on GPUs) runs both models' passes through fixed slots and shapes,
    replayed as CUDA graphs on a GPU (see `pipeline.decode.static_lm`), where the model allows;
    `compiled_passes` (None: wherever static passes run on a GPU) compiles their decoder layers
    first, so that each captured graph replays a few fused kernels (`_compiled_passes`).
    `fused_projections` makes q/k/v and gate/up one matrix product each in both models where
    their layers are plain Linear layers (`pipeline.models.fusion`; not yet measured on a GPU,
    so off unless asked).
    On a GPU the batch-invariant target's static decode and verify passes attend with one fixed
    order per query (`pipeline.models.fixed_attention`); `float64_attention` keeps the float64
    attention there instead (an A/B of the two). Their products run in one fixed order per row
    (`pipeline.models.fixed_linear`) rather than in padded blocks of rows; `block_linears` keeps
    the blocks (the A/B).
    """
    device = resolve_device(device)
    rounded = block_activations == "int8"
    if dtype in (None, "auto") and _blocks_decide_dtype(target, weights, device, batch, rounded):
        dtype = torch.float32  # the block kernel's activations
    torch_dtype = resolve_dtype(dtype, device)
    kernels = _target_kernels(
        target, weights, torch_dtype, device, batch, streamed_linears, batch_invariant, rounded
    )
    streamed_linears, batch_invariant = kernels.streamed_linears, kernels.batch_invariant
    times: dict[str, float] = {}
    t = time.perf_counter()
    tokenizer = load_pair_tokenizer(target, draft, trust_remote_code=trust_remote_code)
    times["tokenizer_s"] = time.perf_counter() - t

    t = time.perf_counter()
    target_model = load_model(target, dtype=torch_dtype, device=device, trust_remote_code=trust_remote_code)
    times["target_s"] = time.perf_counter() - t
    fused = ("target",) if fused_projections and _fuse(target_model, "target", kernels) else ()
    _check_embeddings(target_model, tokenizer, target, "target")
    if block_activations not in ("int8", "float32"):
        raise ModelError(f"models.block_activations is int8 or float32, not {block_activations!r}")
    block_layers = _apply_target_kernels(
        target_model, target, kernels, weights, torch_dtype, device, block_activations
    )
    draft_model = None
    if draft is not None:
        t = time.perf_counter()
        draft_model, draft_int8 = load_draft(
            draft,
            tokenizer,
            dtype=torch_dtype,
            device=device,
            streamed_linears=streamed_linears,
            draft_int8=draft_int8,
            trust_remote_code=trust_remote_code,
        )
        times["draft_s"] = time.perf_counter() - t
        if fused_projections and _fuse(draft_model, "draft"):
            fused += ("draft",)
    static_passes = _static_passes(static_passes, device, target_model, draft_model)
    compiled_passes = _compiled_passes(compiled_passes, device, static_passes)
    for model in (target_model, draft_model) if compiled_passes else ():
        if getattr(model, "_static_passes", False):
            model._compiled_passes = True
    if float64_attention:
        target_model._float64_attention = True
    if static_passes and batch_invariant and not block_linears and fixed_linear.serves(target_model):
        fixed_linear.apply(target_model)
    for model in (target_model, draft_model):
        if model is not None:  # served, never trained here: no pass keeps what a backward would need
            model.requires_grad_(False)
    return LoadedPair(
        tokenizer=tokenizer,
        target=target_model,
        draft=draft_model,
        dtype=torch_dtype,
        device=device,
        target_ref=target,
        draft_ref=draft,
        batch_invariant=batch_invariant,
        draft_int8=bool(draft_model is not None and draft_int8),
        streamed=streamed_linears,
        weights="gguf-blocks" if block_layers else "dense",
        block_layers=block_layers,
        block_activations=block_activations if block_layers else None,
        static_passes=static_passes,
        compiled_passes=compiled_passes,
        fused_projections=fused,
        fixed_attention=static_passes and fixed_attention.used(target_model),
        fixed_linears=fixed_linear.used(target_model),
        load_seconds=times,
    )
