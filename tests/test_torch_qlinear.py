"""The torch engine's int8 CPU kernel (`stoa.backends.torch.qlinear`): it computes a float32 matmul
on exactly the weights of record, reads the state's codes in place, and gives a row the same bits
whatever its batch neighbours and thread count; the narrower (AVX2-width) build agrees too."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the kernel is the torch engine's")

from stoa.backends.torch import qlinear  # noqa: E402
from stoa.backends.torch.int8 import dequantize_torch  # noqa: E402

ok, why = qlinear.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"int8 kernel unavailable: {why}")


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


def test_a_rows_result_does_not_depend_on_neighbours_or_threads():
    rng = np.random.default_rng(1)
    q = qlinear.QLinear([matrix(rng, 300, 576)])
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


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the 8-lane variant")
def test_the_eight_lane_build_computes_the_same(tmp_path):
    """Machines without AVX-512 get 8-lane vectors and 2x4 tiles; build that variant here and check it."""
    so = tmp_path / "q8.so"
    r = subprocess.run(["gcc", "-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-mavx2", "-mfma", "-mno-avx512f", "-o", str(so),
                        str(qlinear._SOURCE)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"this gcc cannot build an AVX2 variant: {r.stderr[-200:]}")
    lib = ctypes.CDLL(str(so))
    assert lib.stoa_qmatmul_width() == 8
    rng = np.random.default_rng(4)
    codes, scales, biases = matrix(rng, 23, 256)
    x = rng.standard_normal((7, 256)).astype(np.float32)
    y = np.zeros((7, 23), np.float32)
    P = ctypes.c_void_p
    rc = lib.stoa_qmatmul(P(x.ctypes.data), ctypes.c_int64(7), ctypes.c_int64(256), 1, (P * 1)(codes.ctypes.data),
                          (P * 1)(scales.ctypes.data), (P * 1)(biases.ctypes.data), (ctypes.c_int64 * 1)(23),
                          P(y.ctypes.data), ctypes.c_int64(23), 2)
    assert rc == 0
    want = x.astype(np.float64) @ record(codes, scales, biases).double().numpy().T
    assert np.abs(y - want).max() < 1e-5 * np.abs(want).max()
