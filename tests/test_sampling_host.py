"""The host sampler computes noise only where it can decide the draw; its draws and log-probs equal
the full computation's (every vocabulary entry noised) on flat, peaked and spiked logits, with
and without top-k / top-p, at the vocabulary sizes of the models people run."""

from __future__ import annotations

import numpy as np
import pytest

from stoa.backends.sampling import HostSampler, draw_margins, gumbel, truncate


def full_rule(logits, seeds, t, top_k=0, top_p=1.0):
    z = logits * np.float32(1 / t)
    if top_k or top_p < 1:
        truncate(z, top_k, top_p)
    z = z - z.max(axis=1, keepdims=True)
    total = np.exp(z).sum(axis=1)
    tok = (gumbel(seeds, logits.shape[1], np.float32) + z).argmax(axis=1)
    return tok, (z[np.arange(len(z)), tok] - np.log(total)).astype(np.float32)


@pytest.mark.parametrize("vocab", [1000, 49152, 151936])
def test_host_sampler_draws_what_the_full_rule_draws(vocab):
    rng = np.random.default_rng(vocab)
    host = HostSampler()
    for trial in range(12):
        spread = (0.3, 3.0, 10.0, 25.0)[trial % 4]  # flat (a random model) to sharply peaked
        logits = (rng.standard_normal((9, vocab)) * spread).astype(np.float32)
        logits[::3, rng.integers(0, vocab)] += 40.0  # one token far ahead: its own noise often < 0
        seeds = rng.integers(0, 2**63, 9, dtype=np.uint64)
        t = 0.7 if trial % 2 else 1.0
        top_k, top_p = ((0, 1.0), (50, 1.0), (0, 0.8))[trial % 3]
        tok, lp = host(logits, seeds, t, top_k, top_p)
        ref, ref_lp = full_rule(logits, seeds, t, top_k, top_p)
        assert np.array_equal(tok, ref), (trial, spread)
        np.testing.assert_allclose(lp, ref_lp, atol=1e-5)
        if not top_k and top_p == 1.0:
            assert (draw_margins(logits, np.full(9, t), tok, seeds)[0] > 0).all()


def test_threaded_draws_equal_one_threads():
    """Blocks of rows drawn on several threads give every row the token and log-prob it gets alone."""
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((37, 40_000)) * 2.5).astype(np.float32)
    logits[np.arange(37), rng.integers(0, 40_000, 37)] += 9.0
    seeds = rng.integers(0, 2**63, 37, dtype=np.uint64)
    one = HostSampler(threads=1)(logits, seeds, 0.9)
    for threads in (2, 3):
        many = HostSampler(threads=threads)(logits, seeds, 0.9)
        assert np.array_equal(one[0], many[0]) and np.array_equal(one[1], many[1])
    alone = HostSampler()(logits[5:6], seeds[5:6], 0.9)
    assert alone[0][0] == one[0][5] and alone[1][0] == one[1][5]
