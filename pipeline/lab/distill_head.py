"""`pipeline distill --head`: a draft head (`pipeline.decode.head`) trained on a finished run.

The run is the data, as for a distilled draft model (`pipeline.lab.distill`, whose reading of
the run and hold-out split this shares): each document's prompt as the run built it, and the
target's own completion. The target reads each document once (its features, no gradient); the
head learns, by teacher forcing, the target's next token after each completion token. The
held-out documents are then replayed round by round (`head.replay`): the acceptance at each
draft position and τ that greedy speculation with the head would have at batch 1, before and
after training. The head and `distill.json` (where it came from, how it trained, what it
reached) are written to the output directory, which a job names as `drafter.head`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from pipeline.lab.distill import (
    DistillError,
    build_examples,
    end_of_turn,
    read_run,
    same_model,
    split_examples,
)

HEAD_DISTILL_FORMAT = 2  # 2: source_runs, a list (several runs)


@dataclass
class HeadSettings:
    """`pipeline distill --head`'s options."""

    holdout: float = 0.1
    epochs: float = 6.0  # why 6: docs/choosing-a-draft.md (chained steps and epochs, measured)
    lr: float = 1e-3
    max_seconds: float | None = None
    seed: int = 0
    gamma: int | None = None  # drafts per round in the replay (None: the run's gamma_max)
    force: bool = False
    # also learn at the prompts' positions, labelled with the target's own choices there
    prompts: bool = False
    # the tokens the head proposes: ids below this plus the training completions' tokens (0: all);
    # None: the completions' tokens alone (each row of the output layer costs every step)
    vocab: int | None = None
    # draft steps learned at every pair, chained on the head's own outputs (`head.head_loss`)
    chained_steps: int | None = None  # None: head.CHAINED_STEPS
    # a directory keeping each document's features (`FeatureCache`); None: none kept
    features_cache: str | None = None


def feature_target(target_ref, models) -> tuple[torch.nn.Module, torch.dtype, str]:
    """The target that computes a head's training features, its dtype and weights ("dense" or
    "gguf-blocks"), for a run whose spec's `models` are `models`.

    It only computes features (the head starts from a copy of its last layer, in float32 as it
    trains): in bfloat16 dense weights where the CPU has bf16 products (several times float32's
    speed), else through the job's own kernels (its GGUF blocks where it keeps them: a cheaper
    prefill than float32 dense weights, and the features a job drafts from). A head's inputs
    need not be any pass's bits: the target checks every draft."""
    from pipeline.models.loading import load_model, load_pair, resolve_dtype

    remote = models.trust_remote_code
    dtype = resolve_dtype("auto", "cpu")
    if dtype == torch.bfloat16:
        return load_model(target_ref, dtype=dtype, device="cpu", trust_remote_code=remote), dtype, "dense"
    loaded = load_pair(
        target_ref,
        None,
        device="cpu",
        trust_remote_code=remote,
        weights=models.weights,
        block_activations=models.block_activations,
        batch=1,
    )
    return loaded.target, loaded.dtype, loaded.weights


