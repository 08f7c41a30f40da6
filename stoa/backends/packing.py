"""Sequence packing: variable-length episodes into micro-batches of rows (numpy only).

Packed mode puts several whole episodes in one row (first-fit decreasing, at most
``budget`` tokens a row, one row per micro-batch); positions restart at 0 for each episode and
:class:`VarlenLayout` tells the attention kernel where episodes begin, so attention never
crosses an episode boundary. Padded mode (the baseline) keeps one episode a row and pads each
micro-batch to its longest episode. Shared by the torch and Megatron learners; numpy only (no
torch, no transformers), so planning a batch is as light as ``import stoa``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["MicroBatch", "VarlenLayout", "build_micro_batches", "by_length", "padded_tokens", "plan_micro_batches",
           "scoring_batches"]


def scoring_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of sequences grouped for padded forward passes (scoring): similar lengths together,
    each group's ``rows x longest`` at most ``max_tokens`` (a longer sequence goes alone)."""
    batches: list[list[int]] = [[]]
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if batches[-1] and (len(batches[-1]) + 1) * lengths[i] > max_tokens:
            batches.append([])
        batches[-1].append(i)
    return [b for b in batches if b]


def by_length(lengths: Sequence[int], max_tokens: int, run: Callable[[list[int]], list]) -> list:
    """``run(indices)`` over each of :func:`scoring_batches`, its results put back in index order."""
    out: dict[int, Any] = {}
    for b in scoring_batches(lengths, max_tokens):
        out.update(zip(b, run(b)))
    return [out[i] for i in range(len(lengths))]


def padded_tokens(episodes: Sequence[Any], vocab_size: int, dtype: Any = np.int64,
                  error: type[Exception] = ValueError) -> tuple[list[np.ndarray], np.ndarray]:
    """Each episode's tokens, and all of them right-padded with 0 into one ``[rows, longest]``
    array; raises ``error`` for a token id outside ``[0, vocab_size)``."""
    toks = [ep.tokens() for ep in episodes]
    for t in toks:
        if t.size and (t.min() < 0 or t.max() >= vocab_size):
            raise error(f"token id outside [0, {vocab_size})")
    x = np.zeros((len(toks), max(len(t) for t in toks)), dtype)
    for r, t in enumerate(toks):
        x[r, :len(t)] = t
    return toks, x


