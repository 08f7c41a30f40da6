"""Group-relative advantages: G samples of one prompt are scored against each other.

For a group with rewards ``r_1..r_G``, mean ``m`` and sample standard deviation ``s``
(Bessel-corrected, as ``torch.std`` and the common GRPO implementations compute it):

``"grpo"``    ``A_i = (r_i - m) / (s + eps)``            (Shao et al. 2024, DeepSeekMath)
``"drgrpo"``  ``A_i = r_i - m``                          (Liu et al. 2025, "Understanding
              R1-Zero-Like Training": dividing by ``s`` up-weights near-solved prompts)
``"rloo"``    ``A_i = r_i - mean_{j != i} r_j = G/(G-1) * (r_i - m)``   (Ahmadian et al. 2024)

A group whose rewards are all equal (including a group of one) has zero variance and carries no
learning signal: every kind gives it advantage exactly 0, and the stats report it so a trainer
can skip those episodes (DAPO's dynamic sampling) or just count them.

Per-token advantages for :class:`stoa.algos.ObjectiveInputs` are these per-episode values
broadcast over each episode's tokens. Everything here is numpy: the learners take the ``[N]``
array and convert it to their tensors once.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any, Literal

import numpy as np

AdvantageKind = Literal["grpo", "drgrpo", "rloo"]
KINDS: tuple[str, ...] = ("grpo", "drgrpo", "rloo")


def group_advantages(
    rewards: np.ndarray | Sequence[float],
    group_ids: Sequence[Hashable] | np.ndarray,
    kind: AdvantageKind = "grpo",
    eps: float = 1e-6,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Advantages of ``N`` episodes from their rewards and group ids (numpy in, numpy out).

    Args:
        rewards: ``[N]`` finite per-episode rewards (any array-like of numbers).
        group_ids: ``N`` hashable ids (``Episode.group_id`` strings); equal ids form a group.
            Groups need not be contiguous or of equal size.
        kind: ``"grpo"``, ``"drgrpo"`` or ``"rloo"`` (formulas in the module docstring).
        eps: added to the group std for ``"grpo"`` (>= 0).

    Returns:
        ``(advantages, stats)``: ``advantages`` is a float32 numpy array ``[N]``; ``stats``
        holds ``num_groups``, ``num_zero_variance_groups`` (ints),
        ``frac_zero_variance_groups``, ``reward_mean``, ``reward_std`` (population std over all
        episodes) (floats), ``group_size_min``, ``group_size_max`` (ints) and
        ``zero_variance_mask`` (bool numpy array ``[N]``, True for episodes in zero-variance
        groups). A learner converts the advantages to its own tensors once.

    Raises:
        ValueError: on a shape mismatch, a non-finite reward, an unknown kind or a bad eps.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {r.shape}")
    if not np.isfinite(r).all():
        raise ValueError("rewards must be finite")
    if hasattr(group_ids, "tolist"):
        group_ids = group_ids.tolist()  # group by plain values, not by array-element objects
    if len(group_ids) != len(r):
        raise ValueError(f"{len(r)} rewards but {len(group_ids)} group ids")
    n = len(r)
    if n == 0:
        return np.zeros(0, np.float32), {
            "num_groups": 0, "num_zero_variance_groups": 0, "frac_zero_variance_groups": 0.0,
            "reward_mean": 0.0, "reward_std": 0.0, "group_size_min": 0, "group_size_max": 0,
            "zero_variance_mask": np.zeros(0, bool),
        }

    index: dict[Hashable, int] = {}
    gid = np.array([index.setdefault(g, len(index)) for g in group_ids], dtype=np.int64)
    num_groups = len(index)
    count = np.bincount(gid, minlength=num_groups).astype(np.float64)
    mean = np.bincount(gid, weights=r, minlength=num_groups) / count
    dev = r - mean[gid]
    std = np.sqrt(np.bincount(gid, weights=dev * dev, minlength=num_groups) / np.maximum(count - 1, 1))
    gmax = np.full(num_groups, -np.inf)
    gmin = np.full(num_groups, np.inf)
    np.maximum.at(gmax, gid, r)
    np.minimum.at(gmin, gid, r)
    zero_var_group = gmax == gmin  # exact: a float mean of equal values need not equal them
    zero_var = zero_var_group[gid]

    if kind == "grpo":
        adv = dev / np.maximum(std[gid] + eps, np.finfo(np.float64).tiny)
    elif kind == "drgrpo":
        adv = dev
    else:
        adv = dev * (count / np.maximum(count - 1, 1))[gid]
    adv = np.where(zero_var, 0.0, adv)

    n_zero = int(zero_var_group.sum())
    stats: dict[str, Any] = {
        "num_groups": num_groups,
        "num_zero_variance_groups": n_zero,
        "frac_zero_variance_groups": n_zero / num_groups,
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std()),
        "group_size_min": int(count.min()),
        "group_size_max": int(count.max()),
        "zero_variance_mask": zero_var,
    }
    return adv.astype(np.float32), stats


def signal_share(loss_tokens: Sequence[int] | np.ndarray, keep: Sequence[bool] | np.ndarray,
                 aggregation: str = "token_mean") -> float:
    """The kept episodes' share of a batch's loss denominator.

    A trainer that leaves zero-variance groups out of a step (their advantage is 0, so they add
    nothing to the gradient) still decides what the loss's mean runs over. Averaging over the
    whole batch, as a full-batch token mean does, is the mean over the kept episodes times this
    share: counted tokens for ``"token_mean"``, sequences with a counted token for the other
    aggregations. ``loss_tokens[i]`` is episode ``i``'s counted (model) tokens. Every objective's
    loss is linear in the advantage's scale, so scaling the kept advantages by the share gives
    that mean without computing the left-out episodes. 1.0 for a batch with nothing counted.
    """
    n = np.asarray(loss_tokens, dtype=np.float64)
    k = np.asarray(keep, dtype=bool)
    if n.shape != k.shape:
        raise ValueError(f"loss_tokens {n.shape} and keep {k.shape} must have the same shape")
    if aggregation != "token_mean":
        n = (n > 0).astype(np.float64)
    total = float(n.sum())
    return float(n[k].sum()) / total if total > 0 else 1.0
