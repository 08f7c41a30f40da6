"""The objective contract: one inputs dataclass, loss aggregation, and shared helpers.

Every objective in :mod:`stoa.algos` is a module exporting

* ``Config``: a frozen dataclass of hyper-parameters, bounds checked at construction, and
* ``loss(inputs: ObjectiveInputs, config: Config) -> (loss, metrics)``: ``loss`` is a scalar
  tensor to call ``.backward()`` on; ``metrics`` is a flat ``dict[str, float]`` for logging.

Objectives are pure functions: no state, no I/O, no optimizer. The caller computes the
trainer's log-probs of the sampled tokens (with grad), the rest comes from the episodes.

Loss aggregation
----------------
Per-token losses ``l[b, t]`` are reduced with the loss mask ``m[b, t]`` in one of three ways
(``config.aggregation``); ``n_b = sum_t m[b, t]`` counts sequence ``b``'s tokens:

``"token_mean"`` (default)
    ``sum_{b,t} m*l / N_tok`` with ``N_tok = sum_{b,t} m``: every token weighs the same (DAPO).
``"seq_mean_token_mean"``
    ``sum_b (sum_t m*l / n_b) / N_seq`` with ``N_seq`` the number of sequences with ``n_b > 0``:
    every sequence weighs the same (the original GRPO).
``"seq_mean_token_sum_norm"``
    ``sum_{b,t} m*l / (max_tokens_norm * N_seq)``: a constant per-token weight, free of the
    length bias of the other two (Dr. GRPO).

Micro-batches
-------------
A learner that splits one optimizer batch into micro-batches for gradient accumulation passes
the *whole batch's* denominator as ``ObjectiveInputs.normalizer``: ``N_tok`` for
``"token_mean"``, ``N_seq`` for the other two (:func:`batch_normalizer` computes it; it is
additive over micro-batches that do not split a sequence). Each micro-batch loss is then its
share of the full-batch loss, so summing micro-batch losses (and their gradients) gives exactly
the full-batch loss and gradient. Without ``normalizer`` the micro-batch's own count is used.
Under data parallelism whose all-reduce *averages* gradients over ``W`` ranks, pass the global
count divided by ``W``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from stoa.algos.checks import AGGREGATIONS, Aggregation, check_choice

__all__ = ["AGGREGATIONS", "Aggregation", "ObjectiveInputs", "Prepared", "aggregate", "batch_normalizer",
           "common_metrics", "k3", "masked_mean", "prepare", "to_floats"]

# Log-ratios are clamped here before exp() so metrics and PPO ratios never overflow float32.
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class ObjectiveInputs:
    """What every objective consumes; all tensors are ``[batch, time]`` on one device.

    Attributes:
        logprobs: the trainer's log-probability of each sampled token, ``log pi``, with grad.
            Any values at positions where ``mask == 0`` are ignored (they may be ``-inf``).
        behavior_logprobs: ``log mu``, the log-probability the rollout worker recorded when it
            sampled the token (the possibly stale, int8 behaviour policy). Never differentiated.
        advantages: per-token advantage ``A`` (usually one per-episode value broadcast over its
            tokens). Never differentiated.
        mask: 1.0 where the token is a model token that counts in the loss, 0.0 at prompt,
            tool/environment output and padding. A bool tensor is accepted and converted.
        normalizer: optional denominator of the whole optimizer batch when this is one
            micro-batch of it (see the module docstring); ``None`` uses this batch's own count.
    """

    logprobs: torch.Tensor
    behavior_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    normalizer: float | None = None

    def __post_init__(self) -> None:
        names = ("logprobs", "behavior_logprobs", "advantages", "mask")
        for name in names:
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"ObjectiveInputs.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.ndim != 2:
                raise ValueError(f"ObjectiveInputs.{name} must be [batch, time], got shape {tuple(t.shape)}")
        if self.mask.dtype == torch.bool:
            object.__setattr__(self, "mask", self.mask.to(self.logprobs.dtype))
        shape, device = self.logprobs.shape, self.logprobs.device
        for name in names:
            t = getattr(self, name)
            if not t.is_floating_point():
                raise TypeError(f"ObjectiveInputs.{name} must be a float tensor, got {t.dtype}")
            if t.shape != shape:
                raise ValueError(
                    f"ObjectiveInputs shapes differ: logprobs {tuple(shape)} vs {name} {tuple(t.shape)}"
                )
            if t.device != device:
                raise ValueError(f"ObjectiveInputs.{name} is on {t.device}, logprobs on {device}")
        if not bool(((self.mask == 0) | (self.mask == 1)).all()):
            raise ValueError("ObjectiveInputs.mask must hold only 0 and 1")
        n = self.normalizer
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n) or n < 0:
                raise ValueError(f"ObjectiveInputs.normalizer must be a finite number >= 0, got {n!r}")
            object.__setattr__(self, "normalizer", float(n))


class Prepared(NamedTuple):
    """Inputs cast to the compute dtype, with every non-counted position zeroed."""

    lp: torch.Tensor  # log pi, with grad (0 where not counted)
    blp: torch.Tensor  # log mu (0 where not counted)
    adv: torch.Tensor  # A (0 where not counted)
    counted: torch.Tensor  # bool mask
    log_ratio: torch.Tensor  # log(pi/mu), detached, clamped to +-LOG_RATIO_CLAMP


def prepare(inputs: ObjectiveInputs) -> Prepared:
    """Cast to at least float32 and zero non-counted positions before any arithmetic.

    Zeroing *before* exp/log keeps ``-inf``/NaN padding from turning into NaN gradients.
    """
    dtype = torch.promote_types(inputs.logprobs.dtype, torch.float32)
    counted = inputs.mask > 0
    zero = torch.zeros((), dtype=dtype, device=counted.device)
    lp = torch.where(counted, inputs.logprobs.to(dtype), zero)
    blp = torch.where(counted, inputs.behavior_logprobs.detach().to(dtype), zero)
    adv = torch.where(counted, inputs.advantages.detach().to(dtype), zero)
    log_ratio = (lp.detach() - blp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return Prepared(lp, blp, adv, counted, log_ratio)


def batch_normalizer(mask: torch.Tensor, aggregation: Aggregation) -> float:
    """The denominator ``aggregation`` uses for a batch with this ``[batch, time]`` mask.

    ``N_tok`` (counted tokens) for ``"token_mean"``, ``N_seq`` (sequences with at least one
    counted token) otherwise. Sum it over the micro-batches of one optimizer batch and pass the
    total as :attr:`ObjectiveInputs.normalizer` to every micro-batch.
    """
    check_choice("aggregation", aggregation, AGGREGATIONS)
    counted = mask > 0
    if aggregation == "token_mean":
        return float(counted.sum())
    return float(counted.any(dim=-1).sum())


def aggregate(
    per_token: torch.Tensor,
    counted: torch.Tensor,
    aggregation: Aggregation,
    *,
    max_tokens_norm: float,
    normalizer: float | None = None,
) -> torch.Tensor:
    """Reduce ``[batch, time]`` per-token losses to a scalar (formulas in the module docstring).

    ``per_token`` must already be 0 where ``counted`` is False. An empty batch gives an exact,
    differentiable 0.
    """
    if aggregation == "token_mean":
        local = counted.sum()
        total = per_token.sum()
    else:
        n_b = counted.sum(dim=-1)
        local = (n_b > 0).sum()
        if aggregation == "seq_mean_token_mean":
            total = (per_token.sum(dim=-1) / n_b.clamp(min=1).to(per_token.dtype)).sum()
        elif aggregation == "seq_mean_token_sum_norm":
            total = per_token.sum() / max_tokens_norm
        else:
            raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")
    if normalizer is None:
        denom = local.clamp(min=1).to(per_token.dtype)
    elif normalizer > 0:
        denom = torch.tensor(normalizer, dtype=per_token.dtype, device=per_token.device)
    else:
        if int(local) > 0:
            raise ValueError("normalizer is 0 but this batch has counted tokens")
        denom = torch.ones((), dtype=per_token.dtype, device=per_token.device)
    return total / denom


# -- metrics ----------------------------------------------------------------------------------


def masked_mean(x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``where`` (0 when ``where`` is empty)."""
    return torch.where(where, x, 0).sum() / where.sum().clamp(min=1)


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(mu || pi) from samples of mu: ``r - 1 - log r``, r = pi/mu."""
    return torch.expm1(log_ratio) - log_ratio


def common_metrics(p: Prepared) -> dict[str, torch.Tensor]:
    """Metrics every objective reports: token count, mismatch KL, ratio range, entropy proxy."""
    c = p.counted
    ratio = p.log_ratio.exp()
    big = torch.finfo(ratio.dtype).max
    any_c = c.any()
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    return {
        "loss/tokens": c.sum().to(ratio.dtype),
        "loss/sequences": c.any(dim=-1).sum().to(ratio.dtype),
        "mismatch/kl_all": masked_mean(k3(p.log_ratio), c),
        "ratio/min": torch.where(any_c, torch.where(c, ratio, big).min(), zero),
        "ratio/mean": masked_mean(ratio, c),
        "ratio/max": torch.where(any_c, torch.where(c, ratio, -big).max(), zero),
        # Mean NLL of the sampled tokens under pi: the entropy itself when pi == mu.
        "entropy_proxy": masked_mean(-p.lp.detach(), c),
    }


def to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """Move scalar metric tensors to Python floats with one device sync."""
    keys = list(metrics)
    values = torch.stack([metrics[k].detach().to(torch.float64) for k in keys]).tolist()
    return dict(zip(keys, values))
