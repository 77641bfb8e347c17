"""`pipeline distill`: a draft model fine-tuned on a run's own outputs, and the check that it paid.

Speculation is bounded by how often the draft agrees with the target, and a corpus job's outputs
are a labelled data set of exactly what the target says about documents like tomorrow's. So:

1. `read_run`: the run's manifest (its spec: task, template, models, drafter settings) and its
   outputs; the documents' texts come from the run's input, so each prompt is rebuilt with the
   run's own `PromptBuilder` and is the token sequence the engine decoded from. The completion
   is the target's own tokens (`generated_ids`, EOS included, so the draft also learns where
   replies stop). Outputs of runs made before that column have text only: their `generated` is
   tokenized again, with the end-of-turn token added where the row ended on EOS; a model need
   not have split its text the way its tokenizer does, so that is the second best.
2. `split_examples`: documents are held out by a hash of their id, so a rerun holds out the same
   ones, and a text under two ids, or two versions of a text, go to one side, so the evaluation
   never sees a document the draft was trained on.
3. `fine_tune`: LoRA adapters on every linear layer (PEFT), merged into the weights at the end so
   the engine loads a plain model; or all weights (`full`). Cross-entropy on the completion
   tokens only, AdamW, a plain loop bounded by steps or epochs and by seconds. A KL term
   against the target's distribution is left out: it needs a target forward pass per example,
   which on a CPU costs more than the draft's own training step.
4. The tuned draft is installed as a local pair (`install_local_pair`): the target referenced,
   not copied; `distill.json` beside it records where it came from.
5. `evaluate`: one interleaved bench run (`pipeline.lab.bench.TaskBench`) over the held-out prompts:
   target-only, then the old and the new draft each under the run's own `draft_model` and `auto`
   settings, at batch 1, greedy; α, acceptance by position, τ, predicted and measured speedup,
   and every output checked equal to target-only. Beside it, `top1_agreement`: how often the
   draft's top token is the target's on the held-out completions, a draft's α measured
   directly, also where the engine's cost model declines to draft with it on this machine.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pipeline.lab.record import write_record
from pipeline.models.pairs import ModelError, ModelRef

DISTILL_FILE = "distill.json"  # the provenance and evaluation, beside the new pair's pair.json
DISTILL_FORMAT = 1
DRAFTERS = ("draft_model", "auto")  # the engine settings the drafts are compared under
# the files of a model directory that make up its tokenizer (and chat template)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)
LORA_LR, FULL_LR = 2e-4, 2e-5  # AdamW defaults: adapters start at zero and move fast, full weights must not


class DistillError(ModelError):
    """A run, pair or setting that distilling cannot use; the message says why and what to do."""


@dataclass(frozen=True)
class Example:
    """One document of the run: the prompt the engine decoded from and the target's completion."""

    id: str
    prompt: list[int]
    completion: list[int]


@dataclass
class RunOutputs:
    """What distilling reads from a run: where it is, its spec, and its output records."""

    url: str
    run_id: str
    job: str
    spec: Any  # JobSpec
    target: dict  # the target model as the manifest records it (LoadedPair.manifest())
    rows: list[dict]  # id, generated, finish_reason (and generated_ids) of every output record
    texts: dict[str, str]  # the documents' texts by id (pipeline.job.ids.id_key)


@dataclass
class Training:
    """How a fine-tuning went: what bounded it, and the loss of every step."""

    mode: str  # "lora" or "full"
    lora_rank: int | None
    lr: float
    batch_size: int
    seed: int
    device: str
    steps: int = 0
    epochs: float = 0.0
    seconds: float = 0.0
    stopped_by: str = ""  # "steps", "epochs" or "max_seconds"
    loss: list[float] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# the run's data


