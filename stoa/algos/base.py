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

Groups
------
``ObjectiveInputs.group_index`` says which rows are samples of one prompt (``Episode.group_id``).
An objective whose per-row terms use statistics over a whole group (GEPO's group expectation of
the behaviour probability) reads them from ``group_context``, the detached behaviour side of every
row of the optimizer batch, so a micro-batch that holds only part of a group still gets the
whole group's statistic; without a context, the rows given are taken to be the whole batch.

Mismatch metrics
----------------
:func:`mismatch_metrics` measures how far the behaviour policy mu is from pi on counted tokens,
the same way for every objective (:func:`common_metrics` includes it): the k3 estimate of
KL(mu || pi), the mean ``|log pi - log mu|``, the fraction of tokens whose plain ratio ``pi/mu``
exceeds 2 and 10, and the fraction DPPO's default binary-TV gate would mask, by advantage sign.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from stoa.algos.checks import AGGREGATIONS, Aggregation, check_choice

__all__ = ["AGGREGATIONS", "Aggregation", "GroupContext", "ObjectiveInputs", "Prepared", "aggregate",
           "batch_normalizer", "common_metrics", "k3", "masked_mean", "mismatch_metrics", "prepare", "to_floats"]

# Log-ratios are clamped here before exp() so metrics and PPO ratios never overflow float32.
LOG_RATIO_CLAMP = 20.0
# The counterfactual gate of mismatch_metrics: DPPO's default binary-TV threshold.
TV_GATE_DELTA = 0.2


