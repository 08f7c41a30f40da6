"""A real pretrained model (SmolLM2-135M-Instruct, bfloat16, its config.json as transformers 5
writes it) on both stacks: the torch learner, the torch int8 scorer and the MLX engine score it
alike; an engine that misreads its RoPE base is refused; the config workers receive reads right
in plain mlx_lm. Skips visibly when the model is not built (see conftest's ``real_model``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch", reason="the learner needs torch")

from stoa.fleet import parity  # noqa: E402


def needs_mlx() -> None:
    """Skip (visibly) where MLX is not installed: only the tests that run its engine or mlx_lm need it."""
    pytest.importorskip("mlx.core", reason="the MLX engine needs mlx")


@pytest.fixture(scope="module")
def stacks(real_model):
    needs_mlx()
    from stoa.backends.learner import LearnerConfig, make_learner
    from stoa.backends.mlx import MLXEngine
    from stoa.backends.torch.int8 import make_scorer
    from stoa.transport.quant import quantize_state

    learner = make_learner("torch", real_model, LearnerConfig(threads=2))
    state = quantize_state(learner.iter_weights("float32"))
    engine = MLXEngine.from_state(real_model, dict(state), 0, mode="dequantized")
    scorer = make_scorer(real_model, "cpu", "float32")
    scorer.load_state(0, state)
    return learner, state, engine, scorer


def test_real_model_config_is_the_nested_layout(real_model):
    cfg = json.loads((real_model / "config.json").read_text())
    assert "rope_theta" not in cfg and cfg["rope_parameters"]["rope_theta"] == 100000.0


def test_engine_learner_and_torch_int8_scorer_agree_on_the_real_model(real_model, stacks):
    learner, _, engine, scorer = stacks
    assert engine.built_config["rope_theta"] == 100000.0
    got = parity.check(real_model, learner, engine, scorer)
    print(f"real model parity: {got}")
    assert got.engine_vs_scorer < 1e-3  # the same int8 weights, float32 on both
    assert 0.005 < got.int8_vs_float < 0.1 and got.scorer_vs_float == pytest.approx(got.int8_vs_float, abs=1e-3)
    # A real model, not noise: after "The capital of France is", " Paris" is likely.
    (ep,) = [e for e in parity.probe_episodes(engine.codec, engine.vocab_size) if e.group_id == "parity-0"]
    lp, toks = learner.logprobs([ep], temperature=1.0)[0], ep.tokens()
    at = [i for i in range(len(toks)) if engine.decode(toks[i:i + 1]) == " Paris"][0]
    assert lp[at] > np.log(0.3)


def test_an_engine_misreading_the_real_models_rope_base_is_refused(real_model, stacks):
    from mlx_lm.utils import load_model

    from stoa.backends.engine import EngineConfig
    from stoa.backends.mlx import weights as W
    from stoa.backends.mlx.engine import MLXEngine

    learner, state, good, _ = stacks
    model, cfg = load_model(real_model, lazy=True, strict=False)  # plain mlx_lm: RoPE base 1e4
    W.quantize(model, cfg)
    W.load_state_into(model, dict(state))
    bad = MLXEngine(real_model, model, cfg, "dequantized", 0, EngineConfig())
    with pytest.raises(parity.ParityError, match=r"^the engine built the model differently from the run's config: "
                                                 r"rope_theta: built 10000.0, config 100000.0$"):
        parity.check(real_model, learner, bad)
    # The probes alone would refuse it too: the misread gap is far above int8's.
    eps = parity.probe_episodes(good.codec, good.vocab_size)
    fl = learner.logprobs(eps, temperature=None)
    misread, honest = parity.gap(bad.score(eps), fl, eps)[0], parity.gap(good.score(eps), fl, eps)[0]
    print(f"probe gap: honest {honest:.4f}, misread {misread:.4f} nat")
    assert honest < parity.INT8_BOUND < misread


def test_int8_kernels_and_bfloat16_scales_score_as_the_trainer_does(real_model, stacks):
    """A state with bfloat16 scales and norms (what a bfloat16 trainer publishes), run through
    MLX's int8 kernels (the ``quantized`` mode Macs use) and through float32 layers: both score the
    real model's probes as the trainer's torch re-score does. Computing in the scales' dtype, or
    rounding ``code * scale`` to it, moved these log-probs by about a nat."""
    from stoa.backends.mlx import MLXEngine
    from stoa.backends.torch.int8 import make_scorer
    from stoa.transport.quant import quantize_state

    learner, _, engine, _ = stacks
    state = quantize_state(learner.iter_weights("bfloat16"))
    assert state["model.embed_tokens.scales"].dtype.name == "bfloat16"
    scorer = make_scorer(real_model, "cpu", "float32")
    scorer.load_state(0, state)
    eps = parity.probe_episodes(engine.codec, engine.vocab_size)[:2]
    ref = scorer.score(eps)
    for mode in ("quantized", "dequantized"):
        mine = MLXEngine.from_state(real_model, dict(state), 0, mode=mode)
        worst = max(float(np.abs(a - b).max()) for a, b in zip(mine.score(eps), ref))
        print(f"{mode} engine vs torch scorer, bfloat16 scales: {worst:.2e} nat")
        assert worst < 1e-3, (mode, worst)


@pytest.mark.slow
def test_honest_draws_of_the_real_model_check_under_both_scorers_and_a_cold_sampler_fails(real_model, stacks):
    """Episodes the engine sampled from the real model (its 49,152-token vocabulary and long
    tail): every token is the rule's draw under the engine's and torch's re-score, far inside the
    band, with its log-prob re-scored; a worker sampling at 0.6x the temperature with honest
    log-probs of what it drew is caught."""
    import dataclasses
    import sys
    from pathlib import Path

    from stoa.backends.engine import RolloutRequest, SamplingConfig
    from stoa.fleet.trust.audit import compare_logprobs
    from stoa.fleet.trust.section import AuditConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from custom_env import ArithmeticEnv

    _, _, engine, scorer = stacks
    band = AuditConfig().sampling_band
    make = lambda: ArithmeticEnv(size=40)  # noqa: E731
    reqs = [RolloutRequest(i, f"g{i}", 4) for i in range(2)]
    honest = engine.rollout(make, reqs, SamplingConfig(max_turn_tokens=16, max_episode_tokens=120, seed=5))
    for sc in (engine, scorer):
        draws = sc.check_draws(honest, [5] * len(honest), drift=band / 2)
        m = np.concatenate([d.margins for d in draws])
        assert m.size == sum(e.num_model_tokens for e in honest) and m.min() > -band / 20, m.min()
        assert not compare_logprobs(honest, [(d.at, d.logprobs) for d in draws]).confirmed
    cold = engine.rollout(make, reqs, SamplingConfig(temperature=0.6, max_turn_tokens=16, max_episode_tokens=120,
                                                     seed=5))
    cold = [dataclasses.replace(e, temperature=1.0) for e in cold]
    for e, lp in zip(cold, engine.score(cold)):
        at = len(e.prompt_tokens)
        for seg in e.segments:
            if seg.kind == "model":
                seg.logprobs = np.asarray(lp[at:at + len(seg.tokens)], np.float32)
            at += len(seg.tokens)
    draws = scorer.check_draws(cold, [5] * len(cold), drift=band / 2)
    assert not compare_logprobs(cold, [(d.at, d.logprobs) for d in draws]).confirmed  # its log-probs are honest
    assert sum(int((d.margins < -band).sum()) for d in draws) >= 3


def test_the_published_config_reads_right_in_plain_mlx_lm(real_model, tmp_path):
    needs_mlx()
    from mlx_lm.utils import load_model

    from stoa.fleet.config import RunConfig
    from stoa.fleet.run import fetch_run, publish_run
    from stoa.transport.signing import generate_private_key
    from stoa.transport.store import LocalStore

    key, store = generate_private_key(), LocalStore(tmp_path / "store")
    publish_run(store, "r", RunConfig.from_dict({"name": "r", "model": {"path": str(real_model)}}), real_model, key)
    _, folder = fetch_run(store, "r", key.public_key(), tmp_path / "worker")
    model, _ = load_model(folder, lazy=True, strict=False)  # what any worker's mlx_lm builds from it
    assert model.args.rope_theta == 100000.0 and model.args.tie_word_embeddings is True
    assert model.model.layers[0].self_attn.rope.base == 100000.0


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


_FLEET = """
name = "real"
seed = 1

