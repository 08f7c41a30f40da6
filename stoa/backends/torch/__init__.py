"""The torch learner backend (``make_learner("torch", ...)``): transformers models, packing, AdamW.

:mod:`.objective` (the objective plumbing both learners share) needs only torch; the learner
imports transformers, loaded on first use of the names below.
"""

from typing import Any

__all__ = ["TorchLearner", "make"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from stoa.backends.torch import learner

        return getattr(learner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
