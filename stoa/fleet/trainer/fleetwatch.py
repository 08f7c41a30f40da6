"""What the trainer sees of its fleet between steps: workers alive, silent or in trouble, store retries.

:class:`FleetWatch` reads the workers' heartbeats (``stoa.fleet.run.Heartbeat``) once per step and
answers with the step's ``fleet/*`` metrics and the events of what changed since the last look: a
worker whose heartbeat went silent (stopped or asleep: no word for ``silent_s``, by default
:data:`SILENT_S`; the trainer's ``trainer.silent_after_s``), one heard
again, one that reports trouble (its store or its own cache disk failing and retried) and one whose
trouble cleared. A heartbeat older than :data:`FORGET_S` is forgotten (:meth:`FleetWatch.forget`):
the trainer deletes it from the store, so a fleet that churns through identities leaves neither
heartbeats nor state here behind it. It keeps only its own state and does no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["FORGET_S", "SILENT_S", "FleetWatch", "store_metrics"]

SILENT_S = 30.0
"""A worker not heard from for this long is silent (not alive)."""
FORGET_S = 600.0
"""A heartbeat this old is deleted: its worker left (or slept that long; its next heartbeat makes it
a worker seen anew, without a ``worker_back`` event)."""


class FleetWatch:
    """Per worker: whether it was silent, and its trouble, at the last look."""

    def __init__(self, silent_s: float = SILENT_S) -> None:
        self.silent_s = silent_s
        self._silent: dict[str, float] = {}  # worker -> time of its last heartbeat when it fell silent
        self._trouble: dict[str, str] = {}

    def see(self, beats: Iterable[Any], now: float) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """The ``fleet/*`` metrics for this step and the events (dicts with ``event`` and ``worker``)."""
        events: list[dict[str, Any]] = []
        alive = silent = trouble = retries = 0
        for b in beats:
            retries += max(0, min(b.store_retries, 10**9))  # a stranger's count: bounded, shown only
            if b.status == "stopped":
                self._silent.pop(b.worker_id, None)
                continue
            quiet = now - b.time >= self.silent_s
            if quiet:
                silent += 1
                if b.worker_id not in self._silent:
                    self._silent[b.worker_id] = b.time
                    events.append({"event": "worker_silent", "worker": b.worker_id, "last_heard_s": round(now - b.time, 1),
                                   "worker_version": b.version})
            else:
                alive += 1
                if b.worker_id in self._silent:
                    events.append({"event": "worker_back", "worker": b.worker_id,
                                   "silent_s": round(b.time - self._silent.pop(b.worker_id), 1), "worker_version": b.version})
            was = self._trouble.get(b.worker_id, "")
            if b.trouble and not quiet:
                trouble += 1
                if b.trouble != was:
                    events.append({"event": "worker_trouble", "worker": b.worker_id, "trouble": b.trouble[:200]})
                self._trouble[b.worker_id] = b.trouble
            elif was and not b.trouble:
                events.append({"event": "worker_recovered", "worker": b.worker_id, "was": was[:200]})
                del self._trouble[b.worker_id]
        return {"fleet/workers_alive": alive, "fleet/workers_silent": silent, "fleet/workers_in_trouble": trouble,
                "fleet/store_retries": retries}, events

    def forget(self, beats: Iterable[Any], now: float) -> list[str]:
        """The worker ids whose heartbeat is :data:`FORGET_S` old or older (for the caller to
        delete); their state here is dropped."""
        gone = sorted({b.worker_id for b in beats if now - b.time >= FORGET_S})
        for wid in gone:
            self._silent.pop(wid, None)
            self._trouble.pop(wid, None)
        return gone


def store_metrics(store: Any) -> dict[str, int]:
    """The trainer's own store client's counters as ``store/*`` metrics (none for a local store)."""
    stats = getattr(store, "stats", None)
    return {f"store/{k}": int(v) for k, v in stats.items()} if isinstance(stats, dict) else {}
