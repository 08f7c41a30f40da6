"""Every key of a run in the store, named in one place.

::

    <run>/config.json                                   signed run config (stoa.fleet.run)
    <run>/model/<file>                                  the model folder's files it lists
    <run>/current.json                                  signed pointer to the newest weights (stoa.transport.manifest)
    <run>/weights/<version:012d>/...                    manifest, anchor, delta of one version
    <run>/workers.json                                  signed roster (stoa.transport.identity)
    <run>/bans/<key_id>.json                            signed: one banned worker key (stoa.transport.identity)
    <run>/salts/<key_id>.json                           signed: one key's assignment salt (stoa.transport.identity)
    <run>/tickets/<key_id>/<seq:012d>.json              signed by the worker's key: it asks for number seq (trust.binding)
    <run>/bindings.json                                 signed: the version and beacon bound to each ticketed number
    <run>/workers/<worker_id>.json                      heartbeats (stoa.fleet.run)
    <run>/rollouts/<worker_id>/s<seq>-v<version>.episodes   rollout batches (stoa.transport.exchange)
    <run>/quarantine/<worker_id>/<name>[.reason.json]   refused batches, and why
    <run>/quarantine/_misnamed/<sha256 of the key, 32 hex>[.reason.json]
    <run>/quarantine/_tickets/<sha256 of the key, 32 hex>[.reason.json]   refused tickets, and why
    <run>/progress.json                                 signed: batches taken per worker
    <run>/finished.json                                 signed: the run is over
    <run>/trust.json                                    signed: the trainer's per-key report (stoa.fleet.trust.records)
    <run>/eval/v<version:012d>.json                     signed: one version's evaluation
    <run>/stages/<pipeline>/<i>.json                    a pipeline stage's address (stoa.fleet.stages.discovery)

Functions take the run's prefix (a valid key prefix) and return keys or listing prefixes; they
check nothing about the other parts, which their callers validate. A worker id, the one part a
stranger chooses, has one rule, :data:`WORKER_ID`, which every writer and reader of these keys
(and the invite, the roster, the ban documents) checks.
"""

from __future__ import annotations

import re

__all__ = [
    "HEX32", "HEX64", "KEY_ID", "MAX_SEQ", "WORKER_ID", "is_next_seq", "is_seq", "ban", "bans", "config", "eval_prefix", "evaluation", "finished", "heartbeat", "heartbeats", "misnamed", "model_file",
    "pointer", "progress", "quarantine", "quarantined", "roster", "rollouts", "salt", "stage", "stages", "ticket", "tickets", "bindings", "quarantined_ticket", "trust_report",
    "weights",
]


WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""A worker id: 1-64 characters of ``[A-Za-z0-9._-]``, not starting with ``.``, ``_`` or ``-``
(never a path, never a hidden name); use ``WORKER_ID.fullmatch``."""

KEY_ID = re.compile(r"[0-9a-f]{16}")
"""A key id (:func:`stoa.transport.signing.key_id`): 16 lowercase hex digits, as in ``bans/<key_id>.json``."""
HEX32 = re.compile(r"[0-9a-f]{32}")
"""32 lowercase hex digits: a salt, a beacon, a batch's content hash (16 bytes)."""
HEX64 = re.compile(r"[0-9a-f]{64}")
"""64 lowercase hex digits: a sha256, or an ed25519 key's raw 32 bytes."""


MAX_SEQ = 10**12 - 1
"""The largest sequence number a batch key names (twelve decimal digits). One bound, here, for every
writer, the trainer and every reader of the numbers: a batch is numbered in ``[0, MAX_SEQ]``, and a
"next number" (a floor, a count of batches taken) lies in ``[0, MAX_SEQ + 1]``."""


def is_seq(n: object) -> bool:
    """Whether ``n`` is a sequence number a batch key may name."""
    return isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_SEQ


def is_next_seq(n: object) -> bool:
    """Whether ``n`` is a next number (one above a sequence number, or 0): a floor or a count."""
    return isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_SEQ + 1


def config(run: str) -> str:
    return f"{run}/config.json"


def model_file(run: str, name: str) -> str:
    return f"{run}/model/{name}"


def pointer(run: str) -> str:
    return f"{run}/current.json"


def weights(run: str) -> str:
    """The prefix of every version's manifest and payloads."""
    return f"{run}/weights/"


def roster(run: str) -> str:
    return f"{run}/workers.json"


def bans(run: str) -> str:
    """The prefix of the ban documents."""
    return f"{run}/bans/"


def ban(run: str, key_id: str) -> str:
    return f"{run}/bans/{key_id}.json"


def salt(run: str, key_id: str) -> str:
    return f"{run}/salts/{key_id}.json"


def tickets(run: str) -> str:
    """The prefix of the workers' tickets."""
    return f"{run}/tickets/"


def ticket(run: str, key_id: str, seq: int) -> str:
    return f"{run}/tickets/{key_id}/{seq:012d}.json"


def bindings(run: str) -> str:
    return f"{run}/bindings.json"


def quarantined_ticket(run: str, digest: str) -> str:
    """Where a refused ticket is kept, by the sha256 of its key (its reason: + ``.reason.json``)."""
    return f"{run}/quarantine/_tickets/{digest}"


def heartbeats(run: str) -> str:
    """The prefix of the workers' heartbeats."""
    return f"{run}/workers/"


def heartbeat(run: str, worker_id: str) -> str:
    return f"{run}/workers/{worker_id}.json"


def rollouts(run: str, worker_id: str = "") -> str:
    """The prefix of the rollout batches (of one worker, when given)."""
    return f"{run}/rollouts/{worker_id}/" if worker_id else f"{run}/rollouts/"


def quarantine(run: str, worker_id: str = "") -> str:
    """The prefix of the quarantine (of one worker, when given)."""
    return f"{run}/quarantine/{worker_id}/" if worker_id else f"{run}/quarantine/"


def quarantined(run: str, worker_id: str, name: str) -> str:
    """Where a worker's refused batch ``name`` is kept (its reason: this key + ``.reason.json``)."""
    return f"{run}/quarantine/{worker_id}/{name}"


def misnamed(run: str, digest: str) -> str:
    """Where an object whose name is not a batch's is kept, by the sha256 of its key."""
    return f"{run}/quarantine/_misnamed/{digest}"


def progress(run: str) -> str:
    return f"{run}/progress.json"


def finished(run: str) -> str:
    return f"{run}/finished.json"


def trust_report(run: str) -> str:
    return f"{run}/trust.json"


def eval_prefix(run: str) -> str:
    """The prefix of the evaluations."""
    return f"{run}/eval/"


def evaluation(run: str, version: int) -> str:
    return f"{run}/eval/v{version:012d}.json"


def stages(run: str, pipeline: str) -> str:
    """The prefix of one pipeline's stage announcements (``pipeline``: a :data:`WORKER_ID`-shaped name)."""
    return f"{run}/stages/{pipeline}/"


def stage(run: str, pipeline: str, index: int) -> str:
    return f"{run}/stages/{pipeline}/{index}.json"
