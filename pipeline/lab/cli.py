"""The lab's commands: `pipeline bench`, `pipeline calibrate` and `pipeline distill`.

Their options and help; what each does with them is a function of its own module in
`pipeline.lab` (`bench.bench`, `calibrate.measure_pair` and `record`, `distill.distill`), so
that importing the CLI loads neither torch nor a model. `pipeline.cli` adds them to `pipeline`.
"""

from __future__ import annotations

import json
import sys

import click

from pipeline.cli_common import EXIT_USAGE, parse_storage_options, storage_option


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


# the target's weights, as models.weights in a job spec: bench and calibrate take both
weights_option = click.option(
    "--weights",
    type=click.Choice(["auto", "gguf-blocks", "dense"]),
    default="auto",
    show_default=True,
    help="The target's weights (as models.weights in a job spec).",
)
block_activations_option = click.option(
    "--block-activations",
    type=click.Choice(["int8", "float32"]),
    default="int8",
    show_default=True,
    help="What the target's GGUF blocks multiply in decoding passes (as models.block_activations).",
)


def pass_path_options(command):
    """How the passes run, as a job would load them unless told: bench and calibrate take these."""
    options = (
        click.option(
            "--static-passes/--dynamic-passes",
            default=None,
            help="Passes through fixed slots and shapes, CUDA graphs on a GPU (default: as a job would "
            "load it; see models.static_passes).",
        ),
        click.option(
            "--compiled-passes/--eager-passes",
            default=None,
            help="The static passes' decoder layers compiled with torch.compile before their graphs are "
            "captured, or not (default: as a job would load it; see models.compiled_passes).",
        ),
        click.option(
            "--fused-projections",
            is_flag=True,
            help="q/k/v and gate/up one matrix product each, in both models where their layers allow "
            "(pipeline/models/fusion.py; off in jobs until measured on a GPU).",
        ),
        click.option(
            "--float64-attention",
            is_flag=True,
            help="The static passes' attention in float64, not the fixed-order kernel a GPU's "
            "batch-invariant target runs (pipeline/models/fixed_attention.py): an A/B of the two.",
        ),
        click.option(
            "--block-linears",
            is_flag=True,
            help="The static passes' products in padded blocks of rows (cuBLAS), not the fixed-order "
            "kernel a GPU's batch-invariant target runs (pipeline/models/fixed_linear.py): an A/B.",
        ),
    )
    for option in reversed(options):
        command = option(command)
    return command


