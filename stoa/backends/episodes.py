"""One cohort's episodes, framework-free: what every engine's rollout loop shares.

An engine's loop owns the model, the KV cache and the batch; :class:`Cohort` owns the episodes
(:mod:`stoa.backends.engine`, "Episode layout"): it starts each one (environment reset, prompt
tokens through :func:`prompt_tokens`), records every sampled token, ends turns by the
:class:`~stoa.backends.engine.TurnRule`, steps the environment, tokenizes observations, and
builds the :class:`~stoa.types.Episode` objects and the :class:`~stoa.backends.engine.RolloutStats`,
and times its own parts (environments, tokenizer) into a :class:`RolloutProfile`.

The loop's side of the conversation, for each episode in flight (a :class:`Play`):

* after :meth:`Cohort.start`, feed ``play.feed`` (prefill, possibly empty) and then keep
  ``play.pending`` as the next token to decode;
* after each sampled token, :meth:`Cohort.record` says what the row does next: ``DECODE`` (feed
  ``play.pending`` at the next decode step), ``PREFILL`` (feed ``play.feed`` on top of the row's
  cache, then decode ``play.pending``), ``RESTART`` (the engine keeps no cache across turns:
  drop the row's cache and prefill ``play.feed``, the whole history, from empty), or ``DONE``
  (the episode is finished; free the row).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from stoa.backends.engine import EngineError, RolloutRequest, RolloutStats, SamplingConfig, TextCodec, TurnRule
from stoa.backends.sampling import episode_key, row_seeds
from stoa.types import Episode, Segment

__all__ = ["DECODE", "DONE", "PREFILL", "RESTART", "Cohort", "Play", "RolloutProfile", "prompt_tokens"]

DECODE, PREFILL, RESTART, DONE = "decode", "prefill", "restart", "done"


def prompt_tokens(codec: TextCodec, text: str) -> list[int]:
    """An episode's prompt tokens: the one place every engine builds them."""
    return [int(t) for t in codec.prompt_tokens(text)]


@dataclass
class RolloutProfile:
    """Where rollouts' wall time went, in seconds summed over the cohorts played while it was
    collected (:func:`stoa.backends.cohort.profiled`). The parts do not overlap, except
    :attr:`sample_s`, which is part of :attr:`decode_s`; :attr:`other_s` is the rest of
    :attr:`wall_s`: the Python between steps (the loop's bookkeeping, turn rules, building each
    step's inputs). Timed with ``time.perf_counter`` on the host: on a GPU, whose work is queued,
    a part holds the wait of the first call that reads a result back (the sampler), not its own."""

    wall_s: float = 0.0
    """Each cohort from its episode book's start to its last episode built."""
    prefill_s: float = 0.0
    """Prefill forward passes: prompts, observations, history re-prefilled without KV reuse
    (the torch loop's; 0 for a loop that does not time them)."""
    decode_s: float = 0.0
    """Decode steps: the forward pass of one token a row, the LM head and the sampler (torch loop)."""
    sample_s: float = 0.0
    """The sampler within :attr:`decode_s`, where a caller times it with :meth:`timed` (as
    ``benchmarks/rollout.py`` does around the torch engine's ``sample``); 0 otherwise."""
    cache_s: float = 0.0
    """KV cache housekeeping: growing it, copying a shared prompt's rows, moving a row to a freed slot."""
    env_s: float = 0.0
    """Environments made, reset and stepped."""
    tokenizer_s: float = 0.0
    """The codec: prompt tokens, observation encoding, turn decoding (stop-string checks included)."""
    decode_steps: int = 0
    decode_rows: int = 0
    """Rows summed over decode steps (``decode_rows / decode_steps``: the mean batch in flight)."""
    cohorts: int = 0

    @property
    def other_s(self) -> float:
        return self.wall_s - (self.prefill_s + self.decode_s + self.cache_s + self.env_s + self.tokenizer_s)

    def timed(self, fn: Callable[..., Any], part: str) -> Callable[..., Any]:
        """``fn``, adding the seconds of each call to the field ``part`` (e.g. ``"sample_s"``)."""
        if not isinstance(getattr(self, part, None), float):
            raise AttributeError(f"RolloutProfile has no time field {part!r}")

        def call(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, part, getattr(self, part) + time.perf_counter() - t)

        return call


