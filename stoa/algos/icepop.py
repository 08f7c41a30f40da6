"""IcePop-style masking: drop tokens whose pi/mu leaves a fixed band, whatever the advantage.

After the Ling team's IcePop ("Every Step Evolves: Scaling Reinforcement Learning for
Trillion-Scale Thinking Model", 2025), which masks tokens where the training and inference
engines disagree too much. With ``r = pi / mu``::

    kept        = ratio_low <= r <= ratio_high
    loss_token  = -A * sg(r) * log pi   on kept tokens     (gradient: -A * r * grad log pi)

Unlike DPPO's gate the band is two-sided and ignores the advantage's sign, so it also drops
corrective moves; comparing the two isolates the value of the direction-aware gate.

Deviations: IcePop applies the mask on the mismatch ratio ``pi_old/mu`` and keeps a PPO clip
against the recomputed old trainer policy; Stoa has neither a recomputed old policy nor a second
forward pass, so the mask and the importance weight use the current ``pi/mu`` and there is no
extra clip (the band already bounds the weight by ``ratio_high``).

Metrics: the common ones plus ``gate/masked_frac``, ``gate/masked_high_frac`` (r > ratio_high),
``gate/masked_low_frac`` (r < ratio_low), ``mismatch/kl_kept`` and ``mismatch/kl_masked``.
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
    """Hyper-parameters of IcePop masking."""

    ratio_low: float = 0.5
    """Tokens with pi/mu below this are dropped (in (0, 1])."""
    ratio_high: float = 5.0
    """Tokens with pi/mu above this are dropped (>= 1)."""
    aggregation: Aggregation = "token_mean"
    """How per-token losses become one scalar (see :mod:`stoa.algos.base`)."""
    max_tokens_norm: float = 1024.0
    """Constant per-sequence token budget for ``"seq_mean_token_sum_norm"`` (> 0)."""

    def __post_init__(self) -> None:
        check_number("ratio_low", self.ratio_low, lo=0, lo_open=True, hi=1)
        check_number("ratio_high", self.ratio_high, lo=1, allow_inf=True)
        check_aggregation(self.aggregation, self.max_tokens_norm)


def loss(inputs: ObjectiveInputs, config: Config) -> tuple[torch.Tensor, dict[str, float]]:
    """IcePop loss and metrics (see the module docstring)."""
    import torch

    from stoa.algos.base import aggregate, common_metrics, gate_metrics, prepare, to_floats

    p = prepare(inputs)
    log_hi = math.log(config.ratio_high) if math.isfinite(config.ratio_high) else math.inf
    high = p.counted & (p.log_ratio > log_hi)
    low = p.counted & (p.log_ratio < math.log(config.ratio_low))
    gated = high | low
    kept = p.counted & ~gated
    per_token = torch.where(kept, -p.adv * p.log_ratio.exp() * p.lp, 0)
    out = aggregate(per_token, p.counted, config.aggregation,
                    max_tokens_norm=config.max_tokens_norm, normalizer=inputs.normalizer)
    return out, to_floats({**common_metrics(p), **gate_metrics(p, high, low)})
