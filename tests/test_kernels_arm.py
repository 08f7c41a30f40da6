"""The torch engine's CPU kernels on 64-bit ARM (NEON), checked from an x86 machine: the kernels and a C
driver (`tests/arm/kernel_driver.c`) are cross-compiled with aarch64-linux-gnu-gcc for armv8-a (NEON
is its baseline), statically, and run under qemu-aarch64 on inputs written here with numpy.

The ARM build computes bit for bit what an x86 build of the same 4-lane arithmetic computes (the
kernels built here with ``STOA_VL=4`` and fused multiply-adds: "the twin"); against the x86 library
this machine's engine uses it agrees within the x86 tests' tolerances, and exactly wherever they ask
for exactness (each weight of record, one position's attention, sampled tokens, the noise and its
threshold table, batch and thread invariance). The integer path is x86's (AVX-512 VNNI): the ARM
build says it has none. The builder's own flags make an aarch64 library with the cross compiler.
Skipped where either tool is missing; no speed is measured (qemu emulates)."""

from __future__ import annotations

import ctypes
import math
import os
import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

CROSS, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
_TOOLS = {CROSS: "the aarch64 cross compiler", QEMU: "qemu's aarch64 user-mode emulator"}
_missing = [f"{t} ({what})" for t, what in _TOOLS.items() if shutil.which(t) is None]
pytestmark = pytest.mark.skipif(bool(_missing), reason=f"needs {' and '.join(_missing)} on PATH")

torch = pytest.importorskip("torch", reason="the kernels are the torch engine's")

from test_torch_csample import full_rule, rounded_noise  # noqa: E402
from test_torch_decode_attention import reference as attention_reference  # noqa: E402
from test_torch_qlinear import matrix, record  # noqa: E402

from stoa.backends.sampling import _NEED, HostSampler, split_seeds  # noqa: E402
from stoa.backends.torch import csample, cstep, qlinear  # noqa: E402

DRIVER = Path(__file__).with_name("arm") / "kernel_driver.c"
P = ctypes.c_void_p
f32 = np.float32


