"""The torch int8 scorer: MLX's dequantization bit for bit, and per-token log-probs that agree
with the MLX int8 engine's ``score`` (same alignment) within the audit's tolerance."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("mlx.core", reason="the reference engine needs mlx")
torch = pytest.importorskip("torch", reason="the scorer needs torch")

from stoa.backends.mlx import MLXEngine  # noqa: E402
from stoa.backends.torch.int8 import Int8ScorerError, TorchInt8Scorer, dequantize_torch  # noqa: E402
from stoa.fleet.trainer.heldstates import HeldStates  # noqa: E402
from stoa.models.tiny import TinyConfig, build_tiny  # noqa: E402
from stoa.transport import quant  # noqa: E402

from helpers import random_episodes  # noqa: E402
from test_tiny import texts  # noqa: E402

MODEL = TinyConfig(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   intermediate_size=256, init_std=0.05, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("int8"), texts(), MODEL)


@pytest.fixture(scope="module")
def engine(tiny):
    return MLXEngine.from_pretrained(tiny)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_dequantize_is_bit_identical_to_mlx_rule(dtype):
    w = (np.random.default_rng(0).standard_normal((32, 256)) * 0.1).astype(dtype)
    codes, scales, biases = quant.quantize(w)
    ref = quant.dequantize(codes, scales, biases)
    t = lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == ml_dtypes.bfloat16 \
        else torch.from_numpy(a)  # noqa: E731
    got = dequantize_torch(torch.from_numpy(codes), t(scales), t(biases)).numpy()
    assert ref.dtype == got.dtype == np.float32 and np.array_equal(got.view(np.uint8), ref.view(np.uint8))
    # MLX's own dequantize of the same codes with float32 scales: the engine's dequantized weights
    mx = pytest.importorskip("mlx.core")
    words = mx.array(np.ascontiguousarray(codes).view(np.uint32))
    f32 = lambda a: mx.array(a.astype(np.float32))  # noqa: E731
    np.testing.assert_array_equal(np.array(mx.dequantize(words, f32(scales), f32(biases), group_size=64, bits=8)), ref)


def test_scores_agree_with_the_mlx_int8_engine(tiny, engine, tmp_path):
    eps = random_episodes(12, engine.vocab_size, seed=1)
    ref = engine.score(eps)
    held = HeldStates(tmp_path, keep=2)  # the scorer reads a memory-mapped held state as is
    held.put(3, engine.state)
    scorer = TorchInt8Scorer(tiny)
    scorer.load_state(3, held.get(3))
    got = scorer.score(eps)
    assert scorer.version == 3
    diffs = np.concatenate([np.abs(a - b) for a, b in zip(got, ref)])
    assert [len(a) for a in got] == [len(e) for e in eps] and all(a[0] == 0.0 for a in got)
    assert diffs.max() < 0.1, f"max |log-prob difference| {diffs.max():.2e} (audit tolerance 0.1 nats)"
    assert diffs.max() < 1e-3  # float32 on both sides: only summation order differs
    assert np.concatenate(ref).std() > 0.1  # the comparison is not between two near-constant outputs
    # The MLX engine takes the same memory-mapped state (as a plain dict) and scores identically.
    engine.load_state(4, dict(held.get(3)))
    assert all(np.array_equal(a, b) for a, b in zip(engine.score(eps), ref))
    # Explicit temperature and a tiny forward budget (one episode per pass) give the same alignment.
    hot = scorer.score(eps[:3], temperature=1.7, max_tokens=1)
    ref_hot = engine.score(eps[:3], temperature=1.7)
    assert max(np.abs(a - b).max() for a, b in zip(hot, ref_hot)) < 1e-3


def test_refuses_what_does_not_fit(tiny, engine):
    scorer = TorchInt8Scorer(tiny)
    with pytest.raises(Int8ScorerError, match="no state"):
        scorer.score(random_episodes(1, 10))
    state = dict(engine.state)
    state.pop("lm_head.scales")
    with pytest.raises(Int8ScorerError, match="without"):
        scorer.load_state(1, state)
    with pytest.raises(Int8ScorerError, match="missing"):
        scorer.load_state(1, {k: v for k, v in engine.state.items() if k != "model.norm.weight"})
    scorer.load_state(1, engine.state)
    with pytest.raises(Int8ScorerError, match="outside"):
        scorer.score(random_episodes(1, engine.vocab_size + 50, seed=3) * 8)


def _rollout(engine, seed, **sampling):
    import stoa.envs
    from stoa.backends.engine import RolloutRequest, SamplingConfig

    make_env = lambda: stoa.envs.make("stoa/SyntheticSearch-v0", num_entities=20, num_test_facts=5)  # noqa: E731
    return engine.rollout(make_env, [RolloutRequest(i, f"g-{i}", 3) for i in range(4)],
                          SamplingConfig(max_turn_tokens=8, max_episode_tokens=160, seed=seed, **sampling))


def _assert_margins_agree(got, ref, sampling):
    """Torch and MLX margins of the same tokens agree to float32 rounding (1e-5 logits), except,
    with top-k / top-p, at near-ties: a ~1e-6 logit difference can move a token across the edge of
    the sets kept under the drift allowance, which changes a margin's competitors. Near-ties are
    rare: at most 5% of tokens (at least one is allowed, for a single short episode)."""
    with np.errstate(invalid="ignore"):  # inf - inf where both are the same infinity
        diff = np.where(np.isinf(got) & (got == ref), 0.0, np.abs(got - ref))
    if sampling.get("top_p", 1.0) < 1.0 or sampling.get("top_k", 0):
        near_ties = int((~(diff < 1e-5)).sum())
        assert near_ties <= 1 or near_ties < 0.05 * diff.size, np.sort(diff)[-5:]
    else:
        assert diff.max() < 1e-5, f"max |margin difference| {diff.max():.2e}"


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_p": 0.9}, {"top_k": 40}])
def test_sampling_margins_agree_with_the_mlx_int8_engine(tiny, engine, sampling):
    """Episodes the MLX int8 engine really sampled: the torch scorer re-derives every token as the
    engine does, and a token the rule did not draw is a violation under both."""
    import copy

    top_k = sampling.get("top_k", 0)
    eps = _rollout(engine, 11, **sampling)
    scorer = TorchInt8Scorer(tiny)
    scorer.load_state(engine.version, engine.state)
    ref = engine.sampling_margins(eps, [11] * len(eps), top_k=top_k, drift=1e-3)
    got = scorer.sampling_margins(eps, [11] * len(eps), top_k=top_k, drift=1e-3, max_tokens=200)
    assert [a.shape for a in got] == [a.shape for a in ref] and sum(a.size for a in got) > 50
    _assert_margins_agree(np.concatenate(got), np.concatenate(ref), sampling)
    assert min(a.min() for a in got if a.size) > -1e-4  # every honest token is the rule's draw
    # One token changed: the rule draws another one there, under both.
    forged = copy.deepcopy(eps)
    ep = next(e for e in forged if any(s.kind == "model" and len(s.tokens) > 2 for s in e.segments))
    seg = next(s for s in ep.segments if s.kind == "model" and len(s.tokens) > 2)
    seg.tokens = seg.tokens.copy()
    seg.tokens[1] = (seg.tokens[1] + 1) % scorer.vocab_size
    bad = scorer.sampling_margins([ep], [11], top_k=top_k, drift=1e-3)[0]
    assert bad.min() < -1e-3 and (bad < -1e-4).sum() >= 1, bad
    ref_bad = engine.sampling_margins([ep], [11], top_k=top_k, drift=1e-3)[0]
    _assert_margins_agree(bad, ref_bad, sampling)
    # Both place the first violation at the forged token (everything before it is honest).
    assert np.flatnonzero(bad < -1e-3)[0] == np.flatnonzero(ref_bad < -1e-3)[0]
    # The wrong seed re-derives other noise: many honest tokens become violations.
    wrong = np.concatenate(scorer.sampling_margins(eps, [12] * len(eps), top_k=top_k))
    assert (wrong < -1e-4).mean() > 0.1


def test_sampling_margins_refuse_what_they_cannot_check(tiny, engine):
    scorer = TorchInt8Scorer(tiny)
    eps = random_episodes(2, 50)
    with pytest.raises(Int8ScorerError, match="no state"):
        scorer.sampling_margins(eps, [0, 0])
    scorer.load_state(0, engine.state)
    with pytest.raises(Int8ScorerError, match="one seed"):
        scorer.sampling_margins(eps, [0])
