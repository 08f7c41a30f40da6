"""A worker's side of assigned work: one object it asks what its next number owes.

The trust layer decides what a worker makes (:mod:`stoa.fleet.trust.assign`): items, group ids and
the sampling seed follow from the run's seed, the worker's key and the number, and once the run
has published the key's salt, from that salt and the beacon the trainer bound to the number, with
the weights brought to the bound version (:mod:`stoa.fleet.trust.binding`). A :class:`Duty` holds
everything of that on the worker's side (the key's tickets, its bindings as last read, its salt)
and answers one question, :meth:`Duty.next`, with an :class:`Order`: make this work at this
version, wait for the binding, or leave the numbers whose binding can only make a stale batch.

A key whose standing is lost (the trainer's signed bindings document says so: while fresh it left
a bound number undelivered) makes probation work again until the document no longer names it; a
fresh key's order may be *carried*: if another's object holds its number, the work goes under the
next free one (the trainer takes it as the bound number's).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stoa.fleet.trust.assign import Assignment, assignment
from stoa.fleet.trust.binding import Tickets
from stoa.transport.identity import read_salt
from stoa.transport.signing import SignatureError
from stoa.transport.store import StoreError

if TYPE_CHECKING:
    from stoa.transport.store import ObjectStore

__all__ = ["Duty", "Order"]

log = logging.getLogger("stoa.worker")

_SALT_EVERY_S = 2.0


@dataclass(frozen=True)
class Order:
    """What number :attr:`seq` calls for (:meth:`Duty.next`)."""

    seq: int
    work: Assignment | None = None
    """The work to make (None: nothing now: wait, or leave numbers)."""
    version: int | None = None
    """The weight version the work must be made with (bound work); None: any (probation work)."""
    skip_to: int | None = None
    """Leave numbers ``seq`` .. ``skip_to - 1`` (a gap: their binding expired or went stale)."""
    reason: str = ""
    """Why the numbers are left, in words."""
    carry: bool = False
    """A fresh key's bound work: if another's object holds :attr:`seq` when it is uploaded, upload it
    under the next free number instead (never for other work: that number's binding is another's)."""


class Duty:
    """A worker key's assigned work (see the module docstring).

    Args:
        store, run: the fleet's store and the run's name.
        private_key, public_key: the worker's key (its tickets) and the run's (its bindings and salt).
        run_seed, n_items, groups: the run's seed, its training items and ``rollout.groups_per_cohort``.
        max_lag: ``trainer.max_lag``: a number bound further behind the head can only make a stale batch.
    """

    def __init__(self, store: ObjectStore, run: str, private_key: Any, public_key: Any, *, run_seed: int,
                 n_items: int, groups: int, max_lag: int):
        self.store, self.run, self.public_key = store, run, public_key
        self.tickets = Tickets(store, run, private_key, public_key)
        self.key_id = self.tickets.kid
        self.run_seed, self.n_items, self.groups, self.max_lag = run_seed, n_items, groups, max_lag
        self._salt: str | None = None
        self._salt_read = 0.0
        self._lost: int | None = None  # the number whose loss of standing was last reported

    def salt(self) -> str | None:
        """This key's assignment salt once the run has published it (read at most every 2 s until
        then); None meanwhile: the work is probation work, checked and never trained on."""
        if self._salt is None and time.time() - self._salt_read > _SALT_EVERY_S:
            self._salt_read = time.time()
            try:
                self._salt = read_salt(self.store, self.run, self.key_id, self.public_key)
            except (SignatureError, StoreError) as e:
                log.warning("this key's assignment salt does not read (%s); making probation work", e)
        return self._salt

    def on_probation(self) -> bool:
        """Whether this key's work is probation work now (no salt yet, or its standing lost): made
        at whatever version the worker follows, never trained."""
        return self.salt() is None or self.tickets.lost is not None

    def next(self, seq: int, head: int | None) -> Order:
        """What number ``seq`` owes, with the newest published version ``head`` (None: unknown).
        Probation work needs no binding; salted work waits for its number's binding (tickets are
        written as needed) and is made at the bound version, unless that version is more than
        ``max_lag`` behind ``head`` or the binding expired while the worker was away: then the
        numbers are left. A key whose standing is lost makes probation work. Raises
        ``StoreError`` or ``SignatureError`` (the bindings document)."""
        salt = self.salt()
        bound = None if salt is None else self.tickets.bound(seq)
        if salt is None or self.tickets.lost is not None:
            if self.tickets.lost is not None and self.tickets.lost != self._lost:
                log.warning("the trainer says this key left its bound number %d undelivered while it was new to the "
                            "run, so it lost its standing: making probation work again (trust.probation_batches; no "
                            "strike)", self.tickets.lost)
            self._lost = self.tickets.lost
            return Order(seq, assignment(self.run_seed, self.key_id, seq, self.n_items, self.groups))
        if self._lost is not None:
            log.info("this key has its standing again: making bound work")
            self._lost = None
        if bound is None:
            later = self.tickets.passed_over(seq)
            if later is None:
                return Order(seq)  # not bound yet
            return Order(seq, skip_to=later, reason=f"number {seq}'s binding expired while this worker was away "
                                                    f"(its version fell behind the trainer's window): leaving "
                                                    f"numbers {seq}-{later - 1}")
        if head is not None and head - bound.version > self.max_lag:
            return Order(seq, skip_to=seq + 1, reason=f"number {seq} was bound to version {bound.version}, now more "
                                                      f"than {self.max_lag} behind the head ({head}): leaving it")
        work = assignment(self.run_seed, self.key_id, bound.work_seq, self.n_items, self.groups, salt, bound.beacon)
        return Order(seq, work, bound.version, carry=self.tickets.fresh)
