"""The memory cap of a stage or a driver, held while the process runs.

``--max-memory-mb`` counts what the model costs a stage: its int8 share, the float weights it
computes with and a full KV cache (:meth:`stoa.backends.torch.pipeline.StageMemory.total`).
It is held in two places:

* **at start**: a stage (or a driver's stage 0) whose need is over the cap refuses to start;
* **while running**, by :class:`RunningCap`: every KV cache a driver asks a stage to grow to is
  counted before it is allocated (:meth:`RunningCap.kv_refusal`: share + weights + ``slots`` x
  the rounded capacity, over the cap is refused as a bad frame), and the process's resident set
  is watched: once it is over :attr:`RunningCap.limit_mb` (its resident set when ready to serve,
  plus the KV room left under the cap, plus :data:`HEADROOM_MB` for activations in flight, frame
  buffers, torch's thread pools and allocator caches) the process refuses further work: a stage
  answers the frame in hand with an error and stops (its driver voids that one cohort), a driver
  stops between cohorts (nothing it made is lost: the batch in hand is uploaded first).

The watch reads ``/proc/self/statm`` (Linux; elsewhere the peak from ``getrusage``), once per
frame, which costs a few microseconds.
"""

from __future__ import annotations

import os

from stoa.fleet.metrics import peak_rss_mib

__all__ = ["HEADROOM_MB", "RunningCap", "rss_mib"]

HEADROOM_MB = 512.0
"""Resident memory the watch allows above the ready process and its KV room: activations of the
largest forward, frames in flight, torch's thread pools (the fleet's stage processes peaked
180-280 MiB above their ready size on models whose share is a few MiB)."""


def rss_mib() -> float:
    """This process's resident memory now, in MiB (its peak where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return peak_rss_mib()


class RunningCap:
    """``cap_mb`` (None: no cap) held while running, for a stage whose share and float weights
    take ``fixed_bytes`` and each cached position of each row ``kv_per_token`` bytes.

    Call :meth:`ready` once the process is built and about to serve."""

    def __init__(self, cap_mb: float | None, fixed_bytes: int, kv_per_token: int, headroom_mb: float = HEADROOM_MB
                 ) -> None:
        self.cap_mb, self.headroom_mb = cap_mb, headroom_mb
        self.fixed, self.kv_per_token = int(fixed_bytes), int(kv_per_token)
        self.limit_mb: float | None = None
        self.tripped = ""

    def ready(self, kv_bytes_now: int = 0) -> None:
        """Fix the resident-memory limit from the process as it is now (``kv_bytes_now``: KV
        already allocated, which the room left under the cap does not count twice)."""
        if self.cap_mb is None:
            return
        room = max(0.0, self.cap_mb - (self.fixed + kv_bytes_now) / 2**20)
        self.limit_mb = rss_mib() + room + self.headroom_mb

    def kv_refusal(self, slots: int, positions: int) -> str | None:
        """Why a KV cache of ``slots`` rows of ``positions`` (rounded up as allocated) is over the
        cap, or None."""
        if self.cap_mb is None:
            return None
        need = (self.fixed + self.kv_per_token * slots * positions) / 2**20
        if need <= self.cap_mb:
            return None
        return (f"a KV cache of {slots} rows x {positions} positions makes this stage {need:.1f} MiB, over its "
                f"memory cap ({self.cap_mb:.1f} MiB)")

    def over(self) -> str | None:
        """Why the process is over its running limit (then for good: it refuses further work), or None."""
        if self.tripped or self.limit_mb is None:
            return self.tripped or None
        now = rss_mib()
        if now > self.limit_mb:
            self.tripped = (f"resident memory {now:.1f} MiB is over the running limit {self.limit_mb:.1f} MiB "
                            f"(memory cap {self.cap_mb:.1f} MiB + {self.headroom_mb:.0f} MiB headroom over the ready "
                            "process): refusing further work (use more stages, or a larger --max-memory-mb)")
        return self.tripped or None
