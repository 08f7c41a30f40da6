"""One optimizer step of RL over a step's groups: advantages, the objective, the metrics of both.

Every trainer of a run takes its steps here: the :class:`~stoa.fleet.trainer.trainer.Trainer`
(one trainer, or rank 0 of ``[outer]``) and the other ranks' :mod:`stoa.fleet.outer.inner`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from stoa.fleet.config import RunConfig
from stoa.fleet.trust.admission import episode_metric_means
from stoa.types import Episode

__all__ = ["learn_step", "successes"]


def successes(episodes: list[Episode], success_metric: str | None) -> np.ndarray:
    """1.0 for each episode that solved its item (the env's ``success_metric``, else reward > 0)."""
    return np.array([bool(e.metrics.get(success_metric)) if success_metric else e.reward > 0 for e in episodes], float)


def learn_step(cfg: RunConfig, learner: Any, episodes: list[Episode], version: int, success_metric: str | None,
               metric_types: dict[str, Any], mismatch: Callable[[list[Episode]], dict[str, float]] | None = None
               ) -> tuple[dict[str, Any], dict]:
    """Advantages and one learner step over a step's ``episodes`` (whole groups) at the trainer's
    ``version``; returns (rollout metrics, learner metrics). ``mismatch``, when given, adds the
    behaviour/trainer split of the episodes before the step. Every trainer of a run takes its
    steps here (:mod:`stoa.fleet.outer`).

    Raises whatever the learner raises (the caller has the intake find the batch to blame)."""
    from stoa.algos.advantages import group_advantages, signal_share

    tc = cfg.trainer
    rewards = np.array([e.reward for e in episodes], np.float32)
    adv, stats = group_advantages(rewards, [e.group_id for e in episodes], kind=tc.advantage)
    adv = np.asarray(adv, np.float32)
    keep = ~np.asarray(stats["zero_variance_mask"], bool) if tc.skip_zero_variance_groups else np.ones(len(adv), bool)
    lags = [version - e.policy_version for e in episodes]
    ok = successes(episodes, success_metric)
    rollout = {
        "reward/mean": float(rewards.mean()),
        "rollout/pass@1": float(np.mean(ok)),
        **episode_metric_means(episodes, metric_types, "rollout"),
        "rollout/model_tokens": float(np.mean([e.num_model_tokens for e in episodes])),
        "staleness/mean": float(np.mean(lags)), "staleness/max": float(max(lags)),
        "groups/zero_variance_frac": float(stats["frac_zero_variance_groups"]),
        "groups/signal_frac": 1.0 - float(stats["frac_zero_variance_groups"]),
        "groups/zero_variance": int(stats["num_zero_variance_groups"]),
    }
    for lag, n in Counter(lags).items():
        rollout[f"staleness/lag{lag}"] = n
    if mismatch is not None:
        rollout.update(mismatch(episodes))
    share = signal_share([e.num_model_tokens for e in episodes], keep,
                         getattr(getattr(cfg.objective, "config", None), "aggregation", "token_mean"))
    rollout["loss/signal_share"] = share
    learn: dict[str, Any] = {"learner/skipped_no_signal": not keep.any()}
    if keep.any():
        sel = [e for e, k in zip(episodes, keep) if k]
        # Averaging over the whole step: the left-out groups have advantage 0 and would only add
        # to the denominator; every objective's loss is linear in the advantage's scale, so
        # scaling the kept advantages by their share is that mean, without their compute.
        scale = share if tc.average_over == "step" else 1.0
        learn = learner.train_step(sel, adv[keep] * np.float32(scale), objective=cfg.objective)
    return rollout, learn
