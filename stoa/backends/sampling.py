"""The sampling rule's framework-free parts: per-token uniforms, truncation, and CDF margins.

Every backend that samples (the MLX engine) or re-derives samples (the MLX engine's and the torch
int8 scorer's ``sampling_margins``) uses these numpy functions, so a token's uniform and the
slice of the CDF it must land in are computed one way everywhere. Only the logits come from the
backend's own model.

Each token gets one uniform ``u`` in (0, 1): a hash of the episode's 64-bit key and the token's
position (:func:`episode_key`, :func:`uniforms`), so an episode's draws do not depend on which
other episodes share its batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stoa.types import Episode

__all__ = ["MarginPlan", "cdf_margins", "episode_key", "margin_plan", "truncate", "uniforms"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def episode_key(seed: int, group_id: str, index: int, sample_index: int) -> int:
    """A 64-bit key naming one episode's random stream."""
    h = hashlib.blake2b(f"{seed}\x1f{group_id}\x1f{index}\x1f{sample_index}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def uniforms(keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """float32 ``u`` in [2^-24, 1 - 2^-24] for each (key, position): splitmix64 of the pair."""
    x = keys.astype(np.uint64) ^ (positions.astype(np.uint64) * _GOLDEN)
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    # 23 bits + 0.5 is exact in float32 and never rounds to 0 or 1.
    return (((x >> np.uint64(41)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23)).astype(np.float32)


def truncate(z: np.ndarray, top_k: int, top_p: float) -> None:
    """Set to ``-inf``, in place, the entries of scaled logits ``z [n, V]`` that top-k / top-p
    drop (the rule of :mod:`stoa.backends.engine`; ties with the last kept probability stay)."""
    b, v = z.shape
    if 0 < top_k < v:
        kth = np.partition(z, v - top_k, axis=1)[:, v - top_k:v - top_k + 1]
        z[z < kth] = -np.inf
    if top_p < 1.0:
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        ps = -np.sort(-p, axis=1)
        k = np.minimum((np.cumsum(ps, axis=1) < np.float32(top_p)).sum(axis=1), v - 1)
        z[p < ps[np.arange(b), k][:, None]] = -np.inf


def cdf_margins(z: np.ndarray, tokens: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Where each row's uniform ``u`` lands relative to its token's slice of the CDF of
    ``softmax(z)`` (``z``: scaled, truncated logits ``[n, V]``): the distance to the nearest edge
    of the slice, positive inside it (the rule draws that token), negative outside (it draws
    another), in units of probability. Computed in float64."""
    z = z.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    c = np.cumsum(np.exp(z), axis=1)
    c /= c[:, -1:]
    rows = np.arange(len(tokens))
    hi = c[rows, tokens]
    lo = np.where(tokens > 0, c[rows, np.maximum(tokens - 1, 0)], 0.0)
    inside = (u > lo) & (u <= hi)
    return np.where(inside, np.minimum(u - lo, hi - u), -np.maximum(lo - u, u - hi))


@dataclass(frozen=True)
class MarginPlan:
    """The sampled tokens of a padded batch of episodes, flattened in episode then position order.

    A backend runs its model over the distinct token rows :attr:`x`, takes the logits that
    predicted each listed token (row ``src[j]`` of :attr:`x`, position ``at[j] - 1``) and hands
    them, in slices, to :meth:`margins`. Identical episodes (a converged policy repeats itself,
    and every repeated episode is re-derived as a possible variant copy) share one forward pass;
    each keeps its own uniforms.
    """

    rows: np.ndarray
    """int64 ``[n]``: the episode (row of the padded batch) of each sampled token."""
    at: np.ndarray
    """int64 ``[n]``: the token's position in its episode (always >= 1)."""
    chosen: np.ndarray
    """int64 ``[n]``: the token id."""
    u: np.ndarray
    """float64 ``[n]``: its re-derived uniform."""
    inv_t: np.ndarray
    """float32 ``[n, 1]``: ``1 / temperature`` of its episode."""
    top_p: np.ndarray
    """float64 ``[n]``: ``top_p`` of its episode."""
    sizes: tuple[int, ...]
    """Sampled tokens per episode."""
    x: np.ndarray
    """``[distinct rows, width]``: the padded batch's distinct rows, what the model runs over."""
    src: np.ndarray
    """int64 ``[n]``: the row of :attr:`x` holding each sampled token's episode."""

    def margins(self, a: int, logits: np.ndarray, top_k: int) -> np.ndarray:
        """:func:`cdf_margins` of tokens ``a .. a + len(logits)`` from their float32 logits ``[m, V]``
        (scaled by each episode's temperature and truncated by its ``top_p`` and ``top_k`` here)."""
        b = a + len(logits)
        z = np.asarray(logits, np.float32) * self.inv_t[a:b]
        top_p = self.top_p[a:b]
        for p in np.unique(top_p) if top_k or (top_p < 1.0).any() else ():
            sel = np.flatnonzero(top_p == p)
            sub = z[sel]
            truncate(sub, top_k, float(p))
            z[sel] = sub
        return cdf_margins(z, self.chosen[a:b], self.u[a:b])

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        """Per-episode arrays of a flat ``[n]`` result."""
        return np.split(flat, np.cumsum(self.sizes)[:-1]) if self.sizes else []


def margin_plan(episodes: Sequence[Episode], seeds: Sequence[int], x: np.ndarray) -> MarginPlan:
    """The plan for ``episodes`` (sampled with cohort seeds ``seeds``) padded into ``x [rows, width]``
    (:func:`stoa.backends.packing.padded_tokens`). A model token at position 0 has no logits to
    re-derive it from and is left out (the episode's array is then empty)."""
    pos = [np.flatnonzero(ep.loss_mask()) for ep in episodes]
    pos = [p if p.size and p[0] > 0 else p[:0] for p in pos]
    rows = np.concatenate([np.full(p.size, r, np.int64) for r, p in enumerate(pos)] or [np.zeros(0, np.int64)])
    at = np.concatenate(pos or [np.zeros(0, np.int64)]).astype(np.int64)
    keys = [episode_key(int(seed), ep.group_id, int(ep.item_index or 0), ep.sample_index)
            for ep, seed in zip(episodes, seeds)]
    u = uniforms(np.array([keys[r] for r in rows], np.uint64), at).astype(np.float64)
    inv_t = np.array([1.0 / episodes[r].temperature for r in rows], np.float32).reshape(-1, 1)
    top_p = np.array([episodes[r].top_p for r in rows], np.float64)
    # Right padding leaves every real position's logits as they are, so equal padded rows give equal logits.
    distinct, same = np.unique(x, axis=0, return_inverse=True)
    return MarginPlan(rows, at, x[rows, at].astype(np.int64), u, inv_t, top_p, tuple(p.size for p in pos),
                      distinct, same.reshape(-1)[rows].astype(np.int64))
