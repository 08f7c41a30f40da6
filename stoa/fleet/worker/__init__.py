"""The worker process: int8 rollouts from the newest weights, uploaded as write-once batches.

Its room, one module per thing:

* :mod:`~stoa.fleet.worker.section`: its config section (``[rollout]``), a leaf that imports
  nothing that runs (the trainer's evaluation and intake read it too);
* :mod:`~stoa.fleet.worker.worker`: the :class:`Worker` and its loop (``stoa worker``);
* :mod:`~stoa.fleet.worker.follower`: the weight chain followed into the engine
  (:class:`~stoa.fleet.worker.follower.LiveWeights`), and ``stoa worker --follow-only``;
* :mod:`~stoa.fleet.worker.invite`: the invite file a volunteer joins with, and the worker's defaults.

This package's face names the section at once and the process on first use, so reading a run
config (:mod:`stoa.fleet.config`) loads none of the worker.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stoa.fleet.worker.section import RolloutConfig

if TYPE_CHECKING:
    from stoa.fleet.worker.worker import (
        EXIT_BANNED,
        EXIT_CONFIG,
        EXIT_NO_RUN,
        EXIT_OK,
        EXIT_UNREACHABLE,
        CohortPlan,
        Worker,
        WorkerExit,
        find_runs,
    )

__all__ = ["EXIT_BANNED", "EXIT_CONFIG", "EXIT_NO_RUN", "EXIT_OK", "EXIT_UNREACHABLE", "CohortPlan",
           "RolloutConfig", "Worker", "WorkerExit", "find_runs"]

_PROCESS = set(__all__) - {"RolloutConfig"}


def __getattr__(name: str) -> Any:
    if name in _PROCESS:
        return getattr(importlib.import_module("stoa.fleet.worker.worker"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
