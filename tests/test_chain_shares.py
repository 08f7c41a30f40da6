"""Pipeline stages following the signed weight chain for their layers only: per-share hashes in
the manifest, range reads of an anchor, deltas applied to a share and checked at every version,
tampering refused with nothing written, and old manifests still read by whole-model workers."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from stoa.transport import pulse, shares
from stoa.transport.chain import ChainError, IntegrityError, ShareSubscriber, WeightPublisher, WeightSubscriber
from stoa.transport.manifest import Layout, Manifest, Payload, Pointer
from stoa.transport.signing import SignatureError, generate_private_key, open_document, sign_document
from stoa.transport.store import LocalStore
from stoa.transport.subscriber import sha256_hex

RUN = "runs/pp"
LAYERS = 8


def make_state(seed: int = 0, layers: int = LAYERS, tied: bool = True) -> dict[str, np.ndarray]:
    """An int8 state shaped like a decoder's: per layer codes + scales + biases and two norms."""
    rng = np.random.default_rng(seed)
    st = {"model.embed_tokens.weight": rng.integers(0, 256, (256, 64), dtype=np.uint8),
          "model.embed_tokens.scales": rng.standard_normal((256, 1)).astype(np.float16),
          "model.norm.weight": rng.standard_normal(64).astype(np.float32)}
    if not tied:
        st["lm_head.weight"] = rng.integers(0, 256, (256, 64), dtype=np.uint8)
    for i in range(layers):
        p = f"model.layers.{i}."
        for w, shape in (("self_attn.q_proj", (64, 64)), ("mlp.up_proj", (128, 64)), ("mlp.down_proj", (64, 128))):
            st[p + w + ".weight"] = rng.integers(0, 256, shape, dtype=np.uint8)
            st[p + w + ".scales"] = rng.standard_normal((shape[0], 1)).astype(np.float16)
            st[p + w + ".biases"] = rng.standard_normal((shape[0], 1)).astype(np.float16)
        st[p + "input_layernorm.weight"] = rng.standard_normal(64).astype(np.float32)
    return st


def step(state, rng, rate=0.01):
    new = {k: v.copy() for k, v in state.items()}
    for k, a in new.items():
        flat = a.reshape(-1)
        at = rng.choice(flat.size, max(1, int(rate * flat.size)), replace=False)
        if a.dtype == np.uint8:
            flat[at] = (flat[at].astype(np.int16) + rng.choice([-1, 1], at.size)).clip(0, 255).astype(np.uint8)
        else:
            flat[at] += a.dtype.type(0.01)
    return new


def make_chain(n, seed=0, tied=True):
    rng = np.random.default_rng(seed + 1)
    out = {1: make_state(seed, tied=tied)}
    for v in range(2, n + 1):
        out[v] = step(out[v - 1], rng)
    return out


def split(layers, stages):
    q, r = divmod(layers, stages)
    bounds = [0]
    for i in range(stages):
        bounds.append(bounds[-1] + q + (i < r))
    return list(zip(bounds[:-1], bounds[1:]))


def want_share(state, part, tied=True):
    return {n: state[n] for n in shares.stage_names(state, part, LAYERS, tied)}


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for n in want:
        assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape, n
        assert got[n].tobytes() == want[n].tobytes(), n


@pytest.fixture(scope="module")
def key():
    return generate_private_key()


@pytest.fixture(scope="module")
def states():
    return make_chain(7)


def publish(store, key, states, upto=None, **kw):
    pub = WeightPublisher(store, RUN, key, anchor_every=4, **kw)
    head = pub.head() or 0
    for v, s in sorted(states.items()):
        if head < v and (upto is None or v <= upto):
            pub.publish(v, s, {"step": v})
    return pub


