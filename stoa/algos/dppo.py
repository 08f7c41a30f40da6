"""DPPO: Divergence Proximal Policy Optimization with a binary probability gate.

Paper: Qi, Zhou, Liu, Pang, Du, Lin, Lee, "Rethinking the Trust Region in LLM Reinforcement
Learning", arXiv:2602.04879 (2026); reference code in sail-sg/Stable-RL.

PPO clips the ratio ``pi/mu`` of one sampled token, a noisy estimate of how far the policy
moved: it over-restricts rare tokens (a tiny absolute change is a big ratio) and under-restricts
likely ones. DPPO instead bounds a divergence between the two next-token distributions. The
*binary* approximation collapses each distribution to {sampled token, everything else}, i.e.
Bernoulli(p) with p the sampled token's probability, so it needs only the two log-probs we have.

The rule, with ``pi = exp(logprobs)``, ``mu = exp(behavior_logprobs)``, advantage ``A``:

* binary-TV gate (``gate="tv"``, default): drop the token when
  ``A > 0 and pi - mu > delta_high`` ("masked high") or ``A < 0 and pi - mu < -delta_low``
  ("masked low"). The TV distance between the two Bernoullis is exactly ``|pi - mu|``.
* binary-KL gate (``gate="kl"``): the same rule with the Bernoulli KL
  ``D = mu log(mu/pi) + (1-mu) log((1-mu)/(1-pi))`` in place of ``|pi - mu|``:
  drop when ``A > 0 and pi > mu and D > delta_high`` or ``A < 0 and pi < mu and D > delta_low``.

A token is dropped only when the update would push it further away from mu in the direction
its advantage pushes; corrective moves (``A > 0`` with ``pi <= mu``, ``A < 0`` with
``pi >= mu``) always pass, and ``A == 0`` is never gated. Dropped tokens contribute no gradient
(but still count in the aggregation denominator, as clipped tokens do in PPO). Kept tokens use

* ``surrogate="pg"`` (default): ``loss_token = -A * sg(min(pi/mu, ratio_cap)) * log pi``,
  whose gradient is ``-A * min(pi/mu, C) * grad log pi`` (sg = stop-gradient); or
* ``surrogate="ppo_dual_clip"``: the PPO clipped surrogate with dual clip on ``pi/mu``
  (:func:`stoa.algos.ppo.clipped_surrogate`), for ablations that want both trust regions.

Deviations from the paper and its reference code, all deliberate:

* The anchor is the behaviour policy mu recorded by the (int8, possibly stale) rollout worker;
  there is no recomputed "old" trainer policy. This is the setting the paper argues for (the
  trust region is around the policy that generated the data), and the only one Stoa has.
* The importance weight is capped at ``ratio_cap`` (default 10) and detached; the reference
  code caps at 20. A cap of ``inf`` removes it.
* ``A == 0`` tokens are never counted as gated (they carry no gradient either way); the
  reference code applies the negative-advantage rule to them.
* The binary KL is computed in float64 from log-probs with ``1 - p`` formed as ``-expm1(log p)``
  and ``log p`` held below ``-1e-12``, instead of adding 1e-8 inside the logs.
* Only the binary approximations are implemented; the paper's top-K variant needs the full
  distributions, which the rollout workers do not record.
* Metrics are computed on counted tokens only and reported with Stoa's names (below).

Metrics (fractions are over counted tokens; empty sets give 0): ``gate/masked_frac``,
``gate/masked_high_frac``, ``gate/masked_low_frac``, ``mismatch/kl_all``, ``mismatch/kl_kept``,
``mismatch/kl_masked`` (k3 estimates of KL(mu||pi)), ``ratio/min``, ``ratio/mean``,
``ratio/max``, ``ratio/capped_frac`` (``"pg"`` only: fraction of kept tokens whose ratio hit
the cap), ``entropy_proxy``
(mean ``-log pi``), ``loss/tokens``, ``loss/sequences``. With ``surrogate="ppo_dual_clip"``,
also ``clip/frac``, ``clip/high_frac``, ``clip/low_frac``, ``clip/dual_frac`` over counted tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from stoa.algos import ppo
from stoa.algos.checks import Aggregation, check_aggregation, check_choice, check_number

# torch is imported inside the functions: building a Config (resolving a run config) needs none.
if TYPE_CHECKING:
    import torch

    from stoa.algos.base import ObjectiveInputs, Prepared

Gate = Literal["tv", "kl"]
Surrogate = Literal["pg", "ppo_dual_clip"]
DEFAULT_DELTAS = {"tv": 0.2, "kl": 0.05}


@dataclass(frozen=True)
class Config:
    """Hyper-parameters of DPPO.

    ``delta_*`` left as None resolve to the gate's default at construction, so the resolved
    config records the numbers used (and ``dataclasses.replace(cfg, gate=...)`` keeps them).
    """

    gate: Gate = "tv"
    """Divergence of the binary gate: ``"tv"`` (|pi - mu|) or ``"kl"`` (Bernoulli KL)."""
    delta_high: float | None = None
    """Threshold for A > 0 moves (pi rising above mu); default 0.2 (tv) / 0.05 (kl)."""
    delta_low: float | None = None
    """Threshold for A < 0 moves (pi falling below mu); default 0.2 (tv) / 0.05 (kl)."""
    ratio_cap: float = 10.0
    """Cap C on the detached importance weight pi/mu of kept tokens (>= 1; inf = no cap)."""
    surrogate: Surrogate = "pg"
    """Loss on kept tokens: ``"pg"`` (capped-ratio policy gradient) or ``"ppo_dual_clip"``."""
    clip_low: float = 0.2
    """``ppo_dual_clip`` only: ratio clipped below at ``1 - clip_low`` (in [0, 1])."""
    clip_high: float = 0.2
    """``ppo_dual_clip`` only: ratio clipped above at ``1 + clip_high`` (>= 0)."""
    dual_clip_c: float = 3.0
    """``ppo_dual_clip`` only: for A < 0 the per-token loss is at most ``-c * A`` (> 1)."""
    aggregation: Aggregation = "token_mean"
    """How per-token losses become one scalar (see :mod:`stoa.algos.base`)."""
    max_tokens_norm: float = 1024.0
    """Constant per-sequence token budget for ``"seq_mean_token_sum_norm"`` (> 0)."""

    def __post_init__(self) -> None:
        check_choice("gate", self.gate, ("tv", "kl"))
        for name in ("delta_high", "delta_low"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, DEFAULT_DELTAS[self.gate])
            # TV between Bernoullis lies in [0, 1]: a delta of 1 never gates.
            hi = 1.0 if self.gate == "tv" else None
            check_number(name, getattr(self, name), lo=0, lo_open=True, hi=hi, allow_inf=self.gate == "kl")
        check_number("ratio_cap", self.ratio_cap, lo=1, allow_inf=True)
        check_choice("surrogate", self.surrogate, ("pg", "ppo_dual_clip"))
        check_number("clip_low", self.clip_low, lo=0, hi=1)
        check_number("clip_high", self.clip_high, lo=0, allow_inf=True)
        check_number("dual_clip_c", self.dual_clip_c, lo=1, lo_open=True, allow_inf=True)
        check_aggregation(self.aggregation, self.max_tokens_norm)


def binary_kl(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(Bernoulli(mu) || Bernoulli(pi)) per token, float64, from log pi and log mu."""
    import torch

    lp = logprobs.detach().to(torch.float64).clamp(max=-1e-12)
    lm = behavior_logprobs.detach().to(torch.float64).clamp(max=-1e-12)
    log1m_pi, log1m_mu = torch.log(-torch.expm1(lp)), torch.log(-torch.expm1(lm))
    return lm.exp() * (lm - lp) + (-torch.expm1(lm)) * (log1m_mu - log1m_pi)


