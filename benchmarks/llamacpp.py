"""llama.cpp as a like-for-like anchor for ``benchmarks/rollout.py --model``: a GGUF of the same
model (F32 and Q8_0, converted with llama.cpp's own converter) run by ``llama-batched-bench`` with
the same threads, prompt and generation lengths.

llama.cpp is built once by ``scripts/build_llama_cpp.sh`` into ``$STOA_LLAMA_CPP`` (default
``~/.cache/stoa/llama.cpp``); GGUF files are converted on first use into ``gguf/`` there. Nothing
here downloads anything; when the build is missing, :func:`status` says so and the column is skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(os.environ.get("STOA_LLAMA_CPP", Path.home() / ".cache" / "stoa" / "llama.cpp"))
ISA = os.environ.get("STOA_LLAMA_ISA", "")
"""``avx2``: the build for AVX2 without AVX-512 (``scripts/build_llama_cpp.sh avx2``); else the native one."""
BENCH = ROOT / "src" / ("build-" + ISA if ISA else "build") / "bin" / "llama-batched-bench"
CONVERT = ROOT / "src" / "convert_hf_to_gguf.py"


def status() -> str | None:
    """Why llama.cpp cannot run here, or None."""
    if not BENCH.is_file():
        return f"skipped: llama.cpp is not built in {ROOT} (run `bash scripts/build_llama_cpp.sh {ISA}`, ~15 min)"
    if not CONVERT.is_file():
        return f"skipped: {CONVERT} is missing"
    return None


def gguf(model: Path, outtype: str) -> Path:
    """The GGUF of the Hugging Face folder ``model`` in ``outtype`` (``f32`` or ``q8_0``), converted once."""
    out = ROOT / "gguf" / f"{model.name}-{outtype}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src" / "gguf-py"))
        subprocess.run([sys.executable, str(CONVERT), str(model), "--outtype", outtype, "--outfile", str(out)],
                       check=True, env=env, capture_output=True)
    return out


def batched_bench(model_gguf: Path, threads: int, prompt: int, gen: int, batches: list[int]) -> dict[int, dict]:
    """``llama-batched-bench`` rows by batch: generated tokens/s over the whole run (prefill
    included, as the engines are timed) and over generation alone."""
    ctx = max(batches) * (prompt + gen) + 64
    cmd = [str(BENCH), "-m", str(model_gguf), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt),
           "-ntg", str(gen), "-npl", ",".join(map(str, batches)), "-t", str(threads), "-tb", str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows: dict[int, dict] = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and re.fullmatch(r"\d+", cells[0] or "") and re.fullmatch(r"\d+", cells[2]):
            pp, tg, b = int(cells[0]), int(cells[1]), int(cells[2])
            total_s, tg_s = float(cells[8]), float(cells[6])
            rows[b] = {"tokens_per_s": b * tg / total_s, "generation_tokens_per_s": float(cells[7]),
                       "prompt": pp, "gen": tg, "wall_s": total_s, "generation_s": tg_s}
    return rows
