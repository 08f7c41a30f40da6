"""`benchmarks/scale.py`: its run config resolves with its task, the task's bonus is what the
config's reward range assumes, and the cost model scales the measured coefficients linearly
(the benchmark itself is minutes of real-size work)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from stoa.fleet.config import import_env_module, load_config

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("scale_bench", ROOT / "benchmarks" / "scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_run_config_and_task(tmp_path):
    import stoa.envs

    cwd = os.getcwd()
    os.chdir(ROOT)  # env.module is relative to the working directory, as the benchmark runs it
    try:
        cfg = load_config(ROOT / "benchmarks" / "scale.toml", {"model.path": str(tmp_path)})
        import_env_module(cfg.env)
    finally:
        os.chdir(cwd)
    assert cfg.trainer.steps >= 3 and not cfg.trainer.skip_zero_variance_groups and cfg.trust.audit.random_spot_check == 1
    env = stoa.envs.make(cfg.env.id, split="train", **cfg.env.kwargs).unwrapped
    env.reset(options={"index": 0})
    _, r_text, *_ = env.step("some words")
    env.reset(options={"index": 0})
    _, r_empty, *_ = env.step("")
    assert r_text == r_empty + 0.5
    assert cfg.trust.reward_range[1] >= 1.0 + 0.5 * 8  # an answer plus a bonus on every turn


def test_cost_model_scales_measured_coefficients():
    bench = _bench()
    from stoa.models.presets import PRESETS, num_params

    c0 = bench._codes(PRESETS["qwen2.5-0.5b"])
    res = {"preset": "qwen2.5-0.5b", "quick": False,
           "mlx": {"state_bytes": int(1.125 * c0), "peak_rss_gb": 4.0, "gen_tokens_per_s": 10.0, "score_s": 50.0,
                   "score_tokens": 1000, "spot_check_s": 9.0},
           "torch": {"score_s": 10.0},
           "pulse": {"delta_bytes": int(1.25 * 0.005 * c0), "changed_code_frac": 0.005, "state_hash_s": 0.3,
                     "apply_s": 0.3, "quantize_s": 3.0, "encode_s": 1.0}}
    cm = bench.cost_model(res)
    small, big = cm["qwen2.5-0.5b"], cm["qwen3-8b"]
    k = bench._codes(PRESETS["qwen3-8b"]) / c0
    assert abs(big["state_gb"] / small["state_gb"] - k) < 1e-6
    assert abs(big["delta_mb"] / small["delta_mb"] - k) < 1e-3
    assert abs(small["full_vs_delta"] - 1.125 / (1.25 * 0.005)) < 0.1
    assert abs(big["trainer_held_dict_gb"] - 9 * big["state_gb"]) < 1e-9
    assert big["gpu_learner_gb"] == 16 * num_params(PRESETS["qwen3-8b"]) / 1e9
    assert big["sync_s"]["flaky10"] > big["sync_s"]["dsl50"] > big["sync_s"]["fiber300"]
