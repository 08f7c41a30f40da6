"""The engine's sampling rule: exact log-probs, the right distribution, host == device."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX engine needs mlx")

from stoa.backends.mlx.sampling import HostSampler, device_sample, episode_key, uniforms  # noqa: E402


def logsoftmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def test_uniforms_are_in_the_open_interval_and_well_spread():
    keys = np.array([episode_key(1, "g", i, 0) for i in range(64)], np.uint64)
    u = np.concatenate([uniforms(keys, np.full(64, p)) for p in range(500)])
    assert u.dtype == np.float32 and 0 < u.min() and u.max() < 1
    hist = np.histogram(u, bins=10, range=(0, 1))[0] / u.size
    assert np.abs(hist - 0.1).max() < 0.01
    assert episode_key(1, "g", 0, 0) != episode_key(1, "g", 0, 1) != episode_key(2, "g", 0, 1)
    assert np.array_equal(uniforms(keys, np.arange(64)), uniforms(keys, np.arange(64)))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_draws_follow_the_tempered_softmax_and_logprobs_are_exact(temperature):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, size=(1, 12)).astype(np.float32)
    n = 20000
    keys = np.array([episode_key(0, "x", i, 0) for i in range(n)], np.uint64)
    u = uniforms(keys, np.zeros(n, np.int64))
    tok, lp = HostSampler()(np.repeat(logits, n, axis=0), u, temperature)
    want = logsoftmax(logits[0].astype(np.float64) / temperature)
    np.testing.assert_allclose(lp, want[tok], atol=2e-6)
    freq = np.bincount(tok, minlength=12) / n
    assert np.abs(freq - np.exp(want)).max() < 0.01


def test_host_and_device_samplers_agree():
    rng = np.random.default_rng(1)
    for (b, v), t, k, p in [((16, 300), 1.0, 0, 1.0), ((8, 5000), 0.7, 0, 1.0), ((8, 300), 1.0, 20, 1.0),
                            ((8, 300), 1.3, 0, 0.9), ((8, 300), 1.0, 50, 0.8)]:
        logits = rng.normal(0, 3, size=(b, v)).astype(np.float32)
        u = rng.uniform(0.001, 0.999, size=b).astype(np.float32)
        t1, l1 = HostSampler()(logits, u, t, k, p)
        t2, l2 = device_sample(mx.array(logits), u, t, k, p)
        assert np.array_equal(t1, t2)
        np.testing.assert_allclose(l1, l2, atol=2e-5)


def test_top_k_and_top_p_record_the_truncated_distribution():
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05]], np.float32))
    n = 4000
    keys = np.array([episode_key(3, "k", i, 0) for i in range(n)], np.uint64)
    u = uniforms(keys, np.zeros(n, np.int64))
    many = np.repeat(logits, n, axis=0)
    tok, lp = HostSampler()(many, u, 1.0, top_k=2)
    assert set(tok) == {0, 1}
    np.testing.assert_allclose(lp, np.log(np.array([0.5, 0.2]) / 0.7)[tok], atol=1e-6)
    # top_p=0.8: the smallest head with mass >= 0.8 is {0.5, 0.2, 0.15} (0.85).
    tok, lp = HostSampler()(many, u, 1.0, top_p=0.8)
    assert set(tok) == {0, 1, 2}
    np.testing.assert_allclose(lp, np.log(np.array([0.5, 0.2, 0.15]) / 0.85)[tok], atol=1e-6)
    # top_k first, then top_p over the renormalized survivors: {0.5, 0.2} -> {0.714, 0.286}.
    tok, lp = HostSampler()(many, u, 1.0, top_k=2, top_p=0.75)
    assert set(tok) == {0, 1}
    tok, lp = HostSampler()(many, u, 1.0, top_k=2, top_p=0.7)
    assert set(tok) == {0} and np.allclose(lp, 0.0, atol=1e-6)
    tok, lp = HostSampler()(many, u, 1.0, top_k=3, top_p=0.5)
    assert set(tok) == {0} and np.allclose(lp, 0.0, atol=1e-6)


def test_zero_probability_tokens_are_never_drawn():
    logits = np.full((4, 50), -1e4, np.float32)
    logits[:, 17] = 0.0
    u = np.array([2.0**-24, 0.5, 1 - 2.0**-24, 0.999], np.float32)
    tok, lp = HostSampler()(logits, u, 1.0)
    assert (tok == 17).all() and np.all(lp == 0.0)
    tok, lp = device_sample(mx.array(logits), u, 1.0)
    assert (tok == 17).all() and np.all(lp == 0.0)