def test_the_share_rule_and_one_pass_hashes():
    assert shares.share_of("model.layers.12.mlp.up_proj.weight") == "layer.12"
    assert shares.share_of("model.embed_tokens.weight") == "embed"
    assert [shares.share_of(n) for n in ("model.norm.weight", "lm_head.weight", "model.layers.x.w")] == ["head"] * 3
    assert shares.stage_shares((0, 2), 8, tied=True) == ["layer.0", "layer.1", "embed"]
    assert shares.stage_shares((6, 8), 8, tied=True) == ["layer.6", "layer.7", "embed", "head"]
    assert shares.stage_shares((6, 8), 8, tied=False) == ["layer.6", "layer.7", "head"]
    assert shares.stage_shares((2, 4), 8, tied=True) == ["layer.2", "layer.3"]
    with pytest.raises(ValueError):
        shares.stage_shares((4, 4), 8, True)
    assert [shares.check_share_key(k) for k in ("layer.0", "layer.10", "layer.01", "embed", "x", 3)] == [
        True, True, False, True, False, False]
    st = make_state()
    whole, per = pulse.state_hashes(st, shares.share_of)
    assert whole == pulse.state_hash(st) and sorted(per) == sorted({"embed", "head"} | {f"layer.{i}" for i in range(8)})
    for g, h in per.items():
        assert h == pulse.state_hash({n: a for n, a in st.items() if shares.share_of(n) == g})


@pytest.mark.parametrize("stages", [2, 4])
def test_stages_sync_their_shares_from_anchor_and_deltas(store, key, states, stages):
    publish(store, key, states, upto=3)  # anchor 1, deltas 2, 3
    parts = split(LAYERS, stages)
    subs = [ShareSubscriber(store, RUN, key.public_key(), p, LAYERS, tied=True) for p in parts]
    held = []
    for p, sub in zip(parts, subs):
        r = sub.sync(None)
        assert r.version == 3 and r.applied == [(1, "anchor"), (2, "delta"), (3, "delta")] and not r.problems
        assert_same(r.state, want_share(states[3], p))
        held.append(r)
    publish(store, key, states)  # 4..7: version 5 is an anchor beside its delta (anchor_every=4)
    for p, sub, r in zip(parts, subs, held):
        before = r.state
        r2 = sub.sync((r.version, r.state), apply_inplace=True)
        assert r2.version == 7 and r2.applied == [(v, "delta") for v in (4, 5, 6, 7)] and r2.inplace
        assert r2.state is before
        assert_same(r2.state, want_share(states[7], p))
        assert r2.changed_names == sorted(before)
        fresh = ShareSubscriber(store, RUN, key.public_key(), p, LAYERS, tied=True).sync(None)
        assert fresh.applied == [(5, "anchor"), (6, "delta"), (7, "delta")]
        assert_same(fresh.state, want_share(states[7], p))
    assert WeightSubscriber(store, RUN, key.public_key()).sync(None).version == 7  # whole-model workers as before


def test_a_middle_stage_reads_a_fraction_of_the_anchor(tmp_path, key, states):
    store = LocalStore(tmp_path)
    pub = publish(store, key, states, upto=1)
    anchor = store.size(Layout(RUN).payload(1, "anchor"))
    manifest = store.size(Layout(RUN).manifest(1))
    whole = WeightSubscriber(store, RUN, key.public_key()).sync(None).bytes_read
    got = {}
    for stages in (2, 4, 8):
        for p in split(LAYERS, stages)[1:-1] or split(LAYERS, stages)[:1]:
            got[(stages, p)] = ShareSubscriber(store, RUN, key.public_key(), p, LAYERS, True).sync(None).bytes_read
    mid4 = got[(4, (2, 4))]
    print(f"\nanchor {anchor} B, whole-model join {whole} B, middle stage of 4 {mid4} B ({mid4 / anchor:.2f}), "
          f"one layer of 8 {got[(8, (3, 4))]} B ({got[(8, (3, 4))] / anchor:.3f}); manifest {manifest} B")
    assert mid4 < 0.3 * anchor and got[(8, (3, 4))] < 0.2 * anchor
    old = WeightPublisher(LocalStore(tmp_path / "old"), RUN, key, shares=False)
    old.publish(1, states[1])
    grown = manifest - old.store.size(Layout(RUN).manifest(1))
    print(f"manifest growth with {LAYERS + 2} shares: {grown} B ({grown / (LAYERS + 2):.0f} B a share)")
    assert 0 < grown < 100 * (LAYERS + 2) + 200
    assert pub.subscriber.manifest(1).shares is not None


