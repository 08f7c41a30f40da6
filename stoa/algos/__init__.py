"""Advantages and policy-gradient objectives: small pure functions.

Every objective is a module with a frozen ``Config`` and
``loss(inputs: ObjectiveInputs, config) -> (loss, metrics)`` on torch tensors; see
:mod:`stoa.algos.base` for the contract and the loss aggregations, and ``docs/algorithms.md``
for the formulas::

    from stoa.algos import ObjectiveInputs, dppo
    loss, metrics = dppo.loss(ObjectiveInputs(logprobs, behavior_logprobs, advantages, mask),
                              dppo.Config())
    loss.backward()

A run names its objective by a key of :data:`OBJECTIVES` or as ``"module:function"``;
:func:`resolve_objective` turns the name and the ``[objective]`` options into one
:class:`Objective` (config + loss function), the value the learners take
(:mod:`stoa.algos.registry`). Advantages (:mod:`stoa.algos.advantages`) are numpy.

Importing this package, building a ``Config`` and resolving a built-in objective import no
torch; torch loads with the first loss (or with :mod:`stoa.algos.base`'s names below).
Never mlx or megatron; ``import stoa`` does not import this package.
"""

from __future__ import annotations

from typing import Any

from stoa.algos import advantages, dppo, gepo, icepop, ppo, reinforce, tis
from stoa.algos.advantages import group_advantages
from stoa.algos.checks import AGGREGATIONS, Aggregation
from stoa.algos.registry import DEFAULT_OBJECTIVE, OBJECTIVES, LossFn, Objective, resolve_objective

_TORCH_NAMES = ("ObjectiveInputs", "aggregate", "batch_normalizer")


def __getattr__(name: str) -> Any:
    # The torch-side contract names load torch on first use, not on `import stoa.algos`.
    if name in _TORCH_NAMES:
        from stoa.algos import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AGGREGATIONS",
    "Aggregation",
    "DEFAULT_OBJECTIVE",
    "LossFn",
    "OBJECTIVES",
    "Objective",
    "ObjectiveInputs",
    "aggregate",
    "advantages",
    "batch_normalizer",
    "dppo",
    "gepo",
    "group_advantages",
    "icepop",
    "ppo",
    "reinforce",
    "resolve_objective",
    "tis",
]
