"""Assigned work: what a worker's n-th batch must contain, from public facts alone.

A worker does not choose its prompts, its group ids or its sampling seed. Its batch with sequence
number ``seq``, sealed with key ``key_id``, holds exactly the groups :func:`assignment` names:
``groups`` items drawn from the run's training split, each played ``group_size`` times
(``sample_index`` 0..G-1), under group ids that name the key and the sequence number, sampled
with one seed. The function is public (run seed, key id, sequence number): the trainer recomputes
it for every batch and refuses one that differs (:func:`assignment_problem`), and its spot-check
re-derives every sampled token from the seed (``RolloutEngine.sampling_margins``).

What follows: a worker cannot pick easy prompts or reroll a group (the same number gives the
same items and the same random stream, so regenerating gives the same episodes), cannot relabel
another key's episodes as its own (their items, ids and draws belong to the other key's
assignment), and cannot hide a batch without leaving a gap in its sequence numbers, which the
trainer counts per key (the withholding rate). What it can still do: skip numbers (every skip
is counted, never proven malicious: a crash mid-cohort also leaves one).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from stoa.types import Episode

__all__ = ["Assignment", "assignment", "assignment_problem"]


@dataclass(frozen=True)
class Assignment:
    """The work of one batch: ``items[j]`` is played as group ``group_ids[j]``, sampled with ``seed``."""

    items: tuple[int, ...]
    group_ids: tuple[str, ...]
    seed: int


def assignment(run_seed: int, key_id: str, seq: int, n_items: int, groups: int) -> Assignment:
    """The batch that key ``key_id`` owes as its sequence number ``seq`` (see the module docstring)."""
    if n_items < 1 or groups < 1 or seq < 0:
        raise ValueError(f"n_items ({n_items}) and groups ({groups}) must be >= 1 and seq ({seq}) >= 0")
    digest = hashlib.blake2b(f"stoa-assignment\x1f{run_seed}\x1f{key_id}\x1f{seq}".encode(), digest_size=16).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    items = tuple(int(i) for i in rng.integers(n_items, size=groups))
    tag = key_id[:16] or "anon"
    return Assignment(items, tuple(f"{tag}-s{seq}-g{j}" for j in range(groups)), int(rng.integers(2**62)))


def assignment_problem(episodes: list[Episode], expected: Assignment, group_size: int) -> str | None:
    """Why a batch is not exactly its assignment (every group, every sample, nothing else), or None."""
    want = dict(zip(expected.group_ids, expected.items))
    seen: dict[str, set[int]] = {}
    for i, ep in enumerate(episodes):
        if ep.group_id not in want:
            return (f"episode {i}: group {ep.group_id[:64]!r} is not one this batch was assigned "
                    f"({', '.join(expected.group_ids[:3])}, ...)")
        if ep.item_index != want[ep.group_id]:
            return f"episode {i}: group {ep.group_id!r} plays item {ep.item_index}, assigned item {want[ep.group_id]}"
        samples = seen.setdefault(ep.group_id, set())
        if ep.sample_index in samples:
            return f"episode {i}: sample {ep.sample_index} of group {ep.group_id!r} appears twice"
        samples.add(ep.sample_index)
    missing = [g for g in expected.group_ids if len(seen.get(g, ())) != group_size]
    if missing:
        return f"group {missing[0]!r} has {len(seen.get(missing[0], ()))} of its {group_size} samples"
    return None
