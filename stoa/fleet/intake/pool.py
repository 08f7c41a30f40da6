"""Whole groups of accepted batches waiting for an optimizer step, and the choice of a step's groups."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from stoa.fleet.trust.gate import group_episodes, scoped
from stoa.transport.exchange import Batch
from stoa.types import Episode

__all__ = ["Pool", "Taken"]


@dataclass(frozen=True)
class Taken:
    """The groups of one optimizer step: ``groups[i]`` came in ``batches[i]``; each group's
    ``group_id`` is scoped to the key that sealed it (:func:`stoa.fleet.trust.scoped`)."""

    batches: tuple[Batch, ...]
    groups: tuple[list[Episode], ...]

    @property
    def episodes(self) -> list[Episode]:
        return [e for g in self.groups for e in g]


class Pool:
    """Accepted batches' groups (ids unscoped), oldest batch first."""

    def __init__(self) -> None:
        self.entries: list[tuple[Batch, dict[str, list[Episode]]]] = []

    def add(self, batch: Batch) -> None:
        self.entries.append((batch, group_episodes(batch.episodes)))

    def remove(self, key: str) -> None:
        """Drop the groups of the batch stored at ``key``."""
        self.entries = [(b, g) for b, g in self.entries if b.key != key]

    def of_key(self, key_id: str) -> list[Batch]:
        """The pooled batches sealed by ``key_id``."""
        return [b for b, _ in self.entries if b.key_id == key_id]

    def batches(self) -> list[Batch]:
        """Batches with groups still waiting."""
        return [b for b, g in self.entries if g]

    def waiting_groups(self) -> set[str]:
        """The scoped ids of the groups still waiting."""
        return {scoped(b.key_id, gid) for b, g in self.entries for gid in g}

    def choose(self, version: int, n: int, group_size: int, max_lag: int, cap: int,
               used: set[str]) -> tuple[Taken | None, dict[str, list[str]]]:
        """``(taken, dropped)``: ``n`` eligible groups, oldest first, at most ``cap`` per key (None
        while there are not enough), and the scoped ids dropped on the way by why (``reused``:
        in ``used``; ``stale``: more than ``max_lag`` versions behind; ``malformed``: not
        ``group_size`` distinct samples)."""
        chosen: list[tuple[int, str]] = []
        dropped: dict[str, list[str]] = {"reused": [], "stale": [], "malformed": []}
        per_key: Counter[str] = Counter()
        for b_i, (batch, groups) in enumerate(self.entries):
            for gid, eps in list(groups.items()):
                sgid = scoped(batch.key_id, gid)  # group ids live in their sender's namespace
                why = ("reused" if sgid in used else "stale" if version - batch.version > max_lag
                       else "malformed" if len(eps) != group_size or len({e.sample_index for e in eps}) != group_size
                       else None)
                if why:
                    dropped[why].append(sgid)
                    del groups[gid]
                elif len(chosen) < n and per_key[batch.key_id] < cap:
                    chosen.append((b_i, gid))
                    per_key[batch.key_id] += 1
        if len(chosen) < n:
            self.entries = [(b, g) for b, g in self.entries if g]
            return None, dropped
        out = [(self.entries[b_i][0], self.entries[b_i][1].pop(gid)) for b_i, gid in chosen]
        self.entries = [(b, g) for b, g in self.entries if g]
        return Taken(tuple(b for b, _ in out),
                     tuple([dataclasses.replace(e, group_id=scoped(b.key_id, e.group_id)) for e in g]
                           for b, g in out)), dropped

    def put_back(self, taken: Taken, refused: Sequence[str]) -> None:
        """The groups of ``taken`` not in a ``refused`` batch go back to the front, as they were
        (ids unscoped again)."""
        back: dict[str, tuple[Batch, dict[str, list[Episode]]]] = {}
        for batch, g in zip(taken.batches, taken.groups):
            if batch.key not in refused:
                cut = len(batch.key_id) + 1 if batch.key_id else 0
                raw = [dataclasses.replace(e, group_id=e.group_id[cut:]) for e in g]
                back.setdefault(batch.key, (batch, {}))[1][raw[0].group_id] = raw
        self.entries = list(back.values()) + self.entries
