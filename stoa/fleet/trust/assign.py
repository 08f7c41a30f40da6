"""Assigned work: what a worker's n-th batch must contain.

A worker does not choose its prompts, its group ids or its sampling seed. Its batch with sequence
number ``seq``, sealed with key ``key_id``, holds exactly the groups :func:`assignment` names:
``groups`` items drawn from the run's training split, each played ``group_size`` times
(``sample_index`` 0..G-1), under group ids that name the key and the sequence number, sampled
with one seed. The trainer recomputes it for every batch and refuses one that differs
(:func:`assignment_problem`), and re-derives sampled tokens from the seed
(``RolloutEngine.sampling_margins``).

**The key's salt.** Key ids cost nothing: were the work a public function of (run seed, key id,
sequence number), anyone could make keys until one's work fell on items of its choosing (a
thousand keys take a fraction of a second). So a key's work also depends on its **assignment
salt**, a secret that only the run's private key makes
(:func:`stoa.transport.identity.assignment_salt`) and that the trainer publishes for a key once
the key has standing: when it is enrolled, or when a batch of it is accepted
(``<run>/salts/<key id>.json``).

**Probation.** Until a key's salt is published, its worker plays *probation* work: the same
function without a salt (group ids ``<key>-p<seq>-g<j>``, where salted work is
``<key>-s<seq>-g<j>``). Probation batches are checked like any other (an accepted one gives the
key standing, binds its id in an open run and publishes its salt) but are never trained on. So
every batch a key can compute before its salt exists is probation, and trying a key costs one
accepted batch of checked work. An enrolled key has its salt from enrollment and has no probation.

**The number's beacon.** A salt alone would fix all of a key's future work once it is out, so an
attacker with many keys could keep those whose work lands where it wants; and a worker holding
several versions could make one batch under each and keep the one it likes. So salted work also
mixes in the **beacon** the trainer binds to the number when the worker tickets it, together with
the one weight version the batch must be made with (:mod:`stoa.fleet.trust.binding`): a key learns
a batch's items and seed only when that batch is due, and a number has one version and one random
stream (what a grinder gains, measured by benchmarks/assign_grinding.py: docs/trust.md).

What follows: a worker cannot pick easy prompts or reroll a group (the same number gives the same
items and the same random stream, under one version), cannot relabel another key's episodes as its
own, and cannot hide a batch without leaving a gap in its sequence numbers, which the trainer
counts per key (the withholding rate). What it can still do: skip numbers, bound or not (every
skip is counted, never proven malicious: a crash mid-cohort also leaves one).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from stoa.types import Episode

__all__ = ["Assignment", "assignment", "assignment_problem", "is_probation"]


@dataclass(frozen=True)
class Assignment:
    """The work of one batch: ``items[j]`` is played as group ``group_ids[j]``, sampled with ``seed``."""

    items: tuple[int, ...]
    group_ids: tuple[str, ...]
    seed: int
    probation: bool = False
    """Work made without the key's salt: checked, never trained on (see the module docstring)."""


def _tag(key_id: str) -> str:
    return key_id[:16] or "anon"


def assignment(run_seed: int, key_id: str, seq: int, n_items: int, groups: int, salt: str | None = None,
               beacon: str | None = None) -> Assignment:
    """The batch that key ``key_id`` owes as its sequence number ``seq``: with the key's published
    ``salt`` and the ``beacon`` the trainer bound to the number its real work, without a salt its
    probation work (see the module docstring)."""
    if n_items < 1 or groups < 1 or seq < 0:
        raise ValueError(f"n_items ({n_items}) and groups ({groups}) must be >= 1 and seq ({seq}) >= 0")
    probation = not salt
    text = (f"stoa-assignment\x1f{run_seed}\x1f{key_id}\x1f{seq}" if probation
            else f"stoa-assignment/salted\x1f{run_seed}\x1f{key_id}\x1f{seq}\x1f{salt}"
            + (f"\x1f{beacon}" if beacon else ""))
    digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    items = tuple(int(i) for i in rng.integers(n_items, size=groups))
    kind = "p" if probation else "s"
    return Assignment(items, tuple(f"{_tag(key_id)}-{kind}{seq}-g{j}" for j in range(groups)),
                      int(rng.integers(2**62)), probation)


def is_probation(episodes: list[Episode], key_id: str, seq: int) -> bool:
    """Whether a batch presents itself as probation work (its first group id is ``<key>-p<seq>-``);
    the trainer then holds it to the probation assignment, and otherwise to the salted one."""
    return bool(episodes) and episodes[0].group_id.startswith(f"{_tag(key_id)}-p{seq}-g")


def _gid(group_id: str) -> str:
    return repr(group_id[:40]) + ("..." if len(group_id) > 40 else "")


def assignment_problem(episodes: list[Episode], expected: Assignment, group_size: int) -> str | None:
    """Why a batch is not exactly its assignment (every group, every sample, nothing else), or None."""
    want = dict(zip(expected.group_ids, expected.items))
    seen: dict[str, set[int]] = {}
    for i, ep in enumerate(episodes):
        if ep.group_id not in want:
            return (f"episode {i}: group {_gid(ep.group_id)} is not one this batch was assigned "
                    f"({', '.join(expected.group_ids[:2])}, ...)")
        if ep.item_index != want[ep.group_id]:
            return f"episode {i}: group {_gid(ep.group_id)} plays item {ep.item_index}, assigned item {want[ep.group_id]}"
        samples = seen.setdefault(ep.group_id, set())
        if ep.sample_index in samples:
            return f"episode {i}: sample {ep.sample_index} of group {_gid(ep.group_id)} appears twice"
        samples.add(ep.sample_index)
    missing = [g for g in expected.group_ids if len(seen.get(g, ())) != group_size]
    if missing:
        return f"group {missing[0]!r} has {len(seen.get(missing[0], ()))} of its {group_size} samples"
    return None
