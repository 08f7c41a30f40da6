"""Sequence numbers planted in a worker's namespace are not that worker's gaps.

Anyone who can write under ``rollouts/<worker id>/`` can put an object at that worker's next
numbers; its writer then skips them (``SequenceTaken``), and without this the trainer's
withholding count (``WorkerRecord.withheld``) would hold every such number against the worker. A
quarantined object under a worker id that the id's key did not seal is counted as
``taken_by_others`` for that key instead: reported, never a gap, and no proof of anything either
way (the worker itself could have planted it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from stoa.transport.exchange import Rejection

__all__ = ["count_planted", "planted_before"]

_MAX_IDS = 4096


class WorkerRecord(Protocol):
    """What counting needs of a key's record (:class:`stoa.fleet.trust.records.WorkerRecord`)."""

    worker_id: str
    taken_by_others: int


def count_planted(records: Mapping[str, WorkerRecord], rejected: Sequence[Rejection],
                  seen: dict[str, dict[str, int]] | None = None) -> None:
    """Add each quarantined object of ``rejected`` (a poll's ``PollReport.rejected``) to the
    ``taken_by_others`` of every key whose record carries its worker id, but did not seal it; and,
    into ``seen`` (worker id -> sealing key id, ``""`` when none -> count), for the keys whose record
    is made later (:func:`planted_before`), so the order in which the store lists objects never
    matters. ``seen`` remembers at most 4096 worker ids."""
    by_id: dict[str, list[tuple[str, WorkerRecord]]] = {}
    for kid, rec in records.items():
        by_id.setdefault(rec.worker_id, []).append((kid, rec))
    for r in rejected:
        if not r.worker_id:
            continue
        for kid, rec in by_id.get(r.worker_id, []):
            if kid != r.key_id:
                rec.taken_by_others += 1
        if seen is not None and (r.worker_id in seen or len(seen) < _MAX_IDS):
            per = seen.setdefault(r.worker_id, {})
            per[r.key_id or ""] = per.get(r.key_id or "", 0) + 1


def planted_before(seen: Mapping[str, Mapping[str, int]], kid: str, worker_id: str) -> int:
    """Objects under ``worker_id`` that ``kid`` did not seal, quarantined before its record was made."""
    return sum(n for sealer, n in seen.get(worker_id, {}).items() if sealer != kid)
