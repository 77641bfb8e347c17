#!/usr/bin/env bash
# What a session with a GPU runs (docs/gpu.md), writing logs and reports
# under OUT:
#   scripts/gpu-check.sh OUT tests                 the decoding tests, models on CUDA
#   scripts/gpu-check.sh OUT calibrate PAIR [opts] pipeline calibrate, report OUT/[DATE-]calibrate-[MACHINE-]PAIR.md
#   scripts/gpu-check.sh OUT bench PAIR [opts]     pipeline bench, report OUT/[DATE-]bench-[MACHINE-]PAIR.md
#   scripts/gpu-check.sh OUT job                   pipeline run on a GPU actor through a local Ray
#   scripts/gpu-check.sh OUT smol                  SmolLM2-135M (real text): bench at batch 1 and 64
# (`all` sets DATE and MACHINE, so its reports carry docs/benchmarks' names: DATE-tool-MACHINE-rest)
# Runs from a source tree (python3 -m pipeline.cli), so a copied checkout needs no install.
set -uo pipefail
out=$1 what=$2
shift 2
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# `all`, `smol`, `job` and `probe` write their reports and their console log (console.log)
# under RES (/tmp/gpu/reports), packed into OUT/reports.tgz after every step: at most 8 files of
# OUT come back from the device, and a call cut short still brings back what it measured.
# A call's steps share its time, BUDGET_S seconds from the script's start (unset: no budget):
# each step's limit is cut to what is left, less RESERVE_S for the acceptance lines and the
# last pack, and a step that would get under 30 s is skipped, so that a call given 450 s of
# the session's 15 minutes ends inside them with its reports (docs/gpu.md).
# `prepare`: what the machine lacks comes unpacked in .gpu-carry/site (`gpu_models.py
# prepare`), put first on the path where anything is missing; the reports' names as
# docs/benchmarks has them (2026-11-28-calibrate-h200-bf16-...); then random-weight
# Qwen2.5-Coder-shaped models from the carried configs (scripts/gpu_models.py).
setup() {
    res=${RES:-/tmp/gpu/reports}
    mkdir -p "$res"
    [ -d .gpu-carry/site ] && { python3 -c "import pydantic_core, tenacity, click, yaml, fsspec, xdist, gguf" 2>/dev/null ||
        export PYTHONPATH="$PWD/.gpu-carry/site:$PYTHONPATH"; }
    DATE=$(date +%F)
    MACHINE=$(python3 -c "import torch; n = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else 'cpu'; print(next((g for g in ('h200', 'h100', 'a100', 'l4') if g in n), n.split()[-1]))")-bf16
    export DATE MACHINE
    # nothing there reaches the internet: no library should try
    export PIPELINE_CONFIG_DIR=/tmp/gpu/config PIPELINE_HOME=/tmp/gpu/home HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
}
# the console, from here on, into RES/console.log as well (packed with the reports)
logged() { exec > >(tee -a "$res/console.log") 2>&1; }
# the seconds a step of at most $1 may take now (see BUDGET_S); fails where under 30 would be left
allowed() {
    local left=$((${BUDGET_S:-1000000} - SECONDS - ${RESERVE_S:-25}))
    [ "$left" -ge 30 ] || return 1
    echo $(($1 < left ? $1 : left))
}
skipped() { echo "== skipped, too little of the call's time left (BUDGET_S=${BUDGET_S:-}): $* ($(date +%T))"; }
# a step of at most $1 s named $2 begins: `limit` set (`allowed`) and its header printed; or it is
# skipped, and says so (the status fails)
opened() {
    limit=$(allowed "$1") || { skipped "$2"; return 1; }
    echo "== $2 ($(date +%T), at most $limit s)"
}
prepare() {
    setup
    if [ -n "${DRY:-}" ]; then # the script's own check on a CPU: the tests' tiny pair, same steps
        python3 scripts/tiny_job.py /tmp/gpu --pair-only 2>&1 | tee "$res/models.log"
        pair=tiny
        return
    fi
    python3 scripts/gpu_models.py build /tmp/gpu 2>&1 | tee "$res/models.log"
    pair=qwen2.5-coder-shaped-random
}
# written aside, then moved: a call cut short in the middle of packing keeps the last whole pack;
# console.log may grow while tar reads it (tar's status 1), which still packs the rest whole
pack() {
    tar --warning=no-file-changed -czf /tmp/gpu/reports.tgz.part -C "$res" .
    [ $? -le 1 ] && mv -f /tmp/gpu/reports.tgz.part "$out/reports.tgz"
}
# one step of `all` or `smol`: this script again under its time limit (at most $1 s, see
# `allowed`), its report under RES
step() {
    local limit
    opened "$1" "${*:2}" || return 0
    shift
    timeout -k 10 "$limit" "$0" "$res" "$@"
    pack
}
# a direct call (not a step of `all`): the carried packages, the pair's config, the reports' names
case $what in tests | calibrate | bench) [ -n "${MACHINE:-}" ] || { setup; rmdir "$res" 2>/dev/null; } ;; esac
case $what in
tests)
    PIPELINE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -o addopts= "$@" \
        tests/test_engine.py tests/test_decode_sampling.py tests/test_batched_lm.py \
        tests/test_policy.py tests/test_drafters.py tests/test_suffix.py tests/test_packing.py \
        tests/test_costs.py tests/test_invariant.py tests/test_static_lm.py tests/test_fusion.py 2>&1 | tee "$out/tests.log"
    ;;
