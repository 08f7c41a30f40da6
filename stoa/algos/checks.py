"""Bounds checks and the aggregation choice shared by every objective ``Config`` (no torch).

Kept apart from :mod:`stoa.algos.base` so an objective's ``Config`` can be built, and a run
config resolved, without importing torch.
"""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)


def check_number(
    name: str, value: Any, *, lo: float | None = None, hi: float | None = None,
    lo_open: bool = False, hi_open: bool = False, allow_inf: bool = False,
) -> None:
    """Raise ValueError unless ``value`` is a real number (not bool) within the bounds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and (value > hi or (hi_open and value == hi)):
        raise ValueError(f"{name} must be {'<' if hi_open else '<='} {hi}, got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise ValueError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_aggregation(aggregation: Any, max_tokens_norm: Any) -> None:
    """The two aggregation fields every objective Config carries."""
    check_choice("aggregation", aggregation, AGGREGATIONS)
    check_number("max_tokens_norm", max_tokens_norm, lo=0, lo_open=True)