@click.command()
@click.option(
    "--pair", default="qwen2.5-coder", show_default=True, help="Named model pair (configs/models.yaml)."
)
@click.option("--tasks", default="summarize,translate", show_default=True)
@click.option("--docs", default=4, show_default=True, help="Documents per task.")
@click.option(
    "--corpus",
    type=click.Choice(["docstrings", "licenses"]),
    default="docstrings",
    show_default=True,
    help="Standard-library docstrings (the demo corpus), or sections of the license texts shipped "
    "with Python and the OS (legal prose whose summaries copy more of their input).",
)
@click.option("--batches", default="1,4", show_default=True, help="Batch sizes for our engine.")
@click.option("--max-new-tokens", default=48, show_default=True)
@click.option("--runs", default=3, show_default=True, help="Runs per configuration (median reported).")
@click.option("--dtype", default="auto", show_default=True)
@click.option("--threads", type=int, default=None, help="torch threads (default: all cores).")
@click.option(
    "--batch-invariant/--stock-kernels",
    default=None,
    help="Target numerics (default: as a job would load it; see models.batch_invariant). HF runs "
    "on the same loaded models.",
)
@pass_path_options
@click.option(
    "--draft-int8/--draft-as-loaded",
    default=None,
    help="Draft decode steps on int8 weights (default: as a job would load it; see "
    "models.draft_int8). HF's assisted generation runs with the draft as loaded and, when this "
    "is on, with the int8 steps too.",
)
@click.option(
    "--hf-assistant-tokens", default="3,5", show_default=True, help="HF num_assistant_tokens to try."
)
@click.option(
    "--hf-lookup-tokens", default="3,10", show_default=True, help="HF prompt_lookup_num_tokens to try."
)
@click.option(
    "--hf/--no-hf",
    default=True,
    show_default=True,
    help="Run HF's rows (batch 1); without them ours target-only is the reference for outputs.",
)
@click.option(
    "--drafters",
    default="draft_model,prompt_lookup,auto",
    show_default=True,
    help="Our drafters to run at every batch size (target-only always runs); `auto:A+B` is auto "
    "choosing among A and B only (drafter.auto_sources), e.g. auto:draft_model+prompt_lookup.",
)
@click.option(
    "--draft-vocab",
    default=32768,
    show_default=True,
    help="Our draft model proposes among ids below this plus prompt tokens (0: all; drafter.draft_vocab).",
)
@click.option(
    "--warm-docs",
    default=0,
    show_default=True,
    help="Also run suffix and auto warm: their corpus holds our outputs of this many other documents "
    "of the task (drafter.suffix_warm_start).",
)
@click.option(
    "--head",
    "head_path",
    type=click.Path(exists=True, file_okay=False),
    help="A draft head trained on this pair's target (`pipeline distill --head`): the `head` drafter "
    "drafts with it (name it in --drafters).",
)
@weights_option
@block_activations_option
@click.option(
    "--llama-cpp",
    "llama_cpp",
    is_flag=True,
    help="Also run llama.cpp (llama-cpp-python, pip install -e '.[llama]') on the target's GGUF file: "
    "greedy and its prompt lookup, batch 1, with every row's tokens/s against its target-only.",
)
@click.option(
    "--dense-reference",
    is_flag=True,
    help="With the target on its GGUF blocks: also run the target on its dense bf16 weights "
    "(target-only, at every batch size) and report how far its outputs agree with the block path's.",
)
@click.option(
    "--llama-cpp-gguf",
    type=click.Path(exists=True, dir_okay=False),
    help="The GGUF file llama.cpp runs (default: the one `pipeline models install --keep-gguf` kept "
    "beside the pair's target).",
)
@click.option(
    "--out",
    "out_path",
    help="Where to write the JSON (default: beside --report as NAME.json, else bench.json).",
)
@click.option(
    "--report",
    "report_path",
    metavar="PATH.md",
    help="Also write a Markdown record of the run (command, commit, machine, pair, settings, tables), "
    "e.g. docs/benchmarks/NAME.md.",
)
def bench(pair, tasks, batches, hf_assistant_tokens, hf_lookup_tokens, drafters, **options):
    """Benchmark target-only vs our speculative engine vs HF assisted generation, one run.

    \b
    Example:
      pipeline bench --docs 4 --batches 1,4,8 --runs 3
    """
    from pipeline.lab.bench import BenchOptions
    from pipeline.lab.bench import bench as run_bench

    parsed = BenchOptions(
        pair=pair,
        tasks=tuple(tasks.split(",")),
        batches=_ints(batches),
        hf_assistant_tokens=_ints(hf_assistant_tokens),
        hf_lookup_tokens=_ints(hf_lookup_tokens),
        drafters=tuple(d for d in drafters.split(",") if d),
        **options,
    )
    run_bench(parsed, click.echo)


@click.command()
@click.option(
    "--pair", default="qwen2.5-coder", show_default=True, help="Named model pair (configs/models.yaml)."
)
@click.option("--batch", "batches", default="1,4,8", show_default=True, help="Batch sizes (rows per pass).")
@click.option(
    "--widths", default="1,2,4,8,16", show_default=True, help="New tokens per row in a pass (must include 1)."
)
@click.option("--context", default=400, show_default=True, help="Cached tokens per row under every pass.")
@click.option("--dtype", default="auto", show_default=True)
@click.option("--threads", type=int, default=None, help="torch threads (default: all cores).")
@weights_option
@block_activations_option
@click.option(
    "--against",
    type=click.Choice(["gguf-blocks", "dense"]),
    help="Also time the target on these weights in the same process, in alternating rounds (one pass "
    "per shape each), and print the ratio of the passes: two settings compared on one drifting machine.",
)
@click.option(
    "--batch-invariant/--stock-kernels",
    default=None,
    help="Target numerics (default: as a job would load it; see models.batch_invariant).",
)
@pass_path_options
@click.option("--runs", default=3, show_default=True, help="Timed passes per shape (median reported).")
@click.option(
    "--head",
    is_flag=True,
    help="Also time a draft head's step (drafter.kind head: one decoder layer of the target's shape "
    "and its output layer over --head-vocab tokens) beside the target's pass.",
)
@click.option(
    "--head-vocab",
    type=click.IntRange(min=1),
    help="With --head: the rows of the head's output layer (default: drafter.draft_vocab's 32768; a "
    "head from `pipeline distill --head` has its distill.json's vocab_rows).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the measurements as JSON instead of a table.")
