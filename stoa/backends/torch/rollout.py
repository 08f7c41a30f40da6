"""One cohort on the torch engine: continuous batching of multi-turn episodes over a slot cache.

Every episode in flight owns one row (*slot*) of the engine's :class:`~stoa.backends.torch.decoder.KVCache`
and a *pending* token (the next to feed, not yet cached). Rows ``0 .. n-1`` are in flight, so a
decode step runs on a contiguous block: feed every pending token, sample one token per row,
hand it to the episode bookkeeping (:class:`stoa.backends.episodes.Cohort`). A row whose turn
ended with an observation gets ``[t] + o[:-1]`` prefilled into its own slot (after its cached
history, nothing moves) before the next decode; newly admitted episodes take the free slots,
and the samples of one prompt share one prefill of it (its cache positions are copied). A
finished episode's slot is refilled by the last row (one row's positions copied), which keeps
the block contiguous. The forward passes and cache moves are timed into :attr:`Cohort.profile`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from stoa.backends import cohort
from stoa.backends.engine import RolloutRequest, SamplingConfig
from stoa.backends.episodes import DONE, Play
from stoa.backends.torch.decoder import KVCache
from stoa.types import Episode


class CohortHost(cohort.CohortHost, Protocol):
    """What a cohort reads of the engine that plays it (:class:`stoa.backends.torch.engine.TorchEngine`)."""

    device: torch.device

    def kv_cache(self, slots: int) -> KVCache: ...

    def feed(self, ids: torch.Tensor, start: torch.Tensor, longest: int, cache: KVCache,
             rows: torch.Tensor) -> None:
        """Write the keys and values of tokens ``ids [n, m]`` of cache ``rows`` from positions
        ``start [n]`` on (``longest = max(start) + m``)."""

    def next_tokens(self, ids: torch.Tensor, start: torch.Tensor, longest: int, cache: KVCache, seeds: Any,
                    s: SamplingConfig) -> tuple[Any, Any]:
        """Feed one token per row of rows ``0 .. n-1`` (``ids [n, 1]``) and draw each row's next
        token: (tokens, behaviour log-probs) by the sampling rule with row ``seeds``."""


def _cached(p: Play) -> int:
    """Positions of ``p``'s row that hold its tokens (everything before its feed and pending token)."""
    return p.length - len(p.feed) - 1


class Cohort(cohort.CohortLoop):
    """Plays one cohort of requests to completion (see :meth:`stoa.backends.torch.engine.TorchEngine.rollout`)."""

    e: CohortHost

    def __init__(self, engine: CohortHost, make_env: Callable[[], Any], requests: Sequence[RolloutRequest],
                 sampling: SamplingConfig, envs: list[Any]) -> None:
        super().__init__(engine, make_env, requests, sampling, envs)
        self.cache = engine.kv_cache(self.cfg.max_batch)
        self.rows: list[Play] = []

    def run(self) -> list[Episode]:
        book = self.book
        while book.todo or self.rows:
            self.rows += book.admit(self.cfg.max_batch - len(self.rows))
            if any(p.feed for p in self.rows):
                self._prefill()
            self._decode()
        return book.episodes()

    def _prefill(self) -> None:
        """Feed every row's pending prefill; fresh rows with equal feeds share one (then copied)."""
        st, dev = self.stats, self.e.device
        todo: list[int] = []
        twins: dict[int, list[int]] = {}  # slot prefilled -> slots that copy it
        first: dict[tuple[int, ...], int] = {}
        for i, p in enumerate(self.rows):
            if not p.feed:
                continue
            if _cached(p) == 0 and self.cfg.share_prompt_prefill:
                key = tuple(p.feed)
                if key in first:
                    twins[first[key]].append(i)
                    st.prefill_saved_shared += len(p.feed)
                    continue
                first[key] = i
                twins[i] = []
            todo.append(i)
        step = self.cfg.prefill_chunk
        width = max(len(self.rows[i].feed) for i in todo)
        clock, prof = time.perf_counter, self.profile
        for a in range(0, width, step):
            part = [i for i in todo if len(self.rows[i].feed) > a]
            feeds = [self.rows[i].feed[a:a + step] for i in part]
            m = max(len(f) for f in feeds)
            ids = torch.tensor([f + [0] * (m - len(f)) for f in feeds], dtype=torch.int64, device=dev)
            starts = [_cached(self.rows[i]) + a for i in part]
            longest = max(starts) + m
            start, slots = torch.tensor(starts, device=dev), torch.tensor(part, device=dev)
            t0 = clock()
            self.cache.ensure(longest)
            t1 = clock()
            self.e.feed(ids, start, longest, self.cache, slots)
            t2 = clock()
            prof.cache_s += t1 - t0
            prof.prefill_s += t2 - t1
        st.prefill_calls += 1
        st.prefill_tokens += sum(len(self.rows[i].feed) for i in todo)
        t0 = clock()
        for i, copies in twins.items():
            self.cache.copy_rows(i, copies, len(self.rows[i].feed))
        prof.cache_s += clock() - t0
        for p in self.rows:
            p.feed = []

    def _decode(self) -> None:
        rows, dev = self.rows, self.e.device
        n = len(rows)
        clock, prof = time.perf_counter, self.profile
        starts = [p.length - 1 for p in rows]
        longest = max(starts) + 1
        t0 = clock()
        self.cache.ensure(longest)
        prof.cache_s += clock() - t0
        ids = torch.tensor([[p.pending] for p in rows], dtype=torch.int64, device=dev)
        start, seeds = torch.tensor(starts, device=dev), self.book.seeds(rows)
        t0 = clock()
        toks, lps = self.e.next_tokens(ids, start, longest, self.cache, seeds, self.s)
        prof.decode_s += clock() - t0
        prof.decode_steps += 1
        prof.decode_rows += n
        self.stats.decode_steps += 1
        done = [i for i in range(n) if self.book.record(rows[i], int(toks[i]), float(lps[i])) == DONE]
        t0 = clock()
        for i in reversed(done):  # refill each freed slot with the last row
            last = len(rows) - 1
            if i != last:
                self.cache.move(last, i, _cached(rows[last]))
                rows[i] = rows[last]
            rows.pop()
        prof.cache_s += clock() - t0

