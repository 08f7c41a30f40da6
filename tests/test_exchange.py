"""Rollout exchange: write-once uploads, ordered polling, quarantine of bad objects, and restart
bookkeeping that neither drops nor double-counts a batch."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from stoa.transport.exchange import RolloutReader, RolloutWriter, rollout_key
from stoa.transport.store import LocalStore, StoreError
from stoa.types import Episode, Segment, Verdict, encode_episodes

RUN = "runs/r1"


def episodes(worker: str, version: int, n: int = 2, tag: int = 0, top: int = 50) -> list[Episode]:
    rng = np.random.default_rng(tag)
    return [
        Episode(
            prompt_tokens=rng.integers(0, top, 5),
            segments=[Segment("model", rng.integers(0, top, 4), -rng.random(4)),
                      Segment("env", rng.integers(0, top, 3)),
                      Segment("model", rng.integers(0, top, 2), -rng.random(2))],
            reward=float(tag + i), policy_version=version, worker_id=worker, group_id=f"g{tag}", sample_index=i,
        )
        for i in range(n)
    ]


def test_upload_and_poll_in_order(store):
    a, b = RolloutWriter(store, RUN, "mac-a"), RolloutWriter(store, RUN, "mac-b")
    keys = [a.upload(episodes("mac-a", 3, tag=1), 3), b.upload(episodes("mac-b", 2, tag=2), 2),
            a.upload(episodes("mac-a", 4, tag=3), 4), b.upload(episodes("mac-b", 3, tag=4), 3)]
    assert keys[0] == f"{RUN}/rollouts/mac-a/s000000000000-v000000000003.episodes"
    assert store.list(f"{RUN}/rollouts/mac-a/") == [keys[0], keys[2]]  # names sort in upload order
    reader = RolloutReader(store, RUN, vocab_size=50)
    got = reader.poll()
    assert [(x.version, x.worker_id, x.seq) for x in got] == [(2, "mac-b", 0), (3, "mac-a", 0), (3, "mac-b", 1),
                                                               (4, "mac-a", 1)]
    first = got[1].episodes[0]
    sent = episodes("mac-a", 3, tag=1)[0]
    assert np.array_equal(first.tokens(), sent.tokens()) and first.reward == sent.reward
    assert np.array_equal(first.behavior_logprobs(), sent.behavior_logprobs())
    assert reader.poll() == [] and reader.consumed == 4 and reader.quarantined == 0


def test_writer_checks_and_continues_after_restart(tmp_path):
    store = LocalStore(tmp_path)
    w = RolloutWriter(store, RUN, "w1")
    with pytest.raises(ValueError, match="policy_version"):
        w.upload(episodes("w1", 3), 4)
    with pytest.raises(ValueError, match="worker_id"):
        w.upload(episodes("w2", 3), 3)
    with pytest.raises(ValueError, match="empty"):
        w.upload([], 3)
    for bad in ("", "../x", "a/b", "-lead", "x" * 65):
        with pytest.raises(ValueError):
            RolloutWriter(store, RUN, bad)
    for i in range(12):
        w.upload(episodes("w1", i // 5), i // 5)
    w2 = RolloutWriter(store, RUN, "w1")  # a restarted worker continues its numbering
    assert w2.next_seq == 12
    k = w2.upload(episodes("w1", 2), 2)
    assert "/s000000000012-" in k and store.list(f"{RUN}/rollouts/w1/")[-1] == k


class LostAnswerStore:
    """The first put_if_absent lands but its answer is lost (a timeout after the server wrote)."""

    def __init__(self, inner):
        self.inner, self.lose = inner, True

    def put_if_absent(self, key, data):
        ok = self.inner.put_if_absent(key, data)
        if self.lose:
            self.lose = False
            raise StoreError("read timeout")
        return ok

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_retrying_an_upload_whose_answer_was_lost_makes_no_duplicate(tmp_path):
    store = LocalStore(tmp_path)
    w = RolloutWriter(LostAnswerStore(store), RUN, "w")
    batch = episodes("w", 1)
    with pytest.raises(StoreError):
        w.upload(batch, 1)
    k = w.upload(batch, 1)
    assert store.list(f"{RUN}/rollouts/") == [k] and k.endswith("s000000000000-v000000000001.episodes")
    assert w.upload(episodes("w", 1, tag=5), 1).endswith("s000000000001-v000000000001.episodes")


def test_two_processes_with_one_worker_id_never_clobber(tmp_path):
    store = LocalStore(tmp_path)
    writers = [RolloutWriter(store, RUN, "dup") for _ in range(4)]
    keys: list[str] = []
    barrier = threading.Barrier(4)

    def go(i: int) -> None:
        barrier.wait()
        keys.append(writers[i].upload(episodes("dup", 1, tag=i), 1))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(keys)) == 4
    got = RolloutReader(store, RUN).poll()
    assert sorted(b.episodes[0].group_id for b in got) == ["g0", "g1", "g2", "g3"]


def test_invalid_objects_are_quarantined_never_raised(store):
    w = RolloutWriter(store, RUN, "good")
    w.upload(episodes("good", 1), 1)
    blob = encode_episodes(episodes("bad", 5))
    store.put(rollout_key(RUN, "bad", 0, 5), b"not an episode batch")
    store.put(rollout_key(RUN, "bad", 1, 6), blob)  # episodes say version 5, the name says 6
    store.put(rollout_key(RUN, "bad", 2, 5), encode_episodes(episodes("other", 5)))  # wrong worker
    store.put(rollout_key(RUN, "bad", 3, 5), encode_episodes(episodes("bad", 5, top=999)))  # ids >= vocab
    store.put(rollout_key(RUN, "bad", 4, 5), blob[: len(blob) // 2])  # truncated
    store.put(f"{RUN}/rollouts/bad/notes.txt", b"junk")
    store.put(f"{RUN}/rollouts/stray", b"a file where a worker folder belongs")
    store.put(rollout_key(RUN, "bad", 5, 5), blob)  # fine
    reader = RolloutReader(store, RUN, vocab_size=50)
    got = reader.poll()
    assert [(b.worker_id, b.seq) for b in got] == [("good", 0), ("bad", 5)]
    assert reader.quarantined == 7 and len(reader.last_problems) == 7
    assert store.list(f"{RUN}/rollouts/") == [rollout_key(RUN, "bad", 5, 5), rollout_key(RUN, "good", 0, 1)]
    reasons = {}
    for k in store.list(f"{RUN}/quarantine/"):
        if k.endswith(".reason.json"):
            r = json.loads(store.get(k))
            reasons[r["key"].rsplit("/", 1)[1]] = r["reason"]
            assert store.exists(k[: -len(".reason.json")])
    assert "bad magic" in reasons["s000000000000-v000000000005.episodes"]
    assert "policy_version 5 != 6" in reasons["s000000000001-v000000000006.episodes"]
    assert "worker_id 'other'" in reasons["s000000000002-v000000000005.episodes"]
    assert "outside the vocabulary" in reasons["s000000000003-v000000000005.episodes"]
    assert "corrupt" in reasons["s000000000004-v000000000005.episodes"]
    assert "object name" in reasons["notes.txt"] and "object name" in reasons["stray"]
    misnamed = [k for k in store.list(f"{RUN}/quarantine/_misnamed/") if not k.endswith(".reason.json")]
    assert len(misnamed) == 2 and all(len(k.rpartition("/")[2]) == 32 for k in misnamed)  # hashed, not the name
    assert store.get(f"{RUN}/quarantine/bad/s000000000001-v000000000006.episodes") == blob
    assert reader.poll() == [] and reader.quarantined == 7
    assert reader.state()["workers"]["bad"] == {"done": 6, "extra": []}


def test_restart_neither_drops_nor_double_counts(tmp_path):
    store = LocalStore(tmp_path)
    w = {n: RolloutWriter(store, RUN, n) for n in ("a", "b")}
    for v in range(3):
        for n in ("a", "b"):
            w[n].upload(episodes(n, v, tag=v), v)
    reader = RolloutReader(store, RUN)
    seen = [b.key for b in reader.poll(max_batches=2)]
    checkpoint = json.loads(json.dumps(reader.state()))  # what the trainer saves with the model
    lost = [b.key for b in reader.poll(max_batches=3)]  # trained on, but the trainer dies before saving
    for n in ("a", "b"):
        w[n].upload(episodes(n, 3, tag=3), 3)

    again = RolloutReader(store, RUN)
    again.restore(checkpoint)
    rest = [b.key for b in again.poll()]
    assert rest[:3] == lost  # redelivered, since no checkpoint recorded them
    everything = sorted(store.list(f"{RUN}/rollouts/"))
    assert sorted(seen + rest) == everything and len(set(seen + rest)) == len(everything)
    assert again.consumed == 8 and again.poll() == []


def test_out_of_order_uploads_leave_gaps_that_fill_later(tmp_path):
    store = LocalStore(tmp_path)
    blob = lambda v: encode_episodes(episodes("w", v))  # noqa: E731
    store.put(rollout_key(RUN, "w", 0, 1), blob(1))
    store.put(rollout_key(RUN, "w", 2, 1), blob(1))  # seq 1 still in flight
    reader = RolloutReader(store, RUN)
    assert [b.seq for b in reader.poll()] == [0, 2]
    assert reader.state()["workers"]["w"] == {"done": 1, "extra": [2]}
    store.put(rollout_key(RUN, "w", 1, 1), blob(1))
    restored = RolloutReader(store, RUN)
    restored.restore(reader.state())
    assert [b.seq for b in restored.poll()] == [1]
    assert restored.state()["workers"]["w"] == {"done": 3, "extra": []}


def test_prune_deletes_only_what_a_saved_state_consumed(tmp_path):
    store = LocalStore(tmp_path)
    w = RolloutWriter(store, RUN, "w")
    for i in range(5):
        w.upload(episodes("w", i), i)
    reader = RolloutReader(store, RUN)
    reader.poll(max_batches=2)
    saved = reader.state()
    reader.poll(max_batches=2)
    assert reader.prune(saved) == 2
    assert [k.split("/")[-1][:13] for k in store.list(f"{RUN}/rollouts/")] == [
        "s000000000002", "s000000000003", "s000000000004"]
    assert [b.seq for b in reader.poll()] == [4]
    assert reader.prune() == 2  # everything is consumed, but the newest batch stays ...
    assert RolloutWriter(store, RUN, "w").next_seq == 5  # ... so a restarted writer never reuses a number
    w.upload(episodes("w", 9), 9)
    assert [b.seq for b in reader.poll()] == [5]


def test_restore_validates_state(tmp_path):
    reader = RolloutReader(LocalStore(tmp_path), RUN)
    good = reader.state()
    with pytest.raises(ValueError, match="run"):
        RolloutReader(LocalStore(tmp_path), "runs/other").restore(good)
    for bad in ({}, {**good, "format": "x"}, {**good, "workers": {"w": {"done": -1, "extra": []}}},
                {**good, "workers": {"w": {"done": 2, "extra": [1]}}}, {**good, "workers": {"../x": {"done": 0, "extra": []}}}):
        with pytest.raises(ValueError):
            reader.restore(bad)


def test_state_with_pending_redelivers_polled_but_untrained_batches(tmp_path):
    store = LocalStore(tmp_path)
    w = {n: RolloutWriter(store, RUN, n) for n in ("a", "b")}
    for v in range(4):
        for n in ("a", "b"):
            w[n].upload(episodes(n, v, tag=v), v)
    reader = RolloutReader(store, RUN)
    polled = reader.poll()  # the trainer pools all 8 but trains on only some before checkpointing
    trained = [b for b in polled if b.version in (0, 2)]
    pending = [b for b in polled if b.version in (1, 3)]
    saved = json.loads(json.dumps(reader.state(pending=pending)))
    assert reader.state()["workers"]["a"] == {"done": 4, "extra": []}  # the live state is untouched

    again = RolloutReader(store, RUN)
    again.restore(saved)
    redelivered = again.poll()
    assert sorted(b.key for b in redelivered) == sorted(b.key for b in pending)
    assert not {b.key for b in redelivered} & {b.key for b in trained}
    assert again.poll() == []


def test_quarantine_a_polled_batch_with_a_reason(tmp_path):
    store = LocalStore(tmp_path)
    RolloutWriter(store, RUN, "a").upload(episodes("a", 5), 5)
    reader = RolloutReader(store, RUN)
    (batch,) = reader.poll()
    reader.quarantine(batch, "policy version 5 is newer than the trainer's 2")
    assert store.list(f"{RUN}/rollouts/") == [] and reader.quarantined == 1 and reader.consumed == 0
    reason = json.loads(store.get(f"{RUN}/quarantine/a/{batch.key.rsplit('/', 1)[1]}.reason.json"))
    assert "newer than the trainer" in reason["reason"]
    fresh = RolloutReader(store, RUN)
    fresh.restore(reader.state())
    assert fresh.poll() == []


def test_planted_objects_cannot_stop_or_steal_a_sealing_writers_numbers(store):
    """Someone else's object at a huge sequence number under a worker's name (or one already
    quarantined at its next number) neither stops its uploads nor swallows one of them."""
    from stoa.transport.identity import seal_batch
    from stoa.transport.signing import generate_private_key

    me, mallory = generate_private_key(), generate_private_key()
    w = RolloutWriter(store, RUN, "w", private_key=me)
    w.upload(episodes("w", 1), 1)
    planted = seal_batch(encode_episodes(episodes("w", 1, tag=9)), run=RUN, worker_id="w", seq=10**12 - 1, version=1,
                         private_key=mallory)
    store.put(rollout_key(RUN, "w", 10**12 - 1, 1), planted)
    store.put(f"{RUN}/quarantine/w/s000000000002-v000000000001.episodes", planted)
    restarted = RolloutWriter(store, RUN, "w", private_key=me)
    assert restarted.next_seq == 1  # its own newest sealed object, not the planted number
    keys = [restarted.upload(episodes("w", 2, tag=t), 2) for t in (1, 2)]
    assert [k.rsplit("/", 1)[1][:13] for k in keys] == ["s000000000001", "s000000000003"]  # 2 was taken
    class OnlyW:  # the caller's admission: w's key only
        def screen(self, seal):
            return None if seal.key_id == restarted.key_id else Verdict("refused", "not w's key")

    reader = RolloutReader(store, RUN)
    got = reader.poll(admission=OnlyW())
    assert [b.seq for b in got] == [0, 1, 3] and {b.key_id for b in got} == {restarted.key_id}
    (rej,) = reader.last_report.rejected
    assert rej.category == "refused" and "not w's key" in rej.reason