def distill_head(
    run_urls: Sequence[str],
    out: str,
    settings: HeadSettings,
    *,
    storage_options: dict | None = None,
    command: str = "",
    log: Callable[[str], None] = print,
) -> dict:
    """Train a head for the runs' target on the runs (one or more: a head needs more
    documents than one night's job holds, docs/choosing-a-draft.md), write it to `out`; return
    `distill.json`."""
    from pipeline.decode.head import CHAINED_STEPS, DraftHead, documents, replay, train
    from pipeline.job.worker import model_refs
    from pipeline.machine import cpu_info, git_state
    from pipeline.models.loading import load_tokenizer

    commit, dirty = git_state()
    directory = Path(out)
    if directory.exists() and any(directory.iterdir()) and not settings.force:
        raise DistillError(f"--out {out}: the directory is not empty (--force replaces it)")
    runs = [read_run(url, storage_options) for url in run_urls]
    run = runs[0]  # names the target, its weights and the replay's gamma
    target_ref, _ = model_refs(run.spec)
    for other in runs[1:]:
        if not same_model(other.target, target_ref):
            raise DistillError(
                f"{other.url} was decoded by {other.target.get('path')}, {run.url} by {target_ref.display}: "
                "a head learns one target's features, so every run must share the target"
            )
    models = run.spec.models
    tokenizer = load_tokenizer(target_ref, trust_remote_code=models.trust_remote_code)
    target, dtype, features_path = feature_target(target_ref, models)
    examples = _examples(runs, tokenizer, end_of_turn(tokenizer, target))
    # a document several runs decoded, or a text under two ids, is held out (or learned) whole
    trained, held = split_examples(examples, settings.holdout)
    held_ids = sorted({e.id for e in held})
    began = time.perf_counter()
    pairs = [(e.prompt, e.completion) for e in trained + held]
    if settings.features_cache:
        cache = FeatureCache(settings.features_cache, target, dtype, features_path)
        docs = [cache.document(p, c, settings.prompts) for p, c in pairs]
        kept = cache.hits
    else:
        docs, kept = documents(target, pairs, choices=settings.prompts), 0
    features_seconds = time.perf_counter() - began
    train_docs, held_docs = docs[: len(trained)], docs[len(trained) :]
    log(
        f"{', '.join(r.url for r in runs)}: {len(examples)} documents, {len(train_docs)} to train on "
        f"({sum(len(d.completion) for d in train_docs)} completion tokens), {len(held_docs)} held out; "
        f"the target's features took {features_seconds:.1f} s"
        + (f" ({kept} of {len(docs)} documents read from {settings.features_cache})" if kept else "")
    )
    # what the head can propose: the tokens the target wrote in the training completions (a
    # label outside them, at a prompt's position, is not learned), below `vocab` where asked
    seen = {t for d in train_docs for t in d.completion}
    torch.manual_seed(settings.seed)  # before the head's start: the same command, the same head
    head = DraftHead.from_target(target, settings.vocab, sorted(seen))
    gamma = settings.gamma or max(run.spec.drafter.gamma_max, 1)
    before = _replayed(replay, head, held_docs, gamma)
    training = train(
        head,
        train_docs,
        lr=settings.lr,
        epochs=settings.epochs,
        max_seconds=settings.max_seconds,
        seed=settings.seed,
        steps=settings.chained_steps or CHAINED_STEPS,
        on_step=lambda step, loss: step % 100 == 0 and log(f"step {step}: loss {loss:.3f}"),
    )
    after = _replayed(replay, head, held_docs, gamma)
    log(
        f"trained {training.steps} steps in {training.seconds:.0f} s ({training.stopped_by}); held out, "
        f"first draft accepted {before['first_position']:.3f} -> {after['first_position']:.3f}, "
        f"tau {before['tau']:.2f} -> {after['tau']:.2f} at gamma {gamma}"
    )
    if directory.exists() and settings.force:
        shutil.rmtree(directory)
    head.save(directory)
    model, flags = cpu_info()
    result = {
        "format": HEAD_DISTILL_FORMAT,
        "command": command,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source_runs": [{"url": r.url, "run_id": r.run_id, "job": r.job} for r in runs],
        "target": {"path": target_ref.path, "display": target_ref.display, "fingerprint": head.fingerprint},
        "data": {
            "documents": len(examples),
            "train": len(train_docs),
            "train_completion_tokens": sum(len(d.completion) for d in train_docs),
            "held_out": held_ids,
            "features_seconds": round(features_seconds, 1),
            "features_from_cache": kept,
            "features_dtype": str(dtype).removeprefix("torch."),
            "features_weights": features_path,
            "prompt_positions": settings.prompts,
        },
        "head": {
            "parameters": sum(p.numel() for p in head.parameters()),
            "vocab_rows": len(head.vocab_rows),
            "layer": type(head.layer).__name__,
        },
        "training": asdict(training),
        "held_out": {"gamma": gamma, "before": before, "after": after},
        "machine": {
            "cpu_model": model,
            "avx2": "avx2" in flags,
            "avx512_bf16": "avx512_bf16" in flags,
            "threads": torch.get_num_threads(),
            "git_commit": commit,
            "git_dirty": dirty,
        },
    }
    (directory / "distill.json").write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote the head to {directory}")
    return result


