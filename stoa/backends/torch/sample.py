"""The sampling rule of :mod:`stoa.backends.sampling` in torch, on the engine's device, at any
vocabulary size.

Each token is ``argmax_j z_j + g_j`` (``z``: logits / T after top-k / top-p, shifted by its
maximum as the host sampler does; ``g_j``: the seeded Gumbel noise of token ``j``), and its log-prob
``z_t - logsumexp(z)``. Noise is never computed for the whole vocabulary: the ``PROBE`` highest
``z`` get theirs first, and the best of those noised scores bounds the winner from below; a token
whose ``z`` plus the largest noise a 23-bit uniform can give (``G_MAX``) falls short of that bound
cannot win, and is skipped. What remains is usually a small share of the vocabulary (all of it
only for a flat distribution, such as a random model's); of those, only the tokens whose integer
noise code reaches the threshold of their deficit to the bound (the table ``draw_margins`` uses)
get float noise. Both steps are exact: the draw equals the full computation. The noise bits are the same integers as
:func:`stoa.backends.sampling.noise_bits`; float noise is float32 like the host sampler's, so the
two draw the same token barring a perturbed-score tie within float32 rounding.
"""

from __future__ import annotations

import numpy as np
import torch

from stoa.backends.sampling import BIN, BITS_AT, G_MAX, H1, H2, PROBE, split_seeds

__all__ = ["gumbel", "noise_bits", "sample", "truncate"]

_MASK = 0xFFFFFFFF
_SLACK = 1e-3  # float32 rounding of z + g above z + G_MAX


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values (products wrap modulo 2^64; the mask keeps
    their low 32 bits, which is the uint32 product)."""
    x = x ^ (x >> 16)
    x = (x * H1) & _MASK
    x = x ^ (x >> 15)
    x = (x * H2) & _MASK
    return x ^ (x >> 16)


def noise_bits(lo: torch.Tensor, hi: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """:func:`stoa.backends.sampling.noise_bits` for row seed words ``lo``/``hi`` (int64, shape
    broadcastable against ``cols``, int64 token ids)."""
    return _mix32(_mix32(cols ^ lo) ^ hi)


def gumbel(lo: torch.Tensor, hi: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """float32 Gumbel noise at token ids ``cols``: :func:`stoa.backends.sampling.gumbel`'s arithmetic."""
    return _noise(noise_bits(lo, hi, cols) >> 9)


def _noise(code: torch.Tensor) -> torch.Tensor:
    """float32 Gumbel noise of 23-bit codes."""
    w = (2**23 - 0.5) - code.to(torch.float32)
    return -torch.log(-torch.log1p(w * -(2.0**-23)))


_TABLES: dict[torch.device, torch.Tensor] = {}


def _thresholds(dev: torch.device) -> torch.Tensor:
    """``draw_margins``' per-bin code thresholds, shifted by one (entry 0: a negative deficit, 0)."""
    if dev not in _TABLES:
        _TABLES[dev] = torch.from_numpy(np.concatenate([[0], BITS_AT[:-1]]).astype(np.int64)).to(dev)
    return _TABLES[dev]


def truncate(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """:func:`stoa.backends.sampling.truncate` (dropped entries of scaled logits set to ``-inf``)."""
    v = z.shape[1]
    if 0 < top_k < v:
        kth = z.topk(top_k, dim=1).values[:, -1:]
        z = z.masked_fill(z < kth, -torch.inf)
    if top_p < 1.0:
        p = torch.softmax(z, dim=1)
        ps = p.sort(dim=1, descending=True).values
        k = torch.clamp((ps.cumsum(dim=1) < np.float32(top_p)).sum(dim=1), max=v - 1)
        z = z.masked_fill(p < ps.gather(1, k[:, None]), -torch.inf)
    return z


def _dense(z: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``argmax_j z_j + g_j`` with every entry's noise computed (rows in chunks of ~16M entries):
    on a GPU a few fused-size elementwise passes cost less than the bound's gather and sync."""
    n, v = z.shape
    tok = torch.empty(n, dtype=torch.int64, device=z.device)
    cols = torch.arange(v, dtype=torch.int64, device=z.device)[None, :]
    step = max(1, (1 << 24) // v)
    for a in range(0, n, step):
        g = gumbel(lo[a:a + step, None], hi[a:a + step, None], cols)
        tok[a:a + step] = (z[a:a + step] + g).argmax(dim=1)  # ties: the first, as the bound path's amin
    return tok


def sample(logits: torch.Tensor, seeds: np.ndarray, temperature: float, top_k: int = 0,
           top_p: float = 1.0, dense: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokens (int64) and behaviour log-probs (float32) of raw logits ``[n, V]`` (any float dtype,
    any device) for uint64 row seeds ``[n]``. ``dense``: compute every entry's noise instead of
    bounding the candidates first (the same tokens; None: dense on a GPU)."""
    n, v = logits.shape
    dev = logits.device
    z = logits.float() * np.float32(1.0 / temperature)
    if top_k or top_p < 1.0:
        z = truncate(z, top_k, top_p)
    z = z - z.max(dim=1, keepdim=True).values
    lse = torch.logsumexp(z, dim=1)
    lo_np, hi_np = split_seeds(seeds)
    lo = torch.from_numpy(lo_np.astype(np.int64)).to(dev)
    hi = torch.from_numpy(hi_np.astype(np.int64)).to(dev)
    if dense if dense is not None else dev.type == "cuda":
        tok = _dense(z, lo, hi)
        lp = z.gather(1, tok[:, None])[:, 0] - lse
        return tok.cpu().numpy(), lp.cpu().numpy().astype(np.float32)
    k = min(PROBE, v)
    top, idx = z.topk(k, dim=1)
    bound = (top + gumbel(lo[:, None], hi[:, None], idx)).max(dim=1).values
    rows, cols = torch.nonzero(z >= (bound - (G_MAX + _SLACK))[:, None], as_tuple=True)
    zc = z[rows, cols]
    code = noise_bits(lo[rows], hi[rows], cols) >> 9
    # a token passes the bound only if its noise exceeds its deficit, hence its code that bin's threshold
    # (less the slack: float32 rounding of z and the bound moves a deficit by more than one code's worth)
    # (floored: the bound's own token may sit a negative deficit away, its noise below 0)
    deficit = ((bound[rows] - zc - _SLACK) * (1 / BIN)).floor().clamp(-1, len(BITS_AT) - 2).to(torch.int64)
    need = _thresholds(dev)[deficit + 1]
    keep = code >= need
    rows, cols = rows[keep], cols[keep]
    s = zc[keep] + _noise(code[keep])
    best = torch.full((n,), -torch.inf, device=dev).scatter_reduce(0, rows, s, "amax")
    win = s == best[rows]
    tok = torch.full((n,), v, dtype=torch.int64, device=dev).scatter_reduce(0, rows[win], cols[win], "amin")
    lp = z.gather(1, tok[:, None])[:, 0] - lse
    return tok.cpu().numpy(), lp.cpu().numpy().astype(np.float32)
