"""The MLX rollout engine on a tiny model and the synthetic search environment (CPU or Metal)."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest

pytest.importorskip("mlx.core", reason="the MLX engine needs mlx")

import stoa.envs  # noqa: E402
from stoa.backends.engine import (  # noqa: E402
    EngineBusyError, EngineConfig, EngineError, RolloutRequest, SamplingConfig, make_engine,
)
from stoa.backends.mlx import MLXEngine  # noqa: E402
from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts  # noqa: E402
from stoa.models.tiny import TinyConfig, build_tiny  # noqa: E402
from stoa.transport import pulse, quant  # noqa: E402

CORPUS = SyntheticConfig(seed=0, num_entities=40, num_test_facts=10)
MODEL = TinyConfig(vocab_size=1024, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   intermediate_size=256, seed=0)
SAMPLING = SamplingConfig(max_turn_tokens=12, max_episode_tokens=400, seed=7)
MODES = ["dequantized", "quantized"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny"), list(tokenizer_texts(generate(CORPUS))), MODEL)


@pytest.fixture(scope="module")
def engines(tiny):
    return {m: MLXEngine.from_pretrained(tiny, mode=m, config=EngineConfig(max_batch=16)) for m in MODES}


def make_env():
    return stoa.envs.make("stoa/SyntheticSearch-v0", config=CORPUS)


def requests(n=6, g=3, prefix="g"):
    return [RolloutRequest(i, f"{prefix}{i}", g) for i in range(n)]


def float_weights(tiny) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(tiny / "model.safetensors"))


class Recorder(gymnasium.Wrapper):
    """Logs every prompt, action and observation of the wrapped (real) environment."""

    def __init__(self, env, log):
        super().__init__(env)
        self.log = log

    def reset(self, **kw):
        prompt, info = self.env.reset(**kw)
        self.rec = {"prompt": prompt, "actions": [], "obs": []}
        self.log.append(self.rec)
        return prompt, info

    def step(self, action):
        out = self.env.step(action)
        self.rec["actions"].append(action)
        self.rec["obs"].append(out[0])
        return out


def model_texts(engine, ep):
    texts = []
    for s in ep.segments:
        if s.kind == "model":
            toks = list(s.tokens)
            if toks[-1] in engine.eos_ids:
                toks = toks[:-1]
            texts.append(engine.decode(toks))
    return texts


def assert_logprobs_match_recomputation(engine, eps, atol):
    scored = engine.score(eps)
    for ep, lp in zip(eps, scored):
        m = ep.loss_mask()
        assert lp.shape == (len(ep),) and lp[0] == 0.0
        np.testing.assert_allclose(ep.behavior_logprobs()[m], lp[m], atol=atol, rtol=0)


# -- loading and the weight state ------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_state_equals_the_trainers_quantization(tiny, engines, mode):
    eng = engines[mode]
    assert eng.mode == mode and eng.version == 0
    trainer_state = quant.quantize_state(float_weights(tiny))
    assert sorted(eng.state) == sorted(trainer_state)
    for k, v in trainer_state.items():
        assert eng.state[k].dtype == v.dtype and eng.state[k].shape == v.shape, k
    assert eng.state_hash() == pulse.state_hash(trainer_state)
    emb = eng.state["model.embed_tokens.weight"]
    assert emb.dtype == np.uint8 and emb.shape == (eng.vocab_size, MODEL.hidden_size)


def test_make_engine_by_name_and_auto_mode(tiny):
    eng = make_engine(tiny, backend="mlx", version=3)
    import mlx.core as mx

    assert eng.version == 3 and eng.mode == ("quantized" if mx.metal.is_available() else "dequantized")
    with pytest.raises(EngineError, match="unknown engine backend"):
        make_engine(tiny, backend="nope")
    with pytest.raises(EngineError, match="mode"):
        MLXEngine.from_pretrained(tiny, mode="int4")


@pytest.mark.parametrize("mode", MODES)
def test_from_state_matches_from_pretrained(tiny, engines, mode):
    state = quant.quantize_state(float_weights(tiny))
    eng = MLXEngine.from_state(tiny, state, version=5, mode=mode, config=EngineConfig(max_batch=16))
    assert eng.version == 5 and eng.state_hash() == engines[mode].state_hash()
    a = eng.rollout(make_env, requests(2, 2), SAMPLING)
    b = engines[mode].rollout(make_env, requests(2, 2), SAMPLING)
    for x, y in zip(a, b):
        assert np.array_equal(x.tokens(), y.tokens()) and x.policy_version == 5 and y.policy_version == 0
    bad = dict(state)
    bad.pop("model.norm.weight")
    with pytest.raises(EngineError, match="missing"):
        MLXEngine.from_state(tiny, bad, version=0, mode=mode)
    bad = {**state, "model.norm.weight": np.ones(3, np.float32)}
    with pytest.raises(EngineError, match="shape"):
        MLXEngine.from_state(tiny, bad, version=0, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_delta_applied_live_gives_the_trainers_state(tiny, mode):
    eng = MLXEngine.from_pretrained(tiny, mode=mode, config=EngineConfig(max_batch=16))
    old = {k: v.copy() for k, v in eng.state.items()}
    w = float_weights(tiny)
    rng = np.random.default_rng(1)
    touched = ["model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight",
               "model.layers.1.input_layernorm.weight"]
    new_w = {k: (v + rng.normal(0, 0.02, v.shape).astype(v.dtype)) if k in touched else v for k, v in w.items()}
    new_state = quant.quantize_state(new_w, previous=old)
    blob = pulse.encode_delta(old, new_state)
    before = eng.rollout(make_env, requests(2, 2), SAMPLING)
    score_before = eng.score(before)

    changed = eng.apply_delta(1, blob)

    assert eng.version == 1
    assert eng.state_hash() == pulse.state_hash(pulse.apply_delta(old, blob)) == pulse.state_hash(new_state)
    assert set(changed) == {k for k in old if not np.array_equal(old[k], new_state[k])}
    assert {k.rsplit(".", 1)[0] for k in changed} == {k.rsplit(".", 1)[0] for k in touched}
    # The live model computes with the new weights: same log-probs as an engine built from them.
    fresh = MLXEngine.from_state(tiny, new_state, version=1, mode=mode)
    live, ref = eng.score(before), fresh.score(before)
    for a, b, c in zip(live, ref, score_before):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
        assert np.abs(a - c).max() > 1e-3
    after = eng.rollout(make_env, requests(2, 2), SAMPLING)
    assert all(ep.policy_version == 1 for ep in after)
    with pytest.raises(pulse.PulseError):
        eng.apply_delta(2, blob[:-3])
    assert eng.version == 1 and eng.state_hash() == pulse.state_hash(new_state)


@pytest.mark.parametrize("mode", MODES)
def test_load_state(tiny, mode):
    eng = MLXEngine.from_pretrained(tiny, mode=mode)
    ref = MLXEngine.from_pretrained(tiny, mode=mode)
    eps = ref.rollout(make_env, requests(1, 2), SAMPLING)
    other = quant.quantize_state(float_weights(tiny) | {"model.norm.weight": np.full(MODEL.hidden_size, 0.5,
                                                                                      np.float32)})
    eng.load_state(4, other)
    assert eng.version == 4 and eng.state_hash() == pulse.state_hash(other)
    assert max(np.abs(a - b).max() for a, b in zip(eng.score(eps), ref.score(eps))) > 1e-3
    eng.load_state(5, {k: v.copy() for k, v in ref.state.items()})
    for a, b in zip(eng.score(eps), ref.score(eps)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    with pytest.raises(EngineError, match="dtype"):
        eng.load_state(6, {**other, "model.norm.weight": other["model.norm.weight"].astype(np.float16)})
    assert eng.version == 5


# -- generation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_behaviour_logprobs_equal_recomputation(engines, mode):
    eng = engines[mode]
    eps = eng.rollout(make_env, requests(), SAMPLING)
    assert len(eps) == 18
    for ep in eps:
        ep.validate(eng.vocab_size)
    # Int8 kernels differ between one-token decode and full-sequence scoring by float noise.
    assert_logprobs_match_recomputation(eng, eps, atol=1e-5 if mode == "dequantized" else 1e-4)


def test_episode_fields_and_order(tiny):
    from stoa.backends.engine import make_engine

    eng = make_engine(tiny, "mlx", mode="dequantized", config=EngineConfig(max_batch=16), worker_id="w-test")
    eps = eng.rollout(make_env, [RolloutRequest(5, "five", 2), RolloutRequest(3, "three", 3)],
                      SamplingConfig(temperature=0.7, max_turn_tokens=8, max_episode_tokens=300, seed=1))
    assert [(e.group_id, e.sample_index) for e in eps] == [("five", 0), ("five", 1), ("three", 0), ("three", 1),
                                                          ("three", 2)]
    for ep in eps:
        assert ep.policy_version == 0 and ep.worker_id == "w-test" and ep.env_id == "stoa/SyntheticSearch-v0"
        assert ep.temperature == 0.7 and ep.top_p == 1.0
        assert ep.metrics["finish_reason"] in ("terminated", "truncated", "eos", "max_episode_tokens")
        assert ep.metrics["turns"] == sum(s.kind == "model" for s in ep.segments)
        assert ep.metrics["truncated"] == (ep.metrics["finish_reason"] != "terminated")
        assert "num_turns" in ep.metrics  # the environment's own metrics are kept
    st = eng.last_stats()
    assert st.episodes == 5 and st.model_tokens == sum(e.num_model_tokens for e in eps)
    assert st.turns == sum(e.metrics["turns"] for e in eps)


def test_tokens_are_the_sampled_ones_and_observations_are_encoded_alone(engines):
    eng = engines["dequantized"]
    log: list[dict] = []
    eps = eng.rollout(lambda: Recorder(make_env(), log), requests(4, 2), SAMPLING)
    assert len(log) == len(eps)
    by_actions = {tuple(r["actions"]): r for r in log}
    for ep in eps:
        rec = by_actions[tuple(model_texts(eng, ep))]  # every model turn's text reached the env verbatim
        chat = eng.tokenizer.apply_chat_template([{"role": "user", "content": rec["prompt"]}],
                                                 add_generation_prompt=True)
        assert list(ep.prompt_tokens) == list(chat)
        env_segs = [s for s in ep.segments if s.kind == "env"]
        appended = [o for o in rec["obs"] if o][:len(env_segs)]
        assert len(env_segs) == len(appended) >= 1
        for seg, obs in zip(env_segs, appended):
            assert list(seg.tokens) == eng.tokenizer.encode(obs, add_special_tokens=False, split_special_tokens=True)
        kinds = [s.kind for s in ep.segments]
        assert kinds[0] == "model" and all(a != b for a, b in zip(kinds, kinds[1:]))
    # Re-tokenizing the decoded transcript would not give the episode's tokens back: the engine
    # never does it (log-probs match a teacher-forced pass over exactly these tokens).
    retok = [eng.tokenizer.encode(eng.decode(ep.tokens()), add_special_tokens=False) for ep in eps]
    assert any(list(r) != list(ep.tokens()) for r, ep in zip(retok, eps))
    assert_logprobs_match_recomputation(eng, eps, atol=1e-5)


def test_stop_strings_and_caps(engines):
    eng = engines["dequantized"]
    stops = ("e", "</search>")
    s = SamplingConfig(max_turn_tokens=6, max_episode_tokens=90, stop_strings=stops, seed=3)
    eps = eng.rollout(make_env, requests(6, 2), s)
    reasons = {"stop": 0, "cap": 0}
    for ep in eps:
        assert len(ep) <= 90
        segs = [x for x in ep.segments if x.kind == "model"]
        for i, seg in enumerate(segs):
            toks = list(seg.tokens)
            assert 1 <= len(toks) <= 6
            text, head = eng.decode(toks), eng.decode(toks[:-1])
            if any(x in text for x in stops):
                assert not any(x in head for x in stops), "a turn ran past its stop string"
                reasons["stop"] += 1
            else:
                last = i == len(segs) - 1
                assert len(toks) == 6 or toks[-1] in eng.eos_ids or (last and len(ep) == 90)
                reasons["cap"] += len(toks) == 6
    assert reasons["stop"] > 0 and reasons["cap"] > 0
    assert any(ep.metrics["finish_reason"] == "max_episode_tokens" for ep in eps)
    # Default stop strings are the environment's.
    env_stops = make_env().unwrapped.stop_strings
    assert env_stops and set(env_stops) <= {"</search>", "</answer>"}


def test_prompt_too_long_is_an_error(engines):
    with pytest.raises(EngineError, match="prompt of"):
        engines["dequantized"].rollout(make_env, requests(1, 1), SamplingConfig(max_episode_tokens=5))


def test_replay_is_exact_and_seeds_matter(engines):
    eng = engines["dequantized"]
    a = eng.rollout(make_env, requests(3, 2), SAMPLING)
    b = eng.rollout(make_env, requests(3, 2), SAMPLING)
    for x, y in zip(a, b):
        assert np.array_equal(x.tokens(), y.tokens()) and np.array_equal(x.behavior_logprobs(), y.behavior_logprobs())
        assert x.reward == y.reward and x.metrics == y.metrics
    c = eng.rollout(make_env, requests(3, 2), SamplingConfig(max_turn_tokens=12, max_episode_tokens=400, seed=8))
    assert any(not np.array_equal(x.tokens(), z.tokens()) for x, z in zip(a, c))
    # Samples of one group differ (each episode has its own random stream).
    assert not np.array_equal(a[0].tokens(), a[1].tokens())
    # An episode's draws do not depend on its batch neighbours.
    alone = eng.rollout(make_env, [RolloutRequest(1, "g1", 2)], SAMPLING)
    assert np.array_equal(alone[1].tokens(), a[3].tokens())


def test_kv_reuse_and_prompt_sharing_save_prefill(tiny, engines):
    eng = engines["dequantized"]
    eps = eng.rollout(make_env, requests(4, 4), SAMPLING)
    st = eng.last_stats()
    assert st.prefill_saved_kv > 0 and st.prefill_saved_shared > 0 and 0 < st.prefill_saved_fraction < 1
    plain = MLXEngine.from_pretrained(tiny, mode="dequantized",
                                      config=EngineConfig(max_batch=16, kv_reuse=False, share_prompt_prefill=False))
    eps2 = plain.rollout(make_env, requests(4, 4), SAMPLING)
    st2 = plain.last_stats()
    assert st2.prefill_saved_kv == 0 and st2.prefill_saved_shared == 0
    assert st2.prefill_tokens > st.prefill_tokens + st.prefill_saved_kv - len(eps)
    assert_logprobs_match_recomputation(plain, eps2, atol=1e-5)
    same = sum(np.array_equal(x.tokens(), y.tokens()) for x, y in zip(eps, eps2))
    assert same >= len(eps) - 1  # identical up to rare float ties: reuse changes no distribution


def test_continuous_batching_with_few_slots(tiny, engines):
    small = MLXEngine.from_pretrained(tiny, mode="dequantized", config=EngineConfig(max_batch=3, prefill_chunk=7))
    eps = small.rollout(make_env, requests(5, 2), SAMPLING)
    assert len(eps) == 10 and small.last_stats().episodes == 10
    for ep in eps:
        ep.validate(small.vocab_size)
    assert_logprobs_match_recomputation(small, eps, atol=1e-5)
    wide = engines["dequantized"].rollout(make_env, requests(5, 2), SAMPLING)
    assert sum(np.array_equal(x.tokens(), y.tokens()) for x, y in zip(eps, wide)) >= len(eps) - 1


def test_no_weight_swap_inside_a_cohort(tiny):
    eng = MLXEngine.from_pretrained(tiny, mode="dequantized", config=EngineConfig(max_batch=4))
    old = {k: v.copy() for k, v in eng.state.items()}
    new_state = quant.quantize_state(float_weights(tiny) | {"model.norm.weight": np.full(MODEL.hidden_size, 2.0,
                                                                                         np.float32)})
    blob = pulse.encode_delta(old, new_state)
    refused = []

    class Meddler(gymnasium.Wrapper):  # tries to change the weights from inside the cohort
        def step(self, action):
            for call in (lambda: eng.apply_delta(1, blob), lambda: eng.load_state(1, new_state),
                         lambda: eng.rollout(make_env, requests(1, 1), SAMPLING)):
                try:
                    call()
                except EngineBusyError:
                    refused.append(1)
            return self.env.step(action)

    eps = eng.rollout(lambda: Meddler(make_env()), requests(3, 3), SAMPLING)
    assert len(refused) == 3 * sum(ep.metrics["turns"] for ep in eps)
    assert {ep.policy_version for ep in eps} == {0} and eng.version == 0
    assert eng.state_hash() == pulse.state_hash(old)
    eng.apply_delta(1, blob)  # allowed between cohorts
    assert eng.state_hash() == pulse.state_hash(new_state)


def test_bad_arguments(engines, tmp_path):
    eng = engines["dequantized"]
    with pytest.raises(EngineError, match="config.json"):
        MLXEngine.from_pretrained(tmp_path)
    with pytest.raises(EngineError):
        eng.rollout(make_env, [(0, "g", 1)], SAMPLING)
    with pytest.raises(ValueError):
        RolloutRequest(-1, "g")
    with pytest.raises(ValueError):
        SamplingConfig(temperature=0)
    with pytest.raises(ValueError):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError):
        SamplingConfig(stop_strings="</answer>")
    with pytest.raises(ValueError):
        EngineConfig(max_batch=0)


def test_fast_ops_and_modes_agree(tiny, engines):
    import mlx.core as mx

    eps = engines["dequantized"].rollout(make_env, requests(3, 2), SAMPLING)
    plain = MLXEngine.from_pretrained(tiny, mode="dequantized", fast_ops=False)
    fast_ = MLXEngine.from_pretrained(tiny, mode="dequantized", fast_ops=True)
    assert fast_.fast_ops and not plain.fast_ops
    assert engines["dequantized"].fast_ops == (not mx.metal.is_available())
    a, b, c = plain.score(eps), fast_.score(eps), engines["quantized"].score(eps)
    for x, y, z in zip(a, b, c):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)  # fused exp: ~1e-6 apart
        np.testing.assert_allclose(x, z, atol=1e-4, rtol=0)  # int8 kernels vs float32 from the same codes


def test_device_sampler_draws_what_the_host_sampler_draws(tiny, engines):
    dev = MLXEngine.from_pretrained(tiny, mode="dequantized", config=EngineConfig(max_batch=16, sampler="device"))
    a = dev.rollout(make_env, requests(3, 2), SAMPLING)
    b = engines["dequantized"].rollout(make_env, requests(3, 2), SAMPLING)
    assert sum(np.array_equal(x.tokens(), y.tokens()) for x, y in zip(a, b)) >= len(a) - 1
    for x, y in zip(a, b):
        if np.array_equal(x.tokens(), y.tokens()):
            np.testing.assert_allclose(x.behavior_logprobs(), y.behavior_logprobs(), atol=2e-5)


def test_environments_are_reused_across_cohorts(engines):
    made = []

    def factory():
        made.append(1)
        return make_env()

    eng = engines["dequantized"]
    eng.rollout(factory, requests(2, 2), SAMPLING)
    first = len(made)
    assert 1 <= first <= 4
    eng.rollout(factory, requests(2, 2), SAMPLING)
    assert len(made) == first  # the same factory: its idle instances are reset and reused


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_state_from_the_weight_channel(tiny, mode):
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    w = {k: v.astype(bf16) for k, v in float_weights(tiny).items()}
    state = quant.quantize_state(w)
    assert state["model.norm.weight"].dtype == bf16 and state["model.embed_tokens.scales"].dtype == bf16
    eng = MLXEngine.from_state(tiny, state, version=2, mode=mode, config=EngineConfig(max_batch=8))
    assert eng.state["model.embed_tokens.scales"].dtype == bf16
    assert eng.state_hash() == pulse.state_hash(state)
    eps = eng.rollout(make_env, requests(2, 2), SAMPLING)
    # bfloat16 weights: decode and full-sequence scoring round differently in quantized mode.
    assert_logprobs_match_recomputation(eng, eps, atol=1e-5 if mode == "dequantized" else 5e-2)
    rng = np.random.default_rng(3)
    new_w = dict(w)
    for k in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.post_attention_layernorm.weight"):
        new_w[k] = (w[k].astype(np.float32) + rng.normal(0, 0.05, w[k].shape).astype(np.float32)).astype(bf16)
    new_state = quant.quantize_state(new_w, previous=state)
    eng.apply_delta(3, pulse.encode_delta(state, new_state))
    assert eng.state_hash() == pulse.state_hash(new_state)
    ref = MLXEngine.from_state(tiny, new_state, version=3, mode=mode)
    for a, b in zip(eng.score(eps), ref.score(eps)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_empty_cohort_and_scoring_in_small_batches(engines):
    eng = engines["dequantized"]
    assert eng.rollout(make_env, [], SAMPLING) == [] and eng.last_stats().episodes == 0
    eps = eng.rollout(make_env, requests(2, 2), SAMPLING)
    whole, pieces = eng.score(eps), eng.score(eps, max_tokens=1)  # one episode per forward pass
    for a, b in zip(whole, pieces):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    hot = eng.score(eps, temperature=2.0)
    assert all(np.abs(h - w).max() > 1e-3 for h, w in zip(hot, whole))


_REPLAY_SCRIPT = """
import hashlib, sys
from stoa import blas
blas.load_openblas()
import numpy as np
from stoa.backends.mlx import MLXEngine
sys.path.insert(0, sys.argv[2])
from test_mlx_engine import SAMPLING, make_env, requests
eps = MLXEngine.from_pretrained(sys.argv[1]).rollout(make_env, requests(3, 2), SAMPLING)
h = hashlib.sha256()
for e in eps:
    h.update(e.tokens().tobytes()); h.update(e.behavior_logprobs().tobytes())
print(h.hexdigest())
"""


def test_replay_is_exact_across_processes(tiny):
    """A restarted worker replays a seeded cohort bit for bit, given the same BLAS thread count
    (a different count changes float summation order: ~1e-6 in log-probs, documented)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    run = lambda: subprocess.run([sys.executable, "-c", _REPLAY_SCRIPT, str(tiny), str(Path(__file__).parent)],  # noqa: E731
                                 env=env, capture_output=True, text=True, timeout=300)
    first, second = run(), run()
    assert first.returncode == 0, first.stderr[-2000:]
    assert len(first.stdout.strip()) == 64 and first.stdout == second.stdout
