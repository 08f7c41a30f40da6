"""A custom objective in one file: CISPO, the clipped importance-sampling policy gradient.

After MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention" (2025),
section 3.1. PPO's clip drops the gradient of every token whose ratio leaves the trust region;
CISPO clips the *detached importance weight* instead, so every token keeps a gradient::

    loss_token = -A * sg(clip(r, 1 - eps_low, 1 + eps_high)) * log pi        r = pi / mu

Deviation: the paper takes ``r`` against the recomputed old trainer policy; Stoa anchors every
objective on the behaviour policy ``mu`` (the int8 worker that sampled the token), so here the
clip also bounds the int8 and staleness mismatch. With ``eps_low = 1`` (the paper's choice: no
lower bound) it is TIS with a cap of ``1 + eps_high``.

Use it from a run config, the path read from the config file's folder::

    [objective]
    kind = "cispo_objective.py:loss"
    eps_high = 0.28

``examples/sweeps/cispo_vs_dppo.toml`` compares it with DPPO under forced staleness
(``stoa sweep``).
Metrics: the common ones and ``ratio/clipped_high_frac`` / ``ratio/clipped_low_frac``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stoa.algos.checks import Aggregation, check_aggregation, check_number

if TYPE_CHECKING:  # torch loads with the first loss, not when a run config is resolved
    import torch

    from stoa.algos.base import ObjectiveInputs


@dataclass(frozen=True)
class Config:
    """Hyper-parameters of CISPO."""

    eps_low: float = 1.0
    """Lower clip of the weight: ``r >= 1 - eps_low`` (in [0, 1]; 1 = no lower bound, as in the paper)."""
    eps_high: float = 0.28
    """Upper clip of the weight: ``r <= 1 + eps_high`` (> 0)."""
    aggregation: Aggregation = "token_mean"
    """How per-token losses become one scalar (see :mod:`stoa.algos.base`)."""
    max_tokens_norm: float = 1024.0
    """Constant per-sequence token budget for ``"seq_mean_token_sum_norm"`` (> 0)."""

    def __post_init__(self) -> None:
        check_number("eps_low", self.eps_low, lo=0, hi=1)
        check_number("eps_high", self.eps_high, lo=0, lo_open=True)
        check_aggregation(self.aggregation, self.max_tokens_norm)


def loss(inputs: ObjectiveInputs, config: Config) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO loss and metrics (see the module docstring)."""
    import torch

    from stoa.algos.base import aggregate, common_metrics, masked_mean, prepare, to_floats

    p = prepare(inputs)
    lo = math.log(1 - config.eps_low) if config.eps_low < 1 else -math.inf
    hi = math.log(1 + config.eps_high)
    weight = p.log_ratio.clamp(min=lo, max=hi).exp()  # detached: prepare() detaches log_ratio
    per_token = torch.where(p.counted, -p.adv * weight * p.lp, 0)
    out = aggregate(per_token, p.counted, config.aggregation,
                    max_tokens_norm=config.max_tokens_norm, normalizer=inputs.normalizer)
    m = common_metrics(p)
    m["ratio/clipped_high_frac"] = masked_mean((p.log_ratio > hi).to(p.log_ratio.dtype), p.counted)
    m["ratio/clipped_low_frac"] = masked_mean((p.log_ratio < lo).to(p.log_ratio.dtype), p.counted)
    return out, to_floats(m)
