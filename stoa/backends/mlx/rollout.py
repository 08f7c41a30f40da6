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
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache

from stoa.backends.engine import (
    EngineConfig,
    EngineError,
    RolloutRequest,
    RolloutStats,
    SamplingConfig,
    TextCodec,
    TurnRule,
)
from stoa.backends.sampling import episode_key, row_seeds
from stoa.types import Episode, Segment


class CohortHost(Protocol):
    """What a cohort reads of the engine that plays it (:class:`stoa.backends.mlx.engine.MLXEngine`)."""

    config: EngineConfig
    version: int

    @property
    def worker_id(self) -> str: ...

    @property
    def codec(self) -> TextCodec: ...

    @property
    def mlx_model(self) -> Any: ...

    @property
    def body(self) -> Any: ...

    def prompt_tokens(self, prompt: str) -> list[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: Sequence[int]) -> str: ...


@dataclass(eq=False)
class _Ep:
    r: int  # request position in the cohort
    req: RolloutRequest
    sample: int
    key: int
    env: Any
    env_id: str
    prompt: list[int]
    length: int  # tokens so far: prompt, segments and the current turn
    segments: list[Segment] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)
    turn_lp: list[float] = field(default_factory=list)
    feed: list[int] = field(default_factory=list)  # to prefill before rejoining the batch
    pending: int = 0
    reward: float = 0.0
    turns: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)


def _take(cache: list[BatchKVCache], idx: list[int]) -> list[BatchKVCache]:
    """New caches holding rows ``idx`` (filter only rebinds arrays, so a shallow copy is safe)."""
    out = []
    for c in cache:
        c2 = copy.copy(c)
        c2.filter(idx)
        out.append(c2)
    return out