def read_run(url: str, storage_options: dict | None = None) -> RunOutputs:
    """The run's spec and target (manifest.json), its output records, and the texts of the
    documents they came from (the run's input). DistillError when any is missing."""
    from pipeline.job.ids import id_key
    from pipeline.job.layout import output_files, read_manifest
    from pipeline.spec import SpecError, spec_from_dict
    from pipeline.storage import Storage, list_shards

    store = Storage(url, storage_options or {})
    manifest = read_manifest(store)
    if manifest is None:
        raise DistillError(f"no manifest.json under {store.url}: not the output prefix of a pipeline run")
    try:
        spec = spec_from_dict(
            manifest["spec"],
            source=f"{store.url}/manifest.json",
            run_id=manifest["run_id"],
            date=manifest["date"],
        )
    except SpecError as exc:
        raise DistillError(f"the run's recorded spec does not load: {exc}") from None
    rows = []
    for _, path in output_files(store):
        table = store.read_parquet(path)
        columns = [spec.input.id_column, "generated", "finish_reason", "generated_ids"]
        for record in table.select([c for c in columns if c in table.column_names]).to_pylist():
            rows.append({**record, "id": id_key(record[spec.input.id_column])})
    if not rows:
        raise DistillError(
            f"no outputs under {store.url}/outputs: the run produced no rows to learn from "
            "(did it finish? see `pipeline stats` on it)"
        )
    target = (manifest.get("models") or {}).get("target")
    if not target:
        raise DistillError(f"{store.url}/manifest.json records no target model")
    wanted = {row["id"] for row in rows}
    texts: dict[str, str] = {}
    input_options = dict(spec.input.storage_options) | (storage_options or {})
    for shard in list_shards(spec.input.url, input_options):
        parent, _, base = shard.rpartition("/")
        table = Storage(parent, input_options).read_parquet(base)
        if spec.input.id_column not in table.column_names or spec.input.text_column not in table.column_names:
            continue  # an unreadable shard of the run: none of its rows is in the outputs
        ids = table.column(spec.input.id_column).to_pylist()
        for row_id, text in zip(ids, table.column(spec.input.text_column).to_pylist()):
            key = id_key(row_id)
            if key in wanted and key not in texts:
                texts[key] = text.decode("utf-8") if isinstance(text, bytes) else text
    missing = sorted(wanted - set(texts))
    if missing:
        raise DistillError(
            f"{len(missing)} output row(s) have no document in the run's input {spec.input.url} "
            f"(e.g. {missing[0]!r}): the input changed since the run, so its prompts cannot be rebuilt"
        )
    return RunOutputs(store.url, manifest["run_id"], manifest["job"], spec, target, rows, texts)


def same_model(recorded: dict, ref: ModelRef) -> bool:
    """Whether a manifest's model record (`LoadedPair.manifest()`) is the model `ref` names: the
    same revision where both have one, else the same directory or hub id."""
    if recorded.get("revision") and ref.revision:
        return recorded["revision"] == ref.revision
    path = recorded.get("path") or ""
    if Path(path).expanduser().exists() and Path(ref.path).expanduser().exists():
        return Path(path).expanduser().resolve() == Path(ref.path).expanduser().resolve()
    return path == ref.path


