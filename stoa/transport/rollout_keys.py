"""The names of rollout batches: one worker's ``seq``-th batch sampled with weights ``version`` is
``<run>/rollouts/<worker_id>/s<seq:012d>-v<version:012d>.episodes`` (:mod:`stoa.transport.layout`
names every key of a run), and a quarantined one keeps that name under ``quarantine/<worker_id>/``.

What both sides of the rollout exchange need to agree on (:mod:`stoa.transport.rollout_writer`,
:mod:`stoa.transport.rollout_reader`, :mod:`stoa.transport.control`): making and parsing a batch
key, the numbers a worker's folders hold, and the checks of a run and worker id.
"""

from __future__ import annotations

import re

from stoa.transport import layout
from stoa.transport.manifest import MAX_VERSION
from stoa.transport.store import ObjectStore, validate_key

__all__ = ["held_numbers", "parse_rollout_key", "rollout_key"]

BATCH_NAME = re.compile(r"s(\d{12})-v(\d{12})\.episodes")
"""A batch object's name in its worker's folder: ``s<seq>-v<version>.episodes``, 12 digits each."""


def check_worker(worker_id: str) -> str:
    """``worker_id`` if it is a valid worker id (see :data:`stoa.transport.layout.WORKER_ID`), else ValueError."""
    if not isinstance(worker_id, str) or not layout.WORKER_ID.fullmatch(worker_id):
        raise ValueError(f"worker id {worker_id!r} must be 1-64 characters of [A-Za-z0-9._-], not starting with . _ or -")
    return worker_id


def check_run(run: str) -> str:
    """The run's key prefix without surrounding slashes, if it is a valid store key (else ValueError)."""
    return validate_key(run.strip("/"))


def shown(key: str) -> str:
    """An untrusted key, bounded and escaped for a report."""
    return repr(key[:120]) + ("..." if len(key) > 120 else "")


def rollout_key(run: str, worker_id: str, seq: int, version: int) -> str:
    """The object key of a worker's ``seq``-th batch, sampled with weights ``version``."""
    if not (layout.is_seq(seq) and 0 <= version <= MAX_VERSION):
        raise ValueError(f"seq {seq} and version {version} must lie in [0, 10^12)")
    return f"{layout.rollouts(check_run(run), check_worker(worker_id))}s{seq:012d}-v{version:012d}.episodes"


def parse_rollout_key(run: str, key: str) -> tuple[str, int, int] | None:
    """``(worker, seq, version)`` of a well-named batch key of ``run`` (see :func:`rollout_key`), else None."""
    worker, _, name = key.removeprefix(layout.rollouts(run)).partition("/")
    m = BATCH_NAME.fullmatch(name) if key.startswith(layout.rollouts(run)) else None
    return (worker, int(m.group(1)), int(m.group(2))) if m and layout.WORKER_ID.fullmatch(worker) else None


def held_numbers(store: ObjectStore, run: str, worker_id: str, after: int, below: int | None = None) -> set[int]:
    """The sequence numbers above ``after`` (and below ``below``) that objects in the worker's
    ``rollouts/`` or ``quarantine/`` folder hold now, whoever wrote them (one listing of each; a
    reason file counts: an oversized batch is quarantined as its reason alone). The writer skips
    these numbers; the trainer's binder does not count them against a key's lookahead."""
    out = set()
    for where in (layout.rollouts(check_run(run), check_worker(worker_id)), layout.quarantine(run, worker_id)):
        for k in store.list(where, start_after=f"{where}s{max(after, 0):012d}"):
            m = BATCH_NAME.fullmatch(k.rpartition("/")[2].removesuffix(".reason.json"))
            if m and int(m.group(1)) > after and (below is None or int(m.group(1)) < below):
                out.add(int(m.group(1)))
    return out
