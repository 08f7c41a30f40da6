"""The signed version chain: publish/sync on both stores, route choice, in-place sync, forgery
and corruption refused or routed around, a crash between any two writes, retention, keys."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from stoa.transport import pulse
from stoa.transport.chain import ChainError, IntegrityError, PointerError, WeightPublisher, WeightSubscriber
from stoa.transport.signing import (
    SignatureError,
    generate_private_key,
    key_id,
    load_private_key,
    load_public_key,
    save_keypair,
)
from stoa.transport.store import LocalStore

RUN = "runs/r1"
W = "model.layers.0.mlp.up_proj"


def make_state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f"{W}.weight": rng.integers(0, 256, (128, 512), dtype=np.uint8),
        f"{W}.scales": rng.standard_normal((128, 8)).astype(np.float16),
        f"{W}.biases": rng.standard_normal((128, 8)).astype(np.float16),
        "model.norm.weight": rng.standard_normal(512).astype(np.float32),
    }


def step(state: dict[str, np.ndarray], rng: np.random.Generator, rate: float = 0.005) -> dict[str, np.ndarray]:
    """An optimizer-step-like change: `rate` of the codes move by +-1, one norm entry moves."""
    new = {k: v.copy() for k, v in state.items()}
    codes = new[f"{W}.weight"].reshape(-1)
    idx = rng.choice(codes.size, int(rate * codes.size), replace=False)
    codes[idx] = np.clip(codes[idx].astype(int) + rng.choice([-1, 1], idx.size), 0, 255).astype(np.uint8)
    new["model.norm.weight"][rng.integers(512)] += np.float32(0.01)
    return new


def make_chain(n: int, rate: float = 0.005, seed: int = 0) -> dict[int, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed + 100)
    states = {1: make_state(seed)}
    for v in range(2, n + 1):
        states[v] = step(states[v - 1], rng, rate)
    return states


@pytest.fixture(scope="module")
def key():
    return generate_private_key()


@pytest.fixture(scope="module")
def states():
    return make_chain(10)


def publish_all(store, key, states, **kw):
    pub = WeightPublisher(store, RUN, key, **kw)
    return pub, {v: pub.publish(v, s, {"step": v}) for v, s in sorted(states.items())}


def same(a: dict, b: dict) -> bool:
    return pulse.state_hash(a) == pulse.state_hash(b)


# --------------------------------------------------------------------------------------------
# Publish and follow, on every store
# --------------------------------------------------------------------------------------------


def test_publish_join_and_follow(store, key, states):
    pub, res = publish_all(store, key, states, anchor_every=4, keep_anchors=None)
    assert [res[v].kind for v in range(1, 11)] == ["anchor", "delta", "delta", "delta", "anchor",
                                                    "delta", "delta", "delta", "anchor", "delta"]
    full = res[1].full_state_bytes
    assert res[2].delta_bytes < full / 20 and res[2].bytes_written < full / 10
    assert res[5].delta_bytes is not None  # a scheduled anchor keeps its delta for workers on the chain
    sub = WeightSubscriber(store, RUN, key.public_key())
    assert sub.head() == 10
    joined = sub.sync(None)
    assert joined.version == 10 and same(joined.state, states[10])
    assert joined.applied == [(9, "anchor"), (10, "delta")] and not joined.problems
    assert sorted(joined.changed_names) == sorted(states[10])
    assert sub.manifest(7).metadata == {"step": 7}
    # A worker one version behind moves only a delta (plus pointer and manifests).
    r = sub.sync((9, states[9]))
    assert r.applied == [(10, "delta")] and same(r.state, states[10])
    assert r.bytes_read < full / 10
    assert r.changed_names == sorted({f"{W}.weight", "model.norm.weight"})
    # Already at head: nothing to apply, the state comes back as is.
    r = sub.sync((10, joined.state))
    assert r.applied == [] and r.state is joined.state


def test_a_long_follow_keeps_a_bounded_number_of_manifests(tmp_path, key, states):
    """A subscriber syncing version after version keeps at most its manifest_cache_entries
    manifests (a run publishing for days must not grow its workers), and still syncs exactly."""
    store = LocalStore(tmp_path)
    pub = WeightPublisher(store, RUN, key, anchor_every=4)
    sub = WeightSubscriber(store, RUN, key.public_key())
    sub.manifest_cache_entries = 3
    held = None
    for v, s in sorted(states.items()):
        pub.publish(v, s, {"step": v})
        r = sub.sync(held)
        assert r.version == v and same(r.state, s)
        held = (r.version, r.state)
        assert len(sub._cache) <= 3
    assert sub.manifest(2).metadata == {"step": 2}  # an evicted manifest is read again


def test_publisher_resumes_from_store_and_refuses_old_versions(tmp_path, key, states):
    store = LocalStore(tmp_path)
    publish_all(store, key, {v: states[v] for v in range(1, 6)}, anchor_every=50)
    pub = WeightPublisher(store, RUN, key, anchor_every=50)
    with pytest.raises(ChainError, match="not newer than the committed head 5"):
        pub.publish(5, states[6])
    r = pub.publish(6, states[6])
    assert r.kind == "delta"
    assert WeightSubscriber(store, RUN, key.public_key()).manifest(6).parent == 5
    assert same(WeightSubscriber(store, RUN, key.public_key()).sync(None).state, states[6])


def test_route_prefers_deltas_when_they_move_fewer_bytes(tmp_path, key, states):
    store = LocalStore(tmp_path)
    publish_all(store, key, states, anchor_every=4, keep_anchors=None)
    r = WeightSubscriber(store, RUN, key.public_key()).sync((2, states[2]))
    assert r.applied == [(v, "delta") for v in range(3, 11)] and same(r.state, states[10])


def test_route_jumps_to_newer_anchor_when_deltas_are_bigger(tmp_path, key):
    store = LocalStore(tmp_path)
    heavy = make_chain(8, rate=0.8)  # each delta is ~1/6 of the state: 7 deltas cost more than anchor 7 + delta 8
    publish_all(store, key, heavy, anchor_every=6, anchor_if_delta_over=1.0, keep_anchors=None)
    r = WeightSubscriber(store, RUN, key.public_key()).sync((1, heavy[1]))
    assert r.applied == [(7, "anchor"), (8, "delta")] and same(r.state, heavy[8])


def test_anchor_when_delta_is_not_much_smaller_or_layout_changes(tmp_path, key):
    store = LocalStore(tmp_path)
    pub = WeightPublisher(store, RUN, key, anchor_every=100)
    pub.publish(1, make_state(0))
    r = pub.publish(2, make_state(1))  # unrelated weights: the delta would be ~ the state
    assert r.kind == "anchor" and r.delta_bytes is None
    grown = {**make_state(1), "lm_head.weight": np.zeros((4, 64), np.uint8)}
    assert pub.publish(3, grown).kind == "anchor"
    sub = WeightSubscriber(store, RUN, key.public_key())
    r = sub.sync((2, make_state(1)))
    assert r.applied == [(3, "anchor")] and same(r.state, grown)
    assert "lm_head.weight" in r.changed_names


def test_sync_in_place_updates_the_callers_arrays(tmp_path, key, states):
    store = LocalStore(tmp_path)
    publish_all(store, key, states, anchor_every=4, keep_anchors=None)
    sub = WeightSubscriber(store, RUN, key.public_key())
    live = {k: v.copy() for k, v in states[6].items()}
    arrays = {k: id(v) for k, v in live.items()}
    r = sub.sync((6, live), apply_inplace=True)
    assert r.inplace and r.state is live and {k: id(v) for k, v in live.items()} == arrays
    assert same(live, states[10]) and r.applied == [(v, "delta") for v in range(7, 11)]
    assert set(r.changed_names) == {f"{W}.weight", "model.norm.weight"}
    # A route through an anchor (the held version is gone from the chain) copies into the arrays too.
    stale = {k: v.copy() for k, v in make_state(7).items()}
    r = sub.sync((3, stale), apply_inplace=True)
    assert r.inplace and r.state is stale and same(stale, states[10])


# --------------------------------------------------------------------------------------------
# Forgery refused
# --------------------------------------------------------------------------------------------


def _envelope(store, key):
    return json.loads(store.get(key))


def test_forged_or_unsigned_objects_are_refused(tmp_path, key, states):
    store = LocalStore(tmp_path)
    publish_all(store, key, {v: states[v] for v in range(1, 5)}, anchor_every=50)
    pub_key = key.public_key()
    mkey = f"{RUN}/weights/{4:012d}/manifest.json"
    good = store.get(mkey)

    # Signed by someone else's key.
    other = WeightPublisher(LocalStore(tmp_path / "other"), RUN, generate_private_key(), anchor_every=50)
    for v in range(1, 5):
        other.publish(v, states[v])
    store.put(mkey, other.store.get(mkey))
    with pytest.raises(IntegrityError, match="not this run's key"):  # the head manifest: no route around it
        WeightSubscriber(store, RUN, pub_key).sync((3, states[3]))

    # Body altered after signing (claims another state hash).
    env = json.loads(good)
    body = json.loads(env["body"])
    body["state_hash"] = "0" * 64
    env["body"] = json.dumps(body, sort_keys=True, separators=(",", ":"))
    store.put(mkey, json.dumps(env).encode())
    with pytest.raises(IntegrityError, match="bad ed25519 signature"):
        WeightSubscriber(store, RUN, pub_key).sync((3, states[3]))
    with pytest.raises(SignatureError, match="bad ed25519 signature"):
        WeightSubscriber(store, RUN, pub_key).manifest(4)

    # No signature at all.
    store.put(mkey, json.dumps({"body": env["body"]}).encode())
    with pytest.raises(IntegrityError, match="unsigned"):
        WeightSubscriber(store, RUN, pub_key).sync((3, states[3]))

    # A genuine signature replayed at another version.
    store.put(mkey, store.get(f"{RUN}/weights/{3:012d}/manifest.json"))
    with pytest.raises(SignatureError, match="version 3"):
        WeightSubscriber(store, RUN, pub_key).manifest(4)

    # A forged pointer (signed with a signature taken from elsewhere).
    store.put(mkey, good)
    ptr = _envelope(store, f"{RUN}/current.json")
    ptr["signature"] = _envelope(store, mkey)["signature"]
    store.put(f"{RUN}/current.json", json.dumps(ptr).encode())
    with pytest.raises(PointerError, match="bad ed25519 signature"):
        WeightSubscriber(store, RUN, pub_key).head()
    assert issubclass(PointerError, ChainError) and issubclass(PointerError, SignatureError)


def test_swapped_payload_is_never_applied(tmp_path, key, states):
    store = LocalStore(tmp_path)
    publish_all(store, key, {v: states[v] for v in range(1, 4)}, anchor_every=50)
    # Replace delta 3 by a valid delta of the same layout that leads elsewhere.
    evil = pulse.encode_delta(states[2], step(states[2], np.random.default_rng(9)))
    store.put(f"{RUN}/weights/{3:012d}/delta.pulse", evil)
    held = {k: v.copy() for k, v in states[2].items()}
    with pytest.raises(IntegrityError, match="no intact route") as e:
        WeightSubscriber(store, RUN, key.public_key()).sync((2, held), apply_inplace=True)
    assert "delta.pulse" in str(e.value) and "corrupted" in str(e.value)
    assert same(held, states[2])  # nothing was written into the live state


# --------------------------------------------------------------------------------------------
# Corruption detected, reported, routed around
# --------------------------------------------------------------------------------------------


def test_truncated_delta_falls_back_to_anchor(tmp_path, key, states):
    store = LocalStore(tmp_path)
    publish_all(store, key, states, anchor_every=4, keep_anchors=None)
    dkey = f"{RUN}/weights/{7:012d}/delta.pulse"
    store.put(dkey, store.get(dkey)[:-10])
    r = WeightSubscriber(store, RUN, key.public_key()).sync((6, states[6]))
    assert r.applied == [(9, "anchor"), (10, "delta")] and same(r.state, states[10])
    assert any(dkey in p and "truncated" in p for p in r.problems)


def test_truncated_anchor_falls_back_to_older_anchor(tmp_path, key, states):
    store = LocalStore(tmp_path)
    publish_all(store, key, states, anchor_every=4, keep_anchors=None)
    akey = f"{RUN}/weights/{9:012d}/anchor.safetensors"
    store.put(akey, store.get(akey)[: 1000])
    r = WeightSubscriber(store, RUN, key.public_key()).sync(None)
    assert r.applied[0] == (5, "anchor") and r.applied[-1] == (10, "delta") and same(r.state, states[10])
    assert any(akey in p for p in r.problems)


def test_garbled_manifest_is_routed_around(tmp_path, key, states):
    store = LocalStore(tmp_path)
    publish_all(store, key, states, anchor_every=4, keep_anchors=None)
    mkey = f"{RUN}/weights/{7:012d}/manifest.json"
    store.put(mkey, store.get(mkey)[:50])
    r = WeightSubscriber(store, RUN, key.public_key()).sync((6, states[6]))
    assert r.applied == [(9, "anchor"), (10, "delta")] and same(r.state, states[10])
    assert any(mkey in p for p in r.problems)


class FlakyStore:
    """Returns a truncated copy the first time each watched key is read (a broken transfer)."""

    def __init__(self, inner, watch: set[str]):
        self.inner, self.watch = inner, set(watch)

    def get(self, key, max_bytes=None):
        data = self.inner.get(key, max_bytes=max_bytes)
        if key in self.watch:
            self.watch.discard(key)
            return data[: len(data) // 2]
        return data

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_transient_corruption_is_fetched_again(tmp_path, key, states):
    store = LocalStore(tmp_path)
    publish_all(store, key, states, anchor_every=4, keep_anchors=None)
    dkey = f"{RUN}/weights/{10:012d}/delta.pulse"
    r = WeightSubscriber(FlakyStore(store, {dkey}), RUN, key.public_key()).sync((9, states[9]))
    assert r.applied == [(10, "delta")] and same(r.state, states[10])
    assert len(r.problems) == 1 and "fetching again" in r.problems[0]


def test_wrong_held_state_is_detected_and_repaired(tmp_path, key, states):
    store = LocalStore(tmp_path)
    publish_all(store, key, states, anchor_every=4, keep_anchors=None)
    live = {k: v.copy() for k, v in states[5].items()}  # claims to be version 6, is version 5
    r = WeightSubscriber(store, RUN, key.public_key()).sync((6, live), apply_inplace=True)
    assert same(r.state, states[10]) and r.state is live and r.applied[0] == (9, "anchor")
    assert any("not the version it claimed" in p for p in r.problems)


def test_garbled_pointer_is_reported_and_repaired_by_the_publisher(tmp_path, key, states):
    store = LocalStore(tmp_path)
    publish_all(store, key, {v: states[v] for v in range(1, 5)}, anchor_every=50)
    ptr = f"{RUN}/current.json"
    store.put(ptr, store.get(ptr)[:40])
    sub = WeightSubscriber(store, RUN, key.public_key())
    with pytest.raises(PointerError, match="current.json: not valid JSON"):
        sub.sync(None)
    pub = WeightPublisher(store, RUN, key, anchor_every=50)
    assert pub.publish(5, states[5]).kind == "delta"  # resumed from version 4 after the repair
    assert same(sub.sync((3, states[3])).state, states[5])


def test_held_version_newer_than_head_and_empty_run(tmp_path, key, states):
    store = LocalStore(tmp_path)
    sub = WeightSubscriber(store, RUN, key.public_key())
    assert sub.head() is None
    with pytest.raises(ChainError, match="no published weights"):
        sub.sync(None)
    publish_all(store, key, {1: states[1]})
    # The newest head the run's key signed is behind the held version: the held state is from
    # another branch (a restart from an older state), never served under a label reused there.
    r = sub.sync((5, states[5]))
    assert r.version == 1 and same(r.state, states[1]) and r.applied == [(1, "anchor")]
    assert "older than the held version 5" in r.problems[0] and "re-joining from an anchor" in r.message


# --------------------------------------------------------------------------------------------
# Crash between any two writes
# --------------------------------------------------------------------------------------------


class SimulatedCrash(Exception):
    pass


class CrashingStore:
    """Forwards to a store, but the `crash_at`-th mutating call (put or delete) raises first."""

    def __init__(self, inner, crash_at: int | None = None):
        self.inner, self.crash_at, self.ops = inner, crash_at, 0

    def _tick(self):
        self.ops += 1
        if self.crash_at is not None and self.ops == self.crash_at:
            raise SimulatedCrash(f"crash at write {self.ops}")

    def put(self, key, data):
        self._tick()
        self.inner.put(key, data)

    def delete(self, key):
        self._tick()
        self.inner.delete(key)

    def put_if_absent(self, key, data):
        self._tick()
        return self.inner.put_if_absent(key, data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_crash_between_any_two_writes(tmp_path, key):
    states = make_chain(6, seed=3)
    kw = dict(anchor_every=2, keep_anchors=1, keep_seconds=0)
    counter = CrashingStore(LocalStore(tmp_path / "count"))
    publish_all(counter, key, states, **kw)
    total = counter.ops
    assert total > 20  # payloads, manifests, pointers and retention deletes
    for crash_at in range(1, total + 1):
        store = LocalStore(tmp_path / f"c{crash_at}")
        crashing = CrashingStore(store, crash_at)
        pub = WeightPublisher(crashing, RUN, key, **kw)
        early = None
        with pytest.raises(SimulatedCrash):
            for v in range(1, 7):
                pub.publish(v, states[v])
                if v == 2:
                    early = WeightSubscriber(store, RUN, key.public_key()).sync(None)
        sub = WeightSubscriber(store, RUN, key.public_key())
        head = sub.head()
        if head is None:
            with pytest.raises(ChainError):
                sub.sync(None)
        else:  # readers see exactly a complete, valid version
            r = sub.sync(None)
            assert r.version == head and same(r.state, states[head]), f"crash at write {crash_at}"
        # The trainer restarts and publishes from the next version on.
        pub2 = WeightPublisher(store, RUN, key, **kw)
        for v in range((head or 0) + 1, 7):
            pub2.publish(v, states[v])
        r = WeightSubscriber(store, RUN, key.public_key()).sync(None)
        assert r.version == 6 and same(r.state, states[6]), f"crash at write {crash_at}"
        if early is not None:  # a worker that synced before the crash catches up
            r = WeightSubscriber(store, RUN, key.public_key()).sync((early.version, early.state))
            assert same(r.state, states[6])


# --------------------------------------------------------------------------------------------
# Retention
# --------------------------------------------------------------------------------------------


def test_retention_keeps_what_joiners_need(tmp_path, key):
    states = make_chain(12, seed=5)
    store = LocalStore(tmp_path)
    publish_all(store, key, states, anchor_every=4, keep_anchors=2, keep_seconds=0)
    versions = sorted({int(k.split("/")[3]) for k in store.list(f"{RUN}/weights/")})
    assert versions == list(range(5, 13))  # anchors 5 and 9 kept, 1-4 deleted at anchor 9
    sub = WeightSubscriber(store, RUN, key.public_key())
    assert same(sub.sync(None).state, states[12])
    r = sub.sync((2, states[2]))  # its version is gone: it goes through an anchor
    assert r.applied[0][1] == "anchor" and same(r.state, states[12])

    # Orphans below the head (a crash's uncommitted leftovers) go; versions above it stay.
    orphan, pending = f"{RUN}/weights/{13:012d}/delta.pulse", f"{RUN}/weights/{20:012d}/delta.pulse"
    store.put(orphan, b"left by a crash")
    store.put(pending, b"being written")
    pub = WeightPublisher(store, RUN, key, anchor_every=4, keep_anchors=None)
    assert pub.publish(14, step(states[12], np.random.default_rng(1))).kind == "anchor"
    assert store.exists(orphan)
    deleted = pub.gc(keep_anchors=2).deleted  # anchors 14 and 9 now
    assert orphan in deleted and store.exists(pending) and not store.exists(orphan)
    assert sorted({int(k.split("/")[3]) for k in store.list(f"{RUN}/weights/")}) == [9, 10, 11, 12, 14, 20]
    assert sub.sync(None).version == 14


# --------------------------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------------------------


def test_keys_raw_pem_and_files(tmp_path, states):
    k = generate_private_key()
    priv, pub = save_keypair(k, tmp_path, "run7")
    assert oct(priv.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(FileExistsError):
        save_keypair(k, tmp_path, "run7")
    raw_priv = base64.b64decode(b"".join(priv.read_bytes().splitlines()[1:-1]))[-32:]
    for src in (priv, str(priv), priv.read_bytes(), raw_priv):
        assert key_id(load_private_key(src).public_key()) == key_id(k.public_key())
    raw_pub = load_public_key(pub).public_bytes_raw()
    for src in (pub, pub.read_bytes(), raw_pub, raw_pub.hex(), k):
        assert key_id(load_public_key(src)) == key_id(k.public_key())
    (tmp_path / "junk").write_bytes(b"not a key")
    with pytest.raises(ValueError):
        load_private_key(tmp_path / "junk")
    with pytest.raises(ValueError):
        load_public_key(priv)  # a private key file is not a public key
    store = LocalStore(tmp_path / "s")
    WeightPublisher(store, RUN, priv).publish(1, states[1])
    assert WeightSubscriber(store, RUN, raw_pub.hex()).head() == 1


def test_overwriting_a_key_ends_with_mode_0600_and_never_writes_through_a_link(tmp_path):
    old = tmp_path / "run.key"
    old.write_bytes(b"an old key")
    old.chmod(0o644)
    priv, pub = save_keypair(generate_private_key(), tmp_path, "run", overwrite=True)
    assert oct(priv.stat().st_mode & 0o777) == "0o600" and oct(pub.stat().st_mode & 0o777) == "0o644"
    assert key_id(load_private_key(priv).public_key()) == key_id(load_public_key(pub))
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"not a key")
    priv.unlink()
    priv.symlink_to(outside)
    save_keypair(generate_private_key(), tmp_path, "run", overwrite=True)
    assert not priv.is_symlink() and outside.read_bytes() == b"not a key"
    assert oct(priv.stat().st_mode & 0o777) == "0o600"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside.txt", "run.key", "run.pub"]  # no temp files left


def test_cli_keygen(tmp_path):
    from stoa.cli import app

    r = CliRunner().invoke(app, ["keygen", str(tmp_path / "keys"), "--name", "demo"])
    assert r.exit_code == 0, r.output
    k = load_private_key(tmp_path / "keys" / "demo.key")
    assert key_id(load_public_key(tmp_path / "keys" / "demo.pub")) == key_id(k.public_key())
    assert key_id(k.public_key()) in r.output
    r = CliRunner().invoke(app, ["keygen", str(tmp_path / "keys"), "--name", "demo"])
    assert r.exit_code != 0  # never overwrites a key


# --------------------------------------------------------------------------------------------
# A real model's weight state through the chain
# --------------------------------------------------------------------------------------------


def test_tiny_model_states_through_the_chain(tmp_path, key, tiny_model):
    from safetensors.numpy import load_file

    from stoa.transport.quant import quantize_state

    weights = load_file(str(tiny_model / "model.safetensors"))
    rng = np.random.default_rng(0)
    states = {1: quantize_state(weights)}
    for v in range(2, 6):  # sign-like steps of an Adam update at lr 1e-4 on 2% of the entries
        weights = {k: w + (1e-4 * np.sign(rng.standard_normal(w.shape)) * (rng.random(w.shape) < 0.02)).astype(w.dtype)
                   for k, w in weights.items()}
        states[v] = quantize_state(weights, previous=states[v - 1])
    store = LocalStore(tmp_path)
    pub = WeightPublisher(store, RUN, key, anchor_every=50)
    results = [pub.publish(v, states[v]) for v in sorted(states)]
    assert results[0].kind == "anchor" and all(r.kind == "delta" for r in results[1:])
    assert max(r.bytes_written for r in results[1:]) < results[0].full_state_bytes / 5
    sub = WeightSubscriber(store, RUN, key.public_key())
    live = sub.sync(None).state
    pub.publish(6, quantize_state({k: w * np.float32(1.001) for k, w in weights.items()}, previous=states[5]))
    r = sub.sync((5, live), apply_inplace=True)
    assert r.inplace and r.applied == [(6, "delta")] and live is r.state
    assert pulse.state_hash(live) == sub.manifest(6).state_hash


def test_retention_keeps_recent_versions_for_slow_followers(tmp_path, key):
    """With an anchor every version, keep_anchors alone would delete the anchor a slow follower
    planned a minute ago; keep_seconds keeps everything published that recently."""
    states = make_chain(6, seed=7)
    store = LocalStore(tmp_path)
    publish_all(store, key, states, anchor_every=1, keep_anchors=1, keep_seconds=3600)
    assert sorted({int(k.split("/")[3]) for k in store.list(f"{RUN}/weights/")}) == [1, 2, 3, 4, 5, 6]
    pub = WeightPublisher(store, RUN, key, anchor_every=1, keep_anchors=1)
    assert pub.gc(keep_anchors=1, keep_seconds=0).deleted  # the floor is what kept them
    assert sorted({int(k.split("/")[3]) for k in store.list(f"{RUN}/weights/")}) == [6]
