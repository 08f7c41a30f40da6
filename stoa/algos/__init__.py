"""Advantages and policy-gradient objectives: small pure functions on torch tensors.

Every objective is a module with a frozen ``Config`` and
``loss(inputs: ObjectiveInputs, config) -> (loss, metrics)``; see :mod:`stoa.algos.base` for
the contract and the loss aggregations, and ``docs/algorithms.md`` for the formulas::

    from stoa.algos import ObjectiveInputs, dppo
    loss, metrics = dppo.loss(ObjectiveInputs(logprobs, behavior_logprobs, advantages, mask),
                              dppo.Config())
    loss.backward()

A run config names its objective by a key of :data:`OBJECTIVES` or as ``"module:function"``
for custom code (the module must also define ``Config``); :func:`make_objective` builds it from
a TOML table. Objective names execute imports: take them only from the operator's own config,
never from the object store.

This package imports torch but never mlx or megatron; ``import stoa`` does not import it.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

from stoa.algos import advantages, dppo, icepop, ppo, reinforce, tis
from stoa.algos.advantages import group_advantages
from stoa.algos.base import (
    AGGREGATIONS,
    Aggregation,
    ObjectiveInputs,
    aggregate,
    batch_normalizer,
)

LossFn = Callable[[ObjectiveInputs, Any], tuple[Any, dict[str, float]]]

OBJECTIVES: dict[str, str] = {
    "dppo": "stoa.algos.dppo:loss",
    "ppo": "stoa.algos.ppo:loss",
    "tis": "stoa.algos.tis:loss",
    "icepop": "stoa.algos.icepop:loss",
    "reinforce": "stoa.algos.reinforce:loss",
}
"""Built-in objectives by name; the first, ``"dppo"``, is the default."""

DEFAULT_OBJECTIVE = "dppo"


def get_objective(name: str) -> tuple[type, LossFn]:
    """Resolve a built-in name or ``"module:function"`` to ``(ConfigClass, loss_fn)``.

    ``ConfigClass`` is the ``Config`` dataclass of the loss function's module.

    Raises:
        ValueError: the name is neither a built-in nor ``"module:function"``, or the module
            lacks a dataclass ``Config`` or a callable ``function``.
        ImportError: the module cannot be imported.
    """
    if not isinstance(name, str):
        raise ValueError(f"objective name must be a string, got {type(name).__name__}")
    target = OBJECTIVES.get(name, name)
    module_name, sep, fn_name = target.partition(":")
    if not sep or not module_name or not fn_name:
        raise ValueError(f"unknown objective {name!r}: expected one of {sorted(OBJECTIVES)} or 'module:function'")
    module = importlib.import_module(module_name)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"objective {name!r}: {module_name} has no callable {fn_name!r}")
    config_cls = getattr(module, "Config", None)
    if not (isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls)):
        raise ValueError(f"objective {name!r}: module {module_name} must define a dataclass 'Config'")
    return config_cls, fn


def make_objective(name: str = DEFAULT_OBJECTIVE, **overrides: Any) -> tuple[Any, LossFn]:
    """Build ``(config, loss_fn)`` from a name and config fields (e.g. a TOML table).

    Raises:
        ValueError: an override names no field of the objective's ``Config`` (the message
            lists the valid ones), or a value is out of bounds.
    """
    config_cls, fn = get_objective(name)
    fields = {f.name for f in dataclasses.fields(config_cls) if f.init}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"objective {name!r} has no option(s) {unknown}; valid options: {sorted(fields)}")
    return config_cls(**overrides), fn


__all__ = [
    "AGGREGATIONS",
    "Aggregation",
    "DEFAULT_OBJECTIVE",
    "LossFn",
    "OBJECTIVES",
    "ObjectiveInputs",
    "aggregate",
    "advantages",
    "batch_normalizer",
    "dppo",
    "get_objective",
    "group_advantages",
    "icepop",
    "make_objective",
    "ppo",
    "reinforce",
    "tis",
]
