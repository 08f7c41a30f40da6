#!/usr/bin/env bash
# One prepared GPU check of the torch rollout engine for a lent CUDA machine (about 4 minutes):
# the engine's CUDA tests, generated tokens/s at batch 64/128/256 on a Qwen2.5-0.5B-shaped model
# built locally (float32 and bfloat16) against transformers' generate on the same GPU, the
# sampler's share of a decode step, and honest episodes through the trainer's int8 check.
#
#   bash benchmarks/gpu_engine.sh                 # results in $OUT (or bench-results/)
#   bash benchmarks/gpu_engine.sh --dry-run       # CPU, toy sizes: checks the script itself
#   bash benchmarks/gpu_check.sh --fetch-wheels   # where pip reaches PyPI: fill .whl/ (carry it)
#
# Needs python3 with CUDA torch, transformers, safetensors, numpy, msgpack, ml_dtypes, tokenizers.
# What else the tests import (gymnasium and its two dependencies, bm25s, zstandard, pytest and
# its dependencies) is installed when missing: from .whl/ when it holds the wheel, else from PyPI.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${OUT:-bench-results}
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_engine.log"
{
  echo "[gpu_engine] $(date -u +%FT%TZ) on $(hostname)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c 'import sys, torch; print("[gpu_engine] python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
} 2>&1 | tee "$LOG"

# import name -> wheel name prefix (PyPI project)
declare -A WHEEL=([gymnasium]=gymnasium [cloudpickle]=cloudpickle [farama_notifications]=Farama_Notifications
                  [bm25s]=bm25s [zstandard]=zstandard [pytest]=pytest [pluggy]=pluggy [iniconfig]=iniconfig
                  [packaging]=packaging [pygments]=pygments)
missing=()
for mod in "${!WHEEL[@]}"; do "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[gpu_engine] installing ${missing[*]}" | tee -a "$LOG"
  site=/tmp/stoa-gpu-site
  wheels=() names=()
  for mod in "${missing[@]}"; do
    w=$(ls .whl/"${WHEEL[$mod]}"-*.whl .whl/"${WHEEL[$mod],,}"-*.whl 2>/dev/null | head -1)
    if [ -n "$w" ]; then wheels+=("$w"); else names+=("${WHEEL[$mod]}"); fi
  done
  [ ${#wheels[@]} -gt 0 ] && "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "${wheels[@]}" 2>&1 | tee -a "$LOG"
  [ ${#names[@]} -gt 0 ] && "$PY" -m pip install -q --no-deps --target "$site" "${names[@]}" 2>&1 | tee -a "$LOG"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore

dry=0
for a in "$@"; do [ "$a" = "--dry-run" ] && dry=1; done
trc=0
if [ "$dry" = 0 ]; then
  # The engine's CUDA tests (tiny models, ~30 s); CI skips them without a GPU.
  timeout 150 "$PY" -m pytest -q -p no:cacheprovider -k cuda tests/test_torch_engine.py 2>&1 \
    | tee "$RESULTS/gpu_engine_pytest.log" | tail -8 | tee -a "$LOG"
  trc=${PIPESTATUS[0]}
fi
timeout 330 "$PY" benchmarks/gpu_engine.py --json "$RESULTS/gpu_engine.json" "$@" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "[gpu_engine] exit $rc (tests $trc); results in $RESULTS/gpu_engine.json" | tee -a "$LOG"
[ "$rc" = 0 ] && rc=$trc
exit "$rc"
