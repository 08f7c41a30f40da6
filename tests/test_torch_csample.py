"""The torch engine's C host sampler (`kernels/sample.c`, stoa.backends.torch.csample): it draws the
token HostSampler draws and the full computation (every entry noised) draws, on peaked, flat, spiked
and truncated-by-hand (-inf) logits, with ties, at any batch size and vocabulary; its log-probs are
HostSampler's to float32 rounding; a row's result does not depend on its batch or the threads; it
refuses what it does not take, and the engine's CPU host path uses it."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the kernel is the torch engine's")

from stoa.backends.engine import SamplingConfig  # noqa: E402
from stoa.backends.sampling import _NEED, HostSampler, _noise_of, noise_bits  # noqa: E402
from stoa.backends.torch import csample as C  # noqa: E402
from stoa.backends.torch import qlinear  # noqa: E402

lib = qlinear.library()
pytestmark = pytest.mark.skipif(lib is None, reason=f"kernel library unavailable: {qlinear.available()[1]}")


def rounded_noise(code: np.ndarray) -> np.ndarray:
    """The float32 Gumbel chain of stoa.backends.sampling.gumbel with each log correctly rounded."""
    t = (np.float32(2**23 - 0.5) - code.astype(np.float32)) * np.float32(-(2.0**-23))  # exact
    l1 = np.log1p(t.astype(np.float64)).astype(np.float32)
    return (-np.log(-l1.astype(np.float64))).astype(np.float32)


def full_rule(logits: np.ndarray, seeds: np.ndarray, t: float) -> np.ndarray:
    """Every entry noised with the C sampler's noise: argmax of z + g, the first on a tie."""
    z = logits * np.float32(1 / t)
    z = z - z[np.arange(len(z)), z.argmax(axis=1)][:, None]
    code = noise_bits(seeds, np.arange(logits.shape[1], dtype=np.uint32)) >> np.uint32(9)
    return (z + C.noise(code)).argmax(axis=1)


def check(logits, seeds, t, threads=2):
    """The C sampler's draws equal HostSampler's and the full computation's; log-probs within 2e-6."""
    tok, lp = C.sample(logits, seeds, t, threads=threads)
    ref_tok, ref_lp = HostSampler()(logits, seeds, t)
    assert tok.dtype == np.int64 and lp.dtype == np.float32
    assert np.array_equal(tok, full_rule(logits, seeds, t))
    assert np.array_equal(tok, ref_tok), np.flatnonzero(tok != ref_tok)
    np.testing.assert_allclose(lp, ref_lp, rtol=0, atol=2e-6)
    return tok, lp


def seeds_of(rng, n):
    return rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)


def test_noise_is_the_correctly_rounded_chain_within_an_ulp_or_two_of_numpys_float32():
    code = np.concatenate([np.arange(0, 2**23, 7, dtype=np.uint32), np.arange(2**23 - 64, 2**23, dtype=np.uint32)])
    mine = C.noise(code)
    assert np.array_equal(mine, rounded_noise(code))
    numpys = _noise_of(code)  # numpy's float32 log and log1p: not always correctly rounded
    assert np.abs(mine.astype(np.float64) - numpys).max() <= 2 * np.spacing(np.float32(16))
    assert mine.max() == np.float32(16.635532) and mine.argmax() == len(code) - 1
    with pytest.raises(ValueError):
        C.noise(np.array([2**23], np.uint32))


def test_code_thresholds_are_the_host_samplers():
    assert np.array_equal(C.table(), _NEED)


@pytest.mark.parametrize("vocab", [1000, 4099, 49152])
@pytest.mark.parametrize("spread", [0.01, 0.3, 2.0, 5.0, 25.0])  # flat (a random model) to sharply peaked
def test_draws_equal_the_host_samplers(vocab, spread):
    rng = np.random.default_rng(vocab + int(spread * 100))
    for t in (0.05, 0.7, 1.0, 2.5):
        logits = (rng.standard_normal((12, vocab)) * spread).astype(np.float32)
        logits[::4, rng.integers(0, vocab)] += 40.0  # one token far ahead: its own noise often < 0
        check(logits, seeds_of(rng, 12), t)


@pytest.mark.parametrize("spread", [0.01, 3.0])
def test_a_qwen_sized_vocabulary(spread):
    rng = np.random.default_rng(151936)
    logits = (rng.standard_normal((6, 151936)) * spread).astype(np.float32)
    for t in (0.6, 1.0):
        check(logits, seeds_of(rng, 6), t)


