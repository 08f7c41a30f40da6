"""The torch backends: the learner (``make_learner("torch", ...)``: transformers models, packing, AdamW) and
the rollout engine (``make_engine(..., "torch")``, :mod:`.engine`: CPUs and CUDA GPUs).

:mod:`.objective` (the objective plumbing both learners share) needs only torch; the learner
imports transformers, loaded on first use of the names below.
"""

from typing import Any

from stoa.backends import openmp

# Idle OpenMP threads spin briefly, then sleep (stoa.backends.openmp: read when torch loads OpenMP,
# so only where nothing imported torch before); a launcher whose processes share the machine's
# cores makes them sleep at once instead (openmp.shared_env).
openmp.dedicated()

__all__ = ["TorchLearner", "make"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from stoa.backends.torch import learner

        return getattr(learner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