@dataclass(frozen=True)
class VarlenLayout:
    """Where each packed episode lives, for attention that runs episode by episode.

    Episodes are grouped in length buckets; bucket ``b`` is a dense ``[n_b, max_b]`` block whose
    entries are flat positions into the micro-batch (``rows * row_len``), right-padded by
    repeating the episode's first position (a causal kernel never lets a real query see those).
    ``slot[p]`` is where flat position ``p`` sits in the concatenation of the flattened buckets.
    """

    buckets: tuple[tuple[np.ndarray, int, int], ...]
    """(flat gather index int64 ``[n_b * max_b]``, n_b, max_b) per bucket."""
    slot: np.ndarray
    """int64 ``[rows * row_len]``: position -> index in the concatenated bucket blocks."""


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward unit: ``rows x row_len`` token slots."""

    input_ids: np.ndarray
    """int64 ``[rows, row_len]`` (pad slots hold 0)."""
    position_ids: np.ndarray
    """int64 ``[rows, row_len]``, restarting at 0 for each episode."""
    attention_mask: np.ndarray | None
    """int64 ``[rows, row_len]`` with 1 at real tokens (padded mode); None when packed."""
    placements: tuple[tuple[int, int, int, int], ...]
    """(episode index, row, start, length) of every episode in this micro-batch."""
    varlen: VarlenLayout | None
    """Attention layout (packed mode only)."""

    @property
    def num_tokens(self) -> int:
        return sum(p[3] for p in self.placements)

    @property
    def num_slots(self) -> int:
        return int(self.input_ids.size)

    def gather(self, per_episode: Sequence[np.ndarray], dtype: np.dtype | type, fill: float = 0) -> np.ndarray:
        """Lay per-episode arrays (``[len(episode)]``, indexed by episode index) out as ``[rows, row_len]``."""
        out = np.full(self.input_ids.shape, fill, dtype=dtype)
        for i, r, s, n in self.placements:
            out[r, s : s + n] = per_episode[i]
        return out

    def split(self, arr: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """Inverse of :meth:`gather`: ``(episode index, arr[row, start:start+length])`` per episode."""
        return [(i, arr[r, s : s + n]) for i, r, s, n in self.placements]


def plan_micro_batches(lengths: Sequence[int], budget: int, packing: bool) -> list[list[list[int]]]:
    """Assign episodes to micro-batches and rows: ``plan[m][r]`` lists episode indices.

    Packed: first-fit decreasing into rows of at most ``budget`` tokens, one row per micro-batch
    (an episode longer than the budget gets a row alone). Padded: in batch order, one episode a
    row, a micro-batch grows while ``rows * longest <= budget``.
    """
    if budget < 1:
        raise ValueError("budget must be >= 1")
    if packing:
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        bins: list[list[int]] = []
        room: list[int] = []
        for i in order:
            n = lengths[i]
            for b, free in enumerate(room):
                if n <= free:
                    bins[b].append(i)
                    room[b] -= n
                    break
            else:
                bins.append([i])
                room.append(budget - n)
        return [[b] for b in bins]
    plan: list[list[list[int]]] = []
    longest = 0
    for i, n in enumerate(lengths):
        if plan and (len(plan[-1]) + 1) * max(longest, n) <= budget:
            plan[-1].append([i])
            longest = max(longest, n)
        else:
            plan.append([[i]])
            longest = n
    return plan


def _varlen(placements: Sequence[tuple[int, int, int, int]], row_len: int, total: int) -> VarlenLayout:
    # Longest first; a new bucket starts when an episode is at most half the bucket's longest,
    # which bounds padded attention work at 4x the exact block-diagonal work.
    segs = sorted(((r * row_len + s, n) for _, r, s, n in placements), key=lambda x: -x[1])
    groups: list[list[tuple[int, int]]] = []
    for seg in segs:
        if groups and 2 * seg[1] > groups[-1][0][1]:
            groups[-1].append(seg)
        else:
            groups.append([seg])
    slot = np.zeros(total, dtype=np.int64)
    buckets = []
    base = 0
    for g in groups:
        width = g[0][1]
        idx = np.empty((len(g), width), dtype=np.int64)
        for j, (start, n) in enumerate(g):
            idx[j, :n] = np.arange(start, start + n)
            idx[j, n:] = start
            slot[start : start + n] = base + j * width + np.arange(n)
        buckets.append((idx.reshape(-1), len(g), width))
        base += len(g) * width
    return VarlenLayout(tuple(buckets), slot)


def build_micro_batches(
    tokens: Sequence[np.ndarray], budget: int, packing: bool
) -> list[MicroBatch]:
    """Pack (or pad) token sequences into micro-batches; see :func:`plan_micro_batches`."""
    lengths = [len(t) for t in tokens]
    out = []
    for rows in plan_micro_batches(lengths, budget, packing):
        row_len = max(sum(lengths[i] for i in row) for row in rows)
        ids = np.zeros((len(rows), row_len), dtype=np.int64)
        pos = np.zeros((len(rows), row_len), dtype=np.int64)
        placements = []
        for r, row in enumerate(rows):
            s = 0
            for i in row:
                n = lengths[i]
                ids[r, s : s + n] = tokens[i]
                pos[r, s : s + n] = np.arange(n)
                placements.append((i, r, s, n))
                s += n
        if packing:
            mask, varlen = None, _varlen(placements, row_len, ids.size)
        else:
            mask = (np.arange(row_len)[None, :] < np.array([lengths[row[0]] for row in rows])[:, None])
            mask, varlen = mask.astype(np.int64), None
        out.append(MicroBatch(ids, pos, mask, tuple(placements), varlen))
    return out