def end_of_turn(tokenizer, model) -> int:
    """The token a reply that ended on EOS ended with: outputs keep text without special tokens,
    so it is not recorded. A chat model ends its turn with its generation config's (first) EOS,
    which may differ from the tokenizer's."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        return configured
    return list(configured)[0] if configured else tokenizer.eos_token_id


def build_examples(run: RunOutputs, tokenizer, end_of_turn: int) -> list[Example]:
    """Every output record as an example: the prompt rebuilt as the run built it, the completion
    the target's tokens; for a record without them, its generated text's tokens and
    `end_of_turn` after them where the row ended on EOS."""
    from pipeline.job.prompts import PromptBuilder

    builder = PromptBuilder(tokenizer, run.spec.task)
    examples = []
    for row in sorted(run.rows, key=lambda r: r["id"]):
        completion = row.get("generated_ids")
        if completion is None:
            completion = tokenizer(row["generated"] or "", add_special_tokens=False).input_ids
            if row["finish_reason"] == "eos":
                completion = [*completion, end_of_turn]
        if completion:
            examples.append(Example(row["id"], builder.build(run.texts[row["id"]]).ids, list(completion)))
    return examples


def split_holdout(ids: list[str], share: float) -> tuple[list[str], list[str]]:
    """(train, held out): the `share` of documents (at least one) whose id hashes lowest.

    By the id's hash, not its position, so that the split does not follow the corpus's order
    (a shard of one kind of document) and a rerun over the same run holds out the same ones.
    """
    if not 0 < share < 1:
        raise DistillError(f"--holdout must be between 0 and 1, got {share}")
    if len(ids) < 2:
        raise DistillError(
            f"the run has {len(ids)} usable document(s): at least 2 are needed, one to hold out"
        )
    order = sorted(ids, key=lambda i: hashlib.sha256(i.encode()).digest())
    held = min(max(1, round(share * len(ids))), len(ids) - 1)
    return sorted(order[held:]), sorted(order[:held])


def split_examples(examples: list[Example], share: float) -> tuple[list[Example], list[Example]]:
    """(train, held out): `split_holdout` over documents, where examples that share an id (one
    document in several runs), a prompt (one text under two ids: a license the OS ships under
    two names, a document in two shards) or most of a completion (`near_twins`: a text and its
    next version, a word or a line apart) are one document, named by the least of their ids, and
    so fall on the same side. Else the evaluation reads a text the model learned by heart: three
    of 22 held-out license sections did, their held-out figures those of training documents."""
    parent = list(range(len(examples)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[tuple, int] = {}
    for i, example in enumerate(examples):
        for key in (("id", example.id), ("prompt", *example.prompt)):
            parent[root(i)] = root(first.setdefault(key, i))
    for i, j in near_twins([e.completion for e in examples]):
        parent[root(i)] = root(j)
    name: dict[int, str] = {}
    for i, example in enumerate(examples):
        name[root(i)] = min(name.get(root(i), example.id), example.id)
    _, held_names = split_holdout(sorted(set(name.values())), share)
    held = set(held_names)
    train = [e for i, e in enumerate(examples) if name[root(i)] not in held]
    return train, [e for i, e in enumerate(examples) if name[root(i)] in held]


TWIN_SHINGLE = 8  # tokens in a run that two completions share
TWIN_SHARE = 0.3  # of the shorter completion's runs, shared: the same text (distinct ones: < 0.05)
TWIN_RUNS = 8  # fewer runs than this (a completion of a dozen tokens) say nothing


def near_twins(completions: list[list[int]]) -> list[tuple[int, int]]:
    """Pairs (i, j) of completions sharing at least `TWIN_SHARE` of the shorter one's
    `TWIN_SHINGLE`-token runs: the target's outputs for two versions of one text (a license's
    1.2 and 1.3 differ in a few words), which a held-out figure must not split. Runs found in
    over half the completions (a preamble every output starts with, a small model's one repeated
    token) are not evidence and are left out. An index from run to completions keeps it near
    linear in the corpus."""
    runs = [{tuple(c[k : k + TWIN_SHINGLE]) for k in range(len(c) - TWIN_SHINGLE + 1)} for c in completions]
    index: dict[tuple, list[int]] = {}
    for i, own in enumerate(runs):
        for run in own:
            index.setdefault(run, []).append(i)
    common = {run for run, holders in index.items() if 2 * len(holders) > len(completions)}
    kept = [own - common for own in runs]
    pairs = []
    for i, own in enumerate(kept):
        if len(own) < TWIN_RUNS:
            continue
        shared: dict[int, int] = {}
        for run in own:
            for j in index[run]:
                if j < i:
                    shared[j] = shared.get(j, 0) + 1
        pairs += [
            (i, j)
            for j, count in shared.items()
            if len(kept[j]) >= TWIN_RUNS and count >= TWIN_SHARE * min(len(own), len(kept[j]))
        ]
    return pairs


def data_hash(examples: list[Example]) -> str:
    """sha256 over the training examples' ids and token ids: the same data gives the same hash."""
    digest = hashlib.sha256()
    for ex in examples:
        digest.update(json.dumps([ex.id, ex.prompt, ex.completion]).encode())
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# training


def _batch(examples: list[Example], pad: int, device: str) -> dict[str, torch.Tensor]:
    """Left-padded prompt+completion rows, so every completion ends at the last position and
    the logits of the last `keep` positions cover them all (the output layer, over a vocabulary
    of 150k on Qwen, then runs on the completions alone); labels -100 outside completions."""
    length = max(len(e.prompt) + len(e.completion) for e in examples)
    keep = max(len(e.completion) for e in examples)
    ids = torch.full((len(examples), length), pad, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    labels = torch.full((len(examples), keep), -100, dtype=torch.long)
    for row, e in enumerate(examples):
        seq = e.prompt + e.completion
        ids[row, length - len(seq) :] = torch.tensor(seq)
        mask[row, length - len(seq) :] = 1
        labels[row, keep - len(e.completion) :] = torch.tensor(e.completion)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": ids.to(device),
        "attention_mask": mask.to(device),
        "position_ids": positions.to(device),
        "labels": labels.to(device),
    }


