"""Replay verification: the trainer re-plays a worker's episode through its own environment.

A worker claims, for each episode, the prompt's tokens, the model's turns, the environment's
observations (as tokens), the reward and the task metrics. Of these only the model's turns are
the worker's to choose; everything else follows from them when the task is replayable
(``TextEnv.replayable``: observations, rewards and metrics are a function of the item and the
turns). :class:`Replayer` rebuilds an episode exactly as the rollout engine built it
(``stoa.backends.engine``, "Episode layout"):

* the prompt: ``env.reset(options={"index": episode.item_index})``, in the run's prompt format
  (``codec.prompt_format``: the chat template applied, or the plain text);
* each model turn ends where the engine would end it (the first token that completes a stop
  string, an EOS, the per-turn cap, or the episode cap), and its text (EOS excluded) is passed
  to ``env.step``;
* each observation is tokenized on its own and must equal the next env segment;
* the episode ends where the environment or a cap ends it, and ``reward`` (the sum of the step
  rewards) and ``metrics`` (the last step's, plus ``turns``, ``truncated``, ``finish_reason``)
  must equal the worker's claims, value and type.

Any difference is a reason string; nothing here raises for a malformed episode. A difference
that a machine-dependent outcome explains (``TextEnv.indeterminate_metrics``: a scorer's timeout,
in the worker's claim or in the replay) is an :class:`Unverifiable` reason: the episode is
neither confirmed nor a forgery (:meth:`Replayer.triage` sorts the two). The text codec
(prompt format, observation encoding, turn decoding, EOS and stop-token candidates) is the
engine's own (``engine.codec``, part of the engine contract in :mod:`stoa.backends.engine`),
and a turn ends by the same :class:`~stoa.backends.engine.TurnRule` the engine's rollout loop
calls, so replay and rollout share one code path. Model tokens are never re-tokenized; their log-probabilities are the audit's business
(:mod:`stoa.fleet.trust.audit`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any

from stoa.backends.engine import TextCodec
from stoa.types import Episode

__all__ = ["Replayer", "Unverifiable", "layout_digest"]

_MAX_SHOWN = 60


def _shown(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= _MAX_SHOWN else r[:_MAX_SHOWN] + "..."


def _same(a: Any, b: Any) -> bool:
    """Equal in value and type (a forged ``1`` is not the environment's ``True``)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return type(a) is type(b) and a == b


class Unverifiable(str):
    """A replay reason that is not the worker's fault: the claim or the replay holds a value of
    the task's ``indeterminate_metrics`` (its outcome depended on the machine, not on the turns),
    so the episode can be neither confirmed nor refuted. It is still a reason (a ``str``)."""


def _indeterminate(metrics: Any, indeterminate: dict[str, tuple[Any, ...]]) -> str | None:
    """The first ``key=value`` of ``metrics`` that ``indeterminate`` lists, or None."""
    if not isinstance(metrics, dict):
        return None
    for key, values in indeterminate.items():
        v = metrics.get(key)
        if isinstance(v, (str, int, float, bool)) and any(_same(v, w) for w in values):
            return f"{key}={v!r}"
    return None


class Replayer:
    """Replays episodes of one task through one environment instance.

    Args:
        make_env: builds the run's training environment (the split workers draw from).
        codec: the engine's text codec (``engine.codec``, :class:`stoa.backends.engine.TextCodec`).
        max_turn_tokens: the run's ``rollout.max_turn_tokens``.
        max_episode_tokens: the run's ``rollout.max_episode_tokens``.
        stop_strings: the run's stop strings; None uses the environment's.
    """

    def __init__(self, make_env: Callable[[], Any], codec: TextCodec, *, max_turn_tokens: int,
                 max_episode_tokens: int, stop_strings: tuple[str, ...] | None = None, prompt_cache: int = 4096):
        self.env = make_env()
        u = self.env.unwrapped
        self.replayable = bool(getattr(u, "replayable", True))
        self.indeterminate: dict[str, tuple[Any, ...]] = {
            str(k): tuple(v) for k, v in (getattr(u, "indeterminate_metrics", None) or {}).items()}
        self.codec = codec
        stops = tuple(stop_strings if stop_strings is not None else getattr(u, "stop_strings", ()) or ())
        self.rule = codec.turn_rule(stops, max_turn_tokens, max_episode_tokens)
        self.n_items = len(u)
        self._prompts: dict[int, list[int]] = {}
        self._prompt_cache = prompt_cache

    def check(self, ep: Episode) -> str | None:
        """Why ``ep`` is not what the engine and the environment would have produced (an
        :class:`Unverifiable` reason when a machine-dependent outcome stands in the way), or None."""
        return _verdict(ep, self._outcome(ep), self.indeterminate)

    def check_all(self, episodes: Sequence[Episode]) -> list[tuple[int, str]]:
        """``(index, reason)`` of every episode that does not replay, unverifiable ones included
        (:meth:`triage` tells them apart). Episodes with the same item and tokens (a converged
        policy repeats itself) are played through the environment once; each one's own reward and
        metrics are compared with that outcome."""
        out = []
        seen: dict[tuple[int | None, bytes], str | tuple[dict[str, Any], float]] = {}
        for i, ep in enumerate(episodes):
            key = (ep.item_index, layout_digest(ep))
            got = seen.get(key)
            if got is None:
                got = seen[key] = self._outcome(ep)
            why = _verdict(ep, got, self.indeterminate)
            if why:
                out.append((i, why))
        return out

    def triage(self, episodes: Sequence[Episode]) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
        """``(forged, unverifiable)``: :meth:`check_all`'s findings, split into episodes that do
        not replay (the worker's fault) and :class:`Unverifiable` ones (nobody's)."""
        bad = self.check_all(episodes)
        return ([(i, w) for i, w in bad if not isinstance(w, Unverifiable)],
                [(i, w) for i, w in bad if isinstance(w, Unverifiable)])

    def _outcome(self, ep: Episode) -> str | tuple[dict[str, Any], float]:
        """Why ``ep``'s tokens are not the engine's and the environment's, or the metrics and
        reward its replay gives."""
        try:
            return self._check(ep)
        except Exception as e:  # an environment failing on a worker's turns is the episode's problem
            return f"replay failed: {type(e).__name__}: {str(e)[:200]}"

    def _prompt(self, item: int) -> list[int]:
        tokens = self._prompts.get(item)
        if tokens is None:
            text, _ = self.env.reset(seed=0, options={"index": item})
            tokens = [int(t) for t in self.codec.prompt_tokens(text)]
            if len(self._prompts) >= self._prompt_cache:
                self._prompts.pop(next(iter(self._prompts)))
            self._prompts[item] = tokens
        return tokens

    def _check(self, ep: Episode) -> str | tuple[dict[str, Any], float]:
        item = ep.item_index
        if item is None:
            return "the episode does not name its item (item_index), so it cannot be replayed"
        if not 0 <= item < self.n_items:
            return f"item_index {item} is outside the task's {self.n_items} items"
        prompt = self._prompt(item)
        if ep.prompt_tokens.tolist() != prompt:
            return f"prompt tokens are not item {item}'s prompt in the run's {self.codec.prompt_format} prompt format"
        self.env.reset(seed=0, options={"index": item})
        segs, j, length, reward, turns = ep.segments, 0, len(prompt), 0.0, 0
        metrics: dict[str, Any] = {}
        finish = None
        while j < len(segs):
            seg = segs[j]
            if seg.kind != "model":
                return f"segment {j}: an env segment where the model's turn belongs"
            turn = seg.tokens.tolist()
            why = None
            for k in range(len(turn)):
                why = self.rule.end(turn[:k + 1], length + k + 1)
                if why is not None and k < len(turn) - 1:
                    return f"segment {j}: the turn runs past its end ({why} at token {k} of {len(turn)})"
            if why is None:
                return f"segment {j}: the turn ends without a stop string, an EOS or a token cap"
            length += len(turn)
            turns += 1
            text = self.codec.decode(turn[:-1] if why == "eos" else turn)
            obs, r, terminated, truncated, info = self.env.step(text)
            reward += float(r)
            if isinstance(info, dict) and isinstance(info.get("metrics"), dict):
                metrics = dict(info["metrics"])
            j += 1
            if terminated or truncated:
                finish = "terminated" if terminated else "truncated"
                break
            if why in ("eos", "max_episode_tokens"):
                finish = why
                break
            obs_tokens = [int(t) for t in self.codec.encode(obs)] if obs else []
            if length + len(obs_tokens) + 1 > self.rule.max_episode_tokens:
                finish = "max_episode_tokens"
                break
            if obs_tokens:
                if j >= len(segs) or segs[j].kind != "env":
                    return f"segment {j}: the environment's observation is missing"
                if segs[j].tokens.tolist() != obs_tokens:
                    got = self.codec.decode(segs[j].tokens.tolist())
                    why = (f"segment {j}: the observation differs from the environment's "
                           f"(claimed {_shown(got)}, replay gives {_shown(obs)})")
                    odd = _indeterminate(metrics, self.indeterminate) or _indeterminate(ep.metrics, self.indeterminate)
                    return Unverifiable(f"{why}; the outcome depends on the machine ({odd})") if odd else why
                length += len(obs_tokens)
                j += 1
        if finish is None:
            return "the episode stops before the environment or a cap ended it"
        if j < len(segs):
            return f"{len(segs) - j} segment(s) after the episode ended ({finish})"
        return {**metrics, "turns": turns, "truncated": finish != "terminated", "finish_reason": finish}, reward


def layout_digest(ep: Episode) -> bytes:
    """A digest of an episode's tokens and segment layout: equal exactly when the prompt, every
    segment's kind and every token are equal (what its replay depends on, with its item)."""
    h = hashlib.sha256(ep.prompt_tokens.astype("<i4").tobytes())
    for seg in ep.segments:
        h.update(seg.kind.encode() + len(seg.tokens).to_bytes(4, "little"))
        h.update(seg.tokens.astype("<i4").tobytes())
    return h.digest()


def _verdict(ep: Episode, outcome: str | tuple[dict[str, Any], float],
             indeterminate: dict[str, tuple[Any, ...]] | None = None) -> str | None:
    """Why ``ep`` fails replay given its tokens' ``outcome`` (a reason, or the replay's metrics
    and reward to compare its claims with), or None. When the claim or the replay holds an
    ``indeterminate`` metric value, the claims cannot be judged: an :class:`Unverifiable` reason
    (even when they agree: the reward is the machine's, not the turns'). Never raises."""
    if isinstance(outcome, str):
        return outcome
    try:
        odd = _indeterminate(outcome[0], indeterminate or {})
        if odd:
            return Unverifiable(f"the replay's outcome depends on the machine ({odd})")
        odd = _indeterminate(ep.metrics, indeterminate or {})
        if odd:
            return Unverifiable(f"the claimed outcome depends on the machine ({odd})")
        return _claims(ep, *outcome)
    except Exception as e:  # a malformed claim is the episode's problem
        return f"replay failed: {type(e).__name__}: {str(e)[:200]}"


def _claims(ep: Episode, want: dict[str, Any], reward: float) -> str | None:
    """Why ``ep``'s claimed metrics and reward are not the replay's ``want`` and ``reward``, or None."""
    for key in sorted(set(want) | set(ep.metrics)):
        if key not in ep.metrics or key not in want or not _same(ep.metrics[key], want[key]):
            return (f"metric {key!r}: claimed {_shown(ep.metrics.get(key, '<missing>'))}, "
                    f"replay gives {_shown(want.get(key, '<missing>'))}")
    if not math.isclose(float(ep.reward), reward, rel_tol=1e-9, abs_tol=1e-9):
        return f"reward: claimed {ep.reward!r}, replay gives {reward!r}"
    return None
