"""Token sampling with exact behaviour log-probs, reproducible per episode.

The rule is :mod:`stoa.backends.sampling`'s seeded Gumbel-max: each token has a 64-bit row seed
(a hash of the episode's key and the token's position), every vocabulary entry ``j`` gets noise
``g_j = -log(-log(u_j))`` from a 32-bit hash of (row seed, ``j``), and the token is
``argmax_j z_j + g_j`` with ``z = logits / T`` (after top-k / top-p truncation, see
:mod:`stoa.backends.engine`); its log-prob is ``z[i] - logsumexp(z)``. A token with zero
probability is never drawn.

Two implementations of the same rule: :class:`HostSampler` (numpy; on CPU-only machines MLX's
elementwise ``exp`` is ~10x slower than numpy's) and :func:`device_sample` (MLX, for GPUs). The
noise bits are the same integers in both; the float noise and sums differ in the last bits, so
the two draw the same token except when two perturbed scores tie to ~1e-6.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from stoa.backends.sampling import H1, H2, HostSampler, episode_key, row_seeds, split_seeds

__all__ = ["HostSampler", "device_sample", "episode_key", "row_seeds"]


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


def _mix32(x: mx.array) -> mx.array:
    x = x ^ (x >> 16)
    x = x * mx.array(H1, mx.uint32)
    x = x ^ (x >> 15)
    x = x * mx.array(H2, mx.uint32)
    return x ^ (x >> 16)


def _gumbel_mx(seeds: np.ndarray, v: int) -> mx.array:
    """:func:`stoa.backends.sampling.gumbel` in MLX (float32): the same noise bits."""
    lo, hi = split_seeds(seeds)
    h = _mix32(mx.arange(v, dtype=mx.uint32)[None, :] ^ mx.array(lo)[:, None])
    h = _mix32(h ^ mx.array(hi)[:, None])
    w = ((2**23 - 0.5) - (h >> 9).astype(mx.float32)) * (2.0**-23)  # 1 - u, exact
    return -mx.log(-mx.log1p(-w))


def device_sample(logits: mx.array, seeds: np.ndarray, temperature: float, top_k: int = 0,
                  top_p: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The same rule as :class:`HostSampler`, computed by MLX on its default device."""
    z = logits.astype(mx.float32) * (1.0 / temperature)
    if top_k or top_p < 1.0:
        z = _truncate_mx(z, top_k, top_p)
    z = z - z.max(axis=1, keepdims=True)
    total = mx.exp(z).sum(axis=1)
    tok = mx.argmax(z + _gumbel_mx(seeds, z.shape[1]), axis=1)
    lp = mx.take_along_axis(z, tok[:, None], axis=1)[:, 0] - mx.log(total)
    mx.eval(tok, lp)
    return np.array(tok).astype(np.int64), np.array(lp, dtype=np.float32)
