"""GEPO: Group Expectation Policy Optimization, a group-level importance weight for long delays.

Paper: Zhang, Zheng, Yi, et al., "GEPO: Group Expectation Policy Optimization for Stable
Heterogeneous Reinforcement Learning", arXiv:2508.17850 (2025); reference code in
HanlardResearch/HeteroRL_GEPO (``learner_script_checkpoint.py``, ``loss_type == "gepo"``).

With long, uneven delays between the sampler and the learner, per-token (GRPO) and per-sequence
(GSPO) ratios ``p/q`` have a variance that grows with KL(q || p). GEPO divides the learner's
sequence probability not by the sample's own behaviour probability but by the *group
expectation* of the behaviour probability, estimated from the G samples of the prompt::

    s_i   = mean over the counted tokens of row i of log mu       (length-normalised log q_i)
    q_i   = exp(s_i),   p_i = exp(mean over the counted tokens of row i of log pi)   (with grad)
    E_g   = sum_{j in g} q_j^2 / sum_{j in g} q_j                   (E_{y~q}[q(y)] by self-normalised IS)
    w_i   = p_i / E_g                                                (differentiated through p_i)
    l_i   = -min(w_i A_i, clip(w_i, 1 - clip_low, 1 + clip_high) A_i)

and every counted token of row ``i`` carries ``l_i``, reduced by ``config.aggregation``. The
gradient of ``l_i`` where no clip is active is ``-A_i w_i * mean_t grad log pi_t``; where a
clip is active (``A > 0, w > 1 + clip_high`` or ``A < 0, w < 1 - clip_low``) it is 0. ``A_i``
is the mean of the row's per-token advantages (the learners broadcast one per episode).

Groups come from :attr:`ObjectiveInputs.group_index` (the episode's ``group_id``); statistics are
taken over :attr:`ObjectiveInputs.group_context` when a learner passes the whole batch's
behaviour side (so a group split across micro-batches keeps its whole-group ``E_g``), else over
the rows given. Rows without counted tokens take no part.

Deviations from the paper and its reference code, all deliberate:

* Without ``group_index`` every row is its own group: ``E_g = q_i`` and ``w_i = p_i / q_i``,
  GSPO's length-normalised sequence ratio (the reference code pools the whole per-device batch,
  which its recipe sizes to one group).
* The default aggregation is Stoa's ``"token_mean"`` (every token of a row carries ``l_i``), the
  same as the other built-ins so a study compares objectives, not reductions; the reference code
  averages ``l_i`` over sequences: ``aggregation = "seq_mean_token_mean"`` gives exactly that.
* The anchor is the behaviour policy mu the (int8, possibly stale) worker recorded, as everywhere
  in Stoa, and the group statistic is computed in log space (``logsumexp``) instead of from raw
  probabilities; ``log w`` is clamped to +-20 before ``exp`` (a row that far off gets no gradient).
* No CPPO-style KL regulariser (the reference recipe adds ``cppo_beta = 0.005``) and no reference
  model KL.

Metrics: the common ones (:func:`stoa.algos.base.common_metrics`: token ratios, mismatch, entropy
proxy), ``gepo/weight_mean``, ``gepo/weight_min``, ``gepo/weight_max`` (``w_i`` over rows with
counted tokens), ``gepo/seq_ratio_mean`` (the per-row ``p_i / q_i`` GSPO would use, for
comparison), and ``clip/frac``, ``clip/high_frac``, ``clip/low_frac`` (fractions of counted tokens
whose row is clipped).
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
    """Hyper-parameters of GEPO."""

    clip_low: float = 0.2
    """The group weight is clipped below at ``1 - clip_low`` (in [0, 1])."""
    clip_high: float = 0.2
    """The group weight is clipped above at ``1 + clip_high`` (>= 0; inf = no upper clip)."""
    aggregation: Aggregation = "token_mean"
    """How per-token losses become one scalar (see :mod:`stoa.algos.base`); the paper's is
    ``"seq_mean_token_mean"``."""
    max_tokens_norm: float = 1024.0
    """Constant per-sequence token budget for ``"seq_mean_token_sum_norm"`` (> 0)."""

    def __post_init__(self) -> None:
        check_number("clip_low", self.clip_low, lo=0, hi=1)
        check_number("clip_high", self.clip_high, lo=0, allow_inf=True)
        check_aggregation(self.aggregation, self.max_tokens_norm)


def row_mean(x: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """``[batch]`` mean of ``x`` over each row's counted tokens (0 for a row with none)."""
    import torch

    n = counted.sum(dim=-1)
    return torch.where(counted, x, 0).sum(dim=-1) / n.clamp(min=1).to(x.dtype)


