"""The outer loop's pure parts and its store objects: the int8 and top-k update codecs with error feedback,
the Nesterov outer optimizer (golden numbers by hand), the exchange's checks on read, and the bytes
of one outer update against float32. CPU, no model."""

from __future__ import annotations

import numpy as np
import pytest

from stoa.fleet.config import ConfigError, RunConfig
from stoa.fleet.outer.codec import UpdateError, decode_update, encode_update, fp32_bytes, l2_norm
from stoa.fleet.outer.exchange import OuterExchange, make_secret, read_secret
from stoa.fleet.outer.nesterov import OuterOptimizer
from stoa.fleet.outer.section import OuterConfig
from stoa.transport import tensorfile
from stoa.transport.signing import generate_private_key
from stoa.transport.store import LocalStore


def update(seed: int = 0, scale: float = 1e-3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"model.embed_tokens.weight": (rng.standard_normal((100, 64)) * scale).astype(np.float32),
            "model.layers.0.mlp.up_proj.weight": (rng.standard_normal((96, 64)) * scale).astype(np.float32),
            "model.layers.0.input_layernorm.weight": (rng.standard_normal(64) * scale).astype(np.float32),
            "model.odd.weight": (rng.standard_normal((5, 3, 10)) * scale).astype(np.float32)}


