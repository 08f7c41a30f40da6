"""The PULSE codec: exact round trips for any dtype, near-entropy size, and refusal of bad blobs."""

import json
import math
import struct
import zlib

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoa.transport import pulse, pulse_codec, pulse_state
from stoa.transport.pulse import (
    DTYPES,
    PulseError,
    apply_delta,
    apply_delta_inplace,
    decode_state,
    encode_delta,
    encode_state,
    state_hash,
)

BF16 = np.dtype(ml_dtypes.bfloat16)


def same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and np.ascontiguousarray(a[k]).tobytes() == np.ascontiguousarray(b[k]).tobytes() for k in a)


def copy(s: dict) -> dict:
    return {k: v.copy() for k, v in s.items()}


def random_bits(rng, dtype, shape):
    n = math.prod(shape) * dtype.itemsize
    return np.frombuffer(rng.integers(0, 256, n, dtype=np.uint8).tobytes(), dtype).reshape(shape).copy()


def perturb(rng, a, rate):
    """Change ~rate of the elements to arbitrary bit patterns (NaNs, -0.0, infs included)."""
    b = a.copy()
    flat = b.reshape(-1).view(np.uint8).reshape(b.size, b.dtype.itemsize) if b.size else None
    if b.size:
        idx = np.flatnonzero(rng.random(b.size) < rate)
        flat[idx] = rng.integers(0, 256, (idx.size, b.dtype.itemsize), dtype=np.uint8)
    return b


def adam_like_codes(rng, shape, rate, big=0.02):
    a = rng.integers(0, 256, shape, dtype=np.uint8)
    b = a.copy().reshape(-1)
    idx = np.flatnonzero(rng.random(b.size) < rate)
    d = rng.choice(np.array([-1, 1]), idx.size)
    d = np.where(rng.random(idx.size) < big, d * rng.integers(2, 6, idx.size), d)
    b[idx] = (b[idx].astype(np.int64) + d).astype(np.uint8)
    return a, b.reshape(shape)


# --- round trips -----------------------------------------------------------------------------------

state_specs = st.lists(
    st.tuples(st.sampled_from(sorted(DTYPES)),
              st.lists(st.integers(0, 40), min_size=0, max_size=3),
              st.sampled_from([0.0, 0.001, 0.05, 0.5, 0.97, 1.0])),
    min_size=1, max_size=6)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=state_specs, seed=st.integers(0, 2**32 - 1))
def test_delta_round_trip_is_exact_for_any_dtype(specs, seed):
    rng = np.random.default_rng(seed)
    prev, new = {}, {}
    for i, (code, shape, rate) in enumerate(specs):
        dt = DTYPES[code]
        a = random_bits(rng, dt, tuple(shape)) if code != "BOOL" else np.asarray(rng.random(shape) < 0.5)
        prev[f"t{i}.{code}"] = a
        new[f"t{i}.{code}"] = perturb(rng, a, rate) if code != "BOOL" else np.asarray(a ^ (rng.random(shape) < rate))
    before = copy(prev)
    blob = encode_delta(prev, new)
    assert same(apply_delta(prev, blob), new)
    assert same(prev, before)  # pure
    live = copy(prev)
    changed = apply_delta_inplace(live, blob)
    assert same(live, new)
    assert changed == sorted(k for k in prev if prev[k].tobytes() != new[k].tobytes())
    assert state_hash(live) == state_hash(new)