def _completion_logits(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits that predict each label: those at the position before it."""
    return model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
        logits_to_keep=batch["labels"].shape[1] + 1,
    ).logits[:, :-1]


def completion_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the completion tokens."""
    logits = _completion_logits(model, batch)
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), ignore_index=-100
    )


@torch.no_grad()
def top1_agreement(model, examples: list[Example], device: str) -> float:
    """The share of completion tokens that are the model's top token, given the target's tokens
    before them: for a greedy run, the α of greedy speculation with this draft (Leviathan's,
    token by token), whether or not the engine's cost model would draft with it here. One
    forward pass of the draft per document; no target pass, the completions are its output."""
    hits = total = 0
    for example in examples:
        batch = _batch([example], 0, device)
        predicted = _completion_logits(model, batch).argmax(-1)
        hits += int((predicted == batch["labels"]).sum())
        total += len(example.completion)
    return hits / total if total else 0.0


def fine_tune(
    model,
    examples: list[Example],
    training: Training,
    *,
    pad: int,
    steps: int | None = None,
    epochs: float | None = None,
    max_seconds: float | None = None,
    progress: bool = True,
):
    """Train `model` on `examples` as `training` says (LoRA adapters of its rank, or all weights);
    return the trained plain model (adapters merged in). `training` records the run: steps,
    epochs, seconds, what stopped it and the loss of every step. Stops after `steps` optimizer
    steps, else `epochs` passes over the examples, or once `max_seconds` have gone by."""
    from tqdm.auto import tqdm

    torch.manual_seed(training.seed)
    if training.mode == "lora":
        from peft import LoraConfig, get_peft_model

        rank = training.lora_rank
        config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear")
        model = get_peft_model(model, config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=training.lr, weight_decay=0.0)
    per_epoch = math.ceil(len(examples) / training.batch_size)
    total = steps if steps is not None else max(1, math.ceil((epochs or 1.0) * per_epoch))
    shuffle = random.Random(training.seed)
    order: list[Example] = []
    began = time.perf_counter()
    training.stopped_by = "steps" if steps is not None else "epochs"
    bar = tqdm(total=total, desc="distill", unit="step", file=sys.stderr, disable=not progress)
    try:
        for _ in range(total):
            if max_seconds is not None and time.perf_counter() - began >= max_seconds:
                training.stopped_by = "max_seconds"
                break
            if len(order) < training.batch_size:  # a new epoch: every example once more, reshuffled
                fresh = list(examples)
                shuffle.shuffle(fresh)
                order += fresh
            chunk, order = order[: training.batch_size], order[training.batch_size :]
            loss = completion_loss(model, _batch(chunk, pad, training.device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            training.loss.append(round(loss.item(), 5))
            training.steps += 1
            bar.update()
            bar.set_postfix(loss=f"{training.loss[-1]:.3f}")
    finally:
        bar.close()
    training.seconds = round(time.perf_counter() - began, 2)
    training.epochs = round(training.steps * training.batch_size / len(examples), 3)
    model.eval()
    return model.merge_and_unload() if training.mode == "lora" else model


# --------------------------------------------------------------------------------------------
# evaluation


@dataclass
class Measured:
    """One configuration of the evaluation: a draft ("before" or "after") under a drafter setting."""

    drafter: str
    draft: str
    alpha: float | None
    acceptance_by_position: dict[str, list[float]]
    tau: float | None
    predicted: float | None
    speedup: float | None
    identical: bool
    tokens_per_second: float
    seconds: float


def evaluate(
    loaded,
    drafts: dict[str, Any],
    prompts: list[list[int]],
    spec,
    max_new: int,
    runs: int,
    log: Callable[[str], None],
) -> list[Measured]:
    """Target-only and every draft in `drafts` (label -> model, loaded beside `loaded.target`)
    under each of DRAFTERS with the run's engine settings, at batch 1, `max_new` tokens per
    document, in one interleaved bench run of `runs` rounds over `prompts`; speedups over
    target-only, outputs checked equal to it."""
    from pipeline.decode.engine import SpeculativeEngine
    from pipeline.decode.settings import EngineConfig
    from pipeline.lab.bench import TaskBench, ours
    from pipeline.models.loading import eos_ids, pad_id

    def engine(draft, kind: str) -> SpeculativeEngine:
        return SpeculativeEngine(
            loaded.target,
            draft,
            eos_token_ids=eos_ids(loaded.tokenizer, loaded.target),
            pad_token_id=pad_id(loaded.tokenizer, loaded.target),
            vocab_size=loaded.vocab_size,
            config=EngineConfig.from_spec(spec.drafter, kind),
        )

    engines = {("none", "-"): engine(None, "none")}
    engines |= {(kind, label): engine(draft, kind) for label, draft in drafts.items() for kind in DRAFTERS}
    for (kind, _), eng in engines.items():  # first calls pay for allocations and cost calibration
        eng.generate(prompts[:1], 8, drafter=kind)
    bench = TaskBench("held-out")
    bench.add("target-only", 1, partial(ours, engines[("none", "-")], prompts, max_new, 1, "none"))
    for (kind, label), eng in engines.items():
        if kind != "none":
            bench.add(f"{kind} {label}", 1, partial(ours, eng, prompts, max_new, 1, kind), base="target-only")
    measured = []
    for row in bench.run(runs, lambda line: None):
        kind, _, label = row.method.partition(" ")
        measured.append(
            Measured(
                drafter=kind if label else "none",
                draft=label or "-",
                alpha=row.alpha,
                acceptance_by_position=row.acceptance_by_position,
                tau=row.tau,
                predicted=row.predicted,
                speedup=row.speedup,
                identical=row.identical,
                tokens_per_second=row.tokens_per_second,
                seconds=row.seconds_median,
            )
        )
        log(format_measured(measured[-1]))
    return measured


EVAL_HEADER = (
    f"{'drafter':<12} {'draft':<7} {'alpha':>6} {'by position (k=1..4)':<24} {'tau':>5} "
    f"{'pred':>6} {'speedup':>8} {'tok/s':>7} {'same':>5}"
)


def format_measured(m: Measured) -> str:
    """A line of the evaluation table (EVAL_HEADER); by position: the draft model's where it
    drafted, else the drafter's that drafted most."""

    def f(v, spec=".2f", suffix=""):
        return "-" if v is None else f"{v:{spec}}{suffix}"

    rates = m.acceptance_by_position.get("draft_model") or next(iter(m.acceptance_by_position.values()), [])
    by_position = " ".join(f"{r:.2f}" for r in rates[:4]) or "-"
    return (
        f"{m.drafter:<12} {m.draft:<7} {f(m.alpha):>6} {by_position:<24} {f(m.tau):>5} "
        f"{f(m.predicted, '.2f', 'x'):>6} {f(m.speedup, '.2f', 'x'):>8} {m.tokens_per_second:>7.2f} "
        f"{'yes' if m.identical else 'NO':>5}"
    )


# --------------------------------------------------------------------------------------------
# the command


@dataclass
class Settings:
    """`pipeline distill`'s options."""

    holdout: float = 0.1
    steps: int | None = None
    epochs: float | None = None
    lora_rank: int = 16
    full: bool = False
    lr: float | None = None
    batch_size: int = 4
    max_seconds: float | None = None
    seed: int = 0
    runs: int = 1
    eval_max_new_tokens: int | None = None  # None: the run's max_new_tokens
    force: bool = False
    progress: bool = True


def _copy_tokenizer(draft: ModelRef, tokenizer, into: Path) -> None:
    """The draft's tokenizer files beside its tuned weights, byte for byte where it is a local
    directory (the loader then sees them equal to the target's and skips comparing vocabularies)."""
    import shutil

    source = Path(draft.path.removeprefix("file://")).expanduser()
    copied = [shutil.copy(source / n, into / n) for n in TOKENIZER_FILES if (source / n).is_file()]
    if not copied:
        tokenizer.save_pretrained(into)


@dataclass
class _Source:
    """What a distill run starts from: the run, the pair's models, and the commit that runs."""

    run: RunOutputs
    target: ModelRef
    draft: ModelRef
    commit: str | None
    dirty: bool | None


def _source(run_url: str, pair: str, out: str, settings: Settings, storage_options: dict | None) -> _Source:
    """Check the settings, the new pair's name, the pair and the run before minutes of training;
    DistillError with what to do where any is unusable."""
    from pipeline.machine import git_state
    from pipeline.models.install import check_local_pair_name
    from pipeline.models.loading import resolve_pair

    if settings.steps is not None and settings.epochs is not None:
        raise DistillError("give --steps or --epochs, not both")
    commit, dirty = git_state()  # the code that runs, whatever the tree becomes in the next hour
    check_local_pair_name(out, settings.force)  # before minutes of training, not after
    target_ref, draft_ref = resolve_pair(pair)
    if draft_ref is None:
        raise DistillError(f"pair {pair!r} has no draft model to fine-tune")
    run = read_run(run_url, storage_options)
    if not same_model(run.target, target_ref):
        raise DistillError(
            f"the run's target {run.target.get('id')!r} ({run.target.get('path')}) is not pair {pair!r}'s "
            f"target {target_ref.display!r} ({target_ref.path}): a draft must learn its own target's outputs"
        )
    return _Source(run, target_ref, draft_ref, commit, dirty)


def _training_draft(source: _Source, pair: str):
    """The pair's tokenizer and its draft as training loads it: float32 wherever it runs, since
    bf16 weights would round small updates away; (tokenizer, draft, device)."""
    from pipeline.models.loading import ModelLoadError, load_model, load_pair_tokenizer, resolve_device

    models = source.run.spec.models
    tokenizer = load_pair_tokenizer(source.target, source.draft, trust_remote_code=models.trust_remote_code)
    device = resolve_device(models.device)
    try:
        draft = load_model(
            source.draft, dtype=torch.float32, device=device, trust_remote_code=models.trust_remote_code
        )
    except ModelLoadError as exc:
        raise DistillError(
            f"pair {pair!r}'s draft cannot be loaded as a causal language model: {exc}"
        ) from None
    return tokenizer, draft, device


def _train(draft, tokenizer, train, held_examples, settings: Settings, device: str, log):
    """Fine-tune `draft` on `train` as `settings` say; (the tuned model, its Training record,
    the held-out top-1 agreement before and after)."""
    from pipeline.models.loading import pad_id

    training = Training(
        mode="full" if settings.full else "lora",
        lora_rank=None if settings.full else settings.lora_rank,
        lr=settings.lr or (FULL_LR if settings.full else LORA_LR),
        batch_size=settings.batch_size,
        seed=settings.seed,
        device=device,
    )
    agreement = {"before": top1_agreement(draft, held_examples, device)}
    tuned = fine_tune(
        draft,
        train,
        training,
        pad=pad_id(tokenizer, draft),
        steps=settings.steps,
        epochs=settings.epochs,
        max_seconds=settings.max_seconds,
        progress=settings.progress,
    )
    if not training.steps:
        raise DistillError(f"no training step ran within --max-seconds {settings.max_seconds}")
    agreement["after"] = top1_agreement(tuned, held_examples, device)
    log(
        f"trained {training.steps} steps ({training.epochs} epochs) in {training.seconds:.0f} s, "
        f"stopped by {training.stopped_by}; loss {training.loss[0]:.3f} -> {training.loss[-1]:.3f}; "
        f"held-out top-1 agreement {agreement['before']:.3f} -> {agreement['after']:.3f}"
    )
    return tuned, training, agreement


def _provenance(source: _Source, pair: str, out: str, command: str, settings: Settings, **parts) -> dict:
    """distill.json before the evaluation: where the new draft came from and how it was trained.
    `parts`: examples, train, train_ids, holdout_ids, training, agreement."""
    run, train = source.run, parts["train"]
    return {
        "format": DISTILL_FORMAT,
        "pair": out,
        "source_pair": pair,
        "command": command,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "source_run": {
            "url": run.url,
            "run_id": run.run_id,
            "job": run.job,
            "task": run.spec.task.model_dump(),
        },
        "target": {
            "path": source.target.path,
            "revision": source.target.revision,
            "name": source.target.name,
        },
        "draft_from": {
            "path": source.draft.path,
            "revision": source.draft.revision,
            "name": source.draft.name,
        },
        "data": {
            "sha256": data_hash(train),
            "documents": len(parts["examples"]),
            "train_ids": parts["train_ids"],
            "holdout_ids": parts["holdout_ids"],
            "holdout_share": settings.holdout,
            "completion_tokens": sum(len(e.completion) for e in train),
        },
        "training": asdict(parts["training"]),
        # on the held-out documents: the draft's top token equal to the target's, teacher-forced
        "top1_agreement": parts["agreement"],
        "evaluation": None,
    }


def _evaluate_installed(source: _Source, out: str, prompts: list[list[int]], settings: Settings, log):
    """Load the pair as the run's actors did, the tuned draft `out` beside it, and evaluate both
    drafts on the held-out `prompts`; (the loaded pair, the measured rows, max_new_tokens)."""
    from pipeline.models.loading import load_draft, load_pair, resolve_pair

    models = source.run.spec.models
    _, new_draft = resolve_pair(out)
    loaded = load_pair(
        source.target,
        source.draft,
        dtype=models.dtype,
        device=models.device,
        trust_remote_code=models.trust_remote_code,
        batch_invariant=models.batch_invariant,
        draft_int8=models.draft_int8,
        weights=models.weights,
        batch=source.run.spec.execution.batch_size,
    )
    after, _ = load_draft(
        new_draft,
        loaded.tokenizer,
        dtype=loaded.dtype,
        device=loaded.device,
        streamed_linears=loaded.streamed,
        draft_int8=models.draft_int8,
        trust_remote_code=models.trust_remote_code,
    )
    max_new = settings.eval_max_new_tokens or source.run.spec.generation.max_new_tokens
    log(
        f"held-out evaluation: {len(prompts)} documents, batch 1, greedy, "
        f"max_new_tokens {max_new}, {settings.runs} run(s)"
    )
    log(EVAL_HEADER)
    drafts = {"before": loaded.draft, "after": after}
    measured = evaluate(loaded, drafts, prompts, source.run.spec, max_new, settings.runs, log)
    return loaded, measured, max_new


def distill(
    run_url: str,
    pair: str,
    out: str,
    settings: Settings,
    *,
    storage_options: dict | None = None,
    command: str = "",
    log: Callable[[str], None] = print,
) -> dict:
    """Fine-tune `pair`'s draft on the run at `run_url`, install it as the local pair `out`, and
    evaluate both drafts on the held-out documents; return the provenance and evaluation that
    is also written as `distill.json` beside the new pair."""
    from pipeline.machine import describe_machine
    from pipeline.models.install import install_local_pair, staging_dir

    source = _source(run_url, pair, out, settings, storage_options)
    tokenizer, draft, device = _training_draft(source, pair)
    examples = build_examples(source.run, tokenizer, end_of_turn(tokenizer, draft))
    train, held_examples = split_examples(examples, settings.holdout)
    train_ids, holdout_ids = sorted(e.id for e in train), sorted(e.id for e in held_examples)
    log(
        f"{source.run.url}: {len(examples)} documents, {len(train)} to train on "
        f"({sum(len(e.completion) for e in train)} completion tokens), {len(holdout_ids)} held out"
    )
    tuned, training, agreement = _train(draft, tokenizer, train, held_examples, settings, device, log)
    staged = staging_dir(out)
    tuned.save_pretrained(staged / "draft")
    _copy_tokenizer(source.draft, tokenizer, staged / "draft")
    del tuned, draft
    gc.collect()  # the training copy's memory back (adapters hold cycles) before the pair loads
    result = _provenance(
        source,
        pair,
        out,
        command,
        settings,
        examples=examples,
        train=train,
        train_ids=train_ids,
        holdout_ids=holdout_ids,
        training=training,
        agreement=agreement,
    )
    (staged / DISTILL_FILE).write_text(json.dumps(result, indent=2) + "\n")
    name = f"{source.draft.display} distilled on {source.run.job} {source.run.run_id}"
    path = install_local_pair(out, staged, source.target, name, force=settings.force)
    log(f"installed pair {out!r} at {path}")

    prompts_by_id = {e.id: e.prompt for e in examples}
    prompts = [prompts_by_id[i] for i in holdout_ids]
    loaded, measured, max_new = _evaluate_installed(source, out, prompts, settings, log)
    result["evaluation"] = {
        "documents": holdout_ids,
        "batch": 1,
        "runs": settings.runs,
        "max_new_tokens": max_new,
        "rows": [asdict(m) for m in measured],
        "alpha_gain": alpha_gains(measured),
    }
    result["machine"] = describe_machine(loaded) | {"git_commit": source.commit, "git_dirty": source.dirty}
    (path / DISTILL_FILE).write_text(json.dumps(result, indent=2) + "\n")
    return result


def alpha_gains(measured: list[Measured]) -> dict[str, float | None]:
    """By drafter setting: held-out α after less α before."""
    alpha = {(m.drafter, m.draft): m.alpha for m in measured}
    gains = {}
    for kind in DRAFTERS:
        before, after = alpha.get((kind, "before")), alpha.get((kind, "after"))
        gains[kind] = None if before is None or after is None else after - before
    return gains


def write_report(path: str, result: dict) -> str:
    """A Markdown record of one distill run for docs/benchmarks/: the command, the machine, the
    source run, the training (its loss curve) and the held-out evaluation, as the tool measured
    them; `distill.json`'s copy beside it (PATH.json), whose path is returned."""
    json_path = Path(path).with_suffix(".json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    write_record(
        path,
        f"Distill: {result['source_pair']} -> {result['pair']}",
        date=result["date"],
        command=result["command"],
        machine=result["machine"],
        json_path=str(json_path),
        body=[*_data_and_training(result), "", *_evaluation_lines(result)],
        linked="Provenance and measurements",
        link_note=", a copy of `distill.json` beside the pair (`pipeline models list` shows where)",
    )
    return str(json_path)


def _data_and_training(result: dict) -> list[str]:
    """The report's Data and Training sections: what was trained on, how, and the loss curve."""
    training, data, source = result["training"], result["data"], result["source_run"]
    loss = training["loss"]
    every = max(1, math.ceil(len(loss) / 40))  # at most ~40 points of the curve
    curve = [f"{step + 1:>5} {loss[step]:.4f}" for step in range(0, len(loss), every)]
    if loss and (len(loss) - 1) % every:
        curve.append(f"{len(loss):>5} {loss[-1]:.4f}")
    return [
        "## Data",
        "",
        f"Source run `{source['run_id']}` of job `{source['job']}` "
        f"({source['url']}), task `{source['task']['kind']}`: "
        f"{data['documents']} documents, {len(data['train_ids'])} trained on "
        f"({data['completion_tokens']} completion tokens, sha256 `{data['sha256'][:16]}`), "
        f"{len(data['holdout_ids'])} held out and never trained on.",
        "",
        "## Training",
        "",
        f"{training['mode']}"
        + (f" rank {training['lora_rank']}" if training["lora_rank"] else "")
        + f", lr {training['lr']}, batch {training['batch_size']}, seed {training['seed']}, on "
        f"{training['device']}: {training['steps']} steps ({training['epochs']} epochs) in "
        f"{training['seconds']:.0f} s, stopped by {training['stopped_by']}.",
        "",
        "Loss (completion tokens' cross-entropy) by step:",
        "",
        "```",
        *curve,
        "```",
    ]


def _evaluation_lines(result: dict) -> list[str]:
    """The report's held-out evaluation: top-1 agreement, the bench table, α's gain."""
    evaluation, agreement = result["evaluation"], result["top1_agreement"]
    return [
        "## Held-out evaluation",
        "",
        f"Top-1 agreement with the target's tokens (teacher-forced, every completion token): "
        f"{agreement['before']:.3f} before, {agreement['after']:.3f} after.",
        "",
        f"{len(evaluation['documents'])} held-out documents, batch {evaluation['batch']}, greedy, "
        f"max_new_tokens {evaluation['max_new_tokens']}, {evaluation['runs']} interleaved run(s); "
        "speedups over target-only in the same run; `same`: every output equals target-only.",
        "",
        "```",
        EVAL_HEADER,
        *[format_measured(Measured(**row)) for row in evaluation["rows"]],
        "```",
        "",
        "α after less before: "
        + ", ".join(
            f"{kind} {'-' if gain is None else f'{gain:+.3f}'}"
            for kind, gain in evaluation["alpha_gain"].items()
        )
        + ".",
    ]
