"""The two control files the trainer writes for workers, signed with the run's key and verified by
workers: ``<run>/progress.json`` (:class:`Progress`, what the trainer has settled of each worker's
uploads: workers throttle on it) and ``<run>/finished.json`` (the run is over).

What workers upload is validated, never trusted (:mod:`stoa.transport.rollout_reader`); what the
trainer tells them here is signed and verified: a file that does not verify is never obeyed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from stoa.transport import layout
from stoa.transport.rollout_keys import check_run, shown
from stoa.transport.signing import SignatureError, read_signed, sign_document
from stoa.transport.store import ObjectStore

__all__ = ["Progress", "is_finished", "mark_finished", "read_progress", "write_progress"]

log = logging.getLogger(__name__)

_PROGRESS_FORMAT = "stoa.progress/1"
_MAX_PROGRESS_WORKERS = 4096
MAX_SETTLED_LISTED = 4
"""Settled numbers above a worker's floor that ``progress.json`` lists (4096 workers fit in 1 MiB)."""
_MAX_CONTROL_BYTES = 1 << 20


@dataclass(frozen=True)
class Progress:
    """What the trainer has taken from each worker (``<run>/progress.json``, signed).

    Workers throttle on it: a worker with ``rollout.max_outstanding`` of its own uploads not yet
    settled waits instead of sampling more.
    """

    taken: dict[str, int]
    """Worker id -> how many of its batches the trainer has settled (trained on, pooled or
    quarantined). At most 4096 workers; :func:`write_progress` keeps those with the most."""
    time: float = 0.0
    """When the trainer made it (the trainer's clock)."""
    settled: dict[str, tuple[int, tuple[int, ...]]] | None = None
    """Worker id -> ``(floor, above)``: every number below ``floor`` is settled, and so are
    ``above``, the highest settled numbers at or above it (ascending, at most 4). Which numbers,
    not how many: a number held by an object someone else planted under the worker's id, which the
    trainer may never settle, then holds back nobody (:meth:`unsettled`). None in the document of
    a trainer that predates it (workers then throttle on ``taken``)."""

    def outstanding(self, worker_id: str, uploaded: int) -> int:
        """How many of a worker's ``uploaded`` batches (its writer's ``next_seq``) are not taken yet."""
        return max(0, uploaded - self.taken.get(worker_id, 0))

    def unsettled(self, worker_id: str, numbers: Iterable[int]) -> list[int]:
        """Those of ``numbers`` (a worker's own uploads) the trainer has not settled. A number
        below a full list of settled ones counts as settled: the trainer has read past it."""
        floor, above = (self.settled or {}).get(worker_id, (0, ()))
        full = len(above) >= MAX_SETTLED_LISTED
        return [n for n in numbers if not (n < floor or n in above or (full and n < above[0]))]

    @classmethod
    def parse(cls, body: Any, *, run: str, where: str) -> Progress:
        """Check a verified progress body for ``run``; raises :class:`SignatureError`."""
        if not isinstance(body, dict) or body.get("format") != _PROGRESS_FORMAT or body.get("run") != run:
            raise SignatureError(f"{where}: not a {_PROGRESS_FORMAT} document for run {run!r}")
        taken, t, settled = body.get("taken"), body.get("time"), body.get("settled")
        if not isinstance(taken, dict) or len(taken) > _MAX_PROGRESS_WORKERS:
            raise SignatureError(f"{where}: taken must map at most {_MAX_PROGRESS_WORKERS} workers to counts")
        for w, n in taken.items():
            if not layout.WORKER_ID.fullmatch(w) or not layout.is_next_seq(n):
                raise SignatureError(f"{where}: bad entry {shown(w)}: {str(n)[:20]}")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise SignatureError(f"{where}: time must be a finite number")
        if settled is None:
            return cls(dict(taken), float(t))
        if not isinstance(settled, dict) or len(settled) > _MAX_PROGRESS_WORKERS:
            raise SignatureError(f"{where}: settled must map at most {_MAX_PROGRESS_WORKERS} workers")
        out = {}
        for w, e in settled.items():
            ok = (layout.WORKER_ID.fullmatch(w) and isinstance(e, list) and len(e) == 2
                  and layout.is_next_seq(e[0]) and isinstance(e[1], list) and len(e[1]) <= MAX_SETTLED_LISTED
                  and all(layout.is_seq(n) and n >= e[0] for n in e[1]) and e[1] == sorted(set(e[1])))
            if not ok:
                raise SignatureError(f"{where}: bad settled entry {shown(w)}")
            out[w] = (e[0], tuple(e[1]))
        return cls(dict(taken), float(t), out)

    def to_body(self, run: str) -> dict[str, Any]:
        """The JSON body the trainer signs (the workers with the most batches, if over the cap)."""
        top = dict(sorted(sorted(self.taken.items(), key=lambda kv: (-kv[1], kv[0]))[:_MAX_PROGRESS_WORKERS]))
        body = {"format": _PROGRESS_FORMAT, "run": run, "taken": top, "time": self.time}
        if self.settled is not None:
            body["settled"] = {w: [f, sorted(a)[-MAX_SETTLED_LISTED:]] for w, (f, a) in sorted(self.settled.items())
                               if w in top}
        return body


def write_progress(store: ObjectStore, run: str, progress: Progress, private_key: Any) -> None:
    """Sign ``progress`` with the run's key and put it at ``<run>/progress.json``."""
    run = check_run(run)
    store.put(layout.progress(run), sign_document("progress", progress.to_body(run), private_key))


def read_progress(store: ObjectStore, run: str, public_key: Any) -> Progress | None:
    """The verified ``<run>/progress.json``, or None if the trainer has not written one yet.

    Raises:
        SignatureError: the object does not verify (then do not throttle on it).
        stoa.transport.store.StoreError: the store failed.
    """
    run = check_run(run)
    key = layout.progress(run)
    body = read_signed(store, key, "progress", public_key, expect={"run": run}, max_bytes=_MAX_CONTROL_BYTES)
    return None if body is None else Progress.parse(body, run=run, where=key)


def mark_finished(store: ObjectStore, run: str, private_key: Any, version: int) -> None:
    """Put the signed "run finished" marker ``<run>/finished.json`` (after the final version)."""
    run = check_run(run)
    store.put(layout.finished(run), sign_document(
        "run-finished", {"run": run, "version": int(version), "time": time.time()}, private_key))


def is_finished(store: ObjectStore, run: str, public_key: Any) -> bool:
    """Whether ``<run>/finished.json`` exists and verifies (signed by the run's key, for this run).

    A marker that does not verify counts as absent and is logged: a planted file must not stop
    the fleet. Raises only :class:`stoa.transport.store.StoreError` (the store failed).
    """
    run = check_run(run)
    try:
        return read_signed(store, layout.finished(run), "run-finished", public_key, expect={"run": run},
                           max_bytes=_MAX_CONTROL_BYTES) is not None
    except SignatureError as e:
        log.warning("ignoring the finished marker: %s", e)
        return False
