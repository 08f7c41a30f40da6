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
from stoa.fleet.heldstates import HeldStates  # noqa: E402
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
    got = dequantize_torch(torch.from_numpy(codes), t(scales), t(biases))
    got = got.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if got.dtype == torch.bfloat16 else got.numpy()
    assert got.dtype == ref.dtype and np.array_equal(got.view(np.uint8), ref.view(np.uint8))


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