def shapes(u: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {k: v.shape for k, v in u.items()}


def test_int8_round_trip_is_close_and_decodes_to_what_the_sender_kept():
    u = update()
    enc = encode_update(u, block=64)
    dec = decode_update(enc.blob, shapes(u), sha256=enc.sha256)
    for k in u:
        assert np.array_equal(dec[k], enc.decoded[k])
        np.testing.assert_allclose(dec[k] + enc.residual[k], u[k], rtol=0, atol=1e-9)
        # symmetric int8 with a scale per 64 values: the error is at most half a step of its block
        assert np.abs(dec[k] - u[k]).max() <= np.abs(u[k]).max() / 127 / 2 + 1e-9
    assert np.array_equal(dec["model.layers.0.input_layernorm.weight"], u["model.layers.0.input_layernorm.weight"])
    zeros = {k: np.zeros_like(v) for k, v in u.items()}
    assert all(not v.any() for v in decode_update(encode_update(zeros).blob, shapes(u)).values())


def test_bytes_of_an_outer_update_against_float32():
    """A 2-D tensor costs 1 byte a value plus a float32 scale per 64 values (1.0625 B), against 4."""
    u = update()
    full = fp32_bytes(shapes(u))
    enc = encode_update(u, block=64)
    none = encode_update(u, compress="none")
    assert full == 4 * sum(v.size for v in u.values())
    assert full < none.bytes < full + 1024  # float32 plus the header
    matrices = sum(v.size for v in u.values() if v.ndim >= 2)
    vectors = sum(v.size for v in u.values() if v.ndim == 1)
    scales = sum(v.size // v.shape[-1] * (v.shape[-1] // 64 if v.shape[-1] % 64 == 0 else 1)
                 for v in u.values() if v.ndim >= 2)
    data = matrices + 4 * scales + 4 * vectors
    assert data < enc.bytes < data + 1024
    print(f"outer update: {enc.bytes} B int8 vs {full} B float32 ({full / enc.bytes:.2f}x)")
    assert full / enc.bytes > 3.4


def test_error_feedback_sends_what_rounding_dropped():
    """Sent over many steps, the sum of what arrived tracks the sum of the updates to within one
    step's rounding (the residual), not a growing drift."""
    rng = np.random.default_rng(1)
    base = rng.standard_normal((8, 64)).astype(np.float32)
    residual, sent, true = None, np.zeros_like(base), np.zeros_like(base)
    for i in range(50):
        u = {"w": (base * 1e-3 + rng.standard_normal(base.shape) * 1e-5).astype(np.float32)}
        enc = encode_update(u, residual)
        residual = enc.residual
        sent += enc.decoded["w"]
        true += u["w"]
    assert np.abs(sent + residual["w"] - true).max() < 1e-6
    assert np.abs(sent - true).max() <= np.abs(residual["w"]).max() + 1e-9
    # without feedback the same updates drift further
    plain = sum(encode_update({"w": (base * 1e-3).astype(np.float32)}).decoded["w"] for _ in range(50))
    assert np.abs(plain - 50 * base * 1e-3).max() > np.abs(sent - true).max()


def test_decode_refuses_what_does_not_fit_the_model():
    u = update()
    enc = encode_update(u)
    s = shapes(u)
    with pytest.raises(UpdateError, match="sha256"):
        decode_update(enc.blob, s, sha256="0" * 64)
    with pytest.raises(UpdateError, match="missing"):
        decode_update(enc.blob, {**s, "extra.weight": (4, 4)})
    with pytest.raises(UpdateError, match="unknown"):
        decode_update(enc.blob, {k: v for k, v in s.items() if k != "model.odd.weight"})
    with pytest.raises(UpdateError, match="expected"):
        decode_update(enc.blob, {**s, "model.embed_tokens.weight": (64, 100)})
    with pytest.raises(UpdateError, match="over"):
        decode_update(enc.blob, s, max_bytes=100)
    with pytest.raises(UpdateError, match="tensor file"):
        decode_update(enc.blob[:-3], s)
    bad = dict(tensorfile.read(enc.blob).tensors)
    bad["model.layers.0.input_layernorm.weight"] = np.full(64, np.nan, np.float32)
    blob = tensorfile.encode(bad, {"format": "stoa.outer-update/1", "compress": "int8", "block": "64"})
    with pytest.raises(UpdateError, match="finite"):
        decode_update(blob, s)
    bad = dict(tensorfile.read(enc.blob).tensors)
    bad["model.embed_tokens.weight#s"] = -bad["model.embed_tokens.weight#s"]
    blob = tensorfile.encode(bad, {"format": "stoa.outer-update/1", "compress": "int8", "block": "64"})
    with pytest.raises(UpdateError, match="scale"):
        decode_update(blob, s)
    with pytest.raises(UpdateError, match="not a stoa.outer-update"):
        decode_update(tensorfile.encode(dict(tensorfile.read(enc.blob).tensors)), s)
    with pytest.raises(UpdateError, match="finite"):
        encode_update({"w": np.array([[np.inf, 0.0]], np.float32)})
    assert l2_norm({"a": np.array([3.0, 4.0], np.float32)}) == 5.0


def test_topk_keeps_the_largest_values_of_each_block_and_decodes_to_what_the_sender_kept():
    u = update()
    enc = encode_update(u, compress="topk", block=64, topk=2)
    dec = decode_update(enc.blob, shapes(u), sha256=enc.sha256)
    for k in u:
        assert np.array_equal(dec[k], enc.decoded[k])
        np.testing.assert_allclose(dec[k] + enc.residual[k], u[k], rtol=0, atol=1e-9)
    w = u["model.embed_tokens.weight"].reshape(100, 1, 64)
    d = dec["model.embed_tokens.weight"].reshape(100, 1, 64)
    assert ((d != 0).sum(axis=2) == 2).all()
    top2 = np.sort(np.argsort(-np.abs(w), axis=2)[..., :2], axis=2)
    assert np.array_equal(np.sort(np.nonzero(d)[2].reshape(100, 1, 2), axis=2), top2)
    # the kept values are int8-coded against the larger of the two: within half a step of it
    assert np.abs(np.take_along_axis(d - w, top2, axis=2)).max() <= np.abs(w).max() / 127 / 2 + 1e-9
    # a row that 64 does not divide is one block with ceil(2 * 10 / 64) = 1 value kept
    odd = dec["model.odd.weight"].reshape(15, 10)
    assert ((odd != 0).sum(axis=1) == 1).all()
    assert np.array_equal(dec["model.layers.0.input_layernorm.weight"], u["model.layers.0.input_layernorm.weight"])


def test_bytes_of_a_topk_update_against_float32():
    """Per block of 64: 2 uint8 positions, 2 int8 codes, 1 float32 scale = 8 bytes against 256."""
    rng = np.random.default_rng(3)
    u = {f"model.layers.{i}.mlp.up_proj.weight": rng.standard_normal((256, 256)).astype(np.float32) for i in range(4)}
    full = fp32_bytes(shapes(u))
    enc = encode_update(u, compress="topk", block=64, topk=2)
    data = sum(v.size for v in u.values()) // 64 * 8
    assert data < enc.bytes < data + 2048  # and the header (12 tensors)
    print(f"top-2 of 64: {enc.bytes} B vs {full} B float32 ({full / enc.bytes:.1f}x)")
    assert full / enc.bytes > 30  # 32x less the header
    wide = encode_update(u, compress="topk", block=256, topk=4)  # 4 + 4 + 4 bytes per 256 values
    assert full / wide.bytes > 75  # 85x less the header


def test_topk_error_feedback_sends_what_sparsity_held_back():
    """A constant update sent top-2 of 64 with feedback: what arrived plus the residual is exactly
    what was meant; a held-back value's residual grows until it is among the largest, so nearly
    every position arrives and the total's error shrinks like 1/steps (measured: 0.56 of its norm
    after 16 steps, 0.22 after 64, 0.06 after 256). Without feedback 2 positions of 64 ever do."""
    rng = np.random.default_rng(2)
    base = (rng.standard_normal((4, 64)) * 1e-3).astype(np.float32)
    residual, sent = None, np.zeros_like(base)
    for _ in range(256):
        enc = encode_update({"w": base}, residual, compress="topk", topk=2)
        residual = enc.residual
        sent += enc.decoded["w"]
    np.testing.assert_allclose(sent + residual["w"], 256 * base, rtol=1e-4, atol=1e-6)
    assert (sent != 0).mean() > 0.9
    assert np.linalg.norm(sent - 256 * base) < 0.1 * np.linalg.norm(256 * base)
    plain = encode_update({"w": base}, compress="topk", topk=2).decoded["w"]
    assert ((plain != 0).sum(axis=1) == 2).all()


def test_decode_refuses_a_malformed_topk_update():
    u = update()
    s = shapes(u)
    enc = encode_update(u, compress="topk", topk=2)
    meta = {"format": "stoa.outer-update/1", "compress": "topk", "block": "64", "topk": "2"}
    name = "model.layers.0.mlp.up_proj.weight"

    def planted(**change) -> bytes:
        t = dict(tensorfile.read(enc.blob).tensors)
        t.update(change)
        return tensorfile.encode(t, meta)

    i = tensorfile.read(enc.blob).tensors[name + "#i"]
    for bad, why in ((np.where(i == i.max(), 64, i).astype(np.uint8), "outside"),      # past the block
                     (i[..., ::-1].copy(), "ascending"),                              # unsorted
                     (np.repeat(i[..., :1], 2, axis=2), "ascending"),                 # a position twice
                     (i.astype(np.int32), "expected"),                                # another dtype
                     (i[..., :1].copy(), "expected")):                                # fewer than k
        with pytest.raises(UpdateError, match=why):
            decode_update(planted(**{name + "#i": bad}), s)
    q = np.array(tensorfile.read(enc.blob).tensors[name + "#q"])
    q[0, 0, 0] = -128
    with pytest.raises(UpdateError, match="-128"):
        decode_update(planted(**{name + "#q": q}), s)
    sc = np.array(tensorfile.read(enc.blob).tensors[name + "#s"])
    sc[0, 0] = np.inf
    with pytest.raises(UpdateError, match="scale"):
        decode_update(planted(**{name + "#s": sc}), s)
    with pytest.raises(UpdateError, match="topk"):
        decode_update(tensorfile.encode(dict(tensorfile.read(enc.blob).tensors), {**meta, "topk": "x"}), s)
    with pytest.raises(UpdateError, match="missing"):  # an int8 file's tensors under a top-k header
        decode_update(tensorfile.encode(dict(tensorfile.read(encode_update(u).blob).tensors), meta), s)
    with pytest.raises(UpdateError, match="expected"):  # and top-k tensors under an int8 one
        decode_update(tensorfile.encode(dict(tensorfile.read(enc.blob).tensors), {**meta, "compress": "int8"}), s)
    with pytest.raises(ValueError, match="compress"):
        encode_update(u, compress="topk", topk=0)


def test_nesterov_outer_step_golden_numbers():
    """lr 0.5, mu 0.9, one parameter. Step 1: g = mean(1, 3) = 2, m = 2, step = g + mu m = 3.8,
    change -1.9. Step 2: g = 1, m = 0.9*2 + 1 = 2.8, step = 1 + 2.52 = 3.52, change -1.76.
    Heavy-ball: changes -1.0 (m = 2) and -1.4 (m = 2.8)."""
    opt = OuterOptimizer(lr=0.5, momentum=0.9, nesterov=True)
    a = opt.step([{"w": np.array([1.0], np.float32)}, {"w": np.array([3.0], np.float32)}])
    b = opt.step([{"w": np.array([1.0], np.float32)}])
    np.testing.assert_allclose([a["w"][0], b["w"][0]], [-1.9, -1.76], rtol=1e-6)
    hb = OuterOptimizer(lr=0.5, momentum=0.9, nesterov=False)
    c = hb.step([{"w": np.array([1.0], np.float32)}, {"w": np.array([3.0], np.float32)}])
    d = hb.step([{"w": np.array([1.0], np.float32)}])
    np.testing.assert_allclose([c["w"][0], d["w"][0]], [-1.0, -1.4], rtol=1e-6)
    avg = OuterOptimizer(lr=1.0, momentum=0.0).step([{"w": np.array([2.0], np.float32)},
                                                     {"w": np.array([4.0], np.float32)}])
    assert avg["w"][0] == -3.0  # plain averaging: theta - mean(theta - theta_i) = mean(theta_i)


def test_outer_config_bounds_and_the_torch_learner():
    assert not OuterConfig().active and OuterConfig(trainers=2).active and OuterConfig(inner_steps=4).active
    for bad in ({"trainers": 0}, {"inner_steps": 0}, {"momentum": 1.0}, {"lr": 0.0}, {"deadline_s": 0.0},
                {"compress": "fp8"}, {"compress": "topk", "topk": 0}, {"topk": 65}):
        with pytest.raises(ConfigError):
            OuterConfig(**bad)
    with pytest.raises(ConfigError, match="megatron"):
        RunConfig.from_dict({"outer": {"trainers": 2}, "learner": {"kind": "megatron"}})
    with pytest.raises(ConfigError, match="outer"):
        RunConfig.from_dict({"outer": {"trainer": 2}})
    assert RunConfig.from_dict({"outer": {"trainers": 2, "inner_steps": 4}}).outer.inner_steps == 4
    assert RunConfig.from_dict({"outer": {"trainers": 2, "compress": "topk", "topk": 4, "block": 256}}).outer.topk == 4


def test_the_exchange_checks_what_it_reads(tmp_path):
    """Updates carry the trainers' MAC, merged steps and bases the run's signature; a planted or
    altered object is refused, never applied."""
    store = LocalStore(tmp_path / "store")
    run_key = generate_private_key()
    secret = read_secret(make_secret(tmp_path / "outer.secret"))
    coord = OuterExchange(store, "r", secret, run_key.public_key(), run_key)
    inner = OuterExchange(store, "r", secret, run_key.public_key())
    stranger = OuterExchange(store, "r", b"x" * 32, run_key.public_key())
    u = update()
    enc = encode_update(u)
    inner.put_update(3, 1, enc, {"items": [0], "failed": {}, "metrics": []})
    meta, dec = coord.update(3, 1, shapes(u))
    assert meta["items"] == [0] and all(np.array_equal(dec[k], enc.decoded[k]) for k in u)
    assert coord.update(3, 2, shapes(u)) is None
    sparse = encode_update(u, compress="topk", topk=2)
    inner.put_update(3, 3, sparse, {"items": [0], "failed": {}, "metrics": []})
    assert all(np.array_equal(coord.update(3, 3, shapes(u))[1][k], sparse.decoded[k]) for k in u)
    stranger.put_update(3, 2, enc, {"items": [0], "failed": {}, "metrics": []})
    with pytest.raises(UpdateError, match="MAC"):
        coord.update(3, 2, shapes(u))
    store.put("r/outer/updates/v000000000003/r1.safetensors", encode_update(update(1)).blob)  # swapped payload
    with pytest.raises(UpdateError, match="sha256"):
        coord.update(3, 1, shapes(u))
    coord.put_merged(3, 4, enc, [0, 1], [])
    meta, _ = inner.merged(3, shapes(u))
    assert meta["to_version"] == 4 and meta["included"] == [0, 1]
    with pytest.raises(Exception):
        inner.put_merged(5, 6, enc, [0], [])  # no run key: it cannot sign a merge
    coord.put_base(3, u)
    assert inner.newest_base() == 3
    assert all(np.array_equal(inner.base(3)[k], u[k]) for k in u)
    inner.beat(1, 3, 2)
    stranger.beat(2, 3, 0)
    assert set(coord.beats()) == {1} and coord.beats()[1].trained == 2
    coord.put_work(3, 1, 0, [])
    assert inner.work(3, 1, set(), 1000) == [(0, [])] and inner.work(3, 1, {0}, 1000) == []
    coord.prune(3, keep_from=4)
    assert not store.list("r/outer/deals/") and not store.list("r/outer/updates/")
    assert not store.list("r/outer/base/")
    assert store.list("r/outer/merged/") == ["r/outer/merged/v000000000005.safetensors"]  # unsigned: never read
    assert inner.merged(5, shapes(u)) is None
