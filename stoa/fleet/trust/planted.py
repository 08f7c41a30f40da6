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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stoa.fleet.trust.records import WorkerRecord
    from stoa.transport.exchange import Rejection

__all__ = ["count_planted"]


def count_planted(records: Mapping[str, WorkerRecord], rejected: Sequence[Rejection]) -> None:
    """Add each quarantined object of ``rejected`` (a poll's ``PollReport.rejected``) to the
    ``taken_by_others`` of every key whose record carries its worker id, but did not seal it."""
    by_id: dict[str, list[tuple[str, WorkerRecord]]] = {}
    for kid, rec in records.items():
        by_id.setdefault(rec.worker_id, []).append((kid, rec))
    for r in rejected:
        for kid, rec in by_id.get(r.worker_id, []) if r.worker_id else []:
            if kid != r.key_id:
                rec.taken_by_others += 1
