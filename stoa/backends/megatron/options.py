"""The Megatron learner's options: parallel layout, attention kernel, collective timeout.

Kept apart from :mod:`.learner` so that a run config (``[learner.megatron]``, read by
:mod:`stoa.fleet.config` on machines without torch) can name and check them without importing
torch or megatron.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["Attention", "MegatronOptions"]

Attention = Literal["auto", "te", "sdpa", "local"]


@dataclass(frozen=True)
class MegatronOptions:
    """Parallel layout, kernels and collective timeout of the Megatron learner.

    ``make_learner("megatron", ..., **options)`` takes these fields as keyword arguments; a run
    config sets them in ``[learner.megatron]``. Data parallelism is what is left:
    ``world_size / (tensor_parallel * pipeline_parallel)`` ranks, each with a model replica.
    """

    tensor_parallel: int = 1
    """Tensor-parallel ranks (must divide heads, kv heads and the MLP width; keep it within one node)."""
    pipeline_parallel: int = 1
    """Pipeline stages (must divide the layer count); CUDA only when > 1."""
    attention: Attention = "auto"
    """Core attention: ``auto`` (Transformer Engine if installed on CUDA, else ``sdpa``), ``te``, ``sdpa``, ``local``."""
    timeout_s: float = 1800.0
    """Longest wait of one collective (process groups' timeout). Under ``stoa trainer`` with several
    ranks, the other ranks wait on rank 0 while it publishes and evaluates: this bounds that too."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.attention not in ("auto", "te", "sdpa", "local"):
            raise ValueError(f"attention={self.attention!r} must be auto, te, sdpa or local")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s >= 1):
            raise ValueError(f"timeout_s must be a finite number of seconds >= 1, got {self.timeout_s!r}")