def test_minus_infinity_entries_and_ties():
    rng = np.random.default_rng(3)
    v = 20011  # three segments, a ragged tail
    logits = (rng.standard_normal((10, v)) * 2).astype(np.float32)
    logits[0, rng.random(v) < 0.99] = -np.inf  # a hand-truncated row
    logits[1, :] = -np.inf
    logits[1, v - 1] = 0.5  # one token left, at the very end: drawn, log-prob 0
    logits[2, :] = 1.25  # every token tied: the largest noise code wins
    logits[3, ::3] = logits[3].max()  # the maximum tied at every third token: `best` is the first
    logits[4, :v // 2] = -np.inf
    logits[5] = np.round(logits[5])  # many ties in z
    logits[6, :] = -1e37  # huge finite logits: exp underflows
    logits[6, 17] = 1e37
    logits[7, -16:] = 30.0  # the leaders in the tail
    seeds = seeds_of(rng, 10)
    tok, lp = check(logits, seeds, 1.0)
    assert tok[1] == v - 1 and lp[1] == 0.0
    assert np.isfinite(logits[0, tok[0]]) and tok[4] >= v // 2 and tok[6] == 17
    check(logits, seeds, 0.3, threads=1)


def test_a_tie_of_noised_scores_goes_to_the_lowest_token():
    """Equal logits and a repeated largest noise code: the two scores are equal, the first token wins."""
    rng = np.random.default_rng(11)
    v = 49152
    found = []
    while len(found) < 3:
        seeds = seeds_of(rng, 256)
        code = noise_bits(seeds, np.arange(v, dtype=np.uint32)) >> np.uint32(9)
        top = code.max(axis=1)
        for r in np.flatnonzero((code == top[:, None]).sum(axis=1) > 1)[: 3 - len(found)]:
            found.append((seeds[r], np.flatnonzero(code[r] == top[r])))
    seeds = np.array([s for s, _ in found], np.uint64)
    tok, _ = check(np.zeros((3, v), np.float32), seeds, 1.0)
    assert [int(t) for t in tok] == [int(at[0]) for _, at in found]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 33, 64, 70])
