#!/usr/bin/env bash
# What a session with a GPU runs (docs/gpu.md), writing logs and reports
# under OUT:
#   scripts/gpu-check.sh OUT tests                 the decoding tests, models on CUDA
#   scripts/gpu-check.sh OUT calibrate PAIR [opts] pipeline calibrate, report OUT/calibrate-PAIR.md
#   scripts/gpu-check.sh OUT bench PAIR [opts]     pipeline bench, report OUT/bench-PAIR.md
# Runs from a source tree (python3 -m pipeline.cli), so a copied checkout needs no install.
set -uo pipefail
out=$1 what=$2
shift 2
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
case $what in
tests)
    PIPELINE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -o addopts= "$@" \
        tests/test_engine.py tests/test_decode_sampling.py tests/test_batched_lm.py \
        tests/test_policy.py tests/test_drafters.py tests/test_suffix.py tests/test_packing.py \
        tests/test_costs.py tests/test_invariant.py 2>&1 | tee "$out/tests.log"
    ;;
calibrate)
    pair=$1
    shift
    python3 -m pipeline.cli calibrate --pair "$pair" --report "$out/calibrate-$pair.md" "$@" 2>&1 |
        grep -v "^Loading weights" | tee "$out/calibrate-$pair.log"
    ;;
bench)
    pair=$1
    shift
    python3 -m pipeline.cli bench --pair "$pair" --report "$out/bench-$pair.md" "$@" 2>&1 |
        grep -v "^Loading weights" | tee "$out/bench-$pair.log"
    ;;
*)
    echo "usage: $0 OUT tests|calibrate PAIR|bench PAIR [options]" >&2
    exit 2
    ;;
esac
