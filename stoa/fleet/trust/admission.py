"""What the trainer checks in a worker's batch before any of it is trained on.

Workers are strangers: a batch that passes the episode codec (types, token ranges, finite
log-probs, sizes) can still carry values the run never asked for. :func:`batch_problem` holds a
batch to the run's own config and the task's declared metric types; the trainer quarantines a
batch it rejects (with the reason) instead of letting it reach advantages or the learner, where
an extreme value would crash the step (and, still pending after a restart, crash it again).

What is *not* checked here: that the reward and the metrics are the ones the environment would
give for these tokens, that the behaviour log-probs are the ones the claimed policy version
gives, and who the worker is. :mod:`stoa.fleet.trust.gate` checks those next (``docs/trust.md``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from stoa.types import Episode

__all__ = ["ENGINE_METRIC_TYPES", "batch_problem", "episode_metric_means"]

ENGINE_METRIC_TYPES: dict[str, type | tuple[type, ...]] = {"turns": int, "truncated": bool, "finish_reason": str}
"""Metrics every rollout engine adds (``stoa.backends.engine``)."""

_F32_MAX = float(np.finfo(np.float32).max)


def batch_problem(episodes: Sequence[Episode], *, temperature: float, top_p: float, group_size: int,
                  reward_range: tuple[float, float], env_id: str,
                  metric_types: dict[str, type | tuple[type, ...]]) -> str | None:
    """Why a batch must not be trained on, or ``None``.

    Checks, per episode: sampled at the run's ``temperature`` and ``top_p`` exactly (the
    objective's ratios assume it); reward finite in float32 and inside ``reward_range``; every
    declared metric of the task (and the engine's own) of its declared type; the task's id; a
    ``sample_index`` inside the group. Group completeness is judged later, per group.
    """
    from stoa.envs.base import metric_problem  # the environments' package imports gymnasium

    lo, hi = reward_range
    types = {**metric_types, **ENGINE_METRIC_TYPES}
    for i, ep in enumerate(episodes):
        where = f"episode {i} (group {_quoted(ep.group_id)})"
        if ep.temperature != temperature or ep.top_p != top_p:
            return (f"{where}: sampled at temperature {ep.temperature}, top_p {ep.top_p}; "
                    f"the run samples at {temperature}, {top_p}")
        r = float(ep.reward)
        if not (math.isfinite(r) and abs(r) <= _F32_MAX):
            return f"{where}: reward {r!r} is not finite in float32"
        if not lo <= r <= hi:
            return f"{where}: reward {r!r} is outside trust.reward_range [{lo}, {hi}]"
        why = metric_problem(ep.metrics, types)
        if why:
            return f"{where}: {why}"
        if env_id and ep.env_id != env_id:
            return f"{where}: env_id {_quoted(ep.env_id)} is not the run's task {env_id!r}"
        if not 0 <= ep.sample_index < group_size:
            return f"{where}: sample_index {ep.sample_index} is outside the group of {group_size}"
    return None


def _quoted(text: str, limit: int = 24) -> str:
    """A worker-written string in a reason: ``repr`` of at most ``limit`` characters (a reason is
    kept per rejection and published bounded; it must not carry a stranger's long strings)."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def episode_metric_means(episodes: Sequence[Episode], metric_types: dict[str, Any], prefix: str) -> dict[str, float]:
    """``{prefix/key: mean}`` of every declared bool or numeric metric present in the episodes."""
    out = {}
    for key, want in {**metric_types, "turns": int}.items():
        kinds = want if isinstance(want, tuple) else (want,)
        if not any(k in (bool, int, float) for k in kinds):
            continue
        vals = [float(e.metrics[key]) for e in episodes if isinstance(e.metrics.get(key), (bool, int, float))]
        if vals:
            out[f"{prefix}/{key}"] = float(np.mean(vals))
    return out