def group_log_expectation(blp: torch.Tensor, counted: torch.Tensor, group_index: torch.Tensor,
                          num_groups: int | None = None) -> torch.Tensor:
    """``[num_groups]`` ``log E_g = log sum q^2 - log sum q`` over each group's rows with counted
    tokens, ``q = exp(mean log mu)`` (``-inf`` for a group without any)."""
    import torch

    s = row_mean(blp.detach(), counted)
    has = counted.any(dim=-1)
    g = group_index.to(s.device).long()
    n = (int(g.max()) + 1 if g.numel() else 0) if num_groups is None else num_groups
    neg_inf = torch.full((n,), -torch.inf, dtype=s.dtype, device=s.device)

    def group_logsumexp(v: torch.Tensor) -> torch.Tensor:
        v = torch.where(has, v, -torch.inf)
        top = neg_inf.scatter_reduce(0, g, v, reduce="amax")
        safe = torch.where(torch.isfinite(top), top, 0)
        total = torch.zeros_like(top).index_add(0, g, torch.where(has, (v - safe[g]).exp(), 0))
        return safe + total.log()

    return group_logsumexp(2 * s) - group_logsumexp(s)


def loss(inputs: ObjectiveInputs, config: Config) -> tuple[torch.Tensor, dict[str, float]]:
    """GEPO loss and metrics (see the module docstring for the rule and metric names)."""
    import torch

    from stoa.algos.base import (
        LOG_RATIO_CLAMP,
        aggregate,
        common_metrics,
        masked_mean,
        prepare,
        to_floats,
    )

    p = prepare(inputs)
    has = p.counted.any(dim=-1)
    ctx, g = inputs.group_context, inputs.group_index
    if g is None:  # every row its own group: E_g = q_i
        log_e = row_mean(p.blp, p.counted)
    else:
        # From the whole batch's behaviour side when given, so a split group keeps its statistic.
        n_groups = int(g.max()) + 1 if g.numel() else 0
        if ctx is not None:
            n_groups = max(n_groups, int(ctx.group_index.max()) + 1 if ctx.group_index.numel() else 0)
            per_group = group_log_expectation(ctx.behavior_logprobs.to(p.blp.dtype), ctx.mask > 0,
                                              ctx.group_index, n_groups)
        else:
            per_group = group_log_expectation(p.blp, p.counted, g, n_groups)
        log_e = torch.where(has, per_group.to(p.lp.device)[g.long()], 0)
    seq_lp = row_mean(p.lp, p.counted)
    log_w = (seq_lp - log_e).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    w = log_w.exp()
    adv = row_mean(p.adv, p.counted)
    clipped = w.clamp(1 - config.clip_low, 1 + config.clip_high)
    per_row = -torch.minimum(w * adv, clipped * adv)
    per_token = torch.where(p.counted, per_row[:, None], 0)
    out = aggregate(per_token, p.counted, config.aggregation,
                    max_tokens_norm=config.max_tokens_norm, normalizer=inputs.normalizer)

    m = common_metrics(p)
    dt = p.log_ratio.dtype
    wd = w.detach()
    big = torch.finfo(dt).max
    zero = torch.zeros((), dtype=dt, device=wd.device)
    any_row = has.any()
    high = has & (adv > 0) & (wd > 1 + config.clip_high)
    low = has & (adv < 0) & (wd < 1 - config.clip_low)
    m["gepo/weight_mean"] = masked_mean(wd, has)
    m["gepo/weight_min"] = torch.where(any_row, torch.where(has, wd, big).min(), zero)
    m["gepo/weight_max"] = torch.where(any_row, torch.where(has, wd, -big).max(), zero)
    seq_ratio = (seq_lp.detach() - row_mean(p.blp, p.counted)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    m["gepo/seq_ratio_mean"] = masked_mean(seq_ratio, has)
    for name, rows in (("frac", high | low), ("high_frac", high), ("low_frac", low)):
        m[f"clip/{name}"] = masked_mean((p.counted & rows[:, None]).to(dt), p.counted)
    return out, to_floats(m)
