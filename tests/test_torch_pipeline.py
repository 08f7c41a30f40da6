"""Pipeline-parallel rollouts on the torch engine (CPU): stages of contiguous layers, each holding
only its share of the int8 state, chained in one process, play the same episodes as one engine."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch engine needs torch")

import stoa.envs  # noqa: E402
from stoa.backends.engine import EngineConfig, EngineError, RolloutRequest, SamplingConfig, make_engine  # noqa: E402
from stoa.backends.torch import pipeline as P  # noqa: E402
from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts  # noqa: E402
from stoa.models.tiny import TinyConfig, build_tiny  # noqa: E402

CORPUS = SyntheticConfig(seed=0, num_entities=40, num_test_facts=10)
MODEL = TinyConfig(vocab_size=1024, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                   intermediate_size=256, seed=0)
SAMPLING = SamplingConfig(max_turn_tokens=12, max_episode_tokens=400, seed=7)
CONFIG = EngineConfig(max_batch=8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny"), list(tokenizer_texts(generate(CORPUS))), MODEL)


@pytest.fixture(scope="module")
def single(tiny):
    return make_engine(tiny, "torch", config=CONFIG, device="cpu")


def make_env():
    return stoa.envs.make("stoa/SyntheticSearch-v0", config=CORPUS)


def requests(n=5, g=3):
    return [RolloutRequest(i, f"q{i}", g) for i in range(n)]


def assert_same_episodes(got, want, tol=1e-4):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert np.array_equal(a.tokens(), b.tokens()) and np.array_equal(a.loss_mask(), b.loss_mask())
        assert (a.group_id, a.sample_index, a.reward, a.policy_version) == (b.group_id, b.sample_index, b.reward,
                                                                          b.policy_version)
        np.testing.assert_allclose(a.behavior_logprobs(), b.behavior_logprobs(), atol=tol, rtol=0)


def test_split_layers_and_stage_names():
    assert P.split_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert P.split_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(EngineError):
        P.split_layers(3, 4)
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.1.mlp.up_proj.scales", "model.layers.10.mlp.up_proj.weight"]
    assert P.stage_names(names, (1, 2), 11, tied=False) == ["model.layers.1.mlp.up_proj.scales"]
    assert P.stage_names(names, (0, 1), 11, tied=True) == ["model.embed_tokens.weight",
                                                           "model.layers.0.mlp.up_proj.weight"]
    assert P.stage_names(names, (2, 11), 11, tied=True) == ["lm_head.weight", "model.embed_tokens.weight",
                                                            "model.layers.10.mlp.up_proj.weight", "model.norm.weight"]


@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_plays_the_single_engines_episodes(tiny, single, stages):
    pipe = P.make(tiny, stages, state=single.state, config=CONFIG)
    assert pipe.state_hash() == single.state_hash()
    want = single.rollout(make_env, requests(), SAMPLING)
    got = pipe.rollout(make_env, requests(), SAMPLING)
    assert_same_episodes(got, want)
    assert any(len(e.segments) > 2 for e in got), "the cohort should include multi-turn episodes (prefill of observations)"
    assert pipe.last_stats().decode_steps == single.last_stats().decode_steps


def test_stages_hold_only_their_share(tiny, single):
    pipe = P.make(tiny, [(0, 1), (1, 3), (3, 4)], state=single.state, config=CONFIG)
    first, mid, last = pipe.stages
    assert "model.embed_tokens.weight" in first.names and "model.norm.weight" not in first.names
    assert all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in mid.names)
    assert {"model.norm.weight", "model.embed_tokens.weight"} <= set(last.names)  # tied head
    assert sorted(set(first.names) | set(mid.names) | set(last.names)) == sorted(single.state)
    whole = sum(a.nbytes for a in single.state.values())
    m = mid.memory()
    assert m.state == sum(single.state[n].nbytes for n in mid.names) and m.state < whole / 2
    assert m.weights > m.state  # float32 weights of record: ~4x the int8 codes
    assert m.kv_per_token == 2 * 2 * MODEL.num_kv_heads * (MODEL.hidden_size // MODEL.num_heads) * 4
    with pytest.raises(EngineError, match="missing"):
        P.Stage(tiny, (1, 3), {n: single.state[n] for n in first.names})
    with pytest.raises(EngineError, match="start where"):
        P.Pipeline(tiny, [last, first])