@dataclass(eq=False)
class Play:
    """One episode in flight."""

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
    feed: list[int] = field(default_factory=list)  # to prefill before the next decode
    pending: int = 0  # the next token to decode, not yet in the row's cache
    reward: float = 0.0
    turns: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)

    def history(self) -> list[int]:
        """Every token of the episode so far (prompt, closed segments, the open turn)."""
        return self.prompt + [int(x) for seg in self.segments for x in seg.tokens] + self.turn


class Cohort:
    """The episodes of one :meth:`RolloutEngine.rollout` call.

    Args:
        codec: the engine's text codec.
        make_env: the environment factory; ``envs`` are idle instances of it to reuse.
        requests, sampling: the call's arguments.
        version, worker_id: stamped on every episode.
        kv_reuse: the engine keeps a row's cache across turns (else :meth:`record` says ``RESTART``).
        profile: where to add this cohort's times (:attr:`profile`; a fresh one when None).
    """

    def __init__(self, codec: TextCodec, make_env: Callable[[], Any], requests: Sequence[RolloutRequest],
                 sampling: SamplingConfig, envs: list[Any], *, version: int, worker_id: str,
                 kv_reuse: bool = True, profile: RolloutProfile | None = None) -> None:
        self.profile = profile if profile is not None else RolloutProfile()
        t = self.profile.timed
        codec = replace(codec, prompt_tokens=t(codec.prompt_tokens, "tokenizer_s"),
                        encode=t(codec.encode, "tokenizer_s"), decode=t(codec.decode, "tokenizer_s"))
        self.codec, self.make_env, self.s = codec, make_env, sampling
        self.version, self.worker_id, self.kv_reuse = version, worker_id, kv_reuse
        self.requests = list(requests)
        self.seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.stats = RolloutStats()
        self.free_envs = envs  # idle environments; every episode resets the one it takes
        self.results: dict[tuple[int, int], Episode] = {}
        self.stops: tuple[str, ...] | None = sampling.stop_strings
        self.rule: TurnRule | None = None
        self._prompts: dict[str, list[int]] = {}
        self.todo = deque((r, req, s) for r, req in enumerate(self.requests) for s in range(req.num_samples))
        self._t0 = time.perf_counter()

    def start(self, r: int, req: RolloutRequest, sample: int) -> Play:
        """A new episode: its environment reset, ``feed`` = prompt[:-1], ``pending`` = prompt[-1]."""
        t = time.perf_counter()
        env = self.free_envs.pop() if self.free_envs else self.make_env()
        self.profile.env_s += time.perf_counter() - t
        if self.stops is None:
            self.stops = tuple(getattr(env.unwrapped, "stop_strings", ()) or ())
        if self.rule is None:
            self.rule = self.codec.turn_rule(self.stops, self.s.max_turn_tokens, self.s.max_episode_tokens)
        key = episode_key(self.seed, req.group_id, int(req.index), sample)
        t = time.perf_counter()
        prompt_text, _ = env.reset(seed=key & 0x7FFFFFFF, options={"index": int(req.index)})
        self.profile.env_s += time.perf_counter() - t
        if not isinstance(prompt_text, str):
            raise EngineError(f"env.reset returned a {type(prompt_text).__name__} prompt, expected str")
        tokens = self._prompts.get(prompt_text)
        if tokens is None:
            tokens = self._prompts[prompt_text] = prompt_tokens(self.codec, prompt_text)
        if len(tokens) > self.s.max_episode_tokens - 1:
            raise EngineError(f"request {r} (index {req.index}): prompt of {len(tokens)} tokens leaves no room "
                              f"under max_episode_tokens={self.s.max_episode_tokens}")
        spec = getattr(env, "spec", None)
        play = Play(r, req, sample, key, env, getattr(spec, "id", "") or "", tokens, len(tokens))
        play.feed, play.pending = tokens[:-1], tokens[-1]
        return play

    def admit(self, room: int) -> list[Play]:
        """Start up to ``room`` queued episodes."""
        out = []
        while self.todo and len(out) < room:
            out.append(self.start(*self.todo.popleft()))
        return out

    def seeds(self, plays: Sequence[Play]) -> np.ndarray:
        """uint64 row seeds of the next token of each episode."""
        return row_seeds(np.array([p.key for p in plays], np.uint64), np.array([p.length for p in plays], np.int64))

    def record(self, play: Play, token: int, logprob: float) -> str:
        """Append a sampled token; what the row does next (see the module docstring)."""
        play.turn.append(token)
        play.turn_lp.append(logprob)
        play.length += 1
        why = self.rule.end(play.turn, play.length)  # type: ignore[union-attr]
        if why is None:
            play.pending = token
            return DECODE
        obs = self._end_turn(play, why)
        if obs is None:
            return DONE
        if not obs:
            play.pending = token
            return DECODE
        if not self.kv_reuse:  # the baseline: prefill the whole history again
            full = play.history()
            play.feed, play.pending = full[:-1], full[-1]
            return RESTART
        play.feed, play.pending = [token] + obs[:-1], obs[-1]
        self.stats.prefill_saved_kv += play.length - len(obs) - 1
        return PREFILL

    def _end_turn(self, play: Play, why: str) -> list[int] | None:
        """Close the turn, step the env; the observation's tokens, or None when the episode ended."""
        play.segments.append(Segment("model", np.array(play.turn, np.int32), np.array(play.turn_lp, np.float32)))
        play.turns += 1
        self.stats.turns += 1
        text = self.codec.decode(play.turn[:-1] if why == "eos" else play.turn)
        play.turn, play.turn_lp = [], []
        t = time.perf_counter()
        obs, reward, terminated, truncated, info = play.env.step(text)
        self.profile.env_s += time.perf_counter() - t
        play.reward += float(reward)
        if isinstance(info, dict) and isinstance(info.get("metrics"), dict):
            play.metrics = dict(info["metrics"])
        if terminated or truncated:
            return self._finish(play, "terminated" if terminated else "truncated")
        if why in ("eos", "max_episode_tokens"):
            return self._finish(play, why)
        obs_tokens = self.codec.encode(obs) if obs else []
        if play.length + len(obs_tokens) + 1 > self.s.max_episode_tokens:
            return self._finish(play, "max_episode_tokens")
        if obs_tokens:
            play.segments.append(Segment("env", np.array(obs_tokens, np.int32)))
            play.length += len(obs_tokens)
            self.stats.env_tokens += len(obs_tokens)
        return obs_tokens

    def _finish(self, play: Play, reason: str) -> None:
        self.free_envs.append(play.env)
        self.stats.finish_reasons[reason] = self.stats.finish_reasons.get(reason, 0) + 1
        self.results[(play.r, play.sample)] = Episode(
            prompt_tokens=np.array(play.prompt, np.int32), segments=play.segments, reward=play.reward,
            metrics={**play.metrics, "turns": play.turns, "truncated": reason != "terminated",
                     "finish_reason": reason},
            policy_version=self.version, worker_id=self.worker_id, env_id=play.env_id,
            group_id=play.req.group_id, sample_index=play.sample, temperature=self.s.temperature,
            top_p=self.s.top_p, item_index=int(play.req.index),
        )
        return None

    def episodes(self) -> list[Episode]:
        """Every episode, in request then sample order (call once all are done); fills :attr:`stats`."""
        out = [self.results[(r, s)] for r, req in enumerate(self.requests) for s in range(req.num_samples)]
        st = self.stats
        st.episodes = len(out)
        st.model_tokens = sum(ep.num_model_tokens for ep in out)
        st.wall_s = time.perf_counter() - self._t0
        self.profile.wall_s += st.wall_s
        self.profile.cohorts += 1
        return out
