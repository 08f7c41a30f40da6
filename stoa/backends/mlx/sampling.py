"""Token sampling with exact behaviour log-probs, reproducible per episode.

Each token gets one uniform ``u`` in (0, 1): a hash of the episode's 64-bit key and the token's
position, so an episode's draws do not depend on which other episodes share its batch. The token
is the inverse-CDF draw ``min {i : cumsum(exp(z))[i] >= u * sum(exp(z))}`` with
``z = logits / T - max`` (after top-k / top-p truncation, see :mod:`stoa.backends.engine`), and
its log-prob is ``z[i] - log(sum(exp(z)))``. The landing index always has positive probability.

Two implementations of the same rule: :class:`HostSampler` (numpy; on CPU-only machines MLX's
elementwise ``exp`` is ~10x slower than numpy's) and :func:`device_sample` (MLX, for GPUs).
"""

from __future__ import annotations

import hashlib

import mlx.core as mx
import numpy as np

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


def _truncate_np(z: np.ndarray, top_k: int, top_p: float) -> None:
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


class HostSampler:
    """The sampling rule in numpy, with reused work buffers (fresh pages cost more than exp)."""

    def __init__(self) -> None:
        self._z = np.empty((0, 0), np.float32)
        self._e = np.empty((0, 0), np.float32)

    def __call__(self, logits: np.ndarray, u: np.ndarray, temperature: float, top_k: int = 0,
                 top_p: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        b, v = logits.shape
        if self._z.shape[0] < b or self._z.shape[1] != v:
            self._z = np.empty((max(b, self._z.shape[0]), v), np.float32)
            self._e = np.empty_like(self._z)
        z, e = self._z[:b], self._e[:b]
        np.multiply(logits, np.float32(1.0 / temperature), out=z, casting="same_kind")
        if top_k or top_p < 1.0:
            _truncate_np(z, top_k, top_p)
        z -= z.max(axis=1, keepdims=True)
        np.exp(z, out=e)
        np.cumsum(e, axis=1, out=e)
        total = e[:, -1].copy()
        x = u * total
        tok = np.fromiter((np.searchsorted(e[i], x[i], side="left") for i in range(b)), np.int64, count=b)
        lp = z[np.arange(b), tok] - np.log(total)
        return tok, lp.astype(np.float32)


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


def _truncate_mx(z: mx.array, top_k: int, top_p: float) -> mx.array:
    v = z.shape[1]
    neg = mx.array(-np.inf, dtype=mx.float32)
    if 0 < top_k < v:
        kth = mx.partition(z, v - top_k, axis=1)[:, v - top_k:v - top_k + 1]
        z = mx.where(z < kth, neg, z)
    if top_p < 1.0:
        p = mx.softmax(z, axis=1)
        ps = -mx.sort(-p, axis=1)
        k = mx.minimum((mx.cumsum(ps, axis=1) < top_p).sum(axis=1), v - 1)
        thr = mx.take_along_axis(ps, k[:, None], axis=1)
        z = mx.where(p < thr, neg, z)
    return z


def device_sample(logits: mx.array, u: np.ndarray, temperature: float, top_k: int = 0,
                  top_p: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The same rule as :class:`HostSampler`, computed by MLX on its default device."""
    z = logits.astype(mx.float32) * (1.0 / temperature)
    if top_k or top_p < 1.0:
        z = _truncate_mx(z, top_k, top_p)
    z = z - z.max(axis=1, keepdims=True)
    c = mx.cumsum(mx.exp(z), axis=1)
    total = c[:, -1]
    tok = (c < (mx.array(u) * total)[:, None]).sum(axis=1)
    lp = mx.take_along_axis(z, tok[:, None], axis=1)[:, 0] - mx.log(total)
    mx.eval(tok, lp)
    return np.array(tok).astype(np.int64), np.array(lp, dtype=np.float32)
