"""The int8 kernel's integer path (`kernels/qmatmul.c`, ``stoa_qmatmul_int``: the engine's default
``int24`` mode on AVX-512 VNNI CPUs, and ``int16``) written again in numpy, operation for operation.
On every CPU the reference is checked against a float64 matmul on the exact weights within an error
bound derived from its arithmetic, so CI without VNNI still checks what the default path computes;
where the kernel runs, it must give the reference's bits."""

from __future__ import annotations

import numpy as np
import pytest

QMAX = {2: 32639, 3: 8355711}  # qmax(D) in qmatmul.c: |q| fits D balanced base-256 digits
U = 2.0 ** -24  # float32's unit roundoff
f32 = np.float32


def fma32(a, b, c) -> np.ndarray:
    """float32 ``a * b + c`` rounded once (the kernel's fused multiply-adds): the float64 sum is
    made round-to-odd (TwoSum's error picks the odd neighbour), so rounding it to float32 is exact."""
    a, b, c = (np.asarray(t, dtype=np.float64) for t in (a, b, c))
    p = a * b  # exact: 24 + 24 bits
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c
        bb = s - p
        e = (p - (s - bb)) + (c - bb)
        even = (s.view(np.int64) & 1) == 0
        s = np.where((e != 0) & even & np.isfinite(e), np.nextafter(s, np.copysign(np.inf, e)), s)
    return s.astype(f32)