calibrate)
    pair=$1
    shift
    name=${DATE:+$DATE-}calibrate-${MACHINE:+$MACHINE-}${NAME:-$pair}
    python3 -m pipeline.cli calibrate --pair "$pair" --report "$out/$name.md" "$@" 2>&1 |
        grep --line-buffered -v "^Loading weights" | tee "$out/$name.log"
    ;;
bench)
    pair=$1
    shift
    name=${DATE:+$DATE-}bench-${MACHINE:+$MACHINE-}${NAME:-$pair}
    python3 -m pipeline.cli bench --pair "$pair" --report "$out/$name.md" "$@" 2>&1 |
        grep --line-buffered -v "^Loading weights" | tee "$out/$name.log"
    ;;
all)
    # The whole check in one call (docs/gpu.md), each step under its own time limit, issue 37's
    # lines first (a call has 600 s, a session 15 minutes with `smol` to follow: BUDGET_S).
    prepare
    logged
    python3 - <<'EOF' 2>&1 | tee "$res/env.log"
import importlib, platform, torch
print(platform.platform(), "python", platform.python_version())
print("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch", torch.__version__)
for name in ("transformers", "accelerate", "pyarrow", "fsspec", "tenacity", "pydantic", "click", "yaml", "xdist", "ray", "triton", "gguf"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as error:
        print(name, "missing:", error)
import shutil
print("compilers", {c: shutil.which(c) for c in ("gcc", "cc", "nvcc")}, "cpus", __import__("os").cpu_count())
EOF
    xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
    # The passes: their cost by width, the bandwidth achieved, a draft step beside a target pass,
    # what the captured graphs hold (the 2026-12-04 call found 26.7 GB for one slot: graphs
    # captured with autograd on). The first step also pays the kernels' compile and their checks
    # in a child process, kept for the steps after (pipeline.models.child_check).
    NAME=$pair-batch1 step 150 calibrate $pair --batch 1 --widths 1,8,16 --runs 3
    # the price of exactness: the same passes with stock kernels (batch_invariant off)
    NAME=$pair-stock-kernels step 90 calibrate $pair --batch 1 --widths 1,8,16 --runs 3 --stock-kernels
    # HF's eager rows (~30 tok/s) would take the step's whole time: ours only. Every graph is
    # captured before the timed runs (`StaticLM.reserve`), so the runs should now be even.
    NAME=$pair-batch1 step 110 bench $pair --tasks translate --corpus licenses --docs 4 --batches 1 --max-new-tokens 128 \
        --runs 3 --drafters prompt_lookup,draft_model,auto --no-hf
    # 4 documents a slot where the machine has that many license sections (222 here and on the H200)
    docs=$(python3 -c "from pipeline.demo_data import CORPORA; print(min(256, len(CORPORA['licenses']())))")
    NAME=$pair-batch64 step 150 bench $pair --tasks translate --corpus licenses --docs "$docs" --batches 64 --max-new-tokens 64 \
        --runs 3 --drafters prompt_lookup,suffix,auto --no-hf
    # the kernels' own tests on CUDA: a row alone against many bit for bit, the last part's adding
    # and the last chunk's merging against a second kernel's (concurrency the interpreter never has)
    if [ -n "${SKIP_TESTS:-}" ]; then
        :
    elif opened 100 "static path and fusion tests"; then
        PIPELINE_TEST_DEVICE=cuda timeout -k 10 "$limit" python3 -m pytest -q -p no:cacheprovider -o addopts= $xdist \
            tests/test_static_lm.py tests/test_fusion.py tests/test_fixed_attention.py tests/test_fixed_linear.py 2>&1 |
            tee "$res/tests-static.log" | tail -15
        pack
    fi
    # the fixed-order products alone against the padded row blocks they replaced and cuBLAS as
    # the rows come, the 1.5B target's weights at 1 to 256 rows
    if opened 60 "products alone"; then
        if [ -n "${DRY:-}" ]; then
            TRITON_INTERPRET=1 timeout -k 10 "$limit" python3 scripts/gpu_linear.py --hidden 64 --intermediate 160 --kv 32 \
                --vocab 320 --rows 1,20 --out "$res/linear.txt"
        else
            timeout -k 10 "$limit" python3 scripts/gpu_linear.py --out "$res/linear.txt"
        fi 2>&1 | tail -40
    fi
    # the fixed-order attention kernel alone against the float64 attention it replaced, the
    # 1.5B target's shapes, batch 1 and 64, 400 and 4,000 cached tokens, beside its chunks merged
    # by a second kernel and chunks of 64 and 128 positions (the dry run: a small check in Triton's interpreter)
    if opened 90 "attention alone"; then
        if [ -n "${DRY:-}" ]; then
            TRITON_INTERPRET=1 timeout -k 10 "$limit" python3 scripts/gpu_attention.py --batches 1,2 --contexts 40 \
                --chunks 64 --out "$res/attention.txt"
        else
            timeout -k 10 "$limit" python3 scripts/gpu_attention.py --out "$res/attention.txt"
        fi 2>&1 | tail -16
        pack
    fi
    # the same passes with the padded row blocks the fixed-order products replaced (the A/B)
    NAME=$pair-block-linears step 90 calibrate $pair --batch 1 --widths 1,8,16 --runs 3 --block-linears
    # target-only with one pass a round against four back to back (EngineConfig.plain_steps:
    # each pass's choices fed to the next on the device), runs alternated in one process
    if opened 60 "plain_steps 1 against 4, target-only, batch 1"; then
        timeout -k 10 "$limit" python3 scripts/gpu_profile.py $pair "$res" --batch 1 --docs 2 --new 64 --plain-steps 1,4 \
            --runs 3 2>&1 | grep --line-buffered -v "^Loading weights" | tee -a "$res/profile.log"
        pack
    fi
    # prompt lookup's rounds on the device against the host's (drafts all rejected on this pair:
    # what the loop costs where lookups never pay), batch 64
    if opened 90 "prompt lookup rounds on the device against the host's, batch 64"; then
        timeout -k 10 "$limit" python3 scripts/gpu_profile.py $pair "$res" --batch 64 --docs 128 --new 64 \
            --drafter prompt_lookup --lookup-steps 1,4 --runs 3 2>&1 | grep --line-buffered -v "^Loading weights" |
            tee -a "$res/profile.log"
        pack
    fi
    # q/k/v and gate/up fused (--fused-projections, off by default until this A/B says otherwise),
    # then the passes at batch 64 (every width's graph compiled and captured for 64 slots)
    NAME=$pair-fused step 90 calibrate $pair --batch 1 --widths 1,8,16 --runs 3 --fused-projections
    # the passes with the float64 attention the fixed-order kernel replaced (an A/B of the two)
    NAME=$pair-float64-attention step 90 calibrate $pair --batch 1 --widths 1,8,16 --runs 3 --float64-attention
    NAME=$pair-batch64 step 150 calibrate $pair --batch 64 --widths 1,8,16 --runs 3
    # the products' free settings (outputs a tile, programs wanted, warps, stages), for the next constants
    if opened 60 "products' settings"; then
        if [ -n "${DRY:-}" ]; then
            TRITON_INTERPRET=1 timeout -k 10 "$limit" python3 scripts/gpu_linear.py --hidden 64 --intermediate 160 --kv 32 \
                --vocab 320 --rows 1,20 --sweep --out "$res/linear-settings.txt"
        else
            timeout -k 10 "$limit" python3 scripts/gpu_linear.py --rows 1,64 --sweep --out "$res/linear-settings.txt"
        fi 2>&1 | tail -8
        pack
    fi
    # a draft head's step on the GPU beside a width-1 pass (issue 39: the head drafts where a
    # verify pass costs the same at width 1 and 16), with as many output rows as the 1.5B's
    # distilled head (2026-11-29-distill-head-...-chained3-6epochs: the training completions' tokens)
    NAME=$pair-head step 60 calibrate $pair --batch 1 --widths 1,8 --runs 3 --head --head-vocab 1822
    # the price of exactness at batch 64 too; captured passes not compiled; the eager path
    # (VARIANTS=1: measured at 6f2e52d and before, docs/gpu.md)
    for kind in ${VARIANTS:+stock eager dynamic}; do
        flags="--stock-kernels --batch 1,64" limit=90
        [ $kind = eager ] && flags="--eager-passes --batch 1" limit=60
        [ $kind = dynamic ] && flags="--dynamic-passes --batch 1" limit=60
        NAME=qwen-shaped-target-$kind step $limit calibrate qwen-shaped-target --widths 1,8,16 --runs 3 $flags
    done
    # every decoding test on CUDA takes another three minutes: the session's second call
    # (`tests -n 8`), or here with ALL_TESTS=1
    [ -n "${ALL_TESTS:-}" ] && step 200 tests $xdist
    echo "== issue 37's lines from the reports ($(date +%T))"
    python3 scripts/gpu_acceptance.py "$res" --pair $pair | tee "$res/acceptance.txt"
    echo "== done ($(date +%T))"
    pack
    ;;
job)
    # `pipeline run` through the real Ray path on the GPU: 2 shards of 4 rows, the random-weight
    # Qwen-shaped pair on a GPU actor, outputs and stats written, the table naming the GPU. Ray
    # comes packed in .gpu-carry/ray.tar.xz (`gpu_models.py prepare`); on a machine still warm
    # from `all`, carrying .gpu-carry/site and .gpu-carry/ray.tar.xz is enough.
    prepare
    logged
    python3 -c "import tarfile; tarfile.open('.gpu-carry/ray.tar.xz').extractall('/tmp/site-ray', filter='tar')"
    export PYTHONPATH="/tmp/site-ray:$PYTHONPATH" RAY_USAGE_STATS_ENABLED=0
    name=${DATE:+$DATE-}tiny-job-${MACHINE:-gpu}-qwen-shaped-random-ray
    if opened 240 "pipeline run on a GPU actor"; then
        timeout -k 10 "$limit" python3 scripts/tiny_job.py /tmp/gpu-job --shards 2 --rows 4 --max-new-tokens 32 \
            --drafter prompt_lookup --models /tmp/gpu/models/qwen-target,/tmp/gpu/models/qwen-draft --gpus 1 \
            --report "$res/$name.json" 2>&1 | grep --line-buffered -v "^Loading weights" | tee "$res/job.log" | tail -40
    fi
    echo "== done ($(date +%T))"
    pack
    ;;
