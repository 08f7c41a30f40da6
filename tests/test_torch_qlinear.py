"""The torch engine's int8 CPU kernel (`stoa.backends.torch.qlinear`): it computes a float32 matmul
on exactly the weights of record, reads the state's codes in place, and gives a row the same bits
whatever its batch neighbours and thread count; the narrower (AVX2-width) build agrees too. Its
integer path (this CPU's build: skipped without one) is exact arithmetic on inputs rounded as
documented, bit for bit the numpy reference of `test_torch_int_reference` (which runs on every CPU),
and batch-invariant too. The AVX2 build's integer path (16-bit products, no VNNI), built here for
`haswell`, gives the same bits: the reference's, and the VNNI build's where this CPU has one."""

from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the kernel is the torch engine's")

from stoa.backends.torch import qlinear  # noqa: E402
from stoa.backends.torch.int8 import dequantize_torch  # noqa: E402
from test_torch_int_reference import inputs, integer_matmul  # noqa: E402  the integer path in numpy, op for op

ok, why = qlinear.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"int8 kernel unavailable: {why}")
int_ok, int_why = qlinear.integer_available()
INTEGER = pytest.mark.skipif(not int_ok, reason=f"the kernel's integer path is unavailable: {int_why}")


def matrix(rng, out, k, scale_dtype=np.float32):
    codes = rng.integers(0, 256, (out, k), dtype=np.uint8)
    scales = (rng.standard_normal((out, k // 64)) * 0.01).astype(scale_dtype)
    biases = (rng.standard_normal((out, k // 64)) * 0.5).astype(scale_dtype)
    return codes, scales, biases


def record(codes, scales, biases) -> torch.Tensor:
    """The weights of record, float32 (what the trainer's re-score computes with)."""
    to = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float32))  # noqa: E731
    return dequantize_torch(torch.from_numpy(codes), to(scales), to(biases))


@pytest.mark.parametrize("n", [1, 3, 4, 5, 17, 64])
def test_it_is_a_float32_matmul_on_the_weights_of_record(n):
    rng = np.random.default_rng(n)
    mats = [matrix(rng, 70, 192), matrix(rng, 33, 192), matrix(rng, 5, 192)]  # q|k|v-like, odd sizes
    q = qlinear.QLinear(mats)
    x = torch.from_numpy(rng.standard_normal((n, 192)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal(108).astype(np.float32))
    want = torch.nn.functional.linear(x.double(), torch.cat([record(*m) for m in mats]).double(), bias.double())
    got = q(x, bias)
    assert got.shape == (n, 108) and got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() < 1e-5 * want.abs().max().item()


def test_each_weight_is_the_weight_of_record_bit_for_bit():
    rng = np.random.default_rng(0)
    m = matrix(rng, 40, 128)
    eye = torch.eye(128, dtype=torch.float32)  # row k picks column k of W: one product, no sum order
    assert torch.equal(qlinear.QLinear([m])(eye).T, record(*m))


@pytest.mark.parametrize("digits", [0, pytest.param(2, marks=INTEGER), pytest.param(3, marks=INTEGER)])
def test_a_rows_result_does_not_depend_on_neighbours_or_threads(digits):
    """The float32 path (digits 0) and the integer path on 16- and 24-bit inputs alike."""
    rng = np.random.default_rng(1)
    q = qlinear.QLinear([matrix(rng, 300, 576), matrix(rng, 40, 576)], digits=digits)
    x = torch.from_numpy(rng.standard_normal((37, 576)).astype(np.float32))
    whole = q(x)
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for a, b in ((0, 1), (5, 8), (3, 37), (36, 37)):
                assert torch.equal(q(x[a:b]), whole[a:b])
    finally:
        torch.set_num_threads(old)


def test_codes_are_read_in_place_and_float16_scales_refresh():
    rng = np.random.default_rng(2)
    codes, scales, biases = matrix(rng, 16, 64, np.float16)
    q = qlinear.QLinear([(codes, scales, biases)])
    x = torch.from_numpy(rng.standard_normal((2, 64)).astype(np.float32))
    codes[3, :] = 255 - codes[3, :]  # what a PULSE delta written into the state does
    torch.testing.assert_close(q(x), x @ record(codes, scales, biases).T, rtol=1e-5, atol=1e-5)
    scales *= 2
    q.refresh()
    torch.testing.assert_close(q(x), x @ record(codes, scales, biases).T, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused():
    rng = np.random.default_rng(3)
    with pytest.raises(ValueError, match="input width"):
        qlinear.QLinear([matrix(rng, 4, 64), matrix(rng, 4, 128)])
    c, s, b = matrix(rng, 4, 64)
    with pytest.raises(ValueError, match="C-contiguous uint8"):
        qlinear.QLinear([(np.asfortranarray(np.tile(c, (1, 2))), np.tile(s, (1, 2)), np.tile(b, (1, 2)))])
    with pytest.raises(ValueError, match="do not fit"):
        qlinear.QLinear([(c, s[:, :0], b)])
    with pytest.raises(ValueError, match="digits"):
        qlinear.QLinear([(c, s, b)], digits=4)


def test_a_named_cpu_replaces_the_native_one_in_the_build(monkeypatch, tmp_path):
    """``$STOA_KERNEL_MARCH`` builds for another CPU (one try, no fallback) into its own file."""
    monkeypatch.setenv("STOA_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("STOA_KERNEL_MARCH", raising=False)
    native = qlinear.kernel_path()
    assert qlinear._attempts("x86_64")[0][-1] == "-march=native" and len(qlinear._attempts("x86_64")) == 3
    monkeypatch.setenv("STOA_KERNEL_MARCH", "haswell")
    assert qlinear._attempts("x86_64") == [[*qlinear._FLAGS, "-march=haswell"]]
    assert qlinear._attempts("aarch64") == [[*qlinear._FLAGS, "-mcpu=haswell"]]
    if native is not None:
        assert qlinear.kernel_path() != native  # a build for another CPU never stands in for this one's
    monkeypatch.setenv("STOA_KERNEL_MARCH", "x; rm -rf /")
    with pytest.raises(OSError, match="not a CPU name"):
        qlinear._attempts("x86_64")


@pytest.fixture(scope="module")
def avx2(tmp_path_factory):
    """The library built as the builder builds it for ``STOA_KERNEL_MARCH=haswell`` (AVX2 and FMA, no
    AVX-512): what a CPU without AVX-512 runs."""
    if qlinear._compiler() is None:
        pytest.skip("needs a C compiler to build the AVX2 variant")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STOA_KERNEL_MARCH", "haswell")
        mp.setenv("STOA_KERNEL_CACHE", str(tmp_path_factory.mktemp("avx2")))
        so = qlinear.kernel_path()
        try:
            qlinear._build(so, qlinear._compiler())
        except (OSError, subprocess.SubprocessError) as e:
            pytest.skip(f"this compiler cannot build for haswell: {str(e)[-200:]}")
    lib = ctypes.CDLL(str(so))
    P = ctypes.c_void_p
    lib.stoa_qmatmul.argtypes = [P, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, P, P, P, P, P, ctypes.c_int64,
                                 ctypes.c_int]
    lib.stoa_qmatmul_int.argtypes = [*lib.stoa_qmatmul.argtypes, ctypes.c_int]
    return lib


def call(lib, x: np.ndarray, mats, digits: int = 0, threads: int = 2) -> np.ndarray:
    """What ``QLinear(mats, digits)(x)`` computes, through another build of the library."""
    P, m, n = ctypes.c_void_p, len(mats), x.shape[0]
    scales = [np.ascontiguousarray(s, np.float32) for _, s, _ in mats]
    biases = [np.ascontiguousarray(b, np.float32) for _, _, b in mats]
    y = np.full((n, sum(c.shape[0] for c, _, _ in mats)), 7.0, np.float32)
    args = (x.ctypes.data, n, x.shape[1], m, (P * m)(*[c.ctypes.data for c, _, _ in mats]),
            (P * m)(*[a.ctypes.data for a in scales]), (P * m)(*[a.ctypes.data for a in biases]),
            (ctypes.c_int64 * m)(*[c.shape[0] for c, _, _ in mats]), y.ctypes.data, y.shape[1], threads)
    assert (lib.stoa_qmatmul_int(*args, digits) if digits else lib.stoa_qmatmul(*args)) == 0
    return y


def test_the_eight_lane_build_computes_the_same(avx2):
    """Machines without AVX-512 get 8-lane vectors and 2x4 tiles: check that variant (and its decode attention)."""
    lib = avx2
    assert lib.stoa_qmatmul_width() == 8
    rng = np.random.default_rng(4)
    codes, scales, biases = matrix(rng, 23, 256)
    for n in (1, 3, 7, 9, 20):  # rows dequantized in registers (n < 9) and through the panel buffer
        x = rng.standard_normal((n, 256)).astype(np.float32)
        y = call(lib, x, [(codes, scales, biases)])
        want = x.astype(np.float64) @ record(codes, scales, biases).double().numpy().T
        assert np.abs(y - want).max() < 1e-5 * np.abs(want).max()
    assert lib.stoa_qmatmul_has_int() == 2  # its integer path: AVX2's (16-bit products, no VNNI)
    P = ctypes.c_void_p
    # its decode attention: one query against 5 positions, in float64 for reference
    kc, vc = rng.standard_normal((2, 3, 5, 64, 2)).astype(np.float32).transpose(4, 0, 1, 2, 3)
    kc, vc = np.ascontiguousarray(kc), np.ascontiguousarray(vc)
    q = rng.standard_normal((1, 6, 64)).astype(np.float32)
    out = np.zeros_like(q)
    rows, pos = np.array([1], np.int64), np.array([4], np.int64)
    lib.stoa_attn_decode.argtypes = [P] * 5 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                               ctypes.c_float, ctypes.c_int64, P, ctypes.c_int]
    assert lib.stoa_attn_decode(q.ctypes.data, kc.ctypes.data, vc.ctypes.data, rows.ctypes.data, pos.ctypes.data, 1, 3, 2,
                                64, 5, 0.125, 0, out.ctypes.data, 2) == 0
    s = np.einsum("hjd,htd->hjt", q[0].reshape(3, 2, 64).astype(np.float64), kc[1]) * 0.125
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hjt,htd->hjd", p / p.sum(-1, keepdims=True), vc[1]).reshape(6, 64)
    assert np.abs(out[0] - want).max() < 1e-5 * np.abs(want).max()


# -- the integer path --------------------------------------------------------------------------------

QMAX = {2: 32639, 3: 8355711}  # the largest |q| of 16- and 24-bit inputs


def rounded_inputs(x: np.ndarray, digits: int) -> np.ndarray:
    """The inputs the integer path multiplies, as documented: per group of 64, q = round(x * (Q / m))
    (m = the group's largest |x|, float32 arithmetic, ties to even), times m / Q."""
    g = x.reshape(x.shape[0], -1, 64).astype(np.float32)
    m = np.abs(g).max(-1, keepdims=True)
    safe = np.where(m > 0, m, np.float32(1))
    inv = np.where(m > 0, np.float32(QMAX[digits]) / safe, np.float32(0)).astype(np.float32)
    q = np.rint((g * inv).astype(np.float32))
    sx = (m / np.float32(QMAX[digits])).astype(np.float32)
    return (q.astype(np.float64) * sx).reshape(x.shape)


@INTEGER
@pytest.mark.parametrize("digits,bound", [(2, 3e-4), (3, 3e-6)])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 64])
def test_the_integer_path_is_exact_arithmetic_on_its_rounded_inputs(n, digits, bound):
    rng = np.random.default_rng(10 + n)
    mats = [matrix(rng, 70, 192), matrix(rng, 33, 192), matrix(rng, 5, 192)]
    q = qlinear.QLinear(mats, digits=digits)
    x = rng.standard_normal((n, 192)).astype(np.float32)
    x[:, 7] *= 40  # an outlier channel: its group's other inputs are rounded more coarsely
    bias = rng.standard_normal(108).astype(np.float32)
    w = torch.cat([record(*m) for m in mats]).double().numpy()
    y = q(torch.from_numpy(x), torch.from_numpy(bias)).numpy()
    # the integer math's own bits: at 24 bits the inputs' rounding (~1e-7) hides under any float32 tolerance
    np.testing.assert_array_equal(y, integer_matmul(x, mats, digits, bias))
    got = y.astype(np.float64)
    want = rounded_inputs(x, digits) @ w.T + bias
    assert np.abs(got - want).max() < 2e-6 * np.abs(want).max()  # only the float32 epilogue rounds
    exact = x.astype(np.float64) @ w.T + bias
    err = np.abs(got - exact).max() / np.abs(exact).max()
    assert err < bound  # the inputs' rounding stays within its documented size
    if digits == 2:
        assert err > 1e-6  # and shows at 16 bits


@INTEGER
@pytest.mark.parametrize("digits", [2, 3])
def test_the_integer_path_reads_codes_in_place_and_handles_zero_and_non_finite_inputs(digits):
    rng = np.random.default_rng(12)
    codes, scales, biases = matrix(rng, 16, 128)
    q = qlinear.QLinear([(codes, scales, biases)], digits=digits)
    x = rng.standard_normal((5, 128)).astype(np.float32)
    x[1, :64] = 0.0   # a group of zeros contributes nothing
    x[2, 70] = np.inf  # a non-finite input makes its row's outputs NaN, never a finite lie
    x[3, 3] = x[4, 63] = np.nan  # a NaN too, wherever it sits in its group (the max instruction drops it)
    codes[3, :] = 255 - codes[3, :]
    y = q(torch.from_numpy(x)).double().numpy()
    w = record(codes, scales, biases).double().numpy()
    for r in (0, 1):
        want = rounded_inputs(x[r:r + 1], digits) @ w.T
        assert np.abs(y[r] - want).max() < 2e-6 * np.abs(want).max()
    np.testing.assert_array_equal(y[:2], integer_matmul(x[:2], [(codes, scales, biases)], digits))
    assert np.isnan(y[2:]).all()


# -- the integer path of the AVX2 build (16-bit products, no VNNI): built and run on any x86 CPU with AVX2

VNNI = pytest.mark.skipif(not (int_ok and qlinear.library().stoa_qmatmul_has_int() == 1),
                          reason="needs this CPU's own build to have AVX-512 VNNI")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("digits", [2, 3])
@pytest.mark.parametrize("n", [1, 2, 4, 5, 8, 9, 17, 64])  # codes read in place (n < 9) and packed tiles
def test_the_avx2_integer_path_gives_the_references_bits(avx2, n, digits, threads):
    """Exact integer sums and the VNNI path's float32 epilogue: the numpy reference's bits, which are
    the VNNI build's (tests/test_torch_int_reference.py)."""
    rng = np.random.default_rng(200 + 10 * n + digits)
    mats = [matrix(rng, 70, 192), matrix(rng, 33, 192, np.float16), matrix(rng, 5, 192)]  # part blocks of 8
    x = inputs(rng, n, 192)
    np.testing.assert_array_equal(call(avx2, x, mats, digits, threads), integer_matmul(x, mats, digits))


@VNNI
@pytest.mark.parametrize("digits", [2, 3])
@pytest.mark.parametrize("n", [1, 3, 7, 12, 40])
def test_the_avx2_integer_path_gives_the_vnni_builds_bits(avx2, n, digits):
    """On the same inputs, the AVX2 build and this CPU's VNNI build give the same bits, across panels
    and matrices (what lets the trainer's re-score take either worker alike)."""
    rng = np.random.default_rng(300 + n + digits)
    for k, outs in ((576, (500, 37)), (1536, (90, 200))):
        mats = [matrix(rng, o, k) for o in outs]
        x = inputs(rng, n, k)
        x[:, 3] *= 1e30  # huge and tiny groups alike
        x[-1, k - 64:] *= 1e-30
        want = qlinear.QLinear(mats, digits=digits)(torch.from_numpy(x)).numpy()
        np.testing.assert_array_equal(call(avx2, x, mats, digits), want)


@pytest.mark.parametrize("digits", [2, 3])
def test_the_avx2_integer_path_is_exact_arithmetic_on_its_rounded_inputs(avx2, digits):
    rng = np.random.default_rng(13)
    mats = [matrix(rng, 70, 192), matrix(rng, 33, 192)]
    x = rng.standard_normal((21, 192)).astype(np.float32)
    x[:, 7] *= 40
    w = torch.cat([record(*m) for m in mats]).double().numpy()
    got = call(avx2, x, mats, digits).astype(np.float64)
    want = rounded_inputs(x, digits) @ w.T
    assert np.abs(got - want).max() < 2e-6 * np.abs(want).max()  # only the float32 epilogue rounds


@pytest.mark.parametrize("digits", [2, 3])
def test_the_avx2_integer_path_handles_zero_and_non_finite_inputs_as_the_vnni_path(avx2, digits):
    rng = np.random.default_rng(14)
    mats = [matrix(rng, 16, 128)]
    for n in (5, 12):  # in place and packed
        x = rng.standard_normal((n, 128)).astype(np.float32)
        x[1, :64] = 0.0
        x[2, 70] = np.inf
        x[3, 3] = x[4, 63] = np.nan
        y = call(avx2, x, mats, digits)
        np.testing.assert_array_equal(y, integer_matmul(x, mats, digits))
        want = rounded_inputs(x[1:2], digits) @ record(*mats[0]).double().numpy().T
        assert np.abs(y[1] - want).max() < 2e-6 * np.abs(want).max()
        assert np.isnan(y[2:5]).all() and np.isfinite(np.delete(y, [2, 3, 4], 0)).all()


@pytest.mark.parametrize("digits", [2, 3])
def test_the_avx2_integer_path_does_not_depend_on_neighbours_or_threads(avx2, digits):
    rng = np.random.default_rng(15)
    mats = [matrix(rng, 300, 576), matrix(rng, 40, 576)]
    x = rng.standard_normal((37, 576)).astype(np.float32)
    whole = call(avx2, x, mats, digits)
    for threads in (1, 2):
        for a, b in ((0, 1), (5, 8), (3, 37), (36, 37), (0, 12)):
            np.testing.assert_array_equal(call(avx2, np.ascontiguousarray(x[a:b]), mats, digits, threads), whole[a:b])