def quantize_rows(x: np.ndarray, digits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``quantize_rows``: per group of 64, q = rint(x * (Q / m)) clamped to +-Q (float32 product,
    ties to even), sx = m / Q, cb = sx * float(sum q); a non-finite group gets sx = NaN.
    Returns q int64 ``[n, G, 64]``, sx and cb float32 ``[n, G]``."""
    Q = QMAX[digits]
    g = x.astype(f32).reshape(x.shape[0], -1, 64)
    m = np.abs(g).max(-1)
    bad, pos = ~(m <= np.finfo(f32).max), m > 0
    safe = np.where(pos & ~bad, m, f32(1))
    sx = np.where(bad, f32(np.nan), np.where(pos, safe / f32(Q), f32(0))).astype(f32)
    inv = np.where(pos & ~bad, f32(Q) / safe, f32(0)).astype(f32)
    with np.errstate(invalid="ignore"):
        t = np.rint(g * inv[..., None])
    q = np.clip(np.where(np.isfinite(t), t, -(2.0 ** 31)), -Q, Q).astype(np.int64)  # cvtps_epi32: NaN -> INT_MIN
    cb = (sx * q.sum(-1).astype(f32)).astype(f32)
    return q, sx, cb


def group_dots(codes: np.ndarray, q: np.ndarray, digits: int) -> np.ndarray:
    """``group_dot``: the exact integer sums of code * q per (row, output, group), as float32 ``[n, out, G]``.
    16-bit: one int32 sum converted; 24-bit: the top digit's sum (exact in float32) times 65536 plus
    the lower two digits' sum (rounded), in one fused multiply-add."""
    c = codes.astype(np.int64).reshape(codes.shape[0], -1, 64)
    if digits == 2:
        return np.einsum("ngk,ogk->nog", q, c).astype(f32)
    low = ((q + 128) & 255) - 128  # the balanced base-256 digits, least significant first
    mid = (((q - low) >> 8) + 128 & 255) - 128
    top = (q - low - 256 * mid) >> 16
    a0 = np.einsum("ngk,ogk->nog", top, c)
    rest = np.einsum("ngk,ogk->nog", 256 * mid + low, c)
    return fma32(a0.astype(f32), f32(65536), rest.astype(f32))


def integer_matmul(x: np.ndarray, parts, digits: int, bias: np.ndarray | None = None) -> np.ndarray:
    """What ``QLinear(parts, digits)(x, bias)`` computes, bit for bit: per group in order,
    acc = fma(dot, scale * sx, acc), then acc = fma(bias_g, cb, acc); the layer bias added last."""
    q, sx, cb = quantize_rows(x, digits)
    outs = []
    for codes, scales, biases in parts:
        s, b = np.asarray(scales, dtype=f32), np.asarray(biases, dtype=f32)
        dot = group_dots(codes, q, digits)
        acc = np.zeros(dot.shape[:2], dtype=f32)
        for g in range(dot.shape[2]):
            acc = fma32(dot[:, :, g], (s[None, :, g] * sx[:, None, g]).astype(f32), acc)
            acc = fma32(b[None, :, g], cb[:, None, g], acc)
        outs.append(acc)
    y = np.concatenate(outs, axis=1)
    return y if bias is None else (y + np.asarray(bias, dtype=f32)).astype(f32)


def matrix(rng, out, k, scale_dtype=np.float32):
    codes = rng.integers(0, 256, (out, k), dtype=np.uint8)
    scales = (rng.standard_normal((out, k // 64)) * 0.01).astype(scale_dtype)
    biases = (rng.standard_normal((out, k // 64)) * 0.5).astype(scale_dtype)
    return codes, scales, biases


def inputs(rng, n, k) -> np.ndarray:
    """Rows with groups of very different sizes, an outlier channel (its group's other inputs are
    rounded coarsely) and a group of zeros."""
    x = rng.standard_normal((n, k)) * 10.0 ** rng.uniform(-3, 3, (n, k // 64, 1)).repeat(64, -1).reshape(n, k)
    x[:, 7] *= 40
    x[:, 64:128] = 0.0
    return x.astype(f32)


def exact(codes, scales, biases) -> np.ndarray:
    """The weights code * scale + bias in float64 (what the integer path applies; the weights of
    record are these rounded to float32)."""
    s = np.asarray(scales, np.float64).repeat(64, 1)
    return codes.astype(np.float64) * s + np.asarray(biases, np.float64).repeat(64, 1)


@pytest.mark.parametrize("digits", [2, 3])
@pytest.mark.parametrize("n", [1, 5])
def test_the_reference_is_a_matmul_within_its_error_bound(n, digits):
    rng = np.random.default_rng(20 + n + digits)
    k = 256
    mats = [matrix(rng, 40, k), matrix(rng, 9, k, np.float16)]
    x = inputs(rng, n, k)
    bias = rng.standard_normal(49).astype(f32)
    got = integer_matmul(x, mats, digits, bias).astype(np.float64)
    w = np.concatenate([exact(*m) for m in mats])
    q, sx, cb = quantize_rows(x, digits)
    G, Q = k // 64, QMAX[digits]
    # the rounded inputs: q * sx is x up to float32's rounding of Q/m, x*inv and m/Q (3u |x|) and
    # one step of the grid (rint's half step, or a step where the clamp cuts Q + 1 back to Q)
    xr = (q * sx[..., None].astype(np.float64)).reshape(n, k)
    step = np.repeat(sx.astype(np.float64), 64, 1)
    assert (np.abs(q) <= Q).all() and (np.abs(xr - x) <= 3.01 * U * np.abs(x) + step).all()
    if digits == 2:
        assert (np.abs(xr - x) > 100 * U * np.abs(x)).any()  # 16-bit rounding shows above float32's
    # the arithmetic on them: each term (dot * (scale * sx): <= 3 roundings, bias * cb: 2) and the
    # 2G fused accumulations round at most 2G + 3 times, the layer bias once more (one spare for 2nd order)
    c = np.concatenate([m[0] for m in mats]).astype(np.int64).reshape(-1, G, 64)
    s = np.concatenate([np.asarray(m[1], np.float64) for m in mats])
    b = np.concatenate([np.asarray(m[2], np.float64) for m in mats])
    mag = (np.einsum("ngk,ogk->nog", np.abs(q), c) * np.abs(s)[None] * sx[:, None].astype(np.float64)
           + np.abs(b)[None] * np.abs(cb[:, None].astype(np.float64))).sum(-1)
    kk = 2 * G + 5
    arith = kk * U / (1 - kk * U) * (mag + np.abs(bias))
    want_r = xr @ w.T + bias
    assert (np.abs(got - want_r) <= arith + 1e-12 * np.abs(want_r).max()).all()
    # and against the unrounded inputs, the inputs' rounding carried through |w|
    want = x.astype(np.float64) @ w.T + bias
    carry = (3.01 * U * np.abs(x) + step) @ np.abs(w).T
    assert (np.abs(got - want) <= arith + carry + 1e-12 * np.abs(want).max()).all()
    size = np.abs(x) @ np.abs(w).T + np.abs(bias)  # a bound worth having: far below a real mistake's size
    assert ((arith + carry) / size).max() < (3e-3 if digits == 2 else 3e-5)


def test_fma32_rounds_once():
    a, c = f32(1 + 2 ** -12), f32(2 ** -80)  # a*a = 1 + 2^-11 + 2^-24, half a float32 step: c breaks the tie
    assert fma32(a, a, c) == f32(1 + 2 ** -11 + 2 ** -23)
    assert f32(np.float64(a) * a + c) == f32(1 + 2 ** -11)  # float64 drops c, then ties go to even
    assert fma32(f32(3), f32(5), f32(-1)) == f32(14)


# -- the kernel, where it runs ----------------------------------------------------------------------

def _kernel():
    torch = pytest.importorskip("torch", reason="the kernel is the torch engine's")
    from stoa.backends.torch import qlinear

    ok, why = qlinear.integer_available()
    if not ok:
        pytest.skip(f"the kernel's integer path needs AVX-512 VNNI: {why}")
    return torch, qlinear


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("digits", [2, 3])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 64])
def test_the_avx512_vnni_kernel_computes_the_references_bits(n, digits, threads):
    torch, qlinear = _kernel()
    rng = np.random.default_rng(100 * n + digits)
    mats = [matrix(rng, 70, 192), matrix(rng, 33, 192, np.float16), matrix(rng, 5, 192)]  # odd sizes: part blocks
    x = inputs(rng, n, 192)
    bias = rng.standard_normal(108).astype(f32)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = qlinear.QLinear(mats, digits=digits)(torch.from_numpy(x), torch.from_numpy(bias)).numpy()
    finally:
        torch.set_num_threads(prev)
    np.testing.assert_array_equal(got, integer_matmul(x, mats, digits, bias))


@pytest.mark.parametrize("digits", [2, 3])
def test_the_avx512_vnni_kernel_computes_the_references_bits_across_panels(digits):
    torch, qlinear = _kernel()
    rng = np.random.default_rng(7 + digits)
    mats = [matrix(rng, 500, 576), matrix(rng, 37, 576)]  # 448 outputs a panel at this width
    x = inputs(rng, 6, 576)
    got = qlinear.QLinear(mats, digits=digits)(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(got, integer_matmul(x, mats, digits))