def test_a_tampered_anchor_byte_in_a_stages_range_is_refused(tmp_path, key, states):
    store = LocalStore(tmp_path)
    publish(store, key, states, upto=2)
    k = Layout(RUN).payload(1, "anchor")
    blob = bytearray(store.get(k))
    _, idx = shares.read_header(lambda a, b: bytes(blob[a:b]), len(blob))
    _, _, a, _ = idx["model.layers.3.mlp.up_proj.weight"]
    blob[a + 100] ^= 1
    store.put(k, bytes(blob))
    sub = ShareSubscriber(store, RUN, key.public_key(), (2, 4), LAYERS, True)
    with pytest.raises(IntegrityError, match=r"layer\.3.*do not match their signed hashes") as e:
        sub.sync(None)
    assert "reading again" in str(e.value)
    ok = ShareSubscriber(store, RUN, key.public_key(), (4, 6), LAYERS, True).sync(None)  # its bytes are intact
    assert_same(ok.state, want_share(states[2], (4, 6)))
    # the header too: a byte of it changed is refused before it is parsed
    blob = bytearray(store.get(k))
    blob[20] ^= 1
    store.put(k, bytes(blob))
    with pytest.raises(IntegrityError, match="header"):
        ShareSubscriber(store, RUN, key.public_key(), (4, 6), LAYERS, True).sync(None)


def _forge_head_delta(store, key, states, v, forged):
    """Re-sign version ``v`` (the head) with a delta to ``forged`` while its share hashes stay the
    honest state's: what a publisher would sign to feed stages layers the whole hash would refuse."""
    keys, sub = Layout(RUN), WeightSubscriber(store, RUN, key.public_key())
    m = sub.manifest(v)
    blob = pulse.encode_delta(states[v - 1], forged)
    store.put(keys.payload(v, "delta"), blob)
    doc = sign_document("manifest", dataclasses.replace(m, delta=Payload(len(blob), sha256_hex(blob))).to_body(), key)
    store.put(keys.manifest(v), doc)
    store.put(keys.pointer, sign_document("pointer", Pointer(RUN, v, sha256_hex(doc), time.time()).to_body(), key))


def test_a_forged_delta_entry_for_a_stages_layers_is_refused_and_nothing_written(tmp_path, key, states):
    store = LocalStore(tmp_path)
    publish(store, key, states, upto=2)
    sub = ShareSubscriber(store, RUN, key.public_key(), (2, 4), LAYERS, True)
    r = sub.sync(None)
    held = {n: a.copy() for n, a in r.state.items()}
    other = ShareSubscriber(store, RUN, key.public_key(), (4, 6), LAYERS, True)
    r_other = other.sync(None)
    publish(store, key, {3: states[3]}, upto=3)
    forged = {n: a.copy() for n, a in states[3].items()}
    forged["model.layers.3.mlp.up_proj.weight"][0, :8] ^= 1
    _forge_head_delta(store, key, states, 3, forged)
    with pytest.raises(IntegrityError, match=r"part 'layer\.3' after blob 1 hashes to") as e:
        sub.sync((r.version, r.state), apply_inplace=True)
    assert "nothing was written" in str(e.value)
    assert_same(r.state, held)  # the held share is untouched
    ok = other.sync((r_other.version, r_other.state), apply_inplace=True)  # its layers are honest
    assert ok.version == 3 and ok.applied == [(3, "delta")]
    assert_same(ok.state, want_share(states[3], (4, 6)))
    with pytest.raises(IntegrityError):  # a whole-model worker refuses it by the whole state's hash
        WeightSubscriber(store, RUN, key.public_key()).sync(None)