[model]
path = "{path}"

[env]
module = "{module}"
id = "example/Arithmetic-v0"
kwargs = {{ size = 40 }}

[rollout]
group_size = 4
groups_per_cohort = 1
max_turn_tokens = 16
max_episode_tokens = 160
max_batch = 8

[trainer]
steps = 2
groups_per_step = 1
threads = 1
skip_zero_variance_groups = false

[eval]
every = 100
num_questions = 2
samples = 1

[fleet]
workers = 1

[trust]
reward_range = [0.0, 1.0]
"""


@pytest.mark.slow
def test_stoa_train_on_the_real_model_accepts_every_honest_batch(real_model, tmp_path):
    """`stoa train` with model.path at the folder save_pretrained wrote (untouched) and the
    arithmetic example's env: parity passes, the audit floor is int8's, and every episode is
    checked (each sampled token re-derived, each log mu re-scored) with no batch rejected."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from stoa.backends.engine import resolve_backend
    from stoa.fleet.metrics import read_metrics

    if resolve_backend("auto") == "mlx":  # the workers' engine here (Apple silicon, or no torch)
        needs_mlx()
    module = Path(__file__).resolve().parents[1] / "examples" / "custom_env.py"
    config = tmp_path / "real.toml"
    config.write_text(_FLEET.format(path=real_model, module=module))
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, "-m", "stoa", "train", str(config), "--runs", str(tmp_path / "runs")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = read_metrics(tmp_path / "runs" / "real" / "metrics.jsonl")
    (par,) = [x for x in rows if x.get("event") == "parity"]
    # The engine's int8 policy against the float learner: int8 rounding of a real model, no more.
    assert 0.005 < par["parity/int8_vs_float"] < parity.INT8_BOUND and par["parity/max_token"] >= par["parity/int8_vs_float"]
    # A trainer whose engine is torch's int8 kernel (a CPU learner, Linux here) checks on it: no
    # second scorer, so no figure comparing one. One that checks on torch's scorer (a CUDA learner,
    # MLX workers) must find it agrees with the engine on the same weights and reads the model alike.
    if par["scorer"] == "engine":
        assert "parity/engine_vs_scorer" not in par and "parity/scorer_vs_float" not in par, par
    else:
        assert {"parity/engine_vs_scorer", "parity/scorer_vs_float"} <= set(par), par
        assert par["parity/engine_vs_scorer"] < 1e-3 and par["parity/scorer_vs_float"] < parity.INT8_BOUND, par
    if resolve_backend("auto") == "torch" and not _has_cuda():
        assert par["scorer"] == "engine", par
    floor = next(x["trust/audit_floor"] for x in rows if "trust/audit_floor" in x)
    train = [x for x in rows if x["kind"] == "train"]
    print(f"real-model fleet: parity {par}, audit floor {floor:.4f}")
    assert len(train) == 2 and 1e-3 <= floor < parity.INT8_BOUND
    assert train[-1]["trust/rejected_batches"] == 0 and train[-1]["trust/accepted_batches"] >= 2
    assert not [x for x in rows if x.get("event") in ("rejected", "banned")]
    assert train[-1]["trust/episodes_checked"] >= 8 and train[-1]["trust/sampled_tokens_checked"] > 0
    assert train[-1]["trust/sampling_violations"] == 0
