"""The torch rollout engine on tiny models and the synthetic search environment (CPU; the CUDA
variants are named *_cuda and skip without a GPU): the episode contract, replay, deltas, the
sampler against the host rule, and agreement with the torch int8 scorer and the MLX engine."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch engine needs torch")

import stoa.envs  # noqa: E402
from stoa.backends.engine import (  # noqa: E402
    EngineBusyError, EngineConfig, EngineError, RolloutRequest, SamplingConfig, make_engine,
)
from stoa.backends.sampling import draw_margins  # noqa: E402
from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts  # noqa: E402
from stoa.models.tiny import TinyConfig, build_tiny  # noqa: E402
from stoa.transport import pulse, quant  # noqa: E402

CORPUS = SyntheticConfig(seed=0, num_entities=40, num_test_facts=10)
MODEL = TinyConfig(vocab_size=1024, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   intermediate_size=256, seed=0)
SAMPLING = SamplingConfig(max_turn_tokens=12, max_episode_tokens=400, seed=7)
qlinear_ok = __import__("stoa.backends.torch.qlinear", fromlist=["available"]).available()[0]
integer_ok = __import__("stoa.backends.torch.qlinear", fromlist=["integer_available"]).integer_available()[0]
integer_faster = __import__("stoa.backends.torch.qlinear", fromlist=["integer_faster"]).integer_faster()
AUTO = "int24" if integer_faster else "quantized" if qlinear_ok else "dequantized"  # auto's choice on this CPU
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny"), list(tokenizer_texts(generate(CORPUS))), MODEL)


@pytest.fixture(scope="module")
def eng(tiny):
    return make_engine(tiny, "torch", config=EngineConfig(max_batch=16), device="cpu")


def make_env():
    return stoa.envs.make("stoa/SyntheticSearch-v0", config=CORPUS)


def requests(n=6, g=3, prefix="g"):
    return [RolloutRequest(i, f"{prefix}{i}", g) for i in range(n)]


def float_weights(tiny) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(tiny / "model.safetensors"))


def same_tokens(a, b) -> int:
    return sum(np.array_equal(x.tokens(), y.tokens()) for x, y in zip(a, b))


def worst(xs, ys, eps) -> float:
    """Largest |difference| of two per-episode log-prob arrays at model tokens."""
    return max(float(np.abs(x[e.loss_mask()] - y[e.loss_mask()]).max()) for x, y, e in zip(xs, ys, eps))


# -- weights ---------------------------------------------------------------------------------------

def test_state_is_the_trainers_quantization_and_from_state_matches(tiny, eng):
    trainer_state = quant.quantize_state(float_weights(tiny))
    assert eng.state_hash() == pulse.state_hash(trainer_state)
    assert eng.mode == AUTO
    other = make_engine(tiny, "torch", state=trainer_state, version=5, device="cpu")
    assert other.version == 5 and other.state_hash() == eng.state_hash()
    a, b = other.rollout(make_env, requests(2, 2), SAMPLING), eng.rollout(make_env, requests(2, 2), SAMPLING)
    assert same_tokens(a, b) == len(a) and {e.policy_version for e in a} == {5}
    bad = dict(trainer_state)
    bad.pop("model.norm.weight")
    with pytest.raises(EngineError, match="missing"):
        make_engine(tiny, "torch", state=bad, device="cpu")
    with pytest.raises(EngineError, match="shape"):
        make_engine(tiny, "torch", state={**trainer_state, "model.norm.weight": np.ones(3, np.float32)}, device="cpu")
    codes = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(EngineError, match="dtype"):
        make_engine(tiny, "torch", state={**trainer_state, codes: trainer_state[codes].astype(np.float32)},
                    device="cpu")
    with pytest.raises(EngineError, match="mode"):
        make_engine(tiny, "torch", mode="int4", device="cpu")


def test_auto_picks_torch_off_apple_silicon_and_the_run_config_accepts_it(tiny):
    import platform

    from stoa.backends.engine import resolve_backend
    from stoa.fleet.worker import RolloutConfig

    apple = (platform.system(), platform.machine()) == ("Darwin", "arm64")
    assert resolve_backend("auto") == ("mlx" if apple else "torch") and resolve_backend("mlx") == "mlx"
    assert RolloutConfig().engine == "auto" and RolloutConfig(engine="torch").engine == "torch"
    if not apple:
        assert type(make_engine(tiny, "auto", device="cpu")).__name__ == "TorchEngine"


@pytest.mark.parametrize("mode", ["quantized", "int24", "int16", "dequantized"])
def test_delta_applied_live_gives_the_trainers_state(tiny, mode):
    if mode == "quantized" and not qlinear_ok:
        pytest.skip("the int8 kernel is unavailable here")
    if mode.startswith("int") and not integer_ok:
        pytest.skip("the int8 kernel's integer path (AVX-512 VNNI) is unavailable here")
    eng = make_engine(tiny, "torch", config=EngineConfig(max_batch=16), device="cpu", mode=mode)
    old = {k: v.copy() for k, v in eng.state.items()}
    w = float_weights(tiny)
    rng = np.random.default_rng(1)
    touched = ["model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight", "model.layers.1.self_attn.k_proj.weight",
               "model.layers.1.input_layernorm.weight"]
    new_w = {k: (v + rng.normal(0, 0.02, v.shape).astype(v.dtype)) if k in touched else v for k, v in w.items()}
    new_state = quant.quantize_state(new_w, previous=old)
    blob = pulse.encode_delta(old, new_state)
    before = eng.rollout(make_env, requests(2, 2), SAMPLING)
    score_before = eng.score(before)
    changed = eng.apply_delta(1, blob)
    assert eng.version == 1 and eng.state_hash() == pulse.state_hash(new_state)
    assert set(changed) == {k for k in old if not np.array_equal(old[k], new_state[k])}
    fresh = make_engine(tiny, "torch", state=new_state, version=1, device="cpu", mode=mode)
    live, ref = eng.score(before), fresh.score(before)
    for a, b, c in zip(live, ref, score_before):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)  # only the touched slices were rebuilt, and rightly
        assert np.abs(a - c).max() > 1e-3
    assert all(ep.policy_version == 1 for ep in eng.rollout(make_env, requests(2, 2), SAMPLING))
    with pytest.raises(pulse.PulseError):
        eng.apply_delta(2, blob[:-3])
    assert eng.version == 1 and eng.state_hash() == pulse.state_hash(new_state)
    eng.load_state(3, old)
    assert eng.version == 3 and eng.state_hash() == pulse.state_hash(old)
    for a, b in zip(eng.score(before), score_before):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("mode", ["quantized", "int24"])
def test_the_kernel_modes_draw_the_dequantized_modes_episodes_holding_no_float_weights(tiny, mode):
    """auto on a CPU computes on the state's int8 codes (no float32 copy of a matrix), in float32 or
    on 24-bit integer inputs, and draws what the float32 weights of record draw; the trainer's
    checks hold unchanged."""
    if not qlinear_ok or (mode == "int24" and not integer_ok):
        pytest.skip(f"the int8 kernel's {mode} path is unavailable here")
    eng = make_engine(tiny, "torch", config=EngineConfig(max_batch=16), device="cpu", mode=mode)
    assert all(t.is_meta for n, t in eng.decoder.views.items() if n.endswith("proj.weight") or "embed" in n)
    f32 = make_engine(tiny, "torch", config=EngineConfig(max_batch=16), device="cpu", mode="dequantized")
    a, b = eng.rollout(make_env, requests(4, 3), SAMPLING), f32.rollout(make_env, requests(4, 3), SAMPLING)
    assert same_tokens(a, b) >= len(a) - 1
    assert worst([e.behavior_logprobs() for e in a], f32.score(a), a) < 1e-5
    assert all(d.margins.min() > -1e-4 for d in f32.check_draws(a, [SAMPLING.seed] * len(a)))


def test_int16_mode_is_opt_in_and_its_episodes_pass_the_trainers_float32_check(tiny):
    """The kernel's 16-bit integer path holds no float weights either; its drift from the float32
    re-score is larger than the other modes' but inside the audit's band, so the trainer's checks
    accept it."""
    from stoa.fleet.trust.audit import AuditConfig

    if not integer_ok:
        pytest.skip("the int8 kernel's integer path (AVX-512 VNNI) is unavailable here")
    band = AuditConfig().sampling_band
    eng = make_engine(tiny, "torch", config=EngineConfig(max_batch=16), device="cpu", mode="int16")
    assert eng.mode == "int16" and make_engine(tiny, "torch", device="cpu").mode == "int24"
    assert all(t.is_meta for n, t in eng.decoder.views.items() if n.endswith("proj.weight") or "embed" in n)
    f32 = make_engine(tiny, "torch", state=eng.state, config=EngineConfig(max_batch=16), device="cpu",
                      mode="dequantized")
    a = eng.rollout(make_env, requests(4, 3), SAMPLING)
    gap = worst([e.behavior_logprobs() for e in a], f32.score(a), a)
    assert 1e-7 < gap < band / 2
    assert all(d.margins.min() > -band for d in f32.check_draws(a, [SAMPLING.seed] * len(a), drift=band / 2))


def test_no_weight_swap_inside_a_cohort(tiny):
    eng = make_engine(tiny, "torch", config=EngineConfig(max_batch=4), device="cpu")
    old = {k: v.copy() for k, v in eng.state.items()}
    new_state = quant.quantize_state(float_weights(tiny) | {"model.norm.weight": np.full(MODEL.hidden_size, 2.0,
                                                                                         np.float32)})
    blob = pulse.encode_delta(old, new_state)
    refused = []

    class Meddler(gymnasium.Wrapper):  # tries to change the weights from inside the cohort
        def step(self, action):
            for call in (lambda: eng.apply_delta(1, blob), lambda: eng.load_state(1, new_state),
                         lambda: eng.rollout(make_env, requests(1, 1), SAMPLING), lambda: eng.score([])):
                try:
                    call()
                except EngineBusyError:
                    refused.append(1)
            return self.env.step(action)

    eps = eng.rollout(lambda: Meddler(make_env()), requests(3, 3), SAMPLING)
    assert len(refused) == 4 * sum(ep.metrics["turns"] for ep in eps)
    assert {ep.policy_version for ep in eps} == {0} and eng.state_hash() == pulse.state_hash(old)
    eng.apply_delta(1, blob)
    assert eng.state_hash() == pulse.state_hash(new_state)


# -- episodes ----------------------------------------------------------------------------------------

def test_episodes_are_valid_and_log_probs_are_the_rescore(eng):
    eps = eng.rollout(make_env, requests(), SAMPLING)
    assert len(eps) == 18 and [(e.group_id, e.sample_index) for e in eps[:4]] == [("g0", 0), ("g0", 1), ("g0", 2),
                                                                                 ("g1", 0)]
    for ep in eps:
        ep.validate(eng.vocab_size)
        assert ep.metrics["finish_reason"] in ("terminated", "truncated", "eos", "max_episode_tokens")
        assert ep.metrics["turns"] == sum(s.kind == "model" for s in ep.segments) and "num_turns" in ep.metrics
    assert max(e.metrics["turns"] for e in eps) >= 2
    st = eng.last_stats()
    assert st.episodes == 18 and st.model_tokens == sum(e.num_model_tokens for e in eps)
    assert st.prefill_saved_kv > 0 and st.prefill_saved_shared > 0
    assert worst([e.behavior_logprobs() for e in eps], eng.score(eps), eps) < 1e-5
    draws = eng.check_draws(eps, [SAMPLING.seed] * len(eps))
    assert min(d.margins.min() for d in draws) > 0  # every token is the rule's draw
    assert worst([e.behavior_logprobs() for e in eps], [np.zeros(len(e)) for e in eps], eps) > 0.1
    for e, d in zip(eps, draws):
        np.testing.assert_allclose(d.logprobs, e.behavior_logprobs()[d.at], atol=1e-5)


def test_replay_is_exact_and_draws_do_not_depend_on_neighbours(tiny, eng):
    a = eng.rollout(make_env, requests(3, 2), SAMPLING)
    b = eng.rollout(make_env, requests(3, 2), SAMPLING)
    for x, y in zip(a, b):
        assert np.array_equal(x.tokens(), y.tokens()) and np.array_equal(x.behavior_logprobs(), y.behavior_logprobs())
        assert x.reward == y.reward and x.metrics == y.metrics
    c = eng.rollout(make_env, requests(3, 2), SamplingConfig(max_turn_tokens=12, max_episode_tokens=400, seed=8))
    assert same_tokens(a, c) < len(a) and not np.array_equal(a[0].tokens(), a[1].tokens())
    alone = eng.rollout(make_env, [RolloutRequest(1, "g1", 2)], SAMPLING)
    assert np.array_equal(alone[1].tokens(), a[3].tokens())
    few = make_engine(tiny, "torch", config=EngineConfig(max_batch=3, prefill_chunk=7), device="cpu")
    small = few.rollout(make_env, requests(3, 2), SAMPLING)  # rows leave and join, prefill in chunks
    assert same_tokens(small, a) >= len(a) - 1
    plain = make_engine(tiny, "torch", config=EngineConfig(max_batch=16, kv_reuse=False, share_prompt_prefill=False),
                        device="cpu")
    eps = plain.rollout(make_env, requests(3, 2), SAMPLING)
    assert plain.last_stats().prefill_saved_kv == 0 and plain.last_stats().prefill_saved_shared == 0
    assert same_tokens(eps, a) >= len(a) - 1


def test_stop_strings_caps_and_errors(eng):
    stops = ("e", "</search>")
    eps = eng.rollout(make_env, requests(6, 2), SamplingConfig(max_turn_tokens=6, max_episode_tokens=90,
                                                               stop_strings=stops, seed=3))
    for ep in eps:
        assert len(ep) <= 90
        for seg in (s for s in ep.segments if s.kind == "model"):
            toks = list(seg.tokens)
            assert 1 <= len(toks) <= 6
            assert not any(x in eng.codec.decode(toks[:-1]) for x in stops), "a turn ran past its stop string"
    assert any(ep.metrics["finish_reason"] == "max_episode_tokens" for ep in eps)
    with pytest.raises(EngineError, match="prompt of"):
        eng.rollout(make_env, requests(1, 1), SamplingConfig(max_episode_tokens=5))
    with pytest.raises(EngineError):
        eng.rollout(make_env, [(0, "g", 1)], SAMPLING)
    assert eng.rollout(make_env, [], SAMPLING) == [] and eng.last_stats().episodes == 0


def test_top_k_and_top_p_draws_check(eng):
    s = SamplingConfig(temperature=0.8, top_p=0.7, top_k=50, max_turn_tokens=8, max_episode_tokens=200, seed=4)
    eps = eng.rollout(make_env, requests(3, 2), s)
    draws = eng.check_draws(eps, [4] * len(eps), top_k=50)
    assert min(d.margins.min() for d in draws) > 0
    full = eng.score(eps)  # the record is the truncated distribution's: above the full softmax's log-prob
    assert all((e.behavior_logprobs()[e.loss_mask()] >= f[e.loss_mask()] - 1e-6).all() for e, f in zip(eps, full))


# -- the sampler ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("vocab,spread", [(1000, 0.5), (49152, 8.0), (151936, 12.0)])
def test_device_sampler_draws_the_host_rules_token(vocab, spread):
    """Flat and peaked logits, and rows with one token far ahead (its own noise then often
    negative: the bound's token sits at a negative deficit and must still be drawn)."""
    from stoa.backends.sampling import HostSampler
    from stoa.backends.torch.sample import sample

    host_sample = HostSampler()

    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((12, vocab)) * spread).astype(np.float32)
    logits[6:, :3] += np.float32(6 * spread)
    logits[9:, 7] += np.float32(40.0)
    seeds = rng.integers(0, 2**63, 12, dtype=np.uint64)
    for t in (0.7, 1.0):
        htok, hlp = host_sample(logits, seeds, t)
        for dense in (False, True):  # the bounded candidates (CPU default) and every entry (GPU default)
            tok, lp = sample(torch.from_numpy(logits), seeds, t, dense=dense)
            assert np.array_equal(tok, htok)
            np.testing.assert_allclose(lp, hlp, atol=1e-5)
        m, _ = draw_margins(logits, np.full(12, t), tok, seeds)
        assert (m > 0).all()


