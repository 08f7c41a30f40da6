"""Plain REINFORCE: ``loss_token = -A * log pi``, no importance correction, no trust region.

Williams 1992. Exact only on-policy (pi == mu); with a stale or quantized behaviour policy it
is biased, which is what makes it the baseline for the mismatch-aware objectives. With
group-relative advantages (:mod:`stoa.algos.advantages`) this is the "GRPO without clipping"
that many small-scale recipes use.

Metrics: the common ones (``loss/tokens``, ``loss/sequences``, ``mismatch/kl_all``,
``ratio/min|mean|max``, ``entropy_proxy``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stoa.algos.checks import Aggregation, check_aggregation

# torch is imported inside loss(): building a Config (resolving a run config) needs none.
if TYPE_CHECKING:
    import torch

    from stoa.algos.base import ObjectiveInputs


@dataclass(frozen=True)
class Config:
    """Hyper-parameters of REINFORCE (only the aggregation)."""

    aggregation: Aggregation = "token_mean"
    """How per-token losses become one scalar (see :mod:`stoa.algos.base`)."""
    max_tokens_norm: float = 1024.0
    """Constant per-sequence token budget for ``"seq_mean_token_sum_norm"`` (> 0)."""

    def __post_init__(self) -> None:
        check_aggregation(self.aggregation, self.max_tokens_norm)


def loss(inputs: ObjectiveInputs, config: Config) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE loss and metrics (see the module docstring)."""
    import torch

    from stoa.algos.base import aggregate, common_metrics, prepare, to_floats

    p = prepare(inputs)
    per_token = torch.where(p.counted, -p.adv * p.lp, 0)
    out = aggregate(per_token, p.counted, config.aggregation,
                    max_tokens_norm=config.max_tokens_norm, normalizer=inputs.normalizer)
    return out, to_floats(common_metrics(p))