smol)
    # SmolLM2-135M with real weights (issue 37's SmolLM2 lines): license translations at batch 1,
    # ours beside Hugging Face's prompt lookup (k=3), then at batch 64 with 4 documents a slot,
    # then a round's host parts for auto at batch 64, every round asking (gpu_profile.py
    # --split-only --always-ask: with the gate shut, only its probes would be timed).
    # Its GGUF travels in two parts (`gpu_models.py prepare`): part-0 beside the `all` call's
    # carry, part-1 in this one's, on a machine still warm from it (no one call carries both).
    setup
    logged
    echo "== SmolLM2-135M from its parts ($(date +%T))"
    timeout -k 10 "$(allowed 120 || echo 1)" python3 scripts/gpu_models.py smol /tmp/gpu 2>&1 | tee "$res/smol.log" | tail -3
    [ -f /tmp/gpu/models/smollm2/model.safetensors ] || { pack; exit 1; }
    NAME=smollm2-licenses-batch1 step 200 bench smollm2 --tasks translate --corpus licenses --docs 4 --batches 1 \
        --max-new-tokens 128 --runs 3 --drafters prompt_lookup,suffix,auto --hf-lookup-tokens 3
    docs=$(python3 -c "from pipeline.demo_data import CORPORA; print(min(256, len(CORPORA['licenses']())))")
    NAME=smollm2-licenses-batch64 step 200 bench smollm2 --tasks translate --corpus licenses --docs "$docs" --batches 64 \
        --max-new-tokens 64 --runs 3 --drafters prompt_lookup,suffix,auto --no-hf
    if opened 90 "a round's host parts, auto at batch 64, the gate held open"; then
        timeout -k 10 "$limit" python3 scripts/gpu_profile.py smollm2 "$res" --batch 64 --docs "$docs" --new 64 \
            --drafter auto --split-only --always-ask 2>&1 | grep --line-buffered -v "^Loading weights" |
            tee -a "$res/profile.log"
        pack
    fi
    # prompt lookup's rounds on the device, back to back (EngineConfig.lookup_steps 4), against
    # its rounds on the host, alternated in one process: off by default until this says
    if opened 150 "prompt lookup rounds on the device against the host's, batch 64"; then
        timeout -k 10 "$limit" python3 scripts/gpu_profile.py smollm2 "$res" --batch 64 --docs "$docs" --new 64 \
            --drafter prompt_lookup --lookup-steps 1,4 --runs 3 2>&1 | grep --line-buffered -v "^Loading weights" |
            tee -a "$res/profile.log"
    fi
    echo "== issue 37's lines from the reports ($(date +%T))"
    python3 scripts/gpu_acceptance.py "$res" | tee "$res/acceptance.txt"
    echo "== done ($(date +%T))"
    pack
    ;;
probe)
    # Where a round's time goes (scripts/gpu_profile.py: the engine's split, cProfile, PyTorch's
    # profiler) at batch 1 and 64, and the batch-1 bench with captured passes that are not
    # compiled (--eager-passes) beside the compiled default.
    prepare
    logged
    for batch in 1 64; do
        if opened 150 "profile, target-only, batch $batch"; then
            timeout -k 10 "$limit" python3 scripts/gpu_profile.py $pair "$res" --batch $batch \
                --docs $((batch == 1 ? 2 : 128)) --new 64 2>&1 | grep --line-buffered -v "^Loading weights" |
                tee -a "$res/profile.log"
            pack
        fi
    done
    NAME=qwen-shaped-target-eager-batch1 step 90 bench qwen-shaped-target --eager-passes \
        --tasks translate --corpus licenses --docs 2 --batches 1 --max-new-tokens 64 --runs 3 --drafters prompt_lookup --no-hf
    echo "== done ($(date +%T))"
    pack
    ;;
*)
    echo "usage: $0 OUT tests|calibrate PAIR|bench PAIR|all|job|smol|probe [options]" >&2
    exit 2
    ;;
esac