def test_sampler_noise_bits_equal_the_host_hash():
    from stoa.backends.sampling import gumbel, noise_bits, split_seeds
    from stoa.backends.torch import sample as S

    rng = np.random.default_rng(0)
    seeds = rng.integers(0, 2**63, 5, dtype=np.uint64) | np.uint64(1 << 63)
    cols = rng.integers(0, 2**31, (5, 300)).astype(np.uint32)
    lo, hi = split_seeds(seeds)
    lo_t, hi_t = (torch.from_numpy(x.astype(np.int64))[:, None] for x in (lo, hi))
    got = S.noise_bits(lo_t, hi_t, torch.from_numpy(cols.astype(np.int64))).numpy()
    assert np.array_equal(got, noise_bits(seeds, cols).astype(np.int64))
    g = S.gumbel(lo_t, hi_t, torch.from_numpy(cols.astype(np.int64))).numpy()
    np.testing.assert_allclose(g, gumbel(seeds, cols, np.float64), atol=2e-6, rtol=0)


# -- other stacks --------------------------------------------------------------------------------------

def test_agrees_with_the_torch_int8_scorer(tiny, eng):
    from stoa.backends.torch.int8 import TorchInt8Scorer

    eps = eng.rollout(make_env, requests(3, 2), SAMPLING)
    scorer = TorchInt8Scorer(tiny, "cpu")
    scorer.load_state(0, eng.state)
    assert worst(eng.score(eps), scorer.score(eps), eps) < 1e-5
    mine, theirs = eng.check_draws(eps, [7] * len(eps)), scorer.check_draws(eps, [7] * len(eps))
    for a, b in zip(mine, theirs):
        np.testing.assert_allclose(a.margins, b.margins, atol=1e-4)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_same_episodes_and_codec_as_the_mlx_engine(tiny, eng):
    pytest.importorskip("mlx.core", reason="the MLX engine needs mlx")
    mlx = make_engine(tiny, "mlx", mode="dequantized", config=EngineConfig(max_batch=16))
    assert mlx.state_hash() == eng.state_hash()
    a, b = eng.rollout(make_env, requests(4, 3), SAMPLING), mlx.rollout(make_env, requests(4, 3), SAMPLING)
    assert same_tokens(a, b) >= len(a) - 1
    assert worst(eng.score(b), mlx.score(b), b) < 1e-5
    text = "Doc 1(Title: x) <|im_end|> kinase </search>"
    assert eng.codec.encode(text) == mlx.codec.encode(text) and eng.codec.eos_ids == mlx.codec.eos_ids
    assert eng.codec.prompt_tokens("which protein?") == mlx.codec.prompt_tokens("which protein?")
    assert eng.codec.stop_candidates(("</search>",)) == mlx.codec.stop_candidates(("</search>",))