@click.option("--out", "out_path", help="Also write the JSON to this file.")
@click.option(
    "--report",
    "report_path",
    type=click.Path(dir_okay=False),
    metavar="PATH.md",
    help="Also write a Markdown record (command, machine, table), e.g. docs/benchmarks/NAME.md, "
    "with the JSON beside it unless --out says where.",
)
def calibrate(batches, widths, **options):
    """Measure what target passes and draft steps cost here, as a job would run them.

    Loads the pair as a job's actor does and times, with the engine's own runner, a target
    pass of every width at every batch size over --context cached tokens, the draft's steps,
    and both prefills; prints them with the speedup Leviathan et al.'s formula predicts at
    α 0.6 and 0.8 for the best γ. The result is also cached for actors on this machine.

    \b
    Example:
      pipeline calibrate --batch 1,8 --widths 1,2,4,8 --runs 3
    """
    from pipeline.lab.calibrate import CalibrateOptions, measure_pair, record
    from pipeline.models.loading import ModelError

    parsed = CalibrateOptions(batches=_ints(batches), widths=_ints(widths), **options)
    try:
        loaded, result = measure_pair(parsed)
    except (ModelError, ValueError) as exc:
        click.echo(f"pipeline calibrate: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    record(parsed, loaded, result, click.echo)


@click.command()
@click.argument("run_output_urls", metavar="RUN_OUTPUT_URL...", nargs=-1, required=True)
@click.option(
    "--pair",
    default="qwen2.5-coder",
    show_default=True,
    help="The pair whose draft to fine-tune; its target must be the one the run decoded with.",
)
@click.option(
    "--out",
    "out_name",
    required=True,
    help="Name of the new local pair (models.pair, --pair); with --head, the head's directory "
    "(drafter.head).",
)
@click.option(
    "--head",
    is_flag=True,
    help="Train a draft head on the target's features instead of tuning the draft model "
    "(options that tune a model, --lora-rank, --full, --batch-size, --runs, --eval-max-new-tokens, "
    "do not apply; --epochs default 6, --lr default 1e-3).",
)
@click.option(
    "--prompts",
    is_flag=True,
    help="With --head: also learn at the prompts' positions, each labelled with the target's own "
    "choice there (more data per document; the target's output layer runs over every position once).",
)
@click.option(
    "--head-vocab",
    type=click.IntRange(min=0),
    help="With --head: the head proposes token ids below this plus every token of the training "
    "completions (0: the whole vocabulary). Default: only the completions' tokens, the smallest "
    "output layer and so the cheapest step.",
)
@click.option(
    "--chained-steps",
    type=click.IntRange(min=1, max=8),
    help="With --head: the draft steps the head learns at every position, each after the last fed "
    "its own output, as it drafts (default 3; 1 learns the first draft alone).",
)
@click.option(
    "--features-cache",
    type=click.Path(file_okay=False),
    metavar="DIR",
    help="With --head: keep each document's target features in DIR and read them back when a "
    "later distill meets the same document with the same target (the target's pass over every "
    "document is most of a distill's time: tonight's distill over every night's runs then "
    "computes only tonight's).",
)
@click.option(
    "--gamma",
    type=click.IntRange(min=1),
    help="With --head: drafts per round when the held-out documents are replayed (default: the "
    "run's gamma_max).",
)
@click.option(
    "--holdout",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=0.1,
    show_default=True,
    help="Share of documents held out (by a hash of their id, at least one) for the evaluation.",
)
@click.option("--steps", type=click.IntRange(min=1), help="Optimizer steps (instead of --epochs).")
@click.option(
    "--epochs",
    type=click.FloatRange(min=0, min_open=True),
    help="Passes over the training documents (default 1 when --steps is not given).",
)
@click.option("--lora-rank", default=16, show_default=True, type=click.IntRange(min=1), help="LoRA rank.")
@click.option("--full", is_flag=True, help="Fine-tune every weight instead of LoRA adapters.")
@click.option(
    "--lr", type=click.FloatRange(min=0, min_open=True), help="AdamW learning rate [2e-4 LoRA, 2e-5 full]."
)
@click.option(
    "--batch-size", default=4, show_default=True, type=click.IntRange(min=1), help="Documents per step."
)
@click.option(
    "--max-seconds",
    type=click.FloatRange(min=0, min_open=True),
    help="Stop training after this long (the evaluation comes after).",
)
@click.option("--seed", default=0, show_default=True, help="Seed of the adapters' start and the shuffling.")
@click.option(
    "--runs", default=1, show_default=True, type=click.IntRange(min=1), help="Evaluation runs (median time)."
)
@click.option(
    "--eval-max-new-tokens",
    type=click.IntRange(min=1),
    help="Tokens per held-out document in the evaluation (default: the run's max_new_tokens). "
    "The draft's prefill is paid once per document: on a CPU, short completions hide what a "
    "better draft saves.",
)
@click.option("--force", is_flag=True, help="Replace a local pair of the same name.")
@click.option("--json", "as_json", is_flag=True, help="Print the provenance and evaluation as JSON.")
@click.option(
    "--report",
    "report_path",
    type=click.Path(dir_okay=False),
    metavar="PATH.md",
    help="Also write a Markdown record (command, machine, loss curve, evaluation), e.g. "
    "docs/benchmarks/DATE-distill-MACHINE.md, with distill.json's copy beside it (PATH.json).",
)
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: only on a terminal).")
@storage_option
def distill(
    run_output_urls,
    pair,
    out_name,
    head,
    prompts,
    head_vocab,
    chained_steps,
    features_cache,
    gamma,
    as_json,
    report_path,
    progress,
    storage_options,
    **settings,
):
    """Fine-tune PAIR's draft on the run at RUN_OUTPUT_URL and install it as the local pair OUT.

    Prompts are rebuilt with the run's own task and template; the completions are the target's
    outputs. LoRA adapters (merged at the end) or all weights learn them; then the old and the
    new draft are compared on the held-out documents under the run's `draft_model` and `auto`
    settings at batch 1: α, acceptance by position, predicted and measured speedup, and every
    output checked equal to target-only. `distill.json` beside the new pair records it all.

    With --head, a draft head on the target's own features is trained instead (drafter.kind
    head): written to the directory OUT with its distill.json, and its held-out acceptance
    replayed before and after training. A head learns from several runs of the same target at
    once (name each): one night's documents are rarely enough to teach it a corpus.

    \b
    Example:
      pipeline distill ./out/licenses/RUN --pair qwen2.5-coder --out coder-licenses \\
          --max-seconds 2400 --report docs/benchmarks/2026-11-26-distill-avx2-float32.md
    """
    from functools import partial

    from pipeline.lab.record import command_line
    from pipeline.models.loading import ModelError
    from pipeline.storage import StorageError

    progress = sys.stderr.isatty() if progress is None else progress
    if head:
        from pipeline.lab.distill_head import HeadSettings, distill_head, write_head_report

        chosen = {k: settings[k] for k in ("holdout", "max_seconds", "seed", "force")}
        chosen |= {k: settings[k] for k in ("epochs", "lr") if settings[k] is not None}
        job = partial(
            distill_head,
            run_output_urls,
            out_name,
            HeadSettings(
                **chosen,
                gamma=gamma,
                prompts=prompts,
                vocab=head_vocab,
                chained_steps=chained_steps,
                features_cache=features_cache,
            ),
        )
        write = write_head_report
    else:
        from pipeline.lab.distill import Settings, write_report
        from pipeline.lab.distill import distill as run_distill

        if len(run_output_urls) > 1:
            click.echo("pipeline distill: several runs are read only with --head; name one run", err=True)
            sys.exit(EXIT_USAGE)
        job = partial(
            run_distill, run_output_urls[0], pair, out_name, Settings(**settings, progress=progress)
        )
        write = write_report
    try:
        result = job(
            storage_options=parse_storage_options(storage_options),
            command=command_line(),
            log=lambda line: click.echo(line, err=as_json),
        )
    except (ModelError, StorageError) as exc:
        click.echo(f"pipeline distill: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    if report_path:
        json_path = write(report_path, result)
        click.echo(f"wrote {report_path} and {json_path}", err=True)
    if as_json:
        click.echo(json.dumps(result, indent=2))
