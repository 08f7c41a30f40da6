"""A worker's sequence numbers against a store that loses or gains objects: one DELETE never makes a
worker reuse a settled number (its cache, then the trainer's signed floor), and numbers planted
in its namespace neither waste its cohorts nor count as its gaps."""

from __future__ import annotations

import numpy as np

from stoa.transport.exchange import RolloutReader, RolloutWriter, rollout_key
from stoa.transport.signing import generate_private_key
from stoa.transport.store import LocalStore
from stoa.types import Episode, Segment, Verdict

RUN = "runs/r1"


class SealedOnly:
    """The reader's admission: what the trainer's intake refuses unread (here, unsealed objects)."""

    def screen(self, seal):
        return Verdict("unsigned", "unsealed") if seal is None else None


sealed_only = SealedOnly()


def episodes(worker: str, version: int, tag: int) -> list[Episode]:
    rng = np.random.default_rng(tag)
    return [Episode(prompt_tokens=rng.integers(0, 50, 5), segments=[Segment("model", rng.integers(0, 50, 4), -rng.random(4))],
                    reward=float(i), policy_version=version, worker_id=worker, group_id=f"g{tag}", sample_index=i)
            for i in range(2)]


def test_a_deleted_newest_batch_never_makes_a_restarted_worker_reuse_a_settled_number(tmp_path):
    from stoa.transport.sequence import RememberingWriter, SequenceFile

    store, me = LocalStore(tmp_path / "store"), generate_private_key()
    cache = SequenceFile(tmp_path / "cache" / "sequence.json")
    reader = RolloutReader(store, RUN)
    w = RememberingWriter(store, RUN, "w", me, cache)
    keys = [w.upload(episodes("w", 1, i), 1) for i in range(3)]
    assert [b.seq for b in reader.poll(admission=sealed_only)] == [0, 1, 2]
    reader.prune()  # consumed batches go, the newest stays
    store.delete(keys[-1])  # one DELETE by whoever can write to the store
    assert RolloutWriter(store, RUN, "w", private_key=me).next_seq == 0  # the store alone forgot everything
    restarted = RememberingWriter(store, RUN, "w", me, cache)
    assert restarted.next_seq == 3
    restarted.upload(episodes("w", 2, 9), 2)
    assert [b.seq for b in reader.poll(admission=sealed_only)] == [3]  # read, not skipped as settled
    assert RememberingWriter(store, "runs/other", "w", me, cache).next_seq == 0  # another run's number is not ours


def test_a_worker_that_lost_its_cache_too_is_told_by_the_trainers_signed_floor(tmp_path):
    from stoa.transport.sequence import RememberingWriter, SequenceFile, catch_up, read_floor, write_floors

    store, me, run_key = LocalStore(tmp_path / "store"), generate_private_key(), generate_private_key()
    reader = RolloutReader(store, RUN)
    w = RememberingWriter(store, RUN, "w", me, SequenceFile(tmp_path / "a" / "sequence.json"))
    keys = [w.upload(episodes("w", 1, i), 1) for i in range(3)]
    assert len(reader.poll(admission=sealed_only)) == 3
    write_floors(store, RUN, reader.next_numbers(), run_key)
    assert read_floor(store, RUN, run_key.public_key(), "w") == 3
    for k in keys:
        store.delete(k)
    fresh = RememberingWriter(store, RUN, "w", me, SequenceFile(tmp_path / "b" / "sequence.json"))
    assert fresh.next_seq == 0
    told = catch_up(fresh, store, RUN, run_key.public_key())
    assert told is not None and "settled" in told and "continuing at 3" in told
    assert fresh.next_seq == 3 and SequenceFile(tmp_path / "b" / "sequence.json").read(RUN) == 3
    fresh.upload(episodes("w", 2, 9), 2)
    assert [b.seq for b in reader.poll(admission=sealed_only)] == [3]
    # A floor document signed by another key is ignored, never followed, never a stall.
    write_floors(store, RUN, {"w": 10**6}, generate_private_key())
    assert catch_up(fresh, store, RUN, run_key.public_key()) is None and fresh.next_seq == 4


