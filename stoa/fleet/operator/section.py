"""The operator's config section: ``[fleet]``, the local launcher (``stoa train``).

A leaf: a frozen dataclass that checks its own bounds and imports nothing that runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from stoa.fleet.sections import check

__all__ = ["FleetConfig"]


@dataclass(frozen=True)
class FleetConfig:
    """The local launcher (``[fleet]``)."""

    workers: int = 2
    """Worker processes started by ``stoa train``."""
    worker_threads: int = 1
    """CPU threads per worker (MLX/OpenBLAS)."""

    def __post_init__(self) -> None:
        check(self.workers >= 0 and self.worker_threads >= 1, "fleet.workers >= 0 and worker_threads >= 1")
