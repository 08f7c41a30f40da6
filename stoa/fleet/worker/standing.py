"""What the run says of a worker: its exit statuses, the roster's word on its key, the trainer's view.

A worker reads these from the store; each is a signed document of the run's key, and one that does
not verify is ignored (logged), never trusted:

* :func:`roster_word`: why the run's roster stops this worker (its key banned: exit ``3``; its
  key bound to another worker id, or its id to another key: exit ``2``), or None;
* :func:`trainer_view`: the trainer's signed trust report's counts for this key, for the
  worker's progress line;
* :func:`find_runs`: the runs a store holds, for the message of a worker pointed at no run;
* :func:`import_task`: the code that registers the run's task, or exit ``2``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stoa.transport.identity import read_ban, read_roster
from stoa.transport.signing import SignatureError
from stoa.transport.store import ObjectStore, StoreError

if TYPE_CHECKING:
    from stoa.fleet.config import RunConfig

__all__ = ["EXIT_BANNED", "EXIT_CONFIG", "EXIT_NO_RUN", "EXIT_OK", "EXIT_UNREACHABLE", "WorkerExit", "find_runs",
           "import_task", "roster_word", "trainer_view"]

log = logging.getLogger("stoa.worker")

EXIT_OK, EXIT_CONFIG, EXIT_BANNED, EXIT_NO_RUN, EXIT_UNREACHABLE = 0, 2, 3, 4, 5
_MAX_TRUST_REPORT = 4 << 20
_MAX_RUNS_LISTED = 20


class WorkerExit(Exception):
    """Ends :meth:`stoa.fleet.worker.worker.Worker.run` with ``code`` and a one-line ``message`` for the user."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def find_runs(store: ObjectStore, limit: int = _MAX_RUNS_LISTED) -> list[str]:
    """Names of the runs a store holds (prefixes with a ``config.json`` beside ``current.json``
    or ``model/``), at most ``limit``. Lists the whole store: for error messages only."""
    keys = store.list("")
    runs = {k[: -len("/config.json")] for k in keys if k.endswith("/config.json") and "/model/" not in k}
    return sorted(r for r in runs if r)[:limit]


def roster_word(store: ObjectStore, run: str, public_key: Any, key_id: str, worker_id: str) -> WorkerExit | None:
    """Why the run's signed roster stops the worker ``worker_id`` of key ``key_id``, or None: its
    key is banned, its key is bound to another worker id (a restart under a new ``--id``), or its
    id belongs to another key. A roster or ban document that does not verify is ignored."""
    try:
        roster = read_roster(store, run, public_key)
    except SignatureError as e:
        log.warning("workers.json does not verify (%s); ignoring it", e)
        return None
    try:  # bans are one document per key (stoa.transport.identity), not roster entries
        ban = read_ban(store, run, key_id, public_key)
    except SignatureError as e:
        log.warning("this key's ban document does not verify (%s); ignoring it", e)
        ban = None
    if ban is not None:
        log.error("this worker's key %s is banned from run %s: %s", key_id, run, ban.reason)
        return WorkerExit(EXIT_BANNED, f"this worker's key {key_id} is banned from run {run!r}; stopping")
    entry = roster.enrolled.get(key_id)
    if entry is not None and entry.worker_id != worker_id:
        return WorkerExit(EXIT_CONFIG, f"this worker's key {key_id} is bound to worker id {entry.worker_id!r} in run "
                                       f"{run!r}, so batches sent as {worker_id!r} are refused: start it with --id "
                                       f"{entry.worker_id} (or without --id)")
    owner = roster.key_for(worker_id)
    if owner is not None and owner != key_id:
        return WorkerExit(EXIT_CONFIG, f"worker id {worker_id!r} belongs to another key ({owner}) in run {run!r}: "
                                       "start this worker with another --id (or without --id)")
    return None


def trainer_view(store: ObjectStore, run: str, public_key: Any, key_id: str) -> str:
    """Accepted / rejected counts for key ``key_id`` from the trainer's signed trust report."""
    from stoa.fleet.trust.records import read_trust_report

    try:
        report = read_trust_report(store, run, public_key, max_bytes=_MAX_TRUST_REPORT)
    except (SignatureError, StoreError) as e:
        return f"trainer report unreadable ({type(e).__name__})"
    rec = report.workers.get(key_id) if report is not None else None
    if rec is None:
        return "trainer: none of ours judged yet"
    text = f"trainer: {rec.accepted_batches} accepted, {rec.rejected_batches} rejected"
    return text + (f" (last: {rec.last_reason[:120]})" if rec.rejected_batches and rec.last_reason else "")


def import_task(run: str, cfg: RunConfig, model_dir: Path) -> None:
    """Import what registers the run's task (``env.module``, the package it names); exit ``2``
    when it cannot be imported here."""
    from stoa.fleet.task import import_env_module

    log.info("run %s: env %s%s, kwargs %s; model files verified in %s", run, cfg.env.id,
             f" (imports module {cfg.env.module!r})" if cfg.env.module else "",
             json.dumps(cfg.env.kwargs, sort_keys=True)[:500], model_dir)
    try:
        import_env_module(cfg.env)
    except Exception as e:
        raise WorkerExit(EXIT_CONFIG, f"the run's environment module cannot be imported here: "
                                      f"{type(e).__name__}: {e}") from None
