"""The trainer process: validated episodes in, optimizer steps, PULSE versions out.

Its room, one module per thing:

* :mod:`~stoa.fleet.trainer.section`: its config sections (``[model]``, ``[trainer]``, ``[eval]``,
  ``[warmstart]``, ``[pulse]``), leaves that import nothing that runs;
* :mod:`~stoa.fleet.trainer.trainer`: the :class:`Trainer` and its loop (``stoa trainer``);
* :mod:`~stoa.fleet.trainer.warmstart`: supervised steps on scripted demonstrations before RL;
* :mod:`~stoa.fleet.trainer.publishing`: what the trainer has published, and the one way it publishes;
* :mod:`~stoa.fleet.trainer.policies` and :mod:`~stoa.fleet.trainer.heldstates`: the int8 policies
  of the versions workers may still claim, held for the checks;
* :mod:`~stoa.fleet.trainer.mismatch`: the behaviour/trainer gap split into its int8 and staleness parts;
* :mod:`~stoa.fleet.trainer.distributed`: the learner's calls mirrored to the other ranks under torchrun.

What a batch meets before it is trained on is the intake's (:mod:`stoa.fleet.intake`). This
package's face names the sections at once and the process on first use, so reading a run config
(:mod:`stoa.fleet.config`) loads none of the trainer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stoa.fleet.trainer.section import EvalConfig, ModelConfig, PulseConfig, TrainerConfig, WarmstartConfig

if TYPE_CHECKING:
    from stoa.fleet.trainer.trainer import StartRefused, Trainer, eval_metrics, prepare_model, successes

__all__ = ["EvalConfig", "ModelConfig", "PulseConfig", "StartRefused", "Trainer", "TrainerConfig", "WarmstartConfig",
           "eval_metrics", "prepare_model", "successes"]

_PROCESS = {"StartRefused", "Trainer", "eval_metrics", "prepare_model", "successes"}


def __getattr__(name: str) -> Any:
    if name in _PROCESS:
        return getattr(importlib.import_module("stoa.fleet.trainer.trainer"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
