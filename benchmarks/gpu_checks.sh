#!/usr/bin/env bash
# The GPU checks and benchmarks, in the order that matters when GPU time is short; each step has
# its own time limit and a failing step does not stop the next. Results go to $OUT (default
# runs/gpu-checks): gpu-<step>.json from bench_gpu, <step>.log for each step.
#   bash benchmarks/gpu_checks.sh vllm train tests     # any of: env tests vllm train logprobs engine flow
# On a machine without internet, install vLLM and TRL first (benchmarks/offline_wheels.py).
# Merge the JSON files into docs/BENCHMARKS_GPU.json and render it with
# `python -m benchmarks.bench_gpu --render docs/BENCHMARKS_GPU.json`.
set -uo pipefail
OUT=${OUT:-runs/gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
failed=()

step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  [ "$rc" = 0 ] || failed+=("$name")
  tail -n 15 "$OUT/$name.log"
}

bench() {  # name, seconds, bench_gpu parts...
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" "$PY" -m benchmarks.bench_gpu --parts "$@" --out "$OUT/gpu-$name.json"
}

[ $# -gt 0 ] || { echo "name steps: env tests vllm train logprobs engine flow" >&2; exit 2; }
for name in "$@"; do
  case "$name" in
    env) step env 60 bash -c 'nvidia-smi -L; "$0" -c "import torch, transformers; print(torch.__version__, transformers.__version__)";
                              "$0" -c "import vllm, trl; print(\"vllm\", vllm.__version__, \"trl\", trl.__version__)"' "$PY" ;;
    # the CUDA tests, and the vLLM engine's log-probs against the trainer's (dense and MoE)
    tests) step tests 300 "$PY" -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_vllm_engine.py ;;
    # issue 15's comparison: TRL GRPOTrainer vs rlpipe, both with vLLM colocated (step time, sync)
    # (three sides, each a process with a vLLM of its own: a hung one gives an error entry, not a lost step)
    vllm) bench vllm 560 rl_vs_trl_vllm --side-timeout-s 175 ;;
    # MFU: eager and compiled, fp32 master and pure bf16, activation checkpointing
    train) bench train 360 train ;;
    logprobs) bench logprobs 180 logprobs ;;
    engine) bench engine 180 engine ;;
    # the real-scale config end to end (needs rlpipe's own dependencies: Prefect, MLflow, DuckDB)
    flow) step flow 420 "$PY" -m flows.cli run configs/gpu.toml --set runs_root=/tmp/gpu-check-runs ;;
    *) echo "unknown step $name" >&2; exit 2 ;;
  esac
done
[ ${#failed[@]} = 0 ] || { echo "failed: ${failed[*]}" >&2; exit 1; }
