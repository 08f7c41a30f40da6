"""The Megatron-core learner backend (``make_learner("megatron", ...)``).

:mod:`.options` (the learner's options) imports nothing heavy; :mod:`.convert` (HF <-> Megatron
weights) needs only torch; the learner and the model builder import megatron-core, loaded on
first use of the names below.
"""

from typing import Any

from stoa.backends.megatron.options import MegatronOptions

__all__ = ["MegatronLearner", "MegatronOptions", "make"]


def __getattr__(name: str) -> Any:
    if name in ("MegatronLearner", "make"):
        from stoa.backends.megatron import learner

        return getattr(learner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