class FeatureCache:
    """A directory keeping each document's target features, one file a document, so that a head
    distilled again (other settings, or last night's runs with tonight's added) computes only
    the documents it has not seen: the target's pass over every document is most of a distill's
    time on a CPU, and the runs of a nightly job pile up.

    A file's name is a digest of what its features depend on: the target (`target_fingerprint`),
    the dtype and weights they were computed with, and the document's token ids. Features are
    kept in the dtype they were computed in, so a document read back is the one computed."""

    def __init__(self, directory: str, target, dtype: torch.dtype, weights: str):
        from pipeline.decode.head import target_fingerprint

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.target, self.dtype = target, dtype
        self.key = [target_fingerprint(target), str(dtype), weights]
        self.hits = 0

    def document(self, prompt: list[int], completion: list[int], choices: bool):
        from pipeline.decode.head import document

        name = hashlib.sha256(json.dumps([*self.key, prompt, completion]).encode()).hexdigest()[:40]
        path = self.directory / f"{name}.pt"
        if path.is_file():
            features = torch.load(path, weights_only=True).float()
            self.hits += 1
            return document(self.target, prompt, completion, choices, features=features)
        doc = document(self.target, prompt, completion, choices)
        partial = path.with_suffix(f".{os.getpid()}.part")  # never a half-written file under the name
        torch.save(doc.features.to(self.dtype), partial)
        os.replace(partial, path)
        return doc


def _examples(runs, tokenizer, eot: int) -> list:
    """Every run's examples, each prompt built with its own run's task; a document two runs
    decoded into the same prompt and completion, once."""
    seen, examples = set(), []
    for run in runs:
        for example in build_examples(run, tokenizer, eot):
            key = (example.id, tuple(example.prompt), tuple(example.completion))
            if key not in seen:
                seen.add(key)
                examples.append(example)
    return examples


def _replayed(replay, head, docs, gamma: int) -> dict:
    from pipeline.decode.head import ChainFigures

    figures = ChainFigures()
    for doc in docs:
        replay(head, doc.prompt, doc.completion, doc.features, gamma, figures)
    return figures.to_dict()


def _steps_learned(steps: int) -> str:
    return "the first draft learned alone" if steps == 1 else f"{steps} chained draft steps learned"


def write_head_report(path: str, result: dict) -> str:
    """A Markdown record of a head's training and held-out figures, with its JSON beside it."""
    md = Path(path)
    md.parent.mkdir(parents=True, exist_ok=True)
    json_path = md.with_suffix(".json")
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    t, h, m = result["training"], result["held_out"], result["machine"]
    dirty = " (dirty)" if m["git_dirty"] else ""
    rows = [
        f"| {name} | {fig['first_position']} | {fig['tau']} | {fig['accepted']} / {fig['drafted']} | "
        f"{fig['by_position']} |"
        for name, fig in (("untrained", h["before"]), ("trained", h["after"]))
    ]
    lines = [
        f"# A draft head for {result['target']['display']}, trained on "
        + ", ".join(f"{r['job']} {r['run_id']}" for r in result["source_runs"]),
        "",
        f"`{result['command']}` at commit {(m['git_commit'] or '?')[:7]}{dirty}; {m['cpu_model']}, "
        f"AVX2 {m['avx2']}, AVX-512 BF16 {m['avx512_bf16']}, {m['threads']} threads; the target's "
        f"features in {result['data'].get('features_dtype', 'float32')}"
        + (" on its GGUF blocks" if result["data"].get("features_weights") == "gguf-blocks" else "")
        + ", the head trained in float32.",
        "",
        f"- data: {result['data']['train']} documents to train on "
        f"({result['data']['train_completion_tokens']} completion tokens), "
        f"{len(result['data']['held_out'])} held out; the target's features took "
        f"{result['data']['features_seconds']} s"
        + (
            f" ({result['data']['features_from_cache']} documents' features read from a cache)"
            if result["data"].get("features_from_cache")
            else ""
        )
        + ("; learned at the prompts' positions too" if result["data"].get("prompt_positions") else ""),
        f"- head: {result['head']['parameters']:,} trained parameters ({result['head']['layer']}), "
        f"{result['head']['vocab_rows']:,} tokens it can propose",
        f"- training: {t['steps']} steps, {t['epochs']} epochs, {t['seconds']} s ({t['stopped_by']}), "
        f"lr {t['lr']}, products in {t.get('dtype', 'float32')}, "
        f"{_steps_learned(t.get('chained_steps', 1))}; loss {t['loss'][:1]} -> {t['loss'][-1:]}",
        "",
        f"Held-out documents replayed with greedy speculation at γ {h['gamma']}, batch 1 (the "
        "target's own completions decide each draft; no timing):",
        "",
        "| head | first draft accepted | τ (tokens per round) | accepted / drafted | accepted by position |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]
    md.write_text("\n".join(lines))
    return str(json_path)
