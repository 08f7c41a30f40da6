"""The CPU fast path (stoa.backends.mlx.fast) against MLX's own ops."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX engine needs mlx")

from stoa.backends.mlx import fast  # noqa: E402


def test_fast_exp_and_swiglu():
    x = mx.array(np.concatenate([np.linspace(-100, 100, 4001), np.random.default_rng(0).normal(0, 4, 5000)])
                 .astype(np.float32))
    want = np.exp(np.array(x).astype(np.float64))
    got = np.array(fast.fast_exp(x)).astype(np.float64)
    rel, ax = np.abs(got - want) / want, np.abs(np.array(x))
    # Like mx.exp, the error grows with |x| through the float32 rounding of x * log2(e).
    ref = np.abs(np.array(mx.exp(x)).astype(np.float64) - want) / want
    assert rel[ax < 20].max() < max(1.5e-6, 2 * ref[ax < 20].max()) and rel[ax < 87].max() < 5e-6
    assert np.all(got[np.array(x) < -88] < 2e-38) and np.all(got[np.array(x) > 89] > 1e37)  # saturates
    g, u = x, mx.array(np.random.default_rng(1).normal(0, 1, x.shape).astype(np.float32))
    ref = np.array(g * mx.sigmoid(g) * u)
    np.testing.assert_allclose(np.array(fast.swiglu(g, u)), ref, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "array"])
@pytest.mark.parametrize("shape", [(3, 4, 1, 16, 9), (2, 6, 5, 8, 5)])  # B, Hq, Lq, D, Lk (GQA: Hq > Hkv)
def test_fast_attention_matches_mlx_sdpa(mask_kind, shape):
    b, hq, lq, d, lk = shape
    hkv = 2
    rng = np.random.default_rng(2)
    q, k, v = (mx.array(rng.normal(0, 1, s).astype(np.float32)) for s in
               ((b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, d)))
    mask = None
    if mask_kind == "causal":
        mask = "causal"
    elif mask_kind == "array":  # mlx_lm's batched-cache mask: causal with per-row left padding
        pad = mx.array(rng.integers(0, lk - lq + 1, b))
        mask = (mx.arange(lk - lq, lk)[:, None] >= mx.arange(lk)[None]) & (pad[:, None, None, None] <= mx.arange(lk))
    got = fast.attention(q, k, v, d**-0.5, mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask=mask)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6, rtol=1e-5)