def test_numbers_planted_ahead_of_a_worker_waste_none_of_its_cohorts(tmp_path):
    store, me = LocalStore(tmp_path / "store"), generate_private_key()
    w = RolloutWriter(store, RUN, "w", private_key=me)
    for j in (0, 1, 2, 4):
        store.put(rollout_key(RUN, "w", j, 1), b"junk")
    got = []
    for cohort in range(3):
        seq = w.skip_taken()  # before making the number's work
        w.upload(episodes("w", 1, cohort), 1, seq=seq)  # never SequenceTaken
        got.append(seq)
    assert got == [3, 5, 6]


def test_one_planted_extreme_number_costs_only_its_own_key_never_the_floor_document(tmp_path):
    """A batch named with the largest sequence number a key can hold must leave every other worker's
    floor readable (writers, trainer and readers share one bound), and a bad entry costs its own key."""
    from stoa.transport.sequence import RememberingWriter, SequenceFile, catch_up, read_floor, write_floors
    from stoa.transport.signing import sign_document

    store, me, run_key = LocalStore(tmp_path / "store"), generate_private_key(), generate_private_key()
    reader = RolloutReader(store, RUN)
    store.put(rollout_key(RUN, "x", 10**12 - 1, 1), b"junk")  # the largest number a key may name
    w = RememberingWriter(store, RUN, "w", me, SequenceFile(tmp_path / "a" / "sequence.json"))
    keys = [w.upload(episodes("w", 1, i), 1) for i in range(3)]
    reader.poll(admission=sealed_only)
    write_floors(store, RUN, reader.next_numbers(), run_key)
    assert read_floor(store, RUN, run_key.public_key(), "x") == 10**12  # one above the largest number
    assert read_floor(store, RUN, run_key.public_key(), "w") == 3
    for k in keys:
        store.delete(k)
    fresh = RememberingWriter(store, RUN, "w", me, SequenceFile(tmp_path / "b" / "sequence.json"))
    assert catch_up(fresh, store, RUN, run_key.public_key()) is not None and fresh.next_seq == 3
    fresh.upload(episodes("w", 2, 9), 2)
    assert [b.seq for b in reader.poll(admission=sealed_only)] == [3]  # read, not silently skipped
    # A worker that remembered the top "next" number keeps it (no number left, never a wrap to 0).
    top = SequenceFile(tmp_path / "c" / "sequence.json")
    top.write(RUN, 10**12)
    assert top.read(RUN) == 10**12
    # An entry out of range, or of the wrong type, costs that key's floor only.
    for bad in (10**12 + 1, -1, "7", True):
        store.put(f"{RUN}/sequence.json", sign_document(
            "sequence-floors", {"format": "stoa.sequence_floors/1", "run": RUN, "next": {"w": 5, "x": bad},
                                "time": 1.0}, run_key))
        assert read_floor(store, RUN, run_key.public_key(), "w") == 5


def test_a_full_cache_disk_never_makes_an_uploaded_batch_look_failed(tmp_path):
    """The cache folder is a 64 KiB tmpfs filled up (writes fail with ENOSPC, as on a full disk):
    each batch is uploaded once and counts as uploaded, no half-written file is left in the cache,
    and once space is back the number is recorded again."""
    import os
    import subprocess

    import pytest

    from stoa.testing.chaos import _FILLER, _fill
    from stoa.transport.sequence import RememberingWriter, SequenceFile

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a size-capped tmpfs for the cache")
    cache = tmp_path / "cache"
    cache.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(cache)], check=True)
    try:
        store, me = LocalStore(tmp_path / "store"), generate_private_key()
        w = RememberingWriter(store, RUN, "w", me, SequenceFile(cache / "sequence.json"))
        w.upload(episodes("w", 0, 0), 0, seq=0)
        _fill(cache)
        keys = [w.upload(episodes("w", 0, tag), 0, seq=tag) for tag in (1, 2)]  # raised OSError before
        assert [k.rpartition("/")[2][:13] for k in keys] == ["s000000000001", "s000000000002"]
        assert "No space left" in w.trouble
        assert sorted(p.name for p in cache.iterdir()) == sorted([_FILLER, "sequence.json"])
        assert SequenceFile(cache / "sequence.json").read(RUN) == 1  # the last number it could record
        (cache / _FILLER).unlink()
        w.upload(episodes("w", 0, 3), 0, seq=3)
        assert w.trouble == "" and SequenceFile(cache / "sequence.json").read(RUN) == 4
        assert len(store.list(f"{RUN}/rollouts/")) == 4
    finally:
        subprocess.run(["umount", "-l", str(cache)], check=True)
