#!/usr/bin/env bash
# One prepared GPU check for a lent H200 (under twelve minutes): Megatron-vs-torch logits on a
# Qwen2.5-0.5B-shaped model built locally, training tokens/s + MFU for both learners, and the
# multi-rank trainer's learner path under torchrun (TP=2 and DP=2 on two GPUs, else TP=1).
#
#   bash benchmarks/gpu_check.sh                  # full check; results in $OUT (or bench-results/)
#   bash benchmarks/gpu_check.sh --quick          # smaller batches, fewer steps
#   bash benchmarks/gpu_check.sh --dry-run        # CPU, toy sizes: checks the script itself
#   bash benchmarks/gpu_check.sh --fetch-wheels   # where pip reaches PyPI: fill .whl/ for an offline GPU box
#                                                 # (also every wheel benchmarks/gpu_engine.sh needs)
#
# Needs python3 with CUDA torch, transformers, safetensors, numpy, msgpack, ml_dtypes (the H200
# image has them). megatron-core and zstandard are installed if missing: from .whl/ when it holds
# wheels (carry it; see --fetch-wheels), else from PyPI. Stoa itself runs from this checkout via
# PYTHONPATH: `pip install -e .` would pull the CPU torch pinned in pyproject.toml.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${OUT:-bench-results}
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check.log"

if [ "${1:-}" = "--fetch-wheels" ]; then
  # cp312 manylinux wheels: the H200 image's python is 3.12 on x86-64.
  exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "megatron-core==0.16.1" "zstandard>=0.22" \
    gymnasium cloudpickle farama-notifications bm25s pytest pluggy iniconfig packaging pygments  # gpu_engine.sh
fi

{
  echo "[gpu_check] $(date -u +%FT%TZ) on $(hostname)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c 'import sys, torch; print("[gpu_check] python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
} 2>&1 | tee "$LOG"

missing=()
"$PY" -c 'import megatron.core' 2>/dev/null || missing+=(megatron_core)
"$PY" -c 'import zstandard' 2>/dev/null || missing+=(zstandard)
if [ ${#missing[@]} -gt 0 ]; then
  echo "[gpu_check] installing ${missing[*]}" | tee -a "$LOG"
  site=/tmp/stoa-gpu-site
  wheels=()
  for name in "${missing[@]}"; do
    for w in .whl/"$name"-*.whl; do [ -e "$w" ] && wheels+=("$w"); done
  done
  if [ ${#wheels[@]} -eq ${#missing[@]} ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "${wheels[@]}" 2>&1 | tee -a "$LOG"
  else
    "$PY" -m pip install -q --target "$site" --no-deps "megatron-core==0.16.1" "zstandard>=0.22" 2>&1 | tee -a "$LOG"
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONWARNINGS=ignore  # megatron-core warns at import about apex / Transformer Engine

dry=0
for a in "$@"; do [ "$a" = "--dry-run" ] && dry=1; done
if [ "$dry" = 0 ]; then
  # The GPU tests CI skips (tiny models; about a minute): ours and the torch learner's.
  timeout 150 "$PY" -m pytest -q -p no:cacheprovider -k "cuda or gpu" tests/test_megatron_cuda.py \
    tests/test_torch_learner.py 2>&1 | tee "$RESULTS/gpu_pytest.log" | tail -15 | tee -a "$LOG"
fi
# Multi-rank: one process per GPU (at most 2), rank 0 driving the others as `torchrun ... stoa trainer` does.
ngpu=$( { nvidia-smi -L 2>/dev/null || true; } | grep -c '^GPU' || true)
nproc=$(( dry == 1 ? 2 : (ngpu >= 2 ? 2 : 1) ))
echo "[gpu_check] multirank: $nproc rank(s) ($ngpu GPU(s) seen)" | tee -a "$LOG"
timeout 200 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$nproc" benchmarks/gpu_check.py \
  --multirank --json "$RESULTS/gpu_multirank.json" "$@" 2>&1 | tee -a "$LOG" | grep -v "Deprecat\|warn"
mrc=${PIPESTATUS[0]}
timeout 400 "$PY" benchmarks/gpu_check.py --json "$RESULTS/gpu_check.json" --budget-s 340 "$@" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "[gpu_check] exit $rc (multirank $mrc); results in $RESULTS/gpu_check.json, $RESULTS/gpu_multirank.json" | tee -a "$LOG"
[ "$rc" = 0 ] && rc=$mrc
exit "$rc"