def gate_masks(p: Prepared, config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool ``(masked_high, masked_low)`` over counted tokens, per the module's rule."""
    pos, neg = p.counted & (p.adv > 0), p.counted & (p.adv < 0)
    if config.gate == "tv":
        diff = p.lp.detach().exp() - p.blp.exp()
        return pos & (diff > config.delta_high), neg & (diff < -config.delta_low)
    d = binary_kl(p.lp, p.blp)
    rising = p.lp.detach() > p.blp
    falling = p.lp.detach() < p.blp
    return pos & rising & (d > config.delta_high), neg & falling & (d > config.delta_low)


def loss(inputs: ObjectiveInputs, config: Config) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO loss and metrics (see the module docstring for the rule and metric names)."""
    import torch

    from stoa.algos.base import aggregate, common_metrics, gate_metrics, masked_mean, prepare, to_floats

    p = prepare(inputs)
    high, low = gate_masks(p, config)
    gated = high | low
    kept = p.counted & ~gated
    dt = p.log_ratio.dtype
    m = common_metrics(p)
    if config.surrogate == "pg":
        log_cap = math.log(config.ratio_cap) if math.isfinite(config.ratio_cap) else math.inf
        weight = p.log_ratio.clamp(max=log_cap).exp()
        per_token = -p.adv * weight * p.lp
        m["ratio/capped_frac"] = masked_mean((p.log_ratio > log_cap).to(dt), kept)
    else:
        per_token, c_high, c_low, c_dual = ppo.clipped_surrogate(
            p.lp, p.blp, p.adv, config.clip_low, config.clip_high, config.dual_clip_c
        )
        for name, flag in (("frac", c_high | c_low | c_dual), ("high_frac", c_high),
                           ("low_frac", c_low), ("dual_frac", c_dual)):
            m[f"clip/{name}"] = masked_mean((flag & kept).to(dt), p.counted)
    per_token = torch.where(kept, per_token, 0)
    out = aggregate(per_token, p.counted, config.aggregation,
                    max_tokens_norm=config.max_tokens_norm, normalizer=inputs.normalizer)
    m.update(gate_metrics(p, high, low))
    return out, to_floats(m)