# -- building and running ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def arm(tmp_path_factory) -> Path:
    """The driver and the kernels as one static aarch64 program, built with the library's own flags."""
    exe = tmp_path_factory.mktemp("arm") / "kernel_driver"
    flags = [f for f in qlinear._FLAGS if f not in ("-fPIC", "-shared")]
    r = subprocess.run([CROSS, *flags, "-march=armv8-a", "-static", "-I", str(qlinear._KERNELS), "-o", str(exe),
                        str(DRIVER), *map(str, qlinear._SOURCES), "-lm"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return exe


@pytest.fixture(scope="module")
def x86():
    """This machine's kernel library as the engine loads it, every function typed."""
    lib = qlinear.library()
    if lib is None or csample._library() is None:
        pytest.skip(f"the x86 kernel library is unavailable: {qlinear.available()[1]}")
    return lib


@pytest.fixture(scope="module")
def twin(x86, tmp_path_factory):
    """The kernels built for x86 with 4 lanes and fused multiply-adds: the ARM build's arithmetic."""
    with open("/proc/cpuinfo") as f:
        if platform.machine() != "x86_64" or " fma" not in f.read():
            pytest.skip("the 4-lane twin of the ARM build is an x86 build with FMA, which this CPU lacks")
    so = tmp_path_factory.mktemp("twin") / "twin.so"
    r = subprocess.run([qlinear._compiler(), *qlinear._FLAGS, "-mfma", "-DSTOA_VL=4", "-o", str(so),
                        *map(str, qlinear._SOURCES)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lib = ctypes.CDLL(str(so))
    for name in ("stoa_qmatmul", "stoa_qmatmul_width", "stoa_attn_decode", "stoa_decode_layers", "stoa_sample",
                 "stoa_sample_noise"):
        theirs, ours = getattr(x86, name), getattr(lib, name)
        ours.argtypes, ours.restype = theirs.argtypes, theirs.restype
    assert lib.stoa_qmatmul_width() == 4
    return lib


def case(root: Path, name: str, op: str, *args, **arrays) -> Path:
    """A driver case: args.txt (floats as exact hex) and each array as a raw file."""
    d = root / name
    d.mkdir()
    words = [a.hex() if isinstance(a, float) else str(int(a)) for a in args]
    (d / "args.txt").write_text(" ".join([op, *words]) + "\n")
    for key, a in arrays.items():
        np.ascontiguousarray(a).tofile(d / f"{key}.bin")
    return d


def run(exe: Path, dirs: list[Path]) -> None:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}  # emulated threads that spin only burn the host's cores
    r = subprocess.run([QEMU, str(exe), *map(str, dirs)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]


def out(d: Path, name: str, dtype) -> np.ndarray:
    return np.fromfile(d / f"out_{name}.bin", dtype)


def rc(d: Path) -> list[int]:
    return [int(w) for w in (d / "rc.txt").read_text().split()]


# -- the build ---------------------------------------------------------------------------------------

def test_the_builder_makes_an_aarch64_library_with_arm_flags(tmp_path):
    """What `qlinear` runs on an ARM Linux box (no x86 flag; -mcpu=native first, which a native
    aarch64 gcc takes and this cross compiler does not, so its next attempt builds) makes an aarch64
    shared library."""
    attempts = qlinear._attempts("aarch64")
    assert attempts[0][-1] == "-mcpu=native" and qlinear._attempts("x86_64")[0][-1] == "-march=native"
    assert not [f for flags in attempts for f in flags if "avx" in f or f.startswith("-march")]
    so = tmp_path / "kernels.so"
    qlinear._build(so, shutil.which(CROSS), machine="aarch64")
    head = so.read_bytes()[:20]
    assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183  # EM_AARCH64


def test_the_arm_build_has_4_lanes_and_no_integer_path(arm, tmp_path):
    d = case(tmp_path, "info", "info")
    run(arm, [d])
    assert rc(d) == [4, 0, -2]  # width, has_int, stoa_qmatmul_int: "this build has none"


# -- the int8 matmul (float32 path: what every CPU without AVX-512 VNNI runs) ------------------------

def qcase(root, name, x, mats, threads=2):
    arrays = {}
    for j, (c, s, b) in enumerate(mats):
        arrays |= {f"c{j}": c, f"s{j}": np.asarray(s, f32), f"b{j}": np.asarray(b, f32)}
    return case(root, name, "qmatmul", 0, x.shape[0], x.shape[1], len(mats), threads, *[c.shape[0] for c, _, _ in mats],
                x=x, **arrays)


def twin_qmatmul(lib, x, mats, threads=2) -> np.ndarray:
    m = len(mats)
    s = [np.asarray(p[1], f32) for p in mats]
    b = [np.asarray(p[2], f32) for p in mats]
    outs = [c.shape[0] for c, _, _ in mats]
    y = np.zeros((x.shape[0], sum(outs)), f32)
    assert lib.stoa_qmatmul(x.ctypes.data, x.shape[0], x.shape[1], m, (P * m)(*[c.ctypes.data for c, _, _ in mats]),
                            (P * m)(*[a.ctypes.data for a in s]), (P * m)(*[a.ctypes.data for a in b]),
                            (ctypes.c_int64 * m)(*outs), y.ctypes.data, y.shape[1], threads) == 0
    return y


def test_the_int8_matmul(arm, x86, twin, tmp_path):
    rng = np.random.default_rng(0)
    cases = []  # (dir, x, mats)
    for n in (1, 2, 3, 4, 5, 17, 64):  # few rows (no panel), whole and partial 4x4 tiles
        mats = [matrix(rng, 70, 192), matrix(rng, 33, 192, np.float16), matrix(rng, 5, 192)]
        x = rng.standard_normal((n, 192)).astype(f32)
        cases.append((qcase(tmp_path, f"n{n}", x, mats), x, mats))
    panels = [matrix(rng, 300, 576), matrix(rng, 40, 576)]  # several panels of outputs a matrix
    x = rng.standard_normal((37, 576)).astype(f32)
    cases.append((qcase(tmp_path, "panels", x, panels), x, panels))
    parts = [(a, b, t) for a, b in ((0, 1), (5, 8), (3, 37), (36, 37)) for t in (1, 2)]
    for a, b, t in parts:
        cases.append((qcase(tmp_path, f"rows{a}-{b}t{t}", np.ascontiguousarray(x[a:b]), panels, t), x[a:b], panels))
    eye = matrix(rng, 40, 128)
    cases.append((qcase(tmp_path, "eye", np.eye(128, dtype=f32), [eye]), np.eye(128, dtype=f32), [eye]))
    run(arm, [d for d, _, _ in cases])
    got = {}
    for d, x, mats in cases:
        assert rc(d) == [0]
        y = got[d.name] = out(d, "y", f32).reshape(x.shape[0], -1)
        np.testing.assert_array_equal(y, twin_qmatmul(twin, np.ascontiguousarray(x), mats))
        mine = qlinear.QLinear(mats)(torch.from_numpy(np.ascontiguousarray(x))).numpy()  # the x86 engine's
        want = x.astype(np.float64) @ torch.cat([record(*m) for m in mats]).double().numpy().T
        scale = np.abs(want).max()
        assert np.abs(y - want).max() < 1e-5 * scale and np.abs(y - mine).max() < 2e-5 * scale
    for a, b, t in parts:  # a row's bits do not depend on its batch or the threads
        np.testing.assert_array_equal(got[f"rows{a}-{b}t{t}"], got["panels"][a:b])
    assert torch.equal(torch.from_numpy(got["eye"]).T, record(*eye))  # each weight of record, bit for bit


# -- decode attention ----------------------------------------------------------------------------------

SHAPES = [(9, 3, 3, 64, 160, 0), (5, 2, 4, 128, 64, 0), (7, 1, 8, 64, 300, 20), (3, 4, 1, 32, 40, 0),
          (2, 2, 2, 256, 33, 5)]  # n, kv heads, query heads each, head dim, positions, window


def test_decode_attention(arm, x86, twin, tmp_path):
    rng = np.random.default_rng(1)
    cases = []
    for i, (n, nkv, rep, d, cap, window) in enumerate(SHAPES):
        slots = n + 4
        kc, vc = (rng.standard_normal((slots, nkv, cap, d)).astype(f32) for _ in range(2))
        q = (rng.standard_normal((n, nkv * rep, d)) * 3).astype(f32)
        rows = rng.permutation(slots)[:n].astype(np.int64)  # rows anywhere in the cache, in any order
        pos = rng.integers(0, cap, n).astype(np.int64)
        pos[0] = 0  # a row that sees only its own position
        args = (n, nkv, rep, d, cap, slots, 0.125, window, 2)
        cases.append((case(tmp_path, f"a{i}", "attn", *args, q=q, kc=kc, vc=vc, rows=rows, pos=pos), args,
                      (q, kc, vc, rows, pos)))
    run(arm, [c[0] for c in cases])
    for dr, (n, nkv, rep, d, cap, _, scale, window, threads), (q, kc, vc, rows, pos) in cases:
        assert rc(dr) == [0]
        got = out(dr, "o", f32).reshape(q.shape)
        outs = {}
        for name, lib in (("twin", twin), ("x86", x86)):
            o = outs[name] = np.full_like(q, np.nan)
            ptrs = [a.ctypes.data for a in (q, kc, vc, rows, pos)]
            assert lib.stoa_attn_decode(*ptrs, n, nkv, rep, d, cap, scale, window, o.ctypes.data, threads) == 0
        np.testing.assert_array_equal(got, outs["twin"])
        t = lambda a: torch.from_numpy(a)  # noqa: E731
        want = attention_reference(t(q), t(kc), t(vc), t(rows), t(pos), scale, window).numpy()
        tol = 2e-5 * np.abs(want).max()
        assert np.abs(got - want).max() < tol and np.abs(got - outs["x86"]).max() < tol
        np.testing.assert_array_equal(got[0], np.repeat(vc[rows[0], :, 0], rep, 0))  # one position: its value


# -- the sampler -------------------------------------------------------------------------------------

def seeds_of(rng, n):
    return rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)


def scase(root, name, logits, seeds, t, threads=2):
    n, v = logits.shape
    lo, hi = split_seeds(seeds)
    return case(root, name, "sample", n, v, v, float(f32(1.0 / t)), threads, logits=logits, lo=lo, hi=hi)


def twin_sample(lib, logits, seeds, t, threads=2):
    n, v = logits.shape
    lo, hi = split_seeds(seeds)
    tok, lp = np.zeros(n, np.int64), np.zeros(n, f32)
    code = lib.stoa_sample(logits.ctypes.data, n, v, v, lo.ctypes.data, hi.ctypes.data, float(f32(1.0 / t)),
                           tok.ctypes.data, lp.ctypes.data, threads)
    return code, tok, lp


def test_the_sampler_draws_the_same_tokens(arm, x86, twin, tmp_path):
    rng = np.random.default_rng(2)
    cases = []  # (dir, logits, seeds, t, threads)

    def add(name, logits, seeds, t, threads=2):
        cases.append((scase(tmp_path, name, logits, seeds, t, threads), logits, seeds, t, threads))

    for v in (1000, 4099, 49152):  # segments of 8192 tokens and ragged tails
        for spread in (0.01, 2.0, 25.0):  # flat (a random model's) to sharply peaked
            logits = (rng.standard_normal((12, v)) * spread).astype(f32)
            logits[::4, rng.integers(0, v)] += 40.0
            for t in (0.05, 1.0, 2.5):
                add(f"v{v}s{spread}t{t}", logits, seeds_of(rng, 12), t)
    v = 20011
    odd = (rng.standard_normal((8, v)) * 2).astype(f32)
    odd[0, rng.random(v) < 0.99] = -np.inf  # a hand-truncated row
    odd[1, :] = -np.inf
    odd[1, v - 1] = 0.5  # one token left, at the very end
    odd[2, :] = 1.25  # every token tied
    odd[3, ::3] = odd[3].max()
    odd[4] = np.round(odd[4])
    odd[5, :] = -1e37  # huge finite logits: exp underflows
    odd[5, 17] = 1e37
    odd[6, -16:] = 30.0
    seeds = seeds_of(rng, 8)
    for t, threads in ((1.0, 2), (0.3, 1), (1.1, 3)):
        add(f"odd{t}-{threads}", odd, seeds, t, threads)
    for r in (0, 3, 7):  # a row alone draws what it draws in its batch
        add(f"alone{r}", np.ascontiguousarray(odd[r:r + 1]), seeds[r:r + 1], 1.0, 2)
    nan = odd.copy()
    nan[2, 5] = np.nan
    add("nan", nan, seeds, 1.0)
    run(arm, [c[0] for c in cases])
    host = HostSampler()
    for d, logits, seeds, t, threads in cases:
        code, tok0, lp0 = twin_sample(twin, logits, seeds, t, threads)
        assert rc(d) == [code]
        if d.name == "nan":
            assert code == 1 and csample.sample(logits, seeds, t) is None  # left to the numpy sampler, as on x86
            continue
        tok, lp = out(d, "tok", np.int64), out(d, "lp", f32)
        np.testing.assert_array_equal(tok, tok0)
        np.testing.assert_array_equal(lp, lp0)
        mine = csample.sample(logits, seeds, t, threads=threads)  # the x86 engine's sampler
        np.testing.assert_array_equal(tok, mine[0])
        np.testing.assert_array_equal(tok, full_rule(logits, seeds, t))
        with np.errstate(all="ignore"):
            ref_tok, ref_lp = host(logits, seeds, t)
        np.testing.assert_array_equal(tok, ref_tok)
        np.testing.assert_allclose(lp, mine[1], rtol=0, atol=2e-6)
        np.testing.assert_allclose(lp, ref_lp, rtol=0, atol=2e-6)
    got = {d.name: (out(d, "tok", np.int64), out(d, "lp", f32)) for d, *_ in cases if d.name != "nan"}
    for r in (0, 3, 7):
        assert got[f"alone{r}"][0][0] == got["odd1.0-2"][0][r]
        assert got[f"alone{r}"][1][0].tobytes() == got["odd1.0-2"][1][r].tobytes()


def test_the_noise_and_its_threshold_table(arm, x86, tmp_path):
    code = np.concatenate([np.arange(0, 2**23, 7, dtype=np.uint32), np.arange(2**23 - 64, 2**23, dtype=np.uint32)])
    d = case(tmp_path, "noise", "noise", code.size, codes=code)
    run(arm, [d])
    assert rc(d) == [0, len(_NEED)]
    noise = out(d, "noise", f32)
    np.testing.assert_array_equal(noise, rounded_noise(code))  # the correctly rounded chain
    np.testing.assert_array_equal(noise, csample.noise(code))
    np.testing.assert_array_equal(out(d, "table", np.uint32), _NEED)


# -- the decode step -----------------------------------------------------------------------------------

def test_the_decode_step(arm, x86, twin, tmp_path):
    """Two layers of a Qwen-like shape (grouped heads; q|k|v biases and q/k norms in one layer, a
    sliding window and an output bias in the other, two RoPE tables), three rows anywhere in the cache."""
    rng = np.random.default_rng(3)
    hidden, nq, nkv, d, inter, cap, slots, rope_len = 128, 4, 2, 32, 192, 24, 6, 24
    eps, scale = float(f32(1e-6)), float(f32(1 / math.sqrt(d)))
    rows, pos = np.array([4, 0, 2], np.int64), np.array([0, 7, 20], np.int64)
    n = len(rows)

    def mat(out_, k):
        c = rng.integers(0, 256, (out_, k), dtype=np.uint8)
        s = (rng.random((out_, k // 64)) * 0.002 + 0.001).astype(f32)
        return c, s, (-127.5 * s + rng.standard_normal(s.shape).astype(f32) * 1e-3).astype(f32)  # centred weights

    layers = []
    for i in range(2):
        ly = {"window": 5 * i, "rope": i, "qk": i == 0,
              "qkv": [mat(nq * d, hidden), mat(nkv * d, hidden), mat(nkv * d, hidden)], "o": [mat(hidden, nq * d)],
              "gu": [mat(inter, hidden), mat(inter, hidden)], "down": [mat(hidden, inter)],
              "norm_in": (1 + 0.1 * rng.standard_normal(hidden)).astype(f32),
              "norm_post": (1 + 0.1 * rng.standard_normal(hidden)).astype(f32),
              "q_norm": (1 + 0.1 * rng.standard_normal(d)).astype(f32),
              "k_norm": (1 + 0.1 * rng.standard_normal(d)).astype(f32)}
        ly["bias"] = {"qkv": rng.standard_normal(nq * d + 2 * nkv * d).astype(f32) * 0.1 if i == 0 else None,
                      "o": rng.standard_normal(hidden).astype(f32) * 0.1 if i == 1 else None, "gu": None, "down": None}
        layers.append(ly)
    inv = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
    ang = [np.arange(rope_len)[:, None] * inv[None] * f for f in (1.0, 0.25)]
    cos = [np.ascontiguousarray(np.concatenate([np.cos(a)] * 2, 1), f32) for a in ang]
    sin = [np.ascontiguousarray(np.concatenate([np.sin(a)] * 2, 1), f32) for a in ang]
    kc = [rng.standard_normal((slots, nkv, cap, d)).astype(f32) for _ in layers]
    vc = [rng.standard_normal((slots, nkv, cap, d)).astype(f32) for _ in layers]
    x = rng.standard_normal((n, hidden)).astype(f32)

    words = [len(layers), n, hidden, nq, nkv, d, cap, rope_len, len(cos), eps, scale, 0, 2, slots]
    arrays = {"x": x, "rows": rows, "pos": pos}
    for t in range(len(cos)):
        arrays |= {f"cos{t}": cos[t], f"sin{t}": sin[t]}
    for i, ly in enumerate(layers):
        words += [ly["window"], ly["rope"], int(ly["qk"])]
        for name in ("qkv", "o", "gu", "down"):
            words += [len(ly[name]), int(ly["bias"][name] is not None), *[c.shape[0] for c, _, _ in ly[name]]]
            for j, (c, s, b) in enumerate(ly[name]):
                arrays |= {f"L{i}_{name}_c{j}": c, f"L{i}_{name}_s{j}": s, f"L{i}_{name}_b{j}": b}
            if ly["bias"][name] is not None:
                arrays[f"L{i}_{name}_bias"] = ly["bias"][name]
        for name in ("norm_in", "norm_post") + (("q_norm", "k_norm") if ly["qk"] else ()):
            arrays[f"L{i}_{name}"] = ly[name]
        arrays |= {f"kc{i}": kc[i], f"vc{i}": vc[i]}
    dr = case(tmp_path, "step", "step", *words, **arrays)
    run(arm, [dr])
    assert rc(dr) == [0]
    got = [out(dr, "x", f32).reshape(n, hidden), *[out(dr, f"kc{i}", f32) for i in range(2)],
           *[out(dr, f"vc{i}", f32) for i in range(2)]]

    keep = []  # what the layer structs point into

    def struct(ly, name):
        q = qlinear.QLinear(ly[name])
        b = None if ly["bias"][name] is None else torch.from_numpy(ly["bias"][name])
        keep.append((q, b))
        return cstep._mat(q, b)

    t = lambda a: None if a is None else torch.from_numpy(a)  # noqa: E731
    arr = (cstep._Layer * 2)(*[cstep._Layer(struct(ly, "qkv"), struct(ly, "o"), struct(ly, "gu"), struct(ly, "down"),
                                            cstep._ptr(t(ly["norm_in"])), cstep._ptr(t(ly["norm_post"])),
                                            cstep._ptr(t(ly["q_norm"]) if ly["qk"] else None),
                                            cstep._ptr(t(ly["k_norm"]) if ly["qk"] else None), ly["window"], ly["rope"])
                               for ly in layers])
    for name, lib in (("twin", twin), ("x86", x86)):
        xs, ks, vs = x.copy(), [a.copy() for a in kc], [a.copy() for a in vc]
        assert lib.stoa_decode_layers(arr, 2, xs.ctypes.data, n, rows.ctypes.data, pos.ctypes.data, hidden, nq, nkv, d,
                                      cap, (P * 2)(*[a.ctypes.data for a in ks]), (P * 2)(*[a.ctypes.data for a in vs]),
                                      (P * 2)(*[a.ctypes.data for a in cos]), (P * 2)(*[a.ctypes.data for a in sin]),
                                      rope_len, eps, scale, 0, 2) == 0
        want = [xs, *[a.reshape(-1) for a in ks], *[a.reshape(-1) for a in vs]]
        for g, w in zip(got, want):
            if name == "twin":
                np.testing.assert_array_equal(g, w)
            else:  # the float32 sums in another order (16 lanes here): the x86 step tests' tolerance
                assert np.abs(g - w).max() < 2e-5 * np.abs(w).max()
    assert not np.array_equal(got[0], x)  # the layers did change the residual stream
