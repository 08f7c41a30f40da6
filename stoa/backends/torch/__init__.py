"""The torch backends: the learner (``make_learner("torch", ...)``: transformers models, packing, AdamW) and
the rollout engine (``make_engine(..., "torch")``, :mod:`.engine`: CPUs and CUDA GPUs).

:mod:`.objective` (the objective plumbing both learners share) needs only torch; the learner
imports transformers, loaded on first use of the names below.
"""

import os
from typing import Any

# Idle OpenMP threads sleep instead of spinning: on a machine whose cores other jobs share (a
# volunteer's, or this project's 2-core ones), a spinning thread pool waits a time slice at
# every barrier (measured: the torch engine at batch 16 fell from 87 to 7 tokens/s). Read when
# torch loads OpenMP, so only where nothing imported torch before.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__all__ = ["TorchLearner", "make"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from stoa.backends.torch import learner

        return getattr(learner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
