"""Int8 scorers, chosen by name: what re-scores episodes under an int8 weight state on the trainer.

The trainer re-scores sampled episodes under the exact int8 weights that produced them (the
checks of :mod:`stoa.fleet.trust.review`, the mismatch split). The rollout engine can do it
(``trainer.int8_scorer = "engine"``); a scorer of this registry does it on the learner's own
device instead (``"torch"``: the state dequantized into a torch model). Like engines
(:data:`stoa.backends.engine.BACKENDS`) and learners (:data:`stoa.backends.learner.BACKENDS`),
a scorer is named here and built with :func:`make_scorer`; the fleet imports no scorer module.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from stoa.backends.sampling import Draws
    from stoa.types import Episode

__all__ = ["SCORERS", "Int8StateScorer", "make_scorer", "scorer_device"]

SCORERS: dict[str, str] = {"torch": "stoa.backends.torch.int8"}
"""Scorer name -> module. The module exports ``make_scorer(hf_dir, device, dtype) -> Int8StateScorer``
(``device``: a learner's ``device`` setting) and ``resolve_device(setting) -> str`` (the device
that setting names)."""


class Int8StateScorer(Protocol):
    """Scores episodes under the one int8 state it holds (``stoa.transport.quant`` layout);
    its scores, margins and draws are the rollout engine's, to the engines' float arithmetic."""

    version: int
    """The version of the state last loaded (-1 before any)."""
    device: Any
    """Where it scores."""

    def load_state(self, version: int, state: Mapping[str, np.ndarray]) -> None:
        """Hold ``state`` as ``version`` (read tensor by tensor; a memory-mapped state is fine)."""
        ...

    def score(self, episodes: Sequence[Episode]) -> list[np.ndarray]:
        """``RolloutEngine.score``: prefill log-probs aligned with ``Episode.tokens()``."""
        ...

    def sampling_margins(self, episodes: Sequence[Episode], seeds: Sequence[int], *,
                         drift: float = 0.0) -> list[np.ndarray]:
        """``RolloutEngine.sampling_margins``."""
        ...

    def check_draws(self, episodes: Sequence[Episode], seeds: Sequence[int], *,
                    drift: float = 0.0) -> list[Draws]:
        """``RolloutEngine.check_draws``."""
        ...


def _module(kind: str) -> Any:
    if kind not in SCORERS:
        raise ValueError(f"unknown int8 scorer {kind!r}; known: {sorted(SCORERS)}")
    return importlib.import_module(SCORERS[kind])


def make_scorer(kind: str, hf_dir: str | Path, device: str = "auto", dtype: str = "float32") -> Int8StateScorer:
    """The scorer ``kind`` (a key of :data:`SCORERS`) for the model folder ``hf_dir``, on the
    device a learner's ``device`` setting names, computing in ``dtype``."""
    return _module(kind).make_scorer(hf_dir, device, dtype)


def scorer_device(kind: str, setting: str) -> str:
    """The device a learner's ``device`` setting names for the scorer ``kind`` (``"auto"``
    resolved; refused when that device is not there)."""
    return _module(kind).resolve_device(setting)
