"""Token sampling with exact behaviour log-probs, reproducible per episode.

Each token gets one uniform ``u`` in (0, 1) (:func:`stoa.backends.sampling.uniforms`: a hash of the
episode's 64-bit key and the token's position, so an episode's draws do not depend on which other
episodes share its batch). The token is the inverse-CDF draw ``min {i : cumsum(exp(z))[i] >= u * sum(exp(z))}`` with
``z = logits / T - max`` (after top-k / top-p truncation, see :mod:`stoa.backends.engine`), and
its log-prob is ``z[i] - log(sum(exp(z)))``. The landing index always has positive probability.

Two implementations of the same rule: :class:`HostSampler` (numpy; on CPU-only machines MLX's
elementwise ``exp`` is ~10x slower than numpy's) and :func:`device_sample` (MLX, for GPUs).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from stoa.backends.sampling import cdf_margins, episode_key, truncate, uniforms

__all__ = ["HostSampler", "cdf_margins", "device_sample", "episode_key", "uniforms"]


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
            truncate(z, top_k, top_p)
        z -= z.max(axis=1, keepdims=True)
        np.exp(z, out=e)
        np.cumsum(e, axis=1, out=e)
        total = e[:, -1].copy()
        x = u * total
        tok = np.fromiter((np.searchsorted(e[i], x[i], side="left") for i in range(b)), np.int64, count=b)
        lp = z[np.arange(b), tok] - np.log(total)
        return tok, lp.astype(np.float32)


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
