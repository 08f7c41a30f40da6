"""Truncated importance sampling (TIS): the policy gradient reweighted by a capped pi/mu.

After Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
(2025), which corrects the rollout/trainer mismatch with a truncated weight. With
``r = pi / mu``::

    loss_token = -A * sg(min(r, cap)) * log pi        (gradient: -A * min(r, cap) * grad log pi)

Deviations: the paper multiplies a PPO loss (against a recomputed old trainer policy) by the
truncated weight ``min(pi_old/mu, cap)``; Stoa has no recomputed old policy, so the weight is
taken against the current trainer policy and there is no PPO clip. This is DPPO's ``"pg"``
surrogate without the gate, which makes it the cleanest ablation of the gate itself.

Metrics: the common ones (``loss/tokens``, ``loss/sequences``, ``mismatch/kl_all``,
``ratio/min|mean|max``, ``entropy_proxy``) and ``ratio/capped_frac`` (counted tokens whose
ratio exceeded the cap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stoa.algos.checks import Aggregation, check_aggregation, check_number

# torch is imported inside loss(): building a Config (resolving a run config) needs none.
if TYPE_CHECKING:
    import torch

    from stoa.algos.base import ObjectiveInputs


@dataclass(frozen=True)
class Config:
    """Hyper-parameters of truncated importance sampling."""

    cap: float = 2.0
    """Cap on the detached importance weight pi/mu (>= 1; inf = plain importance sampling)."""
    aggregation: Aggregation = "token_mean"
    """How per-token losses become one scalar (see :mod:`stoa.algos.base`)."""
    max_tokens_norm: float = 1024.0
    """Constant per-sequence token budget for ``"seq_mean_token_sum_norm"`` (> 0)."""

    def __post_init__(self) -> None:
        check_number("cap", self.cap, lo=1, allow_inf=True)
        check_aggregation(self.aggregation, self.max_tokens_norm)


def loss(inputs: ObjectiveInputs, config: Config) -> tuple[torch.Tensor, dict[str, float]]:
    """TIS loss and metrics (see the module docstring)."""
    import torch

    from stoa.algos.base import aggregate, common_metrics, masked_mean, prepare, to_floats

    p = prepare(inputs)
    log_cap = math.log(config.cap) if math.isfinite(config.cap) else math.inf
    per_token = torch.where(p.counted, -p.adv * p.log_ratio.clamp(max=log_cap).exp() * p.lp, 0)
    out = aggregate(per_token, p.counted, config.aggregation,
                    max_tokens_norm=config.max_tokens_norm, normalizer=inputs.normalizer)
    m = common_metrics(p)
    m["ratio/capped_frac"] = masked_mean((p.log_ratio > log_cap).to(p.log_ratio.dtype), p.counted)
    return out, to_floats(m)
