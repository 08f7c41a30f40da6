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
broadcast over each episode's tokens.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any, Literal

import numpy as np
import torch

AdvantageKind = Literal["grpo", "drgrpo", "rloo"]
KINDS: tuple[str, ...] = ("grpo", "drgrpo", "rloo")


def group_advantages(
    rewards: torch.Tensor | np.ndarray | Sequence[float],
    group_ids: Sequence[Hashable] | np.ndarray | torch.Tensor,
    kind: AdvantageKind = "grpo",
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Advantages of ``N`` episodes from their rewards and group ids.

    Args:
        rewards: ``[N]`` finite per-episode rewards.
        group_ids: ``N`` hashable ids (``Episode.group_id`` strings); equal ids form a group.
            Groups need not be contiguous or of equal size.
        kind: ``"grpo"``, ``"drgrpo"`` or ``"rloo"`` (formulas in the module docstring).
        eps: added to the group std for ``"grpo"`` (>= 0).

    Returns:
        ``(advantages, stats)``: ``advantages`` is float32 ``[N]`` (on the rewards' device when
        they are a tensor, else CPU); ``stats`` holds ``num_groups``,
        ``num_zero_variance_groups`` (ints), ``frac_zero_variance_groups``, ``reward_mean``,
        ``reward_std`` (population std over all episodes) (floats), ``group_size_min``,
        ``group_size_max`` (ints) and ``zero_variance_mask`` (bool tensor ``[N]``, True for
        episodes in zero-variance groups).

    Raises:
        ValueError: on a shape mismatch, a non-finite reward, an unknown kind or a bad eps.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    device = rewards.device if isinstance(rewards, torch.Tensor) else torch.device("cpu")
    r = torch.as_tensor(rewards.detach() if isinstance(rewards, torch.Tensor) else np.asarray(rewards))
    r = r.to(device="cpu", dtype=torch.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(r.shape)}")
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must be finite")
    if isinstance(group_ids, (torch.Tensor, np.ndarray)):
        group_ids = group_ids.tolist()  # tensor elements hash by identity, not value
    if len(group_ids) != len(r):
        raise ValueError(f"{len(r)} rewards but {len(group_ids)} group ids")
    n = len(r)
    if n == 0:
        return torch.zeros(0, dtype=torch.float32, device=device), {
            "num_groups": 0, "num_zero_variance_groups": 0, "frac_zero_variance_groups": 0.0,
            "reward_mean": 0.0, "reward_std": 0.0, "group_size_min": 0, "group_size_max": 0,
            "zero_variance_mask": torch.zeros(0, dtype=torch.bool, device=device),
        }

    index: dict[Hashable, int] = {}
    gid = torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)
    num_groups = len(index)
    count = torch.bincount(gid, minlength=num_groups).to(torch.float64)
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, gid, r) / count
    dev = r - mean[gid]
    sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, gid, dev * dev)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    gmax = torch.full((num_groups,), -math.inf, dtype=torch.float64).scatter_reduce_(0, gid, r, "amax")
    gmin = torch.full((num_groups,), math.inf, dtype=torch.float64).scatter_reduce_(0, gid, r, "amin")
    zero_var_group = gmax == gmin  # exact: a float mean of equal values need not equal them
    zero_var = zero_var_group[gid]

    if kind == "grpo":
        adv = dev / (std[gid] + eps).clamp(min=torch.finfo(torch.float64).tiny)
    elif kind == "drgrpo":
        adv = dev
    else:
        adv = dev * (count / (count - 1).clamp(min=1))[gid]
    adv = torch.where(zero_var, 0.0, adv)

    n_zero = int(zero_var_group.sum())
    stats: dict[str, Any] = {
        "num_groups": num_groups,
        "num_zero_variance_groups": n_zero,
        "frac_zero_variance_groups": n_zero / num_groups,
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std(correction=0)),
        "group_size_min": int(count.min()),
        "group_size_max": int(count.max()),
        "zero_variance_mask": zero_var.to(device),
    }
    return adv.to(device=device, dtype=torch.float32), stats