@pytest.mark.parametrize("k", [1, 2, 3, 63, 64, 65, 500, 4999, 5000, 5001, 9_999, 10_000])
def test_masks_of_every_density(k):
    rng = np.random.default_rng(k)
    n = 10_000
    for pick in ("random", "first", "last", "run"):
        a = rng.integers(0, 256, n, dtype=np.uint8)
        idx = {"random": rng.choice(n, k, replace=False), "first": np.arange(k),
               "last": np.arange(n - k, n), "run": (np.arange(k) + n // 3) % n}[pick]
        b = a.copy()
        b[idx] += np.uint8(1)
        blob = encode_delta({"a": a}, {"a": b})
        assert same(apply_delta({"a": a}, blob), {"a": b}), pick


def test_code_changes_cost_near_their_entropy():
    rng = np.random.default_rng(0)
    for rate in (0.001, 0.005, 0.02):
        a, b = adam_like_codes(rng, (1024, 4096), rate)
        blob = encode_delta({"w": a}, {"w": b})
        d = (b.astype(np.int16) - a.astype(np.int16))[a != b]
        k, n = d.size, a.size
        p = k / n
        _, counts = np.unique(d, return_counts=True)
        q = counts / k
        bound = (n * -(p * math.log2(p) + (1 - p) * math.log2(1 - p)) - k * (q * np.log2(q)).sum()) / k
        bits = len(blob) * 8 / k
        assert bound < bits < bound * 1.02 + 0.1, (rate, bits, bound)


def test_float_tensors_that_all_change_are_compressed():
    rng = np.random.default_rng(1)
    norm = (1 + rng.standard_normal(4096) * 0.01).astype(np.float32)
    step = (norm + rng.standard_normal(4096).astype(np.float32) * 1e-5).astype(np.float32)
    blob = encode_delta({"n": norm}, {"n": step})
    assert len(blob) < 0.6 * norm.nbytes
    assert same(apply_delta({"n": norm}, blob), {"n": step})


def test_unchanged_state_gives_a_tiny_delta():
    rng = np.random.default_rng(2)
    s = {"w": rng.integers(0, 256, (512, 512), dtype=np.uint8), "s": np.ones((512, 8), BF16)}
    blob = encode_delta(s, copy(s))
    assert len(blob) < 64
    assert same(apply_delta(s, blob), s)
    assert apply_delta_inplace(copy(s), blob) == []


def test_in_place_writes_through_shared_buffers():
    # A live engine holds uint32 words (MLX's packed codes) and hands us their bytes.
    rng = np.random.default_rng(3)
    words = rng.integers(0, 2**32, (64, 16), dtype=np.uint32)
    a = words.view(np.uint8)
    b = a.copy()
    b[5, 7] += np.uint8(1)
    b[63, 63] -= np.uint8(1)
    state = {"w": a}
    assert apply_delta_inplace(state, encode_delta({"w": a.copy()}, {"w": b})) == ["w"]
    assert state["w"] is a and np.array_equal(words.view(np.uint8), b)


def test_in_place_updates_a_live_mlx_array():
    mx = pytest.importorskip("mlx.core", reason="needs mlx")
    rng = np.random.default_rng(10)
    wq, scales, biases = mx.quantize(mx.array(rng.standard_normal((8, 128)).astype(np.float32)), group_size=64, bits=8)
    mx.eval(wq, scales, biases)
    codes = np.array(wq, copy=False).view(np.uint8)  # shares MLX's buffer
    new = codes.copy()
    new[3, 70] += np.uint8(1)
    blob = encode_delta({"w": codes.copy()}, {"w": new})
    before = np.array(mx.dequantize(wq, scales, biases, group_size=64, bits=8))
    assert apply_delta_inplace({"w": codes}, blob) == ["w"]
    after = np.array(mx.dequantize(wq, scales, biases, group_size=64, bits=8))
    assert np.array_equal(np.array(wq).view(np.uint8), new)
    assert np.flatnonzero(after != before).tolist() == [3 * 128 + 70]


# --- refusals --------------------------------------------------------------------------------------

def small_pair(seed=4):
    rng = np.random.default_rng(seed)
    a, b = adam_like_codes(rng, (256, 256), 0.05)
    prev = {"w": a, "s": np.ones((256, 4), BF16), "n": rng.standard_normal(256).astype(np.float32)}
    new = {"w": b, "s": prev["s"].copy(), "n": (prev["n"] * 1.001).astype(np.float32)}
    new["s"][3, 2] = 0.5
    return prev, new


def reseal(blob: bytes) -> bytes:
    """Recompute the crc so a forged body reaches the structural checks."""
    body = blob[12:]
    return blob[:8] + struct.pack("<I", zlib.crc32(body)) + body


def test_layout_mismatch_is_refused():
    prev, new = small_pair()
    for bad in ({**new, "extra": np.zeros(3, np.float32)}, {k: v for k, v in new.items() if k != "n"},
                {**new, "n": new["n"].astype(np.float16)}, {**new, "w": new["w"][:-1]}):
        with pytest.raises(PulseError):
            encode_delta(prev, bad)
    blob = encode_delta(prev, new)
    for base in ({**prev, "n": prev["n"][:-1]}, {**prev, "x": np.zeros(1, np.uint8)}):
        with pytest.raises(PulseError, match="different names"):
            apply_delta(base, blob)
    with pytest.raises(PulseError, match="unsupported dtype"):
        encode_delta({"c": np.zeros(2, np.complex64)}, {"c": np.zeros(2, np.complex64)})


def test_corrupted_and_truncated_deltas_are_refused_and_leave_the_state_untouched():
    prev, new = small_pair()
    blob = encode_delta(prev, new)
    rng = np.random.default_rng(5)
    live = copy(prev)
    for pos in rng.choice(len(blob), 300, replace=False):
        bad = bytearray(blob)
        bad[pos] ^= 1 << int(rng.integers(8))
        with pytest.raises(PulseError):
            apply_delta_inplace(live, bytes(bad))
    for cut in [0, 3, 11, 12, 40, len(blob) // 2, len(blob) - 1]:
        with pytest.raises(PulseError):
            apply_delta_inplace(live, blob[:cut])
        with pytest.raises(PulseError):  # the crc cannot save a truncated body either
            apply_delta_inplace(live, reseal(blob[:cut]) if cut >= 12 else blob[:cut])
    assert same(live, prev)


def test_forged_deltas_with_a_valid_crc_raise_pulse_error_only():
    prev, new = small_pair()
    blob = encode_delta(prev, new)
    rng = np.random.default_rng(6)
    outcomes = {"refused": 0, "applied": 0}
    for _ in range(1500):
        bad = bytearray(blob)
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(48, len(bad)))  # past the fingerprint: the structure itself
            bad[pos] = int(rng.integers(256)) if rng.random() < 0.5 else bad[pos] ^ 0xFF
        try:
            out = apply_delta(prev, reseal(bytes(bad)))
        except PulseError:
            outcomes["refused"] += 1
        else:  # a forgery that still parses must still produce a well-formed state
            assert {k: (v.dtype, v.shape) for k, v in out.items()} == {k: (v.dtype, v.shape) for k, v in prev.items()}
            outcomes["applied"] += 1
    assert outcomes["refused"] > 500  # flips inside raw bit streams are valid (if wrong) deltas


def test_forged_sizes_do_not_allocate():
    prev, _ = small_pair()
    fp = pulse_state.fingerprint(prev)[1]
    uv = pulse_codec.varint
    w = uv(sorted(prev).index("w"))
    gaps = w + b"\x01\x03"  # entry for "w", byte kind, Golomb-coded change mask
    forgeries = [
        uv(2**32),  # more entries than tensors
        uv(1) + uv(99) + b"\x01",  # tensor index out of range
        uv(1) + w + b"\x02",  # wrong kind for uint8
        uv(1) + gaps + uv(2**62) + uv(5) + uv(10) + uv(0),  # more changes than elements
        uv(1) + gaps + uv(4) + uv(2**40) + uv(1) + uv(0) + b"\xff",  # absurd Golomb parameter
        uv(1) + gaps + uv(4) + uv(7) + uv(2**60) + uv(0),  # quotient stream past the end
        uv(1) + gaps + uv(4) + uv(7) + b"\xff" * 11,  # varint longer than 64 bits
        uv(1) + w + b"\x01\x09",  # unknown mask method
        uv(1) + w + b"\x01\x01\x00\x00\x00\x00\x00" + b"\x01" + uv(2**40) + b"x",  # huge stored length
        uv(1) + w + b"\x01\x01\x00\x02" + b"\xff" * 8192 + b"\x00\x00\x00\x00" + b"\x01" + uv(9)
        + b"\x28\xb5\x2f\xfd" + b"\x00" * 5,  # corrupt zstd frame
        uv(0) + b"trailing",
    ]
    for body in forgeries:
        body = fp + body
        blob = b"PLSD" + struct.pack("<B3xI", 1, zlib.crc32(body)) + body
        with pytest.raises(PulseError):
            apply_delta(prev, blob)
    with pytest.raises(PulseError, match="magic"):
        apply_delta(prev, b"PK\x03\x04" + b"\x00" * 60)
    with pytest.raises(PulseError, match="version"):
        apply_delta(prev, b"PLSD" + struct.pack("<B3xI", 7, 0) + fp + b"\x00" * 4)


def test_in_place_refuses_read_only_or_strided_arrays():
    prev, new = small_pair()
    blob = encode_delta(prev, new)
    ro = copy(prev)
    ro["w"].flags.writeable = False
    with pytest.raises(PulseError, match="writeable"):
        apply_delta_inplace(ro, blob)
    assert same(ro, prev)
    strided = copy(prev)
    strided["w"] = np.asfortranarray(prev["w"])
    with pytest.raises(PulseError, match="contiguous"):
        apply_delta_inplace(strided, blob)


# --- anchors and hashes ----------------------------------------------------------------------------

def test_anchor_round_trip_keeps_every_dtype_and_is_safetensors():
    rng = np.random.default_rng(7)
    s = {f"t.{c}": random_bits(rng, dt, (3, 5)) for c, dt in DTYPES.items() if c != "BOOL"}
    s["t.BOOL"] = rng.random(7) < 0.5
    s["scalar"] = np.full((), -0.0, np.float32)
    s["empty"] = np.zeros((0, 4), BF16)
    blob = encode_state(s)
    out = decode_state(blob)
    assert same(out, s) and state_hash(out) == state_hash(s)
    out["t.F32"][0, 0] = 1.0  # writeable
    safetensors = pytest.importorskip("safetensors.numpy")
    plain = {k: v for k, v in s.items() if v.dtype != BF16}
    assert same(safetensors.load(encode_state(plain)), plain)


def _anchor(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def test_forged_or_corrupted_anchors_are_refused():
    s = {"a": np.arange(6, dtype=np.float32), "b": np.ones(4, BF16)}
    blob = encode_state(s)
    bad = bytearray(blob)
    bad[-3] ^= 0x40
    with pytest.raises(PulseError, match="crc32"):
        decode_state(bytes(bad))
    for cut in (0, 7, 8, 20, len(blob) - 1):
        with pytest.raises(PulseError):
            decode_state(blob[:cut])
    e = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    forged = [
        struct.pack("<Q", 2**63) + b"{}",
        struct.pack("<Q", 4) + b"[1,]",
        struct.pack("<Q", 2000) + b"[" * 1000 + b"]" * 1000,
        _anchor({"a": {**e, "shape": [2**40]}}, b"\x00" * 8),
        _anchor({"a": {**e, "shape": [-2]}}, b"\x00" * 8),
        _anchor({"a": {**e, "dtype": "C64"}}, b"\x00" * 8),
        _anchor({"a": {**e, "data_offsets": [0, 2**60]}}, b"\x00" * 8),
        _anchor({"a": e, "b": e}, b"\x00" * 8),  # overlap
        _anchor({"a": e}, b"\x00" * 12),  # unclaimed bytes
        _anchor({"a": {**e, "extra": 1}}, b"\x00" * 8),
        _anchor({"": e}, b"\x00" * 8),
        _anchor({"a": [1, 2]}, b"\x00" * 8),
        _anchor([1, 2], b""),
        _anchor({"__metadata__": [1]}, b""),
    ]
    for f in forged:
        with pytest.raises(PulseError):
            decode_state(f)


def test_state_hash_names_exact_contents():
    rng = np.random.default_rng(8)
    s = {"a": rng.standard_normal((4, 4)).astype(np.float32), "b": np.zeros(3, np.uint8)}
    s["a"][0, 0] = -0.0
    h = state_hash(s)
    assert h == state_hash(dict(reversed(list(s.items())))) and len(h) == 64
    plus_zero = s["a"].copy()
    plus_zero[0, 0] = 0.0  # equal as floats, different bits
    variants = [
        {**s, "b": np.array([0, 0, 1], np.uint8)},
        {**s, "a": s["a"].reshape(2, 8)},
        {**s, "a": s["a"].view(np.int32)},
        {"c": s["a"], "b": s["b"]},
        {**s, "a": plus_zero},
    ]
    assert len({h, *(state_hash(v) for v in variants)}) == len(variants) + 1


def test_fixed_width_fields_round_trip_at_every_width():
    rng = np.random.default_rng(9)
    for width in range(1, 64):
        v = rng.integers(0, 1 << min(width, 62), 257, dtype=np.int64)
        packed = pulse_codec.pack_fixed(v, width)
        assert len(packed) == (257 * width + 7) // 8
        assert np.array_equal(pulse_codec.unpack_fixed(memoryview(packed), 257, width), v)