def test_a_replaced_delta_blob_is_refused_by_its_signed_sha256(tmp_path, key, states):
    store = LocalStore(tmp_path)
    publish(store, key, states, upto=2)
    sub = ShareSubscriber(store, RUN, key.public_key(), (0, 2), LAYERS, True)
    r = sub.sync(None)
    held = {n: a.copy() for n, a in r.state.items()}
    publish(store, key, {3: states[3]}, upto=3)
    forged = {n: a.copy() for n, a in states[3].items()}
    forged["model.layers.1.mlp.up_proj.weight"][0, 0] ^= 1
    store.put(Layout(RUN).payload(3, "delta"), pulse.encode_delta(states[2], forged))
    # the delta is routed around: anchor 1 + the deltas would need version 3's delta too, so no route is left
    with pytest.raises(IntegrityError, match="the signed manifest says"):
        sub.sync((r.version, r.state), apply_inplace=True)
    assert_same(r.state, held)


def test_old_manifests_are_read_by_whole_model_workers_and_refused_by_stages(tmp_path, key, states):
    store = LocalStore(tmp_path)
    pub = publish(store, key, states, upto=3, shares=False)
    body = open_document(store.get(Layout(RUN).manifest(3)), "manifest", key.public_key())
    assert body["format"] == "stoa.weights.manifest/2" and "shares" not in body
    r = WeightSubscriber(store, RUN, key.public_key()).sync(None)
    assert r.version == 3 and pulse.state_hash(r.state) == pulse.state_hash(states[3])
    with pytest.raises(ChainError, match="signs no per-share hashes"):
        ShareSubscriber(store, RUN, key.public_key(), (2, 4), LAYERS, True).sync(None)
    assert pub.subscriber.manifest(3).shares is None
    WeightPublisher(store, RUN, key, anchor_every=4).publish(4, states[4])  # an upgraded trainer: a /3 delta
    with pytest.raises(ChainError, match="version 1 .* signs no per-share hashes"):
        ShareSubscriber(store, RUN, key.public_key(), (2, 4), LAYERS, True).sync(None)  # until the next anchor
    assert WeightSubscriber(store, RUN, key.public_key()).sync(None).version == 4


def test_manifest_share_fields_are_validated(tmp_path, key, states):
    store = LocalStore(tmp_path)
    publish(store, key, states, upto=2)
    m1 = WeightSubscriber(store, RUN, key.public_key()).manifest(1)
    good = m1.to_body()
    assert good["format"] == "stoa.weights.manifest/3" and good["shares"]["anchor_header"]["bytes"] > 8

    def parse(body):
        return Manifest.parse(body, run=RUN, version=1, where="m")

    assert parse(good) == m1
    sha = "ab" * 32

    def bad(**change):
        body = dict(good, shares=dict(good["shares"], **change))
        with pytest.raises(SignatureError):
            parse(body)

    bad(rule="stoa.shares.block/9")
    bad(hashes={})
    bad(hashes={"layer.01": sha})
    bad(hashes={"layer.0": "AB" * 32})
    bad(hashes={f"layer.{i}": sha for i in range(m1.tensors + 1)})
    bad(hashes=[sha])
    bad(anchor_header=None)
    bad(anchor_header={"bytes": 5, "sha256": sha})
    bad(anchor_header={"bytes": m1.anchor.bytes + 1, "sha256": sha})
    bad(extra=1)
    with pytest.raises(SignatureError):
        parse({k: v for k, v in good.items() if k != "shares"})
    with pytest.raises(SignatureError):
        parse(dict(good, format="stoa.weights.manifest/2"))
    with pytest.raises(SignatureError):
        parse(dict(good, shares=None))
    with pytest.raises(ChainError, match="8 layer shares.*16-layer model"):
        ShareSubscriber(store, RUN, key.public_key(), (2, 4), 16, True).sync(None)
    m2 = WeightSubscriber(store, RUN, key.public_key()).manifest(2)
    body = m2.to_body()
    assert body["shares"]["anchor_header"] is None  # a delta-only version
    with pytest.raises(SignatureError):
        Manifest.parse(dict(body, shares=dict(body["shares"], anchor_header={"bytes": 100, "sha256": sha})),
                       run=RUN, version=2, where="m")