def test_any_batch_size_and_a_row_alone_draws_what_it_draws_in_its_batch(n):
    rng = np.random.default_rng(n)
    v = 20011
    logits = (rng.standard_normal((n, v)) * rng.choice([0.05, 1.0, 6.0], (n, 1))).astype(np.float32)
    seeds = seeds_of(rng, n)
    tok, lp = check(logits, seeds, 0.9)
    for r in {0, n // 2, n - 1}:
        alone = C.sample(logits[r:r + 1], seeds[r:r + 1], 0.9, threads=2)
        assert alone[0][0] == tok[r] and alone[1][0].tobytes() == lp[r].tobytes()


def test_results_do_not_depend_on_the_threads():
    """One thread, rows spread over threads, and segments spread over threads: the same bits."""
    rng = np.random.default_rng(8)
    for n in (1, 3, 9):
        logits = (rng.standard_normal((n, 40000)) * 1.5).astype(np.float32)
        seeds = seeds_of(rng, n)
        one = C.sample(logits, seeds, 1.1, threads=1)
        for threads in (2, 3, 8):
            many = C.sample(logits, seeds, 1.1, threads=threads)
            assert np.array_equal(one[0], many[0]) and one[1].tobytes() == many[1].tobytes()


def test_torch_tensors_and_strided_rows():
    rng = np.random.default_rng(4)
    wide = torch.from_numpy((rng.standard_normal((5, 3000)) * 3).astype(np.float32))
    seeds = seeds_of(rng, 5)
    ref = C.sample(np.ascontiguousarray(wide[:, :2500].numpy()), seeds, 1.0)
    for x in (wide[:, :2500], wide[:, :2500].numpy(), torch.from_numpy(wide.numpy().T.copy()).T[:, :2500]):
        got = C.sample(x, seeds, 1.0)
        assert np.array_equal(got[0], ref[0]) and np.array_equal(got[1], ref[1])
    got = C.sample(wide.numpy()[:, :5000:2], seeds, 1.0)  # a column stride: copied
    assert np.array_equal(got[0], C.sample(np.ascontiguousarray(wide.numpy()[:, ::2]), seeds, 1.0)[0])
    empty = C.sample(np.zeros((0, 10), np.float32), np.zeros(0, np.uint64), 1.0)
    assert empty[0].shape == (0,) and empty[1].shape == (0,)


def test_rows_it_leaves_to_the_numpy_sampler_and_bad_arguments():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 100)).astype(np.float32)
    seeds = seeds_of(rng, 3)
    for bad in (np.nan, np.inf):
        y = x.copy()
        y[1, 50] = bad
        assert C.sample(y, seeds, 1.0) is None
    y = x.copy()
    y[2] = -np.inf
    assert C.sample(y, seeds, 1.0) is None
    assert C.sample(x * np.float32(1e38), seeds, 1e-3) is None  # scaled logits overflow
    with pytest.raises(ValueError):
        C.sample(x, seeds, 1.0, top_k=5)
    with pytest.raises(ValueError):
        C.sample(x, seeds, 1.0, top_p=0.9)
    with pytest.raises(ValueError):
        C.sample(x.astype(np.float64), seeds, 1.0)
    with pytest.raises(ValueError):
        C.sample(torch.from_numpy(x).bfloat16(), seeds, 1.0)
    with pytest.raises(ValueError):
        C.sample(x[0], seeds[:1], 1.0)
    with pytest.raises(ValueError):
        C.sample(x, seeds[:2], 1.0)
    with pytest.raises(ValueError):
        C.sample(x, seeds.astype(np.int64), 1.0)
    for t in (0.0, -1.0, np.inf, np.nan):
        with pytest.raises(ValueError):
            C.sample(x, seeds, t)
    # the C function itself
    lo, hi = np.zeros(3, np.uint32), np.zeros(3, np.uint32)
    tok, lp = np.zeros(3, np.int64), np.zeros(3, np.float32)
    p = lambda a: a.ctypes.data  # noqa: E731
    call = lambda n, v, ld, it, xp=p(x): lib.stoa_sample(xp, n, v, ld, p(lo), p(hi), it, p(tok), p(lp), 2)  # noqa: E731
    assert call(3, 100, 100, 1.0) == 0
    for args in ((-1, 100, 100, 1.0), (3, 0, 100, 1.0), (3, 100, 99, 1.0), (3, 100, 100, 0.0), (3, 100, 100, -1.0),
                 (3, 100, 100, float("inf")), (3, 100, 100, float("nan")), (3, 2**31 + 1, 2**31 + 1, 1.0)):
        assert call(*args) == -1, args
    assert call(3, 100, 100, 1.0, None) == -1
    assert lib.stoa_sample(None, 0, 100, 100, None, None, 1.0, None, None, 1) == 0  # nothing to do


def test_the_engines_cpu_host_path_uses_it(monkeypatch):
    from stoa.backends.torch import engine

    rng = np.random.default_rng(9)
    logits = torch.from_numpy((rng.standard_normal((4, 5000)) * 2).astype(np.float32))
    seeds = seeds_of(rng, 4)
    host = HostSampler()
    calls = []
    real = C.sample
    monkeypatch.setattr(C, "sample", lambda *a, **k: calls.append(1) or real(*a, **k))
    for where in ("auto", "host"):
        tok, lp = engine.draw(logits, seeds, SamplingConfig(temperature=0.8), where, host)
        ref = host(logits.numpy(), seeds, 0.8)
        assert np.array_equal(tok, ref[0]) and np.abs(lp - ref[1]).max() <= 2e-6
    assert len(calls) == 2
    tok, _ = engine.draw(logits, seeds, SamplingConfig(temperature=0.8, top_k=20), "auto", host)  # HostSampler
    assert len(calls) == 2 and np.array_equal(tok, host(logits.numpy(), seeds, 0.8, 20)[0])
    bad = logits.clone()
    bad[0, 3] = float("nan")  # the C sampler declines: HostSampler has the last word, as before
    calls.clear()
    with np.errstate(all="ignore"):
        try:
            want = host(bad.numpy(), seeds, 0.8)
        except Exception as e:  # noqa: BLE001
            want = type(e)
        try:
            got = engine.draw(bad, seeds, SamplingConfig(temperature=0.8), "auto", host)
        except Exception as e:  # noqa: BLE001
            got = type(e)
    assert calls == [1]
    if isinstance(want, type):
        assert got is want
    else:
        assert np.array_equal(got[0], want[0])
