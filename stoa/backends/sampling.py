"""The sampling rule's framework-free parts: seeded noise, truncation, and draw margins.

**The rule** (seeded Gumbel-max). Each sampled token has a 64-bit *row seed*, a hash of the
episode's key and the token's position (:func:`episode_key`, :func:`row_seeds`), so an episode's
draws do not depend on which other episodes share its batch. Every vocabulary entry ``j`` gets
Gumbel noise ``g_j = -log(-log(u_j))`` from a 23-bit uniform ``u_j`` hashed from (row seed, ``j``)
(:func:`noise_bits`), and the token is

    argmax_j  z_j + g_j,      z = logits / temperature (after top-k / top-p truncation),

an exact draw from ``softmax(z)`` over the kept tokens (a token with ``z_j = -inf`` is never
drawn). Its behaviour log-prob is ``z[token] - logsumexp(z)`` (see :mod:`stoa.backends.engine`).

**The check.** Anyone holding the weights re-derives the noise and asks by how much the drawn
token beats every other kept token (:func:`draw_margins`), in *raw logit* units:

    margin = (l_t + T g_t) - max_{j != t} (l_j + T g_j),      l = logits, T = temperature.

Positive: the rule draws ``t``. If two stacks' logits differ by at most ``d`` per entry (after
the best common shift), a margin moves by at most ``2 d``; so a drift allowance ``d`` makes every
margin ``>= -2 d`` explainable by float drift and anything below a token the rule did not draw.
No sum over the vocabulary enters the margin (an inverse-CDF rule's float32 cumulative sum over
49k entries moved honest landings by up to 3e-4 in probability, more than a tail token's slice);
and honest margins within ``b`` of 0 are a share of at most ``b / T`` of tokens, whatever the
vocabulary size (the Gumbel gap is exponential-like near 0). With top-k / top-p, which tokens
are kept also moves under drift; the margin is taken against the tokens kept under *every*
drift of at most ``d``, and a token kept under *no* such drift has margin ``-inf``.

Every backend that samples (the MLX engine's host and device samplers) or re-derives samples
(the MLX engine's and the torch int8 scorer's ``sampling_margins``) uses these functions (or,
on a device, the same integer arithmetic); only the logits come from the backend's own model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stoa.types import Episode

__all__ = ["G_MAX", "G_MIN", "Draws", "HostSampler", "MarginPlan", "draw_margins", "episode_key", "gumbel", "margin_plan",
           "noise_bits", "row_seeds", "split_seeds", "truncate"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
H1, H2 = 0x7FEB352D, 0x846CA68B
"""The two multipliers of the 32-bit mixer (a "lowbias32" integer hash) behind :func:`noise_bits`."""
G_MAX = float(-np.log(-np.log1p(-(0.5 * 2.0**-23))))
"""The largest Gumbel noise a 23-bit uniform gives (about 16.6)."""
G_MIN = float(-np.log(-np.log(0.5 * 2.0**-23)))
"""The smallest (about -2.81)."""
PROBE = 64
"""Highest logits whose noise :func:`draw_margins` computes first, to bound the rest."""
BIN = 0.125


def _bits_at_least() -> np.ndarray:
    """``[b]``: the smallest 23-bit noise code whose Gumbel noise can exceed ``b * BIN`` (bin
    ``b`` of a deficit), conservatively (one code lower); the last entry is past every code.
    Index -1 (a negative deficit) is 0: every code."""
    edges = np.arange(0.0, G_MAX + BIN, BIN)
    u = np.exp(-np.exp(-edges))  # noise > edge  <=>  u > this
    codes = np.floor(u * 2.0**23 - 0.5).astype(np.int64) - 1
    return np.concatenate([np.clip(codes, 0, None), [2**23, 0]]).astype(np.uint32)


BITS_AT = _bits_at_least()


def episode_key(seed: int, group_id: str, index: int, sample_index: int) -> int:
    """A 64-bit key naming one episode's random stream."""
    h = hashlib.blake2b(f"{seed}\x1f{group_id}\x1f{index}\x1f{sample_index}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def row_seeds(keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """uint64 seed of each (episode key, token position): splitmix64 of the pair."""
    x = keys.astype(np.uint64) ^ (positions.astype(np.uint64) * _GOLDEN)
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def split_seeds(seeds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The low and high 32-bit words of uint64 row seeds (what the 32-bit mixer takes)."""
    s = np.asarray(seeds, np.uint64)
    return (s & np.uint64(0xFFFFFFFF)).astype(np.uint32), (s >> np.uint64(32)).astype(np.uint32)


def _mix32(x: np.ndarray) -> np.ndarray:
    """lowbias32, in place on a uint32 array."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(H1)
    x ^= x >> np.uint32(15)
    x *= np.uint32(H2)
    x ^= x >> np.uint32(16)
    return x


def noise_bits(seeds: np.ndarray | tuple[np.ndarray, np.ndarray], cols: np.ndarray) -> np.ndarray:
    """uint32 hash of (row seed, token id): ``mix(mix(j ^ lo) ^ hi)`` for each row seed
    ``[n]`` (uint64, or its :func:`split_seeds` words) and token ids ``cols`` (``[V]``, shared by
    every row, or ``[n, m]``)."""
    lo, hi = seeds if isinstance(seeds, tuple) else split_seeds(seeds)
    cols = np.asarray(cols, np.uint32)
    h = _mix32(cols[None, :] ^ lo[:, None] if cols.ndim == 1 else cols ^ lo[:, None])
    h ^= hi[:, None]
    return _mix32(h)


def gumbel(seeds: np.ndarray | tuple[np.ndarray, np.ndarray], cols: np.ndarray | int,
           dtype: type = np.float64, out: np.ndarray | None = None) -> np.ndarray:
    """Gumbel noise ``-log(-log(u))`` of each row seed at token ids ``cols`` (an int ``V``:
    every id), in ``dtype`` (into ``out`` if given). ``u = (bits >> 9 + 0.5) / 2^23``; ``1 - u`` is
    exact in float32 and ``log(u)`` is taken as ``log1p(-(1 - u))``, so a float32 noise agrees
    with float64 to ~1e-6 even where ``-log(u)`` is tiny (the largest noise, the one most often
    drawn)."""
    cols = np.arange(cols, dtype=np.uint32) if isinstance(cols, (int, np.integer)) else cols
    bits = noise_bits(seeds, cols)
    bits >>= np.uint32(9)
    g = bits.astype(dtype) if out is None else np.copyto(out, bits, casting="unsafe") or out
    np.subtract(dtype(2**23 - 0.5), g, out=g)
    g *= dtype(-(2.0**-23))  # -(1 - u)
    np.log1p(g, out=g)  # log(u)
    np.negative(g, out=g)
    np.log(g, out=g)
    np.negative(g, out=g)
    return g


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


class HostSampler:
    """The sampling rule in numpy, with reused work buffers (fresh pages cost more than exp).

    Noise is computed only where it can decide the draw, which gives the full computation's token
    (the same float32 arithmetic on the entries that remain): the row's most likely token's noised
    score bounds the winner's from below; a token whose scaled logit plus ``G_MAX`` falls short of
    it is skipped, and of the rest only those whose integer noise code reaches the threshold of
    their deficit (:func:`draw_margins`' table) get float noise. A trained model's distribution
    leaves a few hundred entries of the vocabulary; a flat one (a random model's) all of them, of
    which about half get float noise.

    ``threads`` > 1 splits large batches into that many blocks of rows drawn at once (numpy
    releases the GIL in its array loops); every row's arithmetic is the same, so are its token and
    log-prob."""

    _PARALLEL_MIN = 1 << 20  # logits (rows x vocabulary) below which one thread does it all

    def __init__(self, threads: int = 1) -> None:
        self._z = np.empty((0, 0), np.float32)
        self._e = np.empty((0, 0), np.float32)
        self.threads = threads
        self._pool = None

    def __call__(self, logits: np.ndarray, seeds: np.ndarray, temperature: float, top_k: int = 0,
                 top_p: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        b, v = logits.shape
        if self._z.shape[0] < b or self._z.shape[1] != v:
            self._z = np.empty((max(b, self._z.shape[0]), v), np.float32)
            self._e = np.empty_like(self._z)
        parts = min(self.threads, b) if b * v >= self._PARALLEL_MIN else 1
        if parts <= 1:
            return self._rows(logits, seeds, self._z[:b], self._e[:b], temperature, top_k, top_p)
        if self._pool is None or self._pool._max_workers < parts:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(parts, thread_name_prefix="stoa-sampler")
        cuts = np.linspace(0, b, parts + 1).astype(int)
        done = list(self._pool.map(lambda i: self._rows(
            logits[cuts[i]:cuts[i + 1]], seeds[cuts[i]:cuts[i + 1]], self._z[cuts[i]:cuts[i + 1]],
            self._e[cuts[i]:cuts[i + 1]], temperature, top_k, top_p), range(parts)))
        return np.concatenate([t for t, _ in done]), np.concatenate([lp for _, lp in done])

    @staticmethod
    def _rows(logits: np.ndarray, seeds: np.ndarray, z: np.ndarray, e: np.ndarray, temperature: float, top_k: int,
              top_p: float) -> tuple[np.ndarray, np.ndarray]:
        b, v = logits.shape
        np.multiply(logits, np.float32(1.0 / temperature), out=z, casting="same_kind")
        if top_k or top_p < 1.0:
            truncate(z, top_k, top_p)
        rows = np.arange(b)
        best = z.argmax(axis=1)
        z -= z[rows, best][:, None]
        np.exp(z, out=e)
        total = e.sum(axis=1)
        lo, hi = split_seeds(seeds)
        bound = gumbel((lo, hi), best.astype(np.uint32)[:, None], np.float32)[:, 0]  # z[best] = 0
        tok = np.empty(b, np.int64)
        step = max(1, (1 << 18) // v)  # rows at a time: temporaries stay in cache
        for a in range(0, b, step):
            tok[a:a + step] = _draw(z[a:a + step], lo[a:a + step], hi[a:a + step], bound[a:a + step], e[a:a + step])
        lp = z[rows, tok] - np.log(total)
        return tok, lp.astype(np.float32)


_SLACK = np.float32(1e-3)  # float32 rounding of a deficit, in scaled-logit units
_NEED = np.concatenate([[0], BITS_AT[:-1]]).astype(np.uint32)  # BITS_AT shifted: entry 0 for deficits < 0


def _noise_of(code: np.ndarray) -> np.ndarray:
    """float32 Gumbel noise of 23-bit codes: :func:`gumbel`'s arithmetic."""
    g = code.astype(np.float32)
    np.subtract(np.float32(2**23 - 0.5), g, out=g)
    g *= np.float32(-(2.0**-23))
    np.log1p(g, out=g)
    np.negative(g, out=g)
    np.log(g, out=g)
    np.negative(g, out=g)
    return g


def _need(bound: np.ndarray, z: np.ndarray) -> np.ndarray:
    """The smallest noise code with which each entry of ``z`` could reach ``bound`` (conservative)."""
    deficit = np.floor((bound - z - _SLACK) * np.float32(1 / BIN))
    np.clip(deficit, -1, len(BITS_AT) - 2, out=deficit)
    return _NEED[deficit.astype(np.int64) + 1]


def _draw(z: np.ndarray, lo: np.ndarray, hi: np.ndarray, bound: np.ndarray, scratch: np.ndarray) -> np.ndarray:
    """argmax_j z_j + g_j per row (first index on a tie) of shifted scaled logits ``z [n, V]``
    given a lower bound ``bound [n]`` on each row's best noised score (reached by some entry)."""
    n, v = z.shape
    cand = np.greater_equal(z, (bound - np.float32(G_MAX) - _SLACK)[:, None], out=scratch.view(np.bool_)[:, :v])
    if 4 * int(np.count_nonzero(cand)) > cand.size:  # a flat distribution: every entry (cheaper whole)
        score = gumbel((lo, hi), v, np.float32, out=scratch[:, :v])
        score += z
        return score.argmax(axis=1).astype(np.int64)
    ri, ci = np.nonzero(cand)
    zc = z[ri, ci]
    code = noise_bits((lo[ri], hi[ri]), ci.astype(np.uint32)[:, None])[:, 0] >> np.uint32(9)
    keep = code >= _need(bound[ri], zc)
    ri, ci, zc = ri[keep], ci[keep], zc[keep]
    score = _noise_of(code[keep])
    score += zc
    starts = np.searchsorted(ri, np.arange(n))
    top = np.maximum.reduceat(score, starts)
    return np.minimum.reduceat(np.where(score == top[ri], ci, v), starts).astype(np.int64)


def _kept_bounds(z: np.ndarray, top_k: int, top_p: float, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """``(sure, maybe)`` boolean ``[V]``: the tokens that top-k / top-p keep under every, and
    under some, perturbation of the scaled logits ``z [V]`` (float64) by at most ``delta`` per
    entry. A token is kept when the mass of the tokens ranked above it is below ``top_p``
    (renormalized over the top-k survivors), and by top-k when fewer than ``top_k`` rank above it."""
    v = z.size
    zs = np.sort(z)[::-1]
    w = np.exp(zs - zs[0])
    cum = np.concatenate([[0.0], np.cumsum(w)])  # cum[n]: weight of the n highest
    neg = -zs  # ascending
    strict = np.searchsorted(neg, -(z + 2 * delta), side="left")  # tokens surely above each
    loose = np.searchsorted(neg, -(z - 2 * delta), side="right") - 1  # possibly above or tied (itself excluded)
    sure = np.ones(v, bool)
    maybe = np.ones(v, bool)
    n_sure, n_maybe = v, v
    if 0 < top_k < v:
        sure, maybe = loose < top_k, strict < top_k
        n_sure, n_maybe = int(sure.sum()), int(maybe.sum())
    if top_p < 1.0:
        up, down = np.exp(delta), np.exp(-delta)
        wi = np.exp(z - zs[0])
        above_min = down * cum[strict]
        rest_max = up * np.maximum(cum[n_maybe] - cum[strict], 0.0)
        lo = above_min / np.maximum(above_min + rest_max, 1e-300)
        above_max = up * np.maximum(cum[np.minimum(loose + 1, v)] - wi, 0.0)
        rest_min = down * (wi + np.maximum(cum[n_sure] - cum[np.minimum(loose + 1, v)], 0.0))
        hi = above_max / np.maximum(above_max + rest_min, 1e-300)
        sure, maybe = sure & (hi < top_p), maybe & (lo < top_p)
    return sure, maybe


def draw_margins(logits: np.ndarray, temperature: np.ndarray, tokens: np.ndarray, seeds: np.ndarray,
                 top_p: np.ndarray | float = 1.0, top_k: int = 0, drift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """``(margins, logprobs)`` of drawn ``tokens [n]`` given raw ``logits [n, V]``, per-row
    ``temperature`` and ``top_p`` and row ``seeds``: the margin of the module docstring in raw
    logit units (float64; positive: the rule draws the token), with top-k / top-p sets taken
    most favourably to the drawer under a logit ``drift`` of at most that much per entry, and
    the token's full-softmax log-prob at its temperature (no truncation, as
    ``RolloutEngine.score`` gives it).

    Float noise is computed only where it can matter: the best competitor among the ``PROBE``
    highest logits bounds the rest, and a token whose integer noise code is too small to make up
    its logit's deficit to that bound is skipped (exact: the result equals the full computation)."""
    n, v = logits.shape
    lg = logits.astype(np.float64)
    t = np.broadcast_to(np.asarray(temperature, np.float64), (n,)).copy()
    tp = np.broadcast_to(np.asarray(top_p, np.float64), (n,))
    tokens = np.asarray(tokens, np.int64)
    rows = np.arange(n)
    z = lg / t[:, None]
    z -= z.max(axis=1, keepdims=True)
    lp = z[rows, tokens] - np.log(np.exp(z).sum(axis=1))
    keep: np.ndarray | None = None  # the competitors a drawer must beat under every allowed drift
    admissible = np.ones(n, bool)
    if 0 < top_k < v or (tp < 1.0).any():
        keep = np.ones((n, v), bool)
        for r in np.flatnonzero((tp < 1.0) | (0 < top_k < v)):
            keep[r], maybe = _kept_bounds(z[r], top_k, float(tp[r]), drift / float(t[r]))
            admissible[r] = maybe[tokens[r]]
    lo, hi = split_seeds(seeds)
    drawn = lg[rows, tokens] + t * gumbel((lo, hi), tokens.astype(np.uint32)[:, None])[:, 0]
    k = min(PROBE, v)
    top = np.argpartition(-lg, k - 1, axis=1)[:, :k] if k < v else np.broadcast_to(np.arange(v), (n, v))
    best = np.take_along_axis(lg, top, axis=1) + t[:, None] * gumbel((lo, hi), top.astype(np.uint32))
    out = top == tokens[:, None]
    if keep is not None:
        out |= ~np.take_along_axis(keep, top, axis=1)
    best[out] = -np.inf
    best = best.max(axis=1)
    # A token passes ``best`` only if its noise exceeds its deficit ``(best - l) / T``; its noise
    # exceeds the lower edge of the deficit's bin only if its integer bits reach that bin's
    # threshold. Integer bits for every token, float noise only for the few that reach it.
    deficit = best[:, None] - lg
    deficit /= t[:, None]
    np.multiply(deficit, 1 / BIN, out=deficit)
    np.clip(deficit, -1, len(BITS_AT) - 2, out=deficit)
    need = BITS_AT[deficit.astype(np.int64)]  # bins below 0 (index -1) need nothing
    rest = (noise_bits((lo, hi), np.arange(v, dtype=np.uint32)) >> np.uint32(9)) >= need
    rest[rows, tokens] = False
    if keep is not None:
        rest &= keep
    ri, ci = np.nonzero(rest)
    if ri.size:
        s = lg[ri, ci] + t[ri] * gumbel((lo[ri], hi[ri]), ci.astype(np.uint32)[:, None])[:, 0]
        np.maximum.at(best, ri, s)
    return np.where(admissible, drawn - best, -np.inf), lp


@dataclass(frozen=True)
class Draws:
    """One episode's sampled tokens re-derived under a scorer's weights (``check_draws``), one
    entry per model token in order (a model token at position 0 has no logits and is left out)."""

    at: np.ndarray
    """int64: each token's position in ``Episode.tokens()``."""
    margins: np.ndarray
    """float64: :func:`draw_margins`' margin of each token (raw logits; positive: the rule draws it)."""
    logprobs: np.ndarray
    """float64: each token's full-softmax log-prob at the episode's temperature (``score``'s value there)."""


@dataclass(frozen=True)
class MarginPlan:
    """The sampled tokens of a padded batch of episodes, flattened in episode then position order.

    A backend runs its model over the distinct token rows :attr:`x`, takes the logits that
    predicted each listed token (row ``src[j]`` of :attr:`x`, position ``at[j] - 1``) and hands
    them, in slices, to :meth:`margins`. Identical episodes (a converged policy repeats itself)
    share one forward pass; each keeps its own noise.
    """

    rows: np.ndarray
    """int64 ``[n]``: the episode (row of the padded batch) of each sampled token."""
    at: np.ndarray
    """int64 ``[n]``: the token's position in its episode (always >= 1)."""
    chosen: np.ndarray
    """int64 ``[n]``: the token id."""
    seeds: np.ndarray
    """uint64 ``[n]``: its re-derived row seed."""
    temperature: np.ndarray
    """float64 ``[n]``: its episode's temperature."""
    top_p: np.ndarray
    """float64 ``[n]``: its episode's ``top_p``."""
    sizes: tuple[int, ...]
    """Sampled tokens per episode."""
    x: np.ndarray
    """``[distinct rows, width]``: the padded batch's distinct rows, what the model runs over."""
    src: np.ndarray
    """int64 ``[n]``: the row of :attr:`x` holding each sampled token's episode."""

    def margins(self, a: int, logits: np.ndarray, top_k: int, drift: float) -> tuple[np.ndarray, np.ndarray]:
        """:func:`draw_margins` of tokens ``a .. a + len(logits)`` from their raw logits ``[m, V]``."""
        b = a + len(logits)
        return draw_margins(np.asarray(logits), self.temperature[a:b], self.chosen[a:b], self.seeds[a:b],
                            self.top_p[a:b], top_k, drift)

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        """Per-episode arrays of a flat ``[n]`` result."""
        return np.split(flat, np.cumsum(self.sizes)[:-1]) if self.sizes else []

    def draws(self, margins: np.ndarray, logprobs: np.ndarray) -> list[Draws]:
        """Per-episode :class:`Draws` of flat ``[n]`` margins and log-probs."""
        return [Draws(*parts) for parts in zip(self.split(self.at), self.split(margins), self.split(logprobs))]


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
    rs = row_seeds(np.array([keys[r] for r in rows], np.uint64), at)
    temperature = np.array([episodes[r].temperature for r in rows], np.float64)
    top_p = np.array([episodes[r].top_p for r in rows], np.float64)
    # Right padding leaves every real position's logits as they are, so equal padded rows give equal logits.
    distinct, same = np.unique(x, axis=0, return_inverse=True)
    return MarginPlan(rows, at, x[rows, at].astype(np.int64), rs, temperature, top_p, tuple(p.size for p in pos),
                      distinct, same.reshape(-1)[rows].astype(np.int64))
