"""The engine's sampling rule (seeded Gumbel-max): exact log-probs, the right distribution,
host == device, and the margins that re-derive a draw."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="the MLX engine needs mlx")

from stoa.backends.mlx.sampling import HostSampler, device_sample, episode_key, row_seeds  # noqa: E402
from stoa.backends.sampling import G_MAX, G_MIN, draw_margins, gumbel, noise_bits  # noqa: E402


def logsoftmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def test_noise_is_uniform_bits_and_gumbel_in_its_bounds():
    keys = np.array([episode_key(1, "g", i, 0) for i in range(64)], np.uint64)
    seeds = np.concatenate([row_seeds(keys, np.full(64, p)) for p in range(50)])
    u = (noise_bits(seeds, np.arange(1000, dtype=np.uint32)) >> 9).astype(np.float64) / 2**23
    hist = np.histogram(u, bins=16, range=(0, 1))[0] / u.size
    assert np.abs(hist - 1 / 16).max() < 0.002
    assert abs(np.corrcoef(u[:, :-1].ravel(), u[:, 1:].ravel())[0, 1]) < 0.01  # neighbouring token ids
    assert abs(np.corrcoef(u[:-1].ravel(), u[1:].ravel())[0, 1]) < 0.01  # neighbouring rows
    g = gumbel(seeds[:64], 1000)
    assert G_MIN <= g.min() and g.max() <= G_MAX and abs(g.mean() - np.euler_gamma) < 0.02
    np.testing.assert_allclose(gumbel(seeds[:64], 1000, np.float32), g, atol=2e-5)
    assert episode_key(1, "g", 0, 0) != episode_key(1, "g", 0, 1) != episode_key(2, "g", 0, 1)
    assert np.array_equal(row_seeds(keys, np.arange(64)), row_seeds(keys, np.arange(64)))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_draws_follow_the_tempered_softmax_and_logprobs_are_exact(temperature):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, size=(1, 12)).astype(np.float32)
    n = 20000
    keys = np.array([episode_key(0, "x", i, 0) for i in range(n)], np.uint64)
    u = row_seeds(keys, np.zeros(n, np.int64))
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
        u = rng.integers(0, 2**63, size=b).astype(np.uint64)
        t1, l1 = HostSampler()(logits, u, t, k, p)
        t2, l2 = device_sample(mx.array(logits), u, t, k, p)
        assert np.array_equal(t1, t2)
        np.testing.assert_allclose(l1, l2, atol=2e-5)


def test_top_k_and_top_p_record_the_truncated_distribution():
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05]], np.float32))
    n = 4000
    keys = np.array([episode_key(3, "k", i, 0) for i in range(n)], np.uint64)
    u = row_seeds(keys, np.zeros(n, np.int64))
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
    u = row_seeds(np.arange(4, dtype=np.uint64), np.zeros(4, np.int64))
    tok, lp = HostSampler()(logits, u, 1.0)
    assert (tok == 17).all() and np.all(lp == 0.0)
    tok, lp = device_sample(mx.array(logits), u, 1.0)
    assert (tok == 17).all() and np.all(lp == 0.0)


def test_margins_are_positive_for_the_drawn_token_and_move_at_most_twice_the_drift():
    rng = np.random.default_rng(2)
    n, v, t = 400, 3000, 0.8
    logits = rng.normal(0, 4, size=(n, v)).astype(np.float32)
    seeds = rng.integers(0, 2**63, size=n).astype(np.uint64)
    tok, _ = HostSampler()(logits, seeds, t)
    m, lp = draw_margins(logits, t, tok, seeds)
    assert (m > -1e-5).all()  # float32 sampler vs float64 re-derivation
    z = logits.astype(np.float64) / t
    np.testing.assert_allclose(lp, (z - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True))
                                    - z.max(1, keepdims=True))[np.arange(n), tok], atol=1e-9)
    d = 0.01
    for drift in (rng.uniform(-d, d, size=(n, v)), np.where(np.arange(v) < v // 2, d, -d) + 3.0):
        m2, _ = draw_margins(logits + drift, t, tok, seeds)
        assert (np.abs(m2 - m) <= 2 * d + 1e-5).all()
    # Another token of the same row is not drawn: its margin is negative, by the drawn one's at least.
    other = (tok + 1) % v
    mo, _ = draw_margins(logits, t, other, seeds)
    assert (mo <= -m + 1e-9).all()
    # The share of honest margins within b of 0 is about b / T at most.
    b = 0.05
    assert np.mean(np.abs(m) <= b) < 2 * b / t


def test_top_p_margins_take_the_nucleus_most_favourable_within_the_drift():
    # p = [0.5, 0.25, 0.15, 0.1]: top_p 0.7 keeps {0, 1} (the mass above token 2 is 0.75).
    p = np.array([0.5, 0.25, 0.15, 0.1])
    logits = np.log(p)[None, :].astype(np.float32)
    seeds = row_seeds(np.arange(2000, dtype=np.uint64), np.zeros(2000, np.int64))
    many = np.repeat(logits, 2000, axis=0)
    tok, _ = HostSampler()(many, seeds, 1.0, top_p=0.7)
    assert set(tok) == {0, 1}
    m0, _ = draw_margins(many, 1.0, tok, seeds, top_p=0.7, drift=1e-3)
    assert (m0 > -1e-5).all()
    # A drawer whose nucleus also held token 2 (top_p 0.8), claiming 0.7:
    wide, _ = HostSampler()(many, seeds, 1.0, top_p=0.8)
    assert (wide == 2).any() and not (wide == 3).any()
    far, _ = draw_margins(many, 1.0, wide, seeds, top_p=0.7, drift=1e-3)
    assert np.isneginf(far[wide == 2]).all()  # no drift of 1e-3 puts token 2 in a 0.7 nucleus
    near, _ = draw_margins(many, 1.0, wide, seeds, top_p=0.7, drift=0.2)
    assert not np.isneginf(near).any()  # one of 0.2 may: 0.75 e^-0.2 / (0.75 e^-0.2 + 0.25 e^0.2) < 0.7
    assert (near[wide <= 1] >= m0[wide <= 1] - 1e-9).all()  # a smaller nucleus: fewer competitors
    # A full-softmax draw claimed as a 0.7 nucleus draw: its tail tokens are outside every admissible one.
    full, _ = HostSampler()(many, seeds, 1.0)
    mf, _ = draw_margins(many, 1.0, full, seeds, top_p=0.7, drift=1e-3)
    assert np.isneginf(mf[full >= 2]).all() and (mf[full <= 1] > -1e-5).all()


def test_margins_skip_only_noise_that_cannot_matter():
    """draw_margins computes float noise only where an entry could pass the best competitor; the
    result equals the margin over every entry's noise, on peaked and flat rows, cold and hot."""
    rng = np.random.default_rng(3)
    n, v = 64, 5000
    seeds = rng.integers(0, 2**63, size=n).astype(np.uint64)
    for scale, t in ((1.0, 1.0), (8.0, 0.6), (30.0, 1.0), (3.0, 2.5)):
        logits = rng.normal(0, scale, size=(n, v))
        tok = rng.integers(0, v, size=n)
        tok[: n // 2] = np.argmax(logits[: n // 2] + t * gumbel(seeds[: n // 2], v), axis=1)  # half drawn
        s = logits + t * gumbel(seeds, v)
        want = s[np.arange(n), tok] - np.where(np.arange(v) == tok[:, None], -np.inf, s).max(axis=1)
        got, _ = draw_margins(logits, t, tok, seeds)
        np.testing.assert_array_equal(got, want)
        assert (got[: n // 2] > 0).all() and (got[n // 2:] <= 0).sum() >= n // 2 - 2
