"""A rollout poll is fair between workers: one worker's flood of junk in its own prefix (which a
per-worker store credential allows) neither starves another worker's batches nor eats their budget."""

from __future__ import annotations

import numpy as np

from stoa.transport.exchange import PollLimits, RolloutReader, RolloutWriter
from stoa.transport.store import LocalStore
from stoa.types import Episode, Segment

RUN = "runs/r1"


def episodes(worker: str, version: int, tag: int) -> list[Episode]:
    rng = np.random.default_rng(tag)
    return [Episode(prompt_tokens=rng.integers(0, 50, 5), segments=[Segment("model", rng.integers(0, 50, 4), -rng.random(4))],
                    reward=float(i), policy_version=version, worker_id=worker, group_id=f"g{tag}", sample_index=i)
            for i in range(2)]


def keep_flooding(store, n: int, start: int) -> int:
    """Top the flooder's prefix up to ``n`` tiny junk objects named for version 0; returns the next number."""
    have = len(store.list(f"{RUN}/rollouts/flood/"))
    for seq in range(start, start + n - have):
        store.put(f"{RUN}/rollouts/flood/s{seq:012d}-v000000000000.episodes", b"junk")
    return start + n - have


def test_a_flood_of_old_version_junk_in_one_prefix_does_not_starve_another_worker(tmp_path):
    store = LocalStore(tmp_path / "store")
    reader = RolloutReader(store, RUN)
    honest = RolloutWriter(store, RUN, "honest")
    nxt, read, quarantined = 0, 0, 0
    for i in range(8):
        nxt = keep_flooding(store, 64, nxt)
        honest.upload(episodes("honest", 3, i), 3)
        read += sum(b.worker_id == "honest" for b in reader.poll())
        quarantined += reader.last_report.quarantined
    assert read == 8  # each batch in the poll after its upload
    assert quarantined > 0  # the junk is still cleaned up, within its own budget


def test_quarantined_objects_do_not_use_up_the_batches_budget(tmp_path):
    store = LocalStore(tmp_path / "store")
    reader = RolloutReader(store, RUN, poll_limits=PollLimits(max_batches=4))
    writers = {w: RolloutWriter(store, RUN, w) for w in ("a", "b")}
    for i in range(2):
        for w, writer in writers.items():
            writer.upload(episodes(w, 1, i), 1)
    keep_flooding(store, 6, 0)
    got = reader.poll()
    assert len(got) == 4 and reader.last_report.quarantined == 2  # the junk read on the way cost no batch


def test_workers_take_turns_each_oldest_version_first():
    from stoa.transport.turns import in_turns

    pending = [(0, "flood", s, f"f{s}") for s in range(3)] + [(5, "b", 0, "b0"), (2, "b", 1, "b1"), (1, "c", 0, "c0")]
    assert [k for *_, k in in_turns(pending)] == ["f0", "c0", "b1", "f1", "b0", "f2"]
