"""The torch engine on small random models of each family's real structure (16-token windows
where the family slides) and on the real model: its batched decode over per-row caches equals
its own full forward pass and the torch int8 scorer (transformers' modules on the same weights
of record), it reports what it built, and on SmolLM2-135M-Instruct its honest episodes pass the
trainer's checks while a cold sampler is caught."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="the torch engine needs torch")

from helpers import FAMILY_TEXTS, FAMILY_WINDOW, family_structure  # noqa: E402

from stoa.fleet import parity  # noqa: E402
from stoa.models import hfconfig  # noqa: E402

FAMILIES = ["qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b", "mistral-7b-v0.1", "gemma-2-2b", "gemma-3-1b"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    from stoa.backends.engine import EngineConfig, make_engine
    from stoa.models.presets import build_preset

    path = build_preset(tmp_path_factory.mktemp(request.param), family_structure(request.param), FAMILY_TEXTS,
                        tokenizer_vocab=300, init_std=0.05)
    eng = make_engine(path, "torch", config=EngineConfig(max_batch=5, prefill_chunk=7), device="cpu")
    return request.param, path, eng


def test_decode_score_and_the_int8_scorer_agree_beyond_the_window(family):
    import stoa.envs
    from stoa.backends.engine import RolloutRequest, SamplingConfig
    from stoa.backends.torch.int8 import TorchInt8Scorer
    from stoa.envs.synthetic import SyntheticConfig

    name, path, eng = family
    corpus = SyntheticConfig(seed=0, num_entities=40, num_test_facts=10)
    eps = eng.rollout(lambda: stoa.envs.make("stoa/SyntheticSearch-v0", config=corpus),
                      [RolloutRequest(i, f"g{i}", 2) for i in range(3)],
                      SamplingConfig(max_turn_tokens=10, max_episode_tokens=150, seed=3))
    assert min(len(e) for e in eps) > 6 * FAMILY_WINDOW and max(e.metrics["turns"] for e in eps) >= 2
    mu, scored = [e.behavior_logprobs() for e in eps], eng.score(eps)
    assert parity.gap(mu, scored, eps)[1] < 1e-4  # batched decode over slot caches == one forward pass
    scorer = TorchInt8Scorer(path, "cpu")
    scorer.load_state(0, eng.state)
    sc = scorer.score(eps)
    print(f"{name}: torch engine vs torch int8 scorer {parity.gap(scored, sc, eps)[1]:.1e} nat (largest token)")
    assert parity.gap(scored, sc, eps)[1] < 1e-4
    draws = eng.check_draws(eps, [3] * len(eps))
    assert min(d.margins.min() for d in draws) > 0


def test_reports_what_it_built(family):
    _, path, eng = family
    spec = hfconfig.read(hfconfig.load(path))
    assert hfconfig.disagreements(spec, eng.built_config) == []
    assert parity.join_check(eng, path) is None


@pytest.mark.slow
def test_honest_real_model_episodes_pass_the_trainers_checks_and_a_cold_sampler_fails(real_model):
    """SmolLM2-135M-Instruct (49,152-token vocabulary): every token the torch engine drew is the
    rule's draw under the trainer's torch int8 re-score, far inside the band, with its log-prob
    re-scored; a worker sampling at 0.6x the temperature with honest log-probs is caught."""
    import dataclasses
    import sys
    from pathlib import Path

    from stoa.backends.engine import EngineConfig, RolloutRequest, SamplingConfig, make_engine
    from stoa.backends.torch.int8 import TorchInt8Scorer
    from stoa.fleet.trust.audit import AuditConfig, compare_logprobs
    from stoa.testing.adversaries import claim_logprobs

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from custom_env import ArithmeticEnv

    eng = make_engine(real_model, "torch", config=EngineConfig(max_batch=8), device="cpu")
    scorer = TorchInt8Scorer(real_model, "cpu")
    scorer.load_state(0, eng.state)
    band = AuditConfig().sampling_band
    make = lambda: ArithmeticEnv(size=40)  # noqa: E731
    reqs = [RolloutRequest(i, f"g{i}", 4) for i in range(2)]
    honest = eng.rollout(make, reqs, SamplingConfig(max_turn_tokens=16, max_episode_tokens=120, seed=5))
    for sc in (eng, scorer):
        draws = sc.check_draws(honest, [5] * len(honest), drift=band / 2)
        m = np.concatenate([d.margins for d in draws])
        assert m.size == sum(e.num_model_tokens for e in honest) and m.min() > -band / 20, m.min()
        assert not compare_logprobs(honest, [(d.at, d.logprobs) for d in draws]).confirmed
    cold = eng.rollout(make, reqs, SamplingConfig(temperature=0.6, max_turn_tokens=16, max_episode_tokens=120, seed=5))
    cold = [dataclasses.replace(e, temperature=1.0) for e in cold]
    claim_logprobs(cold, eng.score(cold))
    draws = scorer.check_draws(cold, [5] * len(cold), drift=band / 2)
    assert not compare_logprobs(cold, [(d.at, d.logprobs) for d in draws]).confirmed
    assert sum(int((d.margins < -band).sum()) for d in draws) >= 3
