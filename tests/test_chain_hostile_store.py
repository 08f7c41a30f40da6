"""The weight chain against a hostile or unlucky store: rolled-back and forked pointers, held
states that are not what they claim, deltas verified before they touch live weights, foreign
keys under weights/, oversized control objects, and the byte bounds of a sync
(docs/transport.md, "Bounds"). Store-level cases run on a LocalStore and a real S3 server."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest

from stoa.transport import pulse
from stoa.transport.chain import (
    SYNC_ERRORS,
    IntegrityError,
    PointerError,
    StalePointer,
    WeightPublisher,
    WeightSubscriber,
)
from stoa.transport.manifest import MAX_MANIFEST_BYTES, MAX_POINTER_BYTES
from stoa.transport.signing import generate_private_key
from stoa.transport.store import LocalStore, S3Store
from test_chain import RUN, make_chain, same, step

PTR = f"{RUN}/current.json"


def vkey(v: int, name: str) -> str:
    return f"{RUN}/weights/{v:012d}/{name}"


@pytest.fixture(scope="module")
def key():
    return generate_private_key()


class CountingStore:
    """Forwards to a store and records every get: key, bytes returned."""

    def __init__(self, inner):
        self.inner, self.gets = inner, []

    def get(self, key, max_bytes=None):
        data = self.inner.get(key, max_bytes=max_bytes)
        self.gets.append((key, len(data)))
        return data

    def __getattr__(self, name):
        return getattr(self.inner, name)


def plant(store, key: str, data: bytes) -> None:
    """Put an object under a raw key the store API refuses (through the filesystem or boto3)."""
    if isinstance(store, LocalStore):
        path = os.path.join(str(store.root), *key.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    else:
        assert isinstance(store, S3Store)
        store._client.put_object(Bucket=store.bucket, Key=f"{store.prefix}/{key}", Body=data)


def snapshot(state: dict) -> dict:
    return {k: v.copy() for k, v in state.items()}


def identical(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8))
                                    for k in a)


# --------------------------------------------------------------------------------------------
# Heads never go back; versions are bound to their parent chain
# --------------------------------------------------------------------------------------------


def test_a_rolled_back_pointer_is_reported_and_ignored(store, key):
    states = make_chain(8)
    pub = WeightPublisher(store, RUN, key, anchor_every=50, keep_anchors=None)
    for v in range(1, 4):
        pub.publish(v, states[v])
    old_pointer = store.get(PTR)  # validly signed, version 3
    for v in range(4, 9):
        pub.publish(v, states[v])
    sub = WeightSubscriber(store, RUN, key.public_key())
    live = sub.sync(None).state
    store.put(PTR, old_pointer)  # someone with write access rolls the run back
    assert sub.head() == 8 and "rolled-back pointer" in sub.last_problems[0]
    r = sub.sync((8, live))
    assert r.version == 8 and r.state is live and r.applied == []
    assert any("rolled-back" in p for p in r.problems)


def test_a_newcomer_refuses_a_rolled_back_pointer(store, key):
    """Attack: an old, validly signed pointer put back. A brand-new worker used to start at
    version 3 while the run was at 8; it now sees the newer signed manifests and refuses."""
    states = make_chain(8)
    pub = WeightPublisher(store, RUN, key, anchor_every=50, keep_anchors=None)
    for v in range(1, 4):
        pub.publish(v, states[v])
    old_pointer = store.get(PTR)
    for v in range(4, 9):
        pub.publish(v, states[v])
    store.put(PTR, old_pointer)
    for call in (lambda s: s.head(), lambda s: s.sync(None), lambda s: s.sync((8, states[8]))):
        with pytest.raises(StalePointer, match="names version 3, but the run's key signed version 8 after it"):
            call(WeightSubscriber(store, RUN, key.public_key()))
    # The publisher does not trust it either: it rewrites the pointer to the newest intact manifest.
    assert WeightPublisher(store, RUN, key, anchor_every=50).head() == 8
    assert WeightSubscriber(store, RUN, key.public_key()).head() == 8


def test_a_publish_in_progress_is_not_a_rollback(tmp_path, key):
    """One manifest signed after the pointer and built on it (a crash between manifest and
    pointer, or a publish under way) leaves the pointer usable for newcomers."""
    store = LocalStore(tmp_path)
    states = make_chain(4)
    pub = WeightPublisher(store, RUN, key, anchor_every=50, keep_anchors=None)
    for v in range(1, 4):
        pub.publish(v, states[v])
    ptr = store.get(PTR)
    pub.publish(4, states[4])
    store.put(PTR, ptr)  # as if the publisher died after writing manifest 4
    assert WeightSubscriber(store, RUN, key.public_key()).head() == 3


def test_fork_after_a_restart_never_serves_old_weights_under_a_new_label(tmp_path, key):
    """Attack on the old rule (a fork at the same version was ignored): a worker holding the old
    branch's version 6 kept generating with it under the label 6 while the trainer's 6 was another
    state. Pointers are now ordered by signature time: the newer branch is followed at once."""
    store = LocalStore(tmp_path)
    a = make_chain(6)
    pub = WeightPublisher(store, RUN, key, anchor_every=50, keep_anchors=None)
    for v in range(1, 4):
        pub.publish(v, a[v])
    rolled = store.get(PTR)
    for v in range(4, 7):
        pub.publish(v, a[v])
    sub = WeightSubscriber(store, RUN, key.public_key())  # a long-lived worker at version 6
    live = snapshot(sub.sync(None).state)
    assert same(live, a[6])
    old_six = store.get(PTR)

    # The trainer lost its newer state (and the store its newer versions) and restarts at 3.
    store.put(PTR, rolled)
    for v in range(4, 7):
        for name in ("manifest.json", "delta.pulse"):
            store.delete(vkey(v, name))
    rng = np.random.default_rng(77)
    b = {3: a[3]}
    for v in range(4, 8):
        b[v] = step(b[v - 1], rng)
    pub2 = WeightPublisher(store, RUN, key, anchor_every=50, keep_anchors=None)
    pub2.publish(4, b[4])
    assert sub.head() == 4 and "published version 4 after version 6" in sub.last_problems[0]
    r = sub.sync((6, live), apply_inplace=True)
    assert r.version == 4 and same(live, b[4]) and r.inplace and r.applied[0] == (1, "anchor")
    for v in range(5, 7):
        pub2.publish(v, b[v])
    r = sub.sync((4, live), apply_inplace=True)
    assert r.version == 6 and same(live, b[6]) and r.applied == [(5, "delta"), (6, "delta")]

    # The old branch's pointer at 6, put back, is signed before the one followed: ignored.
    store.put(PTR, old_six)
    assert sub.head() == 6 and "rolled-back pointer" in sub.last_problems[0]
    assert sub.sync((6, live), apply_inplace=True).applied == [] and same(live, b[6])

    # A new subscriber handed the old state under label 6 does not keep it: 6 now means b[6].
    pub2.publish(7, b[7])
    fresh = snapshot(a[6])
    r = WeightSubscriber(store, RUN, key.public_key()).sync((6, fresh), apply_inplace=True)
    assert same(fresh, b[7]) and r.inplace and any("not the version it claimed" in p for p in r.problems)


def test_a_background_check_writes_at_once_and_catches_a_damaged_held_state(tmp_path, key):
    store = LocalStore(tmp_path)
    a = make_chain(4)
    pub = WeightPublisher(store, RUN, key, anchor_every=50, keep_anchors=None)
    pub.publish(1, a[1])
    sub = WeightSubscriber(store, RUN, key.public_key())
    live = snapshot(sub.sync(None).state)
    pub.publish(2, a[2])
    r = sub.sync((1, live), apply_inplace=True, check="background")
    assert r.version == 2 and r.inplace and r.applied == [(2, "delta")] and r.check is not None
    assert r.check.wait() and r.check.seconds is not None and identical(live, a[2])

    live["model.norm.weight"][0] += np.float32(1.0)  # the held weights rot after they verified
    pub.publish(3, a[3])
    r = sub.sync((2, live), apply_inplace=True, check="background")
    assert r.version == 3 and r.check is not None  # the delta's payload verified: written at once
    with pytest.raises(IntegrityError, match="not the signed"):
        r.check.wait()
    assert not same(live, a[3])
    r = sub.sync((3, live), apply_inplace=True, check="background")  # the next sync repairs them
    assert r.check is None and r.inplace and r.applied[0] == (1, "anchor") and identical(live, a[3])
    assert any("re-checking the held state" in p for p in r.problems)

    # A state this subscriber did not verify itself is checked before anything is written.
    pub.publish(4, a[4])
    r = WeightSubscriber(store, RUN, key.public_key()).sync((3, live), apply_inplace=True, check="background")
    assert r.check is None and r.applied == [(4, "delta")] and identical(live, a[4])
    with pytest.raises(ValueError, match="check must be"):
        sub.sync((4, live), check="later")


def test_manifests_are_cached_by_content_hash(tmp_path, key):
    states = make_chain(10)
    inner = LocalStore(tmp_path)
    pub = WeightPublisher(inner, RUN, key, anchor_every=4, keep_anchors=None)
    for v in range(1, 10):
        pub.publish(v, states[v])
    store = CountingStore(inner)
    sub = WeightSubscriber(store, RUN, key.public_key())
    held = sub.sync(None)
    pub.publish(10, states[10])
    store.gets.clear()
    r = sub.sync((9, held.state), apply_inplace=True)
    assert [k for k, _ in store.gets] == [PTR, vkey(10, "manifest.json"), vkey(10, "delta.pulse")]
    assert r.bytes_read == sum(n for _, n in store.gets) and same(r.state, states[10])


# --------------------------------------------------------------------------------------------
# Recovery: a held state ruled out plans as a new joiner; live weights change only when verified
# --------------------------------------------------------------------------------------------


def test_a_ruled_out_held_state_rejoins_from_an_older_anchor(tmp_path, key):
    states = make_chain(10)
    store = LocalStore(tmp_path)
    pub = WeightPublisher(store, RUN, key, anchor_every=50, keep_anchors=None)
    for v in range(1, 11):
        pub.publish(v, states[v])  # one anchor, at version 1
    live = snapshot(states[5])  # claims to be version 6
    r = WeightSubscriber(store, RUN, key.public_key()).sync((6, live), apply_inplace=True)
    assert r.inplace and r.state is live and same(live, states[10])
    assert r.applied == [(1, "anchor")] + [(v, "delta") for v in range(2, 11)]
    assert any("not the version it claimed" in p for p in r.problems)


def test_a_delta_that_fails_verification_never_touches_the_live_weights(tmp_path, key):
    states = make_chain(8)
    store = LocalStore(tmp_path)
    pub = WeightPublisher(store, RUN, key, anchor_every=50, keep_anchors=None)
    for v in range(1, 9):
        pub.publish(v, states[v])
    akey = vkey(1, "anchor.safetensors")
    store.put(akey, store.get(akey)[:100])  # no anchor to fall back on
    live = snapshot(states[5])  # claims 6: the deltas 7, 8 decode but lead elsewhere
    before = snapshot(live)
    with pytest.raises(IntegrityError) as e:
        WeightSubscriber(store, RUN, key.public_key()).sync((6, live), apply_inplace=True)
    assert isinstance(e.value, SYNC_ERRORS) and "not the version it claimed" in str(e.value) and akey in str(e.value)
    assert identical(live, before)


def test_apply_deltas_verified_writes_nothing_unless_the_hash_matches(key):
    states = make_chain(4)
    blobs = [pulse.encode_delta(states[v - 1], states[v]) for v in (2, 3, 4)]
    live = snapshot(states[1])
    with pytest.raises(pulse.PulseError, match="nothing was written"):
        pulse.apply_deltas_verified(live, blobs, pulse.state_hash(states[3]))
    assert identical(live, states[1])
    with pytest.raises(pulse.PulseError):
        pulse.apply_deltas_verified(live, blobs[:1] + [blobs[1][:-3]], pulse.state_hash(states[3]))
    assert identical(live, states[1])
    arrays = {k: id(v) for k, v in live.items()}
    changed = pulse.apply_deltas_verified(live, blobs, pulse.state_hash(states[4]))
    assert identical(live, states[4]) and {k: id(v) for k, v in live.items()} == arrays
    assert changed == sorted(changed) and set(changed) <= set(live)


# --------------------------------------------------------------------------------------------
# Foreign keys under weights/ and oversized control objects
# --------------------------------------------------------------------------------------------


def test_foreign_keys_under_weights_are_skipped_and_reported(store, key):
    states = make_chain(6, seed=2)
    pub = WeightPublisher(store, RUN, key, anchor_every=2, keep_anchors=1, keep_seconds=0)
    for v in range(1, 4):
        pub.publish(v, states[v])
    foreign = [vkey(1, "notes.txt"), f"{RUN}/weights/junk", f"{RUN}/weights/00000000002x/manifest.json"]
    for k in foreign:
        store.put(k, b"not ours")
    raw = [f"{RUN}/weights/000000000001/\x01ctl"] + ([] if isinstance(store, LocalStore) else
                                                     [f"{RUN}/weights/000000000001//double", f"{RUN}/weights/x/"])
    for k in raw:
        plant(store, k, b"")
    listed_raw = [k for k in store.list(f"{RUN}/weights/") if k in raw]
    assert listed_raw  # the store lists at least one key its own API would refuse
    results = [pub.publish(v, states[v]) for v in range(4, 7)]  # anchors at 5: retention runs
    assert pub.head() == 6 and results[1].kind == "anchor"
    text = " ".join(results[1].problems)
    for k in foreign + listed_raw:
        assert repr(k)[:40] in text
    left = store.list(f"{RUN}/weights/")
    assert all(k in left for k in foreign) and vkey(1, "manifest.json") not in left
    r = WeightSubscriber(store, RUN, key.public_key()).sync(None)
    assert r.version == 6 and same(r.state, states[6])


def test_oversized_pointer_and_manifest_are_refused_unread(tmp_path, key):
    states = make_chain(3)
    inner = LocalStore(tmp_path)
    pub = WeightPublisher(inner, RUN, key, anchor_every=50, keep_anchors=None)
    for v in (1, 2):
        pub.publish(v, states[v])
    store = CountingStore(inner)
    seen = WeightSubscriber(store, RUN, key.public_key())
    assert seen.head() == 2
    good_pointer = inner.get(PTR)
    inner.put(PTR, b" " * (MAX_POINTER_BYTES + 1))
    with pytest.raises(PointerError, match="over the 65536-byte pointer limit"):
        WeightSubscriber(store, RUN, key.public_key()).head()
    assert seen.head() == 2 and "pointer limit" in seen.last_problems[0]
    inner.put(PTR, good_pointer)
    inner.put(vkey(2, "manifest.json"), b" " * (MAX_MANIFEST_BYTES + 1))
    store.gets.clear()
    with pytest.raises(IntegrityError, match="manifest limit"):
        WeightSubscriber(store, RUN, key.public_key()).sync(None)
    assert all(k != vkey(2, "manifest.json") for k, _ in store.gets)  # never downloaded
    # The publisher repairs nothing here (the pointer verifies) but keeps publishing.
    assert WeightPublisher(inner, RUN, key, anchor_every=50).publish(3, states[3]).kind == "anchor"


def test_a_forged_pointer_is_rewritten_by_the_publisher(tmp_path, key):
    states = make_chain(4)
    store = LocalStore(tmp_path)
    pub = WeightPublisher(store, RUN, key, anchor_every=50)
    for v in (1, 2, 3):
        pub.publish(v, states[v])
    other = WeightPublisher(LocalStore(tmp_path / "evil"), RUN, generate_private_key())
    other.publish(9, states[1])
    store.put(PTR, other.store.get(PTR))
    with pytest.raises(PointerError, match="not this run's key"):
        WeightSubscriber(store, RUN, key.public_key()).head()
    restarted = WeightPublisher(store, RUN, key, anchor_every=50)
    assert restarted.head() == 3  # repaired: the pointer names the newest intact manifest again
    assert restarted.publish(4, states[4]).kind == "delta"
    assert same(WeightSubscriber(store, RUN, key.public_key()).sync((3, states[3])).state, states[4])


# --------------------------------------------------------------------------------------------
# Bounds: what a sync reads at most (docs/transport.md)
# --------------------------------------------------------------------------------------------


def signed_sizes(store, key) -> dict[str, int]:
    sub = WeightSubscriber(store, RUN, key.public_key())
    out = {}
    for k in store.list(f"{RUN}/weights/"):
        if k.endswith("manifest.json"):
            m = sub.manifest(int(k.split("/")[-2]))
            for kind, name in (("anchor", "anchor.safetensors"), ("delta", "delta.pulse")):
                if getattr(m, kind) is not None:
                    out[vkey(m.version, name)] = getattr(m, kind).bytes
    return out


@pytest.mark.parametrize("damage", ["none", "truncated delta", "swapped anchor", "oversized delta"])
def test_sync_reads_each_object_at_most_twice_and_never_past_its_signed_size(tmp_path, key, damage):
    states = make_chain(12)
    inner = LocalStore(tmp_path)
    pub = WeightPublisher(inner, RUN, key, anchor_every=4, keep_anchors=None)
    for v in range(1, 13):
        pub.publish(v, states[v])
    signed = signed_sizes(inner, key)
    if damage == "truncated delta":
        inner.put(vkey(8, "delta.pulse"), inner.get(vkey(8, "delta.pulse"))[:-5])
    elif damage == "swapped anchor":
        inner.put(vkey(9, "anchor.safetensors"), inner.get(vkey(5, "anchor.safetensors")))
    elif damage == "oversized delta":
        inner.put(vkey(8, "delta.pulse"), inner.get(vkey(8, "delta.pulse")) + b"\0" * 100_000)
    store = CountingStore(inner)
    for have in (None, (6, states[6])):
        store.gets.clear()
        r = WeightSubscriber(store, RUN, key.public_key()).sync(have)
        assert same(r.state, states[12]), damage
        counts = Counter(k for k, _ in store.gets)
        assert max(counts.values()) <= 2
        for k, n in store.gets:
            if k in signed:
                assert n <= signed[k]  # a bigger object is refused unread
            else:
                assert n <= (MAX_POINTER_BYTES if k == PTR else MAX_MANIFEST_BYTES)
        payload = sum(n for k, n in store.gets if k in signed)
        route = sum(signed[vkey(v, "anchor.safetensors" if kind == "anchor" else "delta.pulse")] for v, kind in r.applied)
        assert route <= payload <= 2 * sum(signed.values())
        assert r.bytes_read == sum(n for _, n in store.gets)
        if damage == "none":  # the happy path reads exactly its route's payloads, once
            assert payload == route and max(counts.values()) == 1


def test_sync_to_an_older_version_of_the_chain_for_forced_staleness(tmp_path):
    """``sync(version=v)`` stops at version v of the head's chain (a study's rollout.lag), by the
    same verified route, and moves forward from there later."""
    from stoa.transport.chain import WeightPublisher, WeightSubscriber
    from stoa.transport.pulse import state_hash
    from stoa.transport.signing import generate_private_key
    from stoa.transport.store import LocalStore

    rng = np.random.default_rng(0)
    store, key = LocalStore(tmp_path), generate_private_key()
    pub = WeightPublisher(store, "run", key, anchor_every=4)
    state = {"w": rng.integers(0, 256, size=(64, 64)).astype(np.uint8), "b": np.zeros(8, np.float32)}
    hashes = {}
    for v in range(7):
        state = {k: a.copy() for k, a in state.items()}
        state["w"][v, :3] += 1
        pub.publish(v, state)
        hashes[v] = state_hash(state)
    sub = WeightSubscriber(store, "run", key.public_key())
    res = sub.sync(None, version=3)
    assert res.version == 3 and state_hash(res.state) == hashes[3]
    res = sub.sync((res.version, res.state), apply_inplace=True, version=5)
    assert res.version == 5 and state_hash(res.state) == hashes[5] and res.inplace
    res = sub.sync((res.version, res.state), apply_inplace=True, version=99)  # not older than the head: head
    assert res.version == 6 and state_hash(res.state) == hashes[6]


def test_a_payload_deleted_mid_sync_bans_that_route_instead_of_retrying_it(tmp_path, key):
    """Retention can delete the planned anchor while a slow follower syncs: the next plan must
    route around it (an older anchor plus deltas), not pick the same dead route again."""
    from stoa.transport.manifest import Layout

    store = LocalStore(tmp_path)
    states = make_chain(9)
    pub = WeightPublisher(store, RUN, key, anchor_every=4, keep_anchors=None)
    for v, s in sorted(states.items()):
        pub.publish(v, s)
    sub = WeightSubscriber(store, RUN, key.public_key())
    store.delete(Layout(RUN).payload(9, "anchor"))  # the newest anchor: the cheapest route to 9
    res = sub.sync(None)
    assert res.version == 9 and same(res.state, states[9])
    assert (5, "anchor") in res.applied and any("is gone" in p for p in res.problems)
