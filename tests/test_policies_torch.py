"""The trainer's int8 policies scored by the torch int8 scorer (``trainer.int8_scorer``): the same
log-probs and sampling margins as the MLX engine at every held version, one scorer loaded only
when the asked version differs, and the choice validated when the config loads."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core", reason="the reference engine needs mlx")
pytest.importorskip("torch", reason="the scorer needs torch")

from stoa.fleet.config import ConfigError, RolloutConfig, load_config  # noqa: E402
from stoa.fleet.trainer.policies import HeldPolicies  # noqa: E402

from helpers import tiny_fleet_config  # noqa: E402


@pytest.fixture(scope="module")
def sampled(tiny_model):
    import stoa.envs
    from stoa.backends.engine import EngineConfig, RolloutRequest, SamplingConfig, make_engine

    engine = make_engine(tiny_model, "mlx", config=EngineConfig(max_batch=16), worker_id="w")
    make_env = lambda: stoa.envs.make("stoa/SyntheticSearch-v0", num_entities=20, num_test_facts=5)  # noqa: E731
    eps = engine.rollout(make_env, [RolloutRequest(i, f"w-{i}", 2) for i in range(4)],
                         SamplingConfig(max_turn_tokens=8, max_episode_tokens=160, seed=5))
    return engine, eps


def test_held_policies_score_on_torch_as_the_engine_does(tiny_model, sampled, tmp_path):
    engine, eps = sampled
    v0 = {k: np.array(a) for k, a in engine.state.items()}
    v1 = {k: a.copy() for k, a in v0.items()}
    v1["model.embed_tokens.weight"][:, :64] = 255 - v1["model.embed_tokens.weight"][:, :64]  # another policy
    policies = HeldPolicies(tiny_model, RolloutConfig(), max_lag=2, directory=tmp_path / "held", scorer="torch",
                            device="cpu", dtype="float32")
    assert policies.scorer == "torch"
    policies.keep(0, v0)
    policies.keep(1, v1)
    seeds = [5] * len(eps)
    ref0, m0 = engine.score(eps), engine.sampling_margins(eps, seeds)
    got0, g0 = policies.score(0, eps), policies.sampling_margins(0, eps, seeds)
    scorer = policies.scorer_at(0)
    assert type(scorer).__name__ == "TorchInt8Scorer" and scorer.version == 0
    assert max(np.abs(a - b).max() for a, b in zip(got0, ref0)) < 1e-4
    assert max(np.abs(a - b).max() for a, b in zip(g0, m0) if a.size) < 1e-5
    assert min(a.min() for a in g0 if a.size) > -1e-4  # every honest token is the rule's draw
    got1 = policies.score(1, eps)  # the same scorer, loaded with version 1
    assert policies.scorer_at(1) is scorer and scorer.version == 1
    engine.load_state(1, v1)
    assert max(np.abs(a - b).max() for a, b in zip(got1, engine.score(eps))) < 1e-4
    assert max(np.abs(a - b).max() for a, b in zip(got1, ref0)) > 0.01  # it did load another policy
    g1 = np.concatenate(policies.sampling_margins(1, eps, seeds))
    assert (g1 < -1e-4).any()  # version 0's draws are not all version 1's
    assert policies.score(7, eps) is None and policies.sampling_margins(7, eps, seeds) is None  # never held
    engine.load_state(0, v0)


def test_auto_scores_on_the_int8_kernel_else_on_torch_for_a_small_model_and_the_engine_for_a_large_one_on_a_cpu(
        tiny_model, tmp_path):
    import json
    import shutil

    from stoa.fleet.trainer import policies as mod

    from stoa.backends.torch import qlinear

    kernel = qlinear.available()[0]
    assert HeldPolicies(tiny_model, RolloutConfig(engine="torch"), 1, tmp_path / "a", scorer="auto",
                        device="cpu").scorer == ("engine" if kernel else "torch")  # the int8 kernel checks fastest
    for rc in (RolloutConfig(engine="torch", engine_mode="dequantized"), RolloutConfig(engine="mlx")):
        assert HeldPolicies(tiny_model, rc, 1, tmp_path / "a", scorer="auto", device="cpu").scorer == "torch"
    big = tmp_path / "big"
    shutil.copytree(tiny_model, big)
    cfg = json.loads((big / "config.json").read_text())
    (big / "config.json").write_text(json.dumps({**cfg, "hidden_size": 4096, "intermediate_size": 12288,
                                                 "num_hidden_layers": 32}))
    assert 4 * mod._num_params(big) > mod.SMALL_CPU_SCORER_BYTES
    assert HeldPolicies(big, RolloutConfig(engine="mlx"), 1, tmp_path / "c", scorer="auto",
                        device="cpu").scorer == "engine"
    with pytest.raises(ValueError, match="auto, engine or torch"):
        HeldPolicies(tiny_model, RolloutConfig(), 1, tmp_path / "b", scorer="gpu")


def test_an_unknown_int8_scorer_fails_at_load_with_its_key(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(tiny_fleet_config("s", trainer={"int8_scorer": "gpu"}))
    with pytest.raises(ConfigError, match="trainer.int8_scorer"):
        load_config(path)
    path.write_text(tiny_fleet_config("s", trainer={"int8_scorer": "torch"}))
    assert load_config(path).trainer.int8_scorer == "torch"
    assert load_config(tmp_path / "run.toml", {"trainer.int8_scorer": "engine"}).trainer.int8_scorer == "engine"


def test_engine_mode_tells_what_an_engine_would_run_without_building_one():
    from stoa.backends.engine import EngineError, engine_mode
    from stoa.backends.torch import qlinear

    assert engine_mode("torch", "dequantized", device="cpu") == "dequantized"
    auto = "int24" if qlinear.integer_faster() else "quantized" if qlinear.available()[0] else "dequantized"
    assert engine_mode("torch", "auto", device="cpu") == auto
    with pytest.raises(EngineError, match="unknown engine backend"):
        engine_mode("nope")
    with pytest.raises(EngineError, match="must be one of"):
        engine_mode("torch", "fp8", device="cpu")
