"""PPO / GRPO ratio clipping, anchored on the behaviour policy mu.

The clipped surrogate of Schulman et al. 2017 ("Proximal Policy Optimization Algorithms"),
as GRPO uses it (Shao et al. 2024, DeepSeekMath), with the optional dual clip of Ye et al. 2020
("Mastering Complex Control in MOBA Games with Deep Reinforcement Learning"). With
``r = pi / mu`` (differentiated through pi) and advantage ``A``::

    s = min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)
    s = max(s, dual_clip_c * A)          if A < 0 and dual_clip_c is set
    loss_token = -s

Deviations from the papers:

* The ratio is taken against the behaviour log-probs the rollout worker recorded, not against a
  recomputed "old" trainer policy: Stoa has no second forward pass, so clipping here also
  absorbs the rollout/trainer mismatch (int8 weights, staleness).
* ``log r`` is clamped to +-20 before ``exp`` so the ratio never overflows; a token that far off
  gets no gradient through the ratio.
* No KL penalty to a reference model and no entropy bonus (add them outside if wanted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stoa.algos.checks import Aggregation, check_aggregation, check_number

# torch is imported inside the functions: building a Config (resolving a run config) needs none.
if TYPE_CHECKING:
    import torch

    from stoa.algos.base import ObjectiveInputs


@dataclass(frozen=True)
class Config:
    """Hyper-parameters of PPO-clip against mu."""

    clip_low: float = 0.2
    """Lower clip: the ratio is clipped at ``1 - clip_low`` (in [0, 1])."""
    clip_high: float = 0.2
    """Upper clip: the ratio is clipped at ``1 + clip_high`` (>= 0; 0.28 is DAPO's clip-higher)."""
    dual_clip_c: float | None = None
    """Dual-clip bound for A < 0: the loss per token is at most ``-c * A`` (> 1); None = off."""
    aggregation: Aggregation = "token_mean"
    """How per-token losses become one scalar (see :mod:`stoa.algos.base`)."""
    max_tokens_norm: float = 1024.0
    """Constant per-sequence token budget for ``"seq_mean_token_sum_norm"`` (> 0)."""

    def __post_init__(self) -> None:
        check_number("clip_low", self.clip_low, lo=0, hi=1)
        check_number("clip_high", self.clip_high, lo=0, allow_inf=True)
        if self.dual_clip_c is not None:
            check_number("dual_clip_c", self.dual_clip_c, lo=1, lo_open=True, allow_inf=True)
        check_aggregation(self.aggregation, self.max_tokens_norm)


def clipped_surrogate(
    lp: torch.Tensor, blp: torch.Tensor, adv: torch.Tensor,
    clip_low: float, clip_high: float, dual_clip_c: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO(-dual-clip) loss and where each clip is active (zero gradient there).

    Returns ``(loss_token, clipped_high, clipped_low, clipped_dual)``; the flags are bool.
    """
    import torch

    from stoa.algos.base import LOG_RATIO_CLAMP

    ratio = torch.exp((lp - blp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    s = torch.minimum(ratio * adv, clipped * adv)
    r = ratio.detach()
    high = (adv > 0) & (r > 1 + clip_high)
    low = (adv < 0) & (r < 1 - clip_low)
    if dual_clip_c is None:
        dual = torch.zeros_like(high)
    else:
        s = torch.where(adv < 0, torch.maximum(s, dual_clip_c * adv), s)
        dual = (adv < 0) & (r > dual_clip_c)
    return -s, high, low, dual


def loss(inputs: ObjectiveInputs, config: Config) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip loss against mu; metrics add ``clip/frac``, ``clip/high_frac``,
    ``clip/low_frac`` and ``clip/dual_frac`` (fractions of counted tokens) to the common ones."""
    import torch

    from stoa.algos.base import aggregate, common_metrics, masked_mean, prepare, to_floats

    p = prepare(inputs)
    per_token, high, low, dual = clipped_surrogate(
        p.lp, p.blp, p.adv, config.clip_low, config.clip_high, config.dual_clip_c
    )
    per_token = torch.where(p.counted, per_token, 0)
    out = aggregate(per_token, p.counted, config.aggregation,
                    max_tokens_norm=config.max_tokens_norm, normalizer=inputs.normalizer)
    m = common_metrics(p)
    dt = p.log_ratio.dtype
    m["clip/frac"] = masked_mean((high | low | dual).to(dt), p.counted)
    m["clip/high_frac"] = masked_mean(high.to(dt), p.counted)
    m["clip/low_frac"] = masked_mean(low.to(dt), p.counted)
    m["clip/dual_frac"] = masked_mean(dual.to(dt), p.counted)
    return out, to_floats(m)
