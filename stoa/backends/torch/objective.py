"""The objective plumbing both learners share (torch and numpy only; no transformers, no megatron).

Each learner scores its micro-batches its own way (transformers hidden states, Megatron logits
under tensor/pipeline parallelism); everything between those log-probs and the
:class:`stoa.algos.Objective` lives here: the checks of ``train_step``'s arguments, the padded
``[episodes, longest]`` masks, behaviour log-probs and per-token advantages (built once on the
host), the full-batch normalizer every micro-batch loss uses, and the full-batch loss and
metrics once the micro-batches have run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from stoa.algos import DEFAULT_OBJECTIVE, Objective, resolve_objective
from stoa.algos.base import GroupContext, ObjectiveInputs, batch_normalizer
from stoa.backends.learner import LearnerError

if TYPE_CHECKING:
    from stoa.types import Episode


def checked_objective(objective: Any) -> Objective:
    """``objective`` itself, or DPPO with its defaults for None; anything else is a LearnerError."""
    if objective is None:
        return resolve_objective(DEFAULT_OBJECTIVE)
    if isinstance(objective, Objective):
        return objective
    if isinstance(objective, str):
        hint = f"the bare name {objective!r}; resolve it first: stoa.algos.resolve_objective({objective!r}, options)"
    elif dataclasses.is_dataclass(objective) and not isinstance(objective, type):
        cls = type(objective)
        hint = (f"a bare {cls.__module__}.{cls.__qualname__}; pair it with its objective's name: "
                f"stoa.algos.Objective(name, config)")
    else:
        hint = f"{type(objective).__name__} {objective!r}"
    raise LearnerError(f"objective must be a stoa.algos.Objective, got {hint}")


class ObjectiveBatch:
    """One ``train_step``'s objective over its micro-batches.

    Build it with the step's arguments; call :meth:`loss` once per micro-batch and backpropagate
    what it returns (each is that micro-batch's exact share of the full-batch loss); then
    :meth:`metrics` gives the full-batch loss and the objective's metrics.

    Attributes:
        objective: the resolved objective.
        masks: each episode's ``loss_mask()`` (bool ``[len(episode)]``).
        mask, behavior, advantages: float32 ``[episodes, longest]`` CPU tensors aligned with
            ``episode.tokens()``: the loss mask, the behaviour log-probs, and the episode's
            advantage broadcast over its counted tokens (0 elsewhere).
        normalizer: the whole batch's denominator (:func:`stoa.algos.batch_normalizer`).
        group_index: int64 ``[episodes]``, ``Episode.group_id`` numbered in order of appearance;
            with ``group_context`` (the whole batch's behaviour side) every micro-batch's
            objective sees whole-group statistics (:class:`stoa.algos.base.GroupContext`).

    Raises:
        LearnerError: advantages not ``len(episodes)`` finite numbers; ``objective`` not an
            :class:`~stoa.algos.Objective` (or None).
    """

    def __init__(self, episodes: Sequence[Episode], advantages: np.ndarray, objective: Objective | None) -> None:
        self.objective = checked_objective(objective)
        n = len(episodes)
        adv = np.asarray(advantages)
        if adv.shape != (n,) or adv.dtype.kind not in "iuf" or not np.isfinite(adv).all():
            raise LearnerError(f"advantages must be {n} finite numbers, got shape {adv.shape} dtype {adv.dtype}")
        self.masks = [ep.loss_mask() for ep in episodes]
        mask = np.zeros((n, max(len(m) for m in self.masks)), np.float32)
        behavior = np.zeros_like(mask)
        for i, ep in enumerate(episodes):
            mask[i, : len(self.masks[i])] = self.masks[i]
            behavior[i, : len(self.masks[i])] = ep.behavior_logprobs()
        self.mask = torch.from_numpy(mask)
        self.behavior = torch.from_numpy(behavior)
        self.advantages = torch.from_numpy(adv.astype(np.float32)[:, None] * mask)
        self.normalizer = batch_normalizer(self.mask, getattr(self.objective.config, "aggregation", "token_mean"))
        numbers: dict[str, int] = {}
        self.group_index = torch.tensor([numbers.setdefault(ep.group_id, len(numbers)) for ep in episodes],
                                        dtype=torch.int64)
        self.group_context = GroupContext(self.behavior, self.mask, self.group_index)
        self._scored: list[tuple[torch.Tensor, torch.Tensor]] = []

    def loss(self, ids: Sequence[int], flat: torch.Tensor, index: np.ndarray) -> torch.Tensor:
        """One micro-batch's share of the full-batch loss, to backpropagate as is.

        Args:
            ids: the episodes (batch indices) of the micro-batch; the objective sees one row
                each, so per-sequence aggregations see episodes, not packed rows.
            flat: the micro-batch's log-probs ``[P]``, with grad, in the learner's own layout.
            index: int64 ``[len(ids), w]``: ``flat[index[j, t]]`` is the log-prob of token
                ``t`` of episode ``ids[j]``; ``P`` where there is none (it reads as 0, and only
                counted tokens matter).
        """
        dev = flat.device
        rows = torch.cat([flat, flat.new_zeros(1)])[torch.from_numpy(index).to(dev)]
        sel, w = torch.as_tensor(ids), index.shape[1]
        self._scored.append((sel, rows.detach()))
        inputs = ObjectiveInputs(rows, self.behavior[sel, :w].to(dev), self.advantages[sel, :w].to(dev),
                                 self.mask[sel, :w].to(dev), normalizer=self.normalizer,
                                 group_index=self.group_index[sel].to(dev), group_context=self.group_context)
        return self.objective.loss(inputs)[0]

    def metrics(self, logprobs: Sequence[np.ndarray] | None = None) -> dict[str, float]:
        """``loss`` and the objective's metrics, computed once over the whole batch.

        From the log-probs the micro-batches gave :meth:`loss`, or from ``logprobs`` (one
        ``[len(episode)]`` array per episode, aligned with its tokens) when other ranks ran some
        of the micro-batches.
        """
        lp = torch.zeros_like(self.mask)
        if logprobs is None:
            for sel, rows in self._scored:
                lp[sel, : rows.shape[1]] = rows.float().cpu()
        else:
            for i, row in enumerate(logprobs):
                lp[i, : len(row)] = torch.from_numpy(np.asarray(row, np.float32))
        with torch.no_grad():
            loss, metrics = self.objective.loss(ObjectiveInputs(lp, self.behavior, self.advantages, self.mask,
                                                                group_index=self.group_index))
        return {"loss": float(loss), **metrics}
