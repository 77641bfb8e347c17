"""A whole job on the tests' tiny pair, where a pass costs about what a captured GPU pass does:
what the engine's own per-round time costs a job (docs/engine.md, "What a round costs besides
its passes").

    python scripts/tiny_job.py WORKDIR [--shards 20] [--rows 3] [--max-new-tokens 64]
        [--drafter auto] [--report docs/benchmarks/NAME.json] [--models TARGET,DRAFT] [--gpus 1]

Builds the tiny target and draft (tests/tiny_models.py) and `--shards` Parquet shards of `--rows`
sentences under WORKDIR, runs `pipeline run` on them with a local Ray, and prints the manifest's
totals: the pooled measured speedup and its interval. `--report` keeps the manifest, with the
machine and commit beside it. `--models` runs another pair instead of the tiny one, `--gpus` on
GPU actors (`gpu-check.sh job`: a job through the real Ray path on a GPU).

    python scripts/tiny_job.py WORKDIR --pair-only
        then: PIPELINE_CONFIG_DIR=WORKDIR/config pipeline bench --pair tiny ...

builds the tiny pair only and names it `tiny` in WORKDIR/config/models.yaml, for `pipeline bench`
and `calibrate` (docs/engine.md: what a round costs at batch 64).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_corpus(data: Path, shards: int, rows: int, sentences: tuple[int, int] = (3, 8)) -> None:
    """`shards` Parquet shards of `rows` documents, each a few of the tiny corpus's sentences."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import CORPUS

    pool = sorted(set(CORPUS))
    rng = random.Random(0)
    data.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        table = [
            {"id": f"s{s}r{r}", "text": " ".join(rng.choice(pool) for _ in range(rng.randint(*sentences)))}
            for r in range(rows)
        ]
        pq.write_table(pa.Table.from_pylist(table), data / f"part-{s:05d}.parquet")


def build(
    work: Path,
    shards: int,
    rows: int,
    max_new_tokens: int,
    drafter: str,
    models: str | None = None,
    gpus: int = 0,
) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import build_tiny_pair

    target, draft = models.split(",") if models else build_tiny_pair(work / "models")
    data = work / "data"
    write_corpus(data, shards, rows)
    spec = work / "job.yaml"
    spec.write_text(
        "name: tiny\n"
        f"input: {{url: {data}, text_column: text, id_column: id}}\n"
        "task: {kind: summarize, chat_template: true, max_input_tokens: 384}\n"
        f"generation: {{max_new_tokens: {max_new_tokens}, greedy: true}}\n"
        f"models: {{target: {target}, draft: {draft}{', device: cuda' if gpus else ''}}}\n"
        f"drafter: {{kind: {drafter}}}\n"
        f"execution: {{num_actors: 1, num_cpus: 2, num_gpus: {gpus}}}\n"
        f'output:\n  url: "{work}/out/{{run_id}}"\n  overwrite: true\n'
    )
    return spec


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("work", type=Path)
    parser.add_argument("--shards", type=int, default=20)
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--drafter", default="auto")
    parser.add_argument("--run-id", default="tiny")
    parser.add_argument("--report", type=Path)
    parser.add_argument("--models", help="TARGET,DRAFT directories (default: the tiny pair, built)")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per actor (models on cuda)")
    parser.add_argument("--pair-only", action="store_true", help="build the pair and name it `tiny`")
    args = parser.parse_args()
    if args.pair_only:
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_models import build_tiny_pair

        target, draft = build_tiny_pair(args.work / "models")
        (args.work / "config").mkdir(parents=True, exist_ok=True)
        pairs = f"pairs:\n  tiny:\n    target: {target}\n    draft: {draft}\n"
        (args.work / "config" / "models.yaml").write_text(pairs)
        print(f"export PIPELINE_CONFIG_DIR={args.work / 'config'}")
        return
    spec = build(args.work, args.shards, args.rows, args.max_new_tokens, args.drafter, args.models, args.gpus)
    command = [sys.executable, "-m", "pipeline.cli", "run", str(spec), "--run-id", args.run_id]
    subprocess.run(command, check=True, cwd=ROOT)
    manifest = json.loads((args.work / "out" / args.run_id / "manifest.json").read_text())
    totals = manifest["totals"]
    keys = ("shards", "rows_out", "tokens_out", "alpha", "tau", "speedup", "speedup_ci95", "speedup_verdict")
    print(json.dumps({k: totals.get(k) for k in keys}))
    if args.report:
        from pipeline.machine import cpu_info, git_state

        model, flags = cpu_info()
        commit, dirty = git_state()
        record = {
            "command": " ".join(["python", "scripts/tiny_job.py", *sys.argv[1:]]),
            "machine": {
                "cpu_model": model,
                "avx2": "avx2" in flags,
                "avx512_bf16": "avx512_bf16" in flags,
                "gpu": gpu_name(),
            },
            "commit": commit,
            "dirty": dirty,
            "manifest": manifest,
        }
        args.report.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"wrote {args.report}")


if __name__ == "__main__":
    main()
