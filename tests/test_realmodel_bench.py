"""The benchmarks' real-model modes (``--model PATH --quick --json``) run on SmolLM2-135M-Instruct
and write the figures the docs quote. Skips visibly when the model is not built (conftest's
``real_model``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the benchmarks' learner needs torch")

ROOT = Path(__file__).resolve().parents[1]


def _bench(name: str, real_model: Path, out: Path, *extra: str) -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="2", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), "--model", str(real_model), "--quick",
                        "--json", str(out), *extra], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(r.stdout[-2000:])
    return json.loads(out.read_text())


@pytest.mark.slow
def test_pulse_on_the_real_model_measures_a_real_step(real_model, tmp_path):
    got = _bench("pulse.py", real_model, tmp_path / "pulse.json")
    (row,) = got["rows"]
    assert got["model"] == real_model.name and row["lr"] == got["example_lr"] and row["params"] > 100e6
    assert 0 < got["code_change_rate"] < 0.2 and 0 < got["ratio_delta_vs_full"] < 0.5
    assert got["bits_per_changed_code"] >= got["entropy_bound_bits_per_changed_code"] * 0.9


@pytest.mark.slow
def test_offpolicy_on_the_real_model_reports_lags_0_and_1(real_model, tmp_path):
    pytest.importorskip("mlx.core", reason="the benchmark samples with the MLX engine")
    got = _bench("offpolicy.py", real_model, tmp_path / "offpolicy.json")
    assert [r["lag"] for r in got["rows"]] == [0, 1] and got["episodes"] == 16
    for r in got["rows"]:
        assert r["tokens"] > 0 and 0 <= r["tv_gate_with_advantages"] <= r["tv_gate_either_sign"] <= 1
        assert r["kl_k3"] >= 0 and r["abs_dlogp_p50"] <= r["abs_dlogp_p99"] <= r["abs_dlogp_max"]
    assert got["rows"][0]["abs_dlogp_p50"] < 0.1  # lag 0 is int8 rounding alone


@pytest.mark.slow
def test_rollout_on_the_real_model_compares_with_mlx_lm(real_model, tmp_path):
    pytest.importorskip("mlx.core", reason="the benchmark runs the MLX engine and mlx_lm")
    got = _bench("rollout.py", real_model, tmp_path / "rollout.json", "--engines", "mlx")  # torch's: test_torch_engine
    (m,) = got["models"].values()
    assert m["params"] > 100e6 and got["ratio_vs_mlx_lm_batch_generate"] > 0
    assert m["single_turn"]["ours_tokens"] > 0 and m["mismatch"]["tokens"] > 0
    like = got["like_for_like"]  # every engine at fixed lengths; llama.cpp joins where it is built
    assert like["llama_cpp"] == "built" or like["llama_cpp"].startswith("skipped: ")
    for row in like["tokens_per_s"].values():
        assert all(v > 0 for v in row.values())
