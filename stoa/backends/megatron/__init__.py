"""The Megatron-core learner backend (``make_learner("megatron", ...)``).

:mod:`.convert` (HF <-> Megatron weights) needs only torch; the learner and the model builder
import megatron-core, loaded on first use of the names below.
"""

from typing import Any

__all__ = ["MegatronLearner", "MegatronOptions", "make"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from stoa.backends.megatron import learner

        return getattr(learner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
