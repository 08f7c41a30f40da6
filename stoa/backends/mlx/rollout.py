"""One cohort: continuous batching of multi-turn episodes over ``mlx_lm``'s batched KV cache.

Every row of the decode batch holds one episode and a *pending* token: the next token to feed,
not yet in its cache (the last sampled token, or the last token of a prompt or observation). A
decode step feeds all pending tokens at once and samples one token per row. When a turn ends,
the environment's observation ``o`` makes the row feed ``[t] + o``: it leaves the batch with its
cache rows, ``[t] + o[:-1]`` is prefilled (together with the prompts of newly admitted
episodes), and it rejoins with ``o[-1]`` pending. ``BatchKVCache`` keeps rows right-aligned with
per-row left padding; ``filter`` / ``extend`` / ``prepare`` / ``finalize`` are ``mlx_lm``'s.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from stoa.backends import cohort
from stoa.backends.engine import RolloutRequest, SamplingConfig
from stoa.backends.episodes import DECODE, PREFILL, RESTART, Play
from stoa.types import Episode


class CohortHost(cohort.CohortHost, Protocol):
    """What a cohort reads of the engine that plays it (:class:`stoa.backends.mlx.engine.MLXEngine`)."""

    @property
    def mlx_model(self) -> Any: ...

    @property
    def body(self) -> Any: ...

    def sample_tokens(self, logits: Any, seeds: Any, s: SamplingConfig) -> tuple[Any, Any]: ...


def _take(cache: list[BatchKVCache], idx: list[int]) -> list[BatchKVCache]:
    """New caches holding rows ``idx`` (filter only rebinds arrays, so a shallow copy is safe)."""
    out = []
    for c in cache:
        c2 = copy.copy(c)
        c2.filter(idx)
        out.append(c2)
    return out


class Cohort(cohort.CohortLoop):
    """Plays one cohort of requests to completion (see :meth:`stoa.backends.mlx.engine.MLXEngine.rollout`); the episodes
    themselves are :class:`stoa.backends.episodes.Cohort`'s."""

    e: CohortHost

    def __init__(self, engine: CohortHost, make_env: Callable[[], Any], requests: Sequence[RolloutRequest],
                 sampling: SamplingConfig, envs: list[Any]) -> None:
        super().__init__(engine, make_env, requests, sampling, envs)
        self.rows: list[Play] = []
        self.cache: list[BatchKVCache] | None = None
        self.moving: list[Play] = []
        self.moving_cache: list[BatchKVCache] | None = None
        self.fresh: list[Play] = []  # need a prefill from an empty cache

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> list[Episode]:
        book = self.book
        while book.todo or self.rows or self.moving or self.fresh:
            self.fresh += book.admit(self.cfg.max_batch - len(self.rows) - len(self.moving) - len(self.fresh))
            if self.moving or self.fresh:
                self._prefill()
            if self.rows:
                self._decode()
        return book.episodes()

    def _prefill(self) -> None:
        """Prefill moving rows (with their caches) and fresh rows (empty caches) in one pass."""
        moving, fresh = self.moving, self.fresh
        feeds = [ep.feed for ep in moving]
        slot: dict[Any, int] = {}
        expand = []
        for ep in fresh:
            k = tuple(ep.feed) if self.cfg.share_prompt_prefill else id(ep)
            if k not in slot:
                slot[k] = len(feeds)
                feeds.append(ep.feed)
            expand.append(slot[k])
        n_new = len(feeds) - len(moving)
        layers = len(self.e.mlx_model.layers)
        cache = self.moving_cache
        if n_new:
            empty = [BatchKVCache([0] * n_new) for _ in range(layers)]
            if cache is None:
                cache = empty
            else:
                for c, o in zip(cache, empty):
                    c.extend(o)
        width = max(len(f) for f in feeds)
        if width:
            pads = [width - len(f) for f in feeds]
            x = mx.array([f + [0] * p for f, p in zip(feeds, pads)], dtype=mx.int32)
            if max(pads):
                for c in cache:
                    c.prepare(right_padding=pads)
            step = self.cfg.prefill_chunk
            for a in range(0, width, step):
                self.e.body(x[:, a:a + step], cache=cache)
                mx.eval([c.state for c in cache])
            if max(pads):
                for c in cache:
                    c.finalize()
            self.stats.prefill_calls += 1
        prefilled = sum(len(f) for f in feeds)
        self.stats.prefill_tokens += prefilled
        self.stats.prefill_saved_shared += sum(len(ep.feed) for ep in fresh) - sum(len(f) for f in feeds[len(moving):])
        idx = list(range(len(moving))) + expand
        if idx != list(range(len(feeds))):
            for c in cache:
                c.filter(idx)
        joined = moving + fresh
        for ep in joined:
            ep.feed = []
        if self.cache is None:
            self.cache = cache
        else:
            for c, o in zip(self.cache, cache):
                c.extend(o)
        self.rows += joined
        self.moving, self.moving_cache, self.fresh = [], None, []

    def _decode(self) -> None:
        rows, e = self.rows, self.e
        x = mx.array([ep.pending for ep in rows], dtype=mx.int32)[:, None]
        logits = e.mlx_model(x, cache=self.cache)[:, -1, :]
        toks, lps = e.sample_tokens(logits, self.book.seeds(rows), self.s)
        self.stats.decode_steps += 1
        keep, move = [], []
        for i, ep in enumerate(rows):
            then = self.book.record(ep, int(toks[i]), float(lps[i]))
            if then == DECODE:
                keep.append(i)
            elif then == PREFILL:
                move.append(i)
            elif then == RESTART:  # the baseline: prefill the whole history again
                self.fresh.append(ep)
        if move:
            self.moving = [rows[i] for i in move]
            self.moving_cache = _take(self.cache, move)
        if len(keep) < len(rows):
            if keep:
                for c in self.cache:
                    c.filter(keep)
            else:
                self.cache = None
            self.rows = [rows[i] for i in keep]