# -- CUDA ---------------------------------------------------------------------------------------------

@CUDA
def test_episodes_on_cuda_match_the_cpu_engine_cuda(tiny, eng):
    gpu = make_engine(tiny, "torch", config=EngineConfig(max_batch=16), device="cuda")
    assert gpu.device.type == "cuda" and gpu.state_hash() == eng.state_hash()
    a, b = gpu.rollout(make_env, requests(4, 3), SAMPLING), eng.rollout(make_env, requests(4, 3), SAMPLING)
    assert same_tokens(a, b) >= len(a) - 1
    assert worst([e.behavior_logprobs() for e in a], gpu.score(a), a) < 1e-4
    assert worst(gpu.score(a), eng.score(a), a) < 1e-4
    draws = eng.check_draws(a, [SAMPLING.seed] * len(a))
    assert min(d.margins.min() for d in draws) > -1e-3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA, id="cuda")])
def test_bfloat16_mode_runs_and_its_drift_is_bounded(tiny, eng, device):
    gpu = make_engine(tiny, "torch", mode="bfloat16", config=EngineConfig(max_batch=16), device=device)
    assert gpu.mode == "bfloat16"
    eps = gpu.rollout(make_env, requests(3, 2), SAMPLING)
    for ep in eps:
        ep.validate(gpu.vocab_size)
    drift = worst([e.behavior_logprobs() for e in eps], eng.score(eps), eps)
    assert 0 < drift < 0.5, drift


@CUDA
def test_sampler_on_cuda_draws_the_host_rules_token_cuda():
    from stoa.backends.sampling import HostSampler
    from stoa.backends.torch.sample import sample

    host_sample = HostSampler()

    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((64, 151936)) * 10).astype(np.float32)
    seeds = rng.integers(0, 2**63, 64, dtype=np.uint64)
    htok, hlp = host_sample(logits, seeds, 1.0)
    for dense in (False, True):
        tok, lp = sample(torch.from_numpy(logits).cuda(), seeds, 1.0, dense=dense)
        assert np.array_equal(tok, htok)
        np.testing.assert_allclose(lp, hlp, atol=1e-4)