class Cohort:
    """Plays one cohort of requests to completion (see :meth:`stoa.backends.mlx.engine.MLXEngine.rollout`)."""

    def __init__(self, engine: CohortHost, make_env: Callable[[], Any], requests: Sequence[RolloutRequest],
                 sampling: SamplingConfig, envs: list[Any]) -> None:
        self.e, self.make_env, self.s = engine, make_env, sampling
        self.cfg, self.version = engine.config, engine.version  # fixed for the whole cohort
        self.requests = list(requests)
        self.seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.stats = RolloutStats()
        self.rows: list[_Ep] = []
        self.cache: list[BatchKVCache] | None = None
        self.moving: list[_Ep] = []
        self.moving_cache: list[BatchKVCache] | None = None
        self.fresh: list[_Ep] = []  # need a prefill from an empty cache
        self.free_envs = envs  # idle environments; every episode resets the one it takes
        self.results: dict[tuple[int, int], Episode] = {}
        self.stops: tuple[str, ...] | None = sampling.stop_strings
        self.rule: TurnRule | None = None
        self.prompt_cache: dict[str, list[int]] = {}

    # -- episode life cycle -------------------------------------------------------------------
    def _start(self, r: int, req: RolloutRequest, sample: int) -> _Ep:
        env = self.free_envs.pop() if self.free_envs else self.make_env()
        if self.stops is None:
            self.stops = tuple(getattr(env.unwrapped, "stop_strings", ()) or ())
        if self.rule is None:
            self.rule = self.e.codec.turn_rule(self.stops, self.s.max_turn_tokens, self.s.max_episode_tokens)
        key = episode_key(self.seed, req.group_id, int(req.index), sample)
        prompt_text, _ = env.reset(seed=key & 0x7FFFFFFF, options={"index": int(req.index)})
        if not isinstance(prompt_text, str):
            raise EngineError(f"env.reset returned a {type(prompt_text).__name__} prompt, expected str")
        tokens = self.prompt_cache.get(prompt_text)
        if tokens is None:
            tokens = self.prompt_cache[prompt_text] = self.e.prompt_tokens(prompt_text)
        if len(tokens) > self.s.max_episode_tokens - 1:
            raise EngineError(f"request {r} (index {req.index}): prompt of {len(tokens)} tokens leaves no room "
                              f"under max_episode_tokens={self.s.max_episode_tokens}")
        spec = getattr(env, "spec", None)
        ep = _Ep(r, req, sample, key, env, getattr(spec, "id", "") or "", tokens, len(tokens))
        ep.feed, ep.pending = tokens[:-1], tokens[-1]
        return ep

    def _end_turn(self, ep: _Ep, why: str) -> list[int] | None:
        """Close the turn, step the env; the observation's tokens, or None when the episode ended."""
        ep.segments.append(Segment("model", np.array(ep.turn, np.int32), np.array(ep.turn_lp, np.float32)))
        ep.turns += 1
        self.stats.turns += 1
        text = self.e.decode(ep.turn[:-1] if why == "eos" else ep.turn)
        ep.turn, ep.turn_lp = [], []
        obs, reward, terminated, truncated, info = ep.env.step(text)
        ep.reward += float(reward)
        if isinstance(info, dict) and isinstance(info.get("metrics"), dict):
            ep.metrics = dict(info["metrics"])
        if terminated or truncated:
            return self._finish(ep, "terminated" if terminated else "truncated")
        if why in ("eos", "max_episode_tokens"):
            return self._finish(ep, why)
        obs_tokens = self.e.encode(obs) if obs else []
        if ep.length + len(obs_tokens) + 1 > self.s.max_episode_tokens:
            return self._finish(ep, "max_episode_tokens")
        if obs_tokens:
            ep.segments.append(Segment("env", np.array(obs_tokens, np.int32)))
            ep.length += len(obs_tokens)
            self.stats.env_tokens += len(obs_tokens)
        return obs_tokens

    def _finish(self, ep: _Ep, reason: str) -> None:
        self.free_envs.append(ep.env)
        self.stats.finish_reasons[reason] = self.stats.finish_reasons.get(reason, 0) + 1
        self.results[(ep.r, ep.sample)] = Episode(
            prompt_tokens=np.array(ep.prompt, np.int32), segments=ep.segments, reward=ep.reward,
            metrics={**ep.metrics, "turns": ep.turns, "truncated": reason != "terminated",
                     "finish_reason": reason},
            policy_version=self.version, worker_id=self.e.worker_id, env_id=ep.env_id,
            group_id=ep.req.group_id, sample_index=ep.sample, temperature=self.s.temperature, top_p=self.s.top_p,
            item_index=int(ep.req.index),
        )
        return None

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> list[Episode]:
        t0 = time.perf_counter()
        todo = deque((r, req, s) for r, req in enumerate(self.requests) for s in range(req.num_samples))
        while todo or self.rows or self.moving or self.fresh:
            room = self.cfg.max_batch - len(self.rows) - len(self.moving) - len(self.fresh)
            while todo and room > 0:
                self.fresh.append(self._start(*todo.popleft()))
                room -= 1
            if self.moving or self.fresh:
                self._prefill()
            if self.rows:
                self._decode()
        out = [self.results[(r, s)] for r, req in enumerate(self.requests) for s in range(req.num_samples)]
        st = self.stats
        st.episodes = len(out)
        st.model_tokens = sum(ep.num_model_tokens for ep in out)
        st.wall_s = time.perf_counter() - t0
        return out

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
        rows, s, e = self.rows, self.s, self.e
        x = mx.array([ep.pending for ep in rows], dtype=mx.int32)[:, None]
        logits = e.mlx_model(x, cache=self.cache)[:, -1, :]
        seeds = row_seeds(np.array([ep.key for ep in rows], np.uint64), np.array([ep.length for ep in rows], np.int64))
        toks, lps = e.sample_tokens(logits, seeds, s)
        self.stats.decode_steps += 1
        keep, move = [], []
        for i, ep in enumerate(rows):
            t = int(toks[i])
            ep.turn.append(t)
            ep.turn_lp.append(float(lps[i]))
            ep.length += 1
            why = self.rule.end(ep.turn, ep.length)  # type: ignore[union-attr]
            if why is None:
                ep.pending = t
                keep.append(i)
                continue
            obs = self._end_turn(ep, why)
            if obs is None:
                continue
            feed = [t] + obs
            if len(feed) == 1:
                ep.pending = t
                keep.append(i)
            elif not self.cfg.kv_reuse:  # the baseline: prefill the whole history again
                full = ep.prompt + [int(x) for seg in ep.segments for x in seg.tokens]
                ep.feed, ep.pending = full[:-1], full[-1]
                self.fresh.append(ep)
            else:
                ep.feed, ep.pending = feed[:-1], feed[-1]
                self.stats.prefill_saved_kv += ep.length - len(feed)
                move.append(i)
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