@dataclass(frozen=True)
class GroupContext:
    """The detached behaviour side of *every* row of an optimizer batch, ``N`` rows.

    A learner that splits the batch into micro-batches passes the same context to each, so
    statistics over a whole group (which depend only on mu and the mask, both known before any
    forward pass) come out the same whatever the split.

    Attributes:
        behavior_logprobs: ``log mu`` of every row, float ``[N, T]``.
        mask: the loss mask of every row, float ``[N, T]`` of 0 and 1 (a bool tensor is converted).
        group_index: int64 ``[N]``, the group of each row, numbered as in
            :attr:`ObjectiveInputs.group_index`.
    """

    behavior_logprobs: torch.Tensor
    mask: torch.Tensor
    group_index: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("behavior_logprobs", "mask", "group_index"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise TypeError(f"GroupContext.{name} must be a torch.Tensor")
        if self.mask.dtype == torch.bool:
            object.__setattr__(self, "mask", self.mask.to(self.behavior_logprobs.dtype))
        b, m, g = self.behavior_logprobs, self.mask, self.group_index
        if b.ndim != 2 or m.shape != b.shape or not b.is_floating_point() or not m.is_floating_point():
            raise ValueError(f"GroupContext: behavior_logprobs and mask must be float [N, T] of one shape, "
                             f"got {tuple(b.shape)} and {tuple(m.shape)}")
        _check_group_index("GroupContext.group_index", g, b.shape[0], b.device)
        if m.device != b.device:
            raise ValueError(f"GroupContext.mask is on {m.device}, behavior_logprobs on {b.device}")


def _check_group_index(name: str, g: torch.Tensor, rows: int, device: torch.device) -> None:
    if g.dtype not in (torch.int32, torch.int64) or g.shape != (rows,):
        raise ValueError(f"{name} must be an int64 [batch] tensor of {rows} rows, got {g.dtype} {tuple(g.shape)}")
    if g.device != device:
        raise ValueError(f"{name} is on {g.device}, expected {device}")
    if rows and int(g.min()) < 0:
        raise ValueError(f"{name} must hold group numbers >= 0")


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
        group_index: optional int64 ``[batch]``: rows with the same number are samples of one
            prompt (the learners number ``Episode.group_id`` in order of appearance, the same
            numbering in every micro-batch of a batch). ``None``: every row is its own group.
            Objectives that do not use groups ignore it.
        group_context: optional :class:`GroupContext` of the whole optimizer batch (needs
            ``group_index``); ``None``: group statistics are taken over the rows given.
    """

    logprobs: torch.Tensor
    behavior_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    normalizer: float | None = None
    group_index: torch.Tensor | None = None
    group_context: GroupContext | None = None

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
        if self.group_index is not None:
            if not isinstance(self.group_index, torch.Tensor):
                raise TypeError("ObjectiveInputs.group_index must be a torch.Tensor or None")
            _check_group_index("ObjectiveInputs.group_index", self.group_index, shape[0], device)
        if self.group_context is not None:
            if not isinstance(self.group_context, GroupContext):
                raise TypeError("ObjectiveInputs.group_context must be a GroupContext or None")
            if self.group_index is None:
                raise ValueError("ObjectiveInputs.group_context needs group_index")


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


def mismatch_metrics(p: Prepared | ObjectiveInputs) -> dict[str, torch.Tensor]:
    """How far mu is from pi on counted tokens, the same for every objective (``r = pi/mu``).

    ``mismatch/kl_all``: mean k3 estimate of KL(mu || pi); ``mismatch/abs_log_ratio``: mean
    ``|log pi - log mu|``; ``mismatch/ratio_gt2_frac``, ``mismatch/ratio_gt10_frac``: fraction of
    tokens with ``r > 2``, ``r > 10``; ``mismatch/tv_gate_frac``: fraction DPPO's default binary-TV
    gate (``delta = 0.2``) masks, or would mask under another objective, split by advantage sign
    into ``mismatch/tv_gate_pos_frac`` (``A > 0``, ``pi - mu > 0.2``) and
    ``mismatch/tv_gate_neg_frac`` (``A < 0``, ``pi - mu < -0.2``). Fractions are over counted
    tokens; empty sets give 0. Log-ratios are clamped to +-20.
    """
    if isinstance(p, ObjectiveInputs):
        p = prepare(p)
    c, lr = p.counted, p.log_ratio
    dt = lr.dtype
    diff = p.lp.detach().exp() - p.blp.exp()
    pos = c & (p.adv > 0) & (diff > TV_GATE_DELTA)
    neg = c & (p.adv < 0) & (diff < -TV_GATE_DELTA)
    return {
        "mismatch/kl_all": masked_mean(k3(lr), c),
        "mismatch/abs_log_ratio": masked_mean(lr.abs(), c),
        "mismatch/ratio_gt2_frac": masked_mean((lr > math.log(2.0)).to(dt), c),
        "mismatch/ratio_gt10_frac": masked_mean((lr > math.log(10.0)).to(dt), c),
        "mismatch/tv_gate_frac": masked_mean((pos | neg).to(dt), c),
        "mismatch/tv_gate_pos_frac": masked_mean(pos.to(dt), c),
        "mismatch/tv_gate_neg_frac": masked_mean(neg.to(dt), c),
    }


def gate_metrics(p: Prepared, high: torch.Tensor, low: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a token gate did, for objectives that mask tokens (DPPO, IcePop): ``gate/masked_frac``,
    ``gate/masked_high_frac``, ``gate/masked_low_frac`` (over counted tokens) and the k3 mismatch
    ``mismatch/kl_kept`` / ``mismatch/kl_masked`` on the tokens kept and masked. ``high`` and
    ``low`` are the bool masks of counted tokens the gate dropped on each side."""
    gated = high | low
    dt, kl = p.log_ratio.dtype, k3(p.log_ratio)
    return {
        "gate/masked_frac": masked_mean(gated.to(dt), p.counted),
        "gate/masked_high_frac": masked_mean(high.to(dt), p.counted),
        "gate/masked_low_frac": masked_mean(low.to(dt), p.counted),
        "mismatch/kl_kept": masked_mean(kl, p.counted & ~gated),
        "mismatch/kl_masked": masked_mean(kl, gated),
    }


def common_metrics(p: Prepared) -> dict[str, torch.Tensor]:
    """Metrics every objective reports: token count, mismatch (:func:`mismatch_metrics`), ratio
    range, entropy proxy."""
    c = p.counted
    ratio = p.log_ratio.exp()
    big = torch.finfo(ratio.dtype).max
    any_c = c.any()
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    return {
        "loss/tokens": c.sum().to(ratio.dtype),
        "loss/sequences": c.any(dim=-1).sum().to(ratio.dtype),
        **mismatch_metrics(p),
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
