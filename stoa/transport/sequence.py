"""A worker's rollout sequence numbers, kept where the store cannot take them back.

The store is not trusted: after one DELETE of a worker's newest batch, a writer that numbered from
the store alone would start again below numbers the trainer has already settled, and the reader
skips a settled number, so that work would be lost without a word. Two records prevent it:

* :class:`SequenceFile`: the worker keeps its next number in its cache folder, and its
  :class:`RememberingWriter` never starts below it;
* the trainer's signed ``<run>/sequence.json`` (:func:`write_floors`): per worker, the number
  above every one it has settled. A worker whose next number is below its floor (its cache was
  lost too) is told, says so, and continues at the floor (:func:`catch_up`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stoa.transport import layout
from stoa.transport.exchange import Progress, RolloutWriter
from stoa.transport.signing import SignatureError, read_signed, sign_document

if TYPE_CHECKING:
    from stoa.transport.store import ObjectStore

__all__ = ["RememberingWriter", "SequenceFile", "catch_up", "read_floor", "write_floors"]

log = logging.getLogger(__name__)

_KIND = "sequence-floors"
_FORMAT = "stoa.sequence_floors/1"
_MAX_WORKERS = 4096
_MAX_BYTES = 1 << 20


class SequenceFile:
    """``path`` holds a worker's next sequence number in one run, how many numbers below it the
    worker left without uploading, and its own uploads not yet seen settled (``{"run", "next",
    "left", "pending"}``), replaced atomically."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def read(self, run: str) -> int:
        """The remembered next number in ``run`` (0 when there is none, or it is another run's; a
        damaged file is reported and read as 0)."""
        try:
            body = json.loads(self.path.read_text())
            n = body.get("next") if body.get("run") == run else 0
        except FileNotFoundError:
            return 0
        except (OSError, ValueError, AttributeError) as e:
            log.warning("ignoring %s (%s); numbering from the store", self.path, e)
            return 0
        return n if layout.is_next_seq(n) else 0

    def left(self, run: str) -> int:
        """How many numbers below the remembered next one were left without an upload (0 when
        none are recorded, or the file is another run's, damaged, or out of range)."""
        try:
            body = json.loads(self.path.read_text())
            n = body.get("left", 0) if body.get("run") == run else 0
        except (OSError, ValueError, AttributeError):
            return 0
        return n if layout.is_next_seq(n) and n <= self.read(run) else 0

    def pending(self, run: str) -> list[int]:
        """The remembered numbers of the worker's own uploads not yet seen settled (empty when none
        are recorded, or the file is another run's or damaged; numbers out of range are dropped)."""
        try:
            body = json.loads(self.path.read_text())
            ns = body.get("pending", []) if body.get("run") == run else []
        except (OSError, ValueError, AttributeError):
            return []
        top = self.read(run)
        return [n for n in ns if layout.is_seq(n) and n < top][-64:] if isinstance(ns, list) else []

    def write(self, run: str, n: int, left: int = 0, pending: Iterable[int] = ()) -> None:
        """Replace the file (a failed write, e.g. a full disk, leaves the old one and no temp file)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(tmp, "w") as f:
                f.write(json.dumps({"run": run, "next": int(n), "left": int(left),
                                    "pending": [int(s) for s in pending]}) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise


class RememberingWriter(RolloutWriter):
    """A :class:`~stoa.transport.exchange.RolloutWriter` that keeps its next number in ``remember``
    (after every upload) and never numbers below it, whatever the store lost.

    It also keeps :attr:`left`: how many of its numbers it gave up without uploading (their
    binding expired while the worker was away, :meth:`skip_to` with ``left=True``). The trainer
    never settles such a number, so a worker that throttles on "numbers used minus numbers the
    trainer took" must not count them, or a few gaps would hold it back forever."""

    def __init__(self, store: ObjectStore, run: str, worker_id: str, private_key: Any, remember: SequenceFile):
        super().__init__(store, run, worker_id, private_key)
        self.remember = remember
        self.next_seq = max(self.next_seq, remember.read(self.run))
        self.left = remember.left(self.run)
        self.pending = remember.pending(self.run)
        self.trouble = ""
        """Why the cache file could not be written (e.g. the disk is full), or empty."""

    def upload(self, *args: Any, **kwargs: Any) -> str:
        key = super().upload(*args, **kwargs)
        self._remember()
        return key

    def settle(self, progress: Progress) -> int:
        n = len(self.pending)
        left = super().settle(progress)
        if left != n:
            self._remember()
        return left

    def skip_to(self, seq: int, *, left: bool = False) -> None:
        """Continue at ``seq`` or above (remembered at once); ``left``: the numbers skipped were
        given up by this worker, never uploaded (counted in :attr:`left`)."""
        if left:
            self.left += max(0, seq - self.next_seq)
        self.next_seq = max(self.next_seq, seq)
        self._remember()

    def count_unsettled_as_left(self, taken: int) -> None:
        """After a jump to the trainer's floor (:func:`catch_up`): of the numbers below the next
        one, those the trainer has not settled (all but ``taken``) are ones this worker has no
        record of, so none is waiting on it: count them as left."""
        self.left = max(self.left, self.next_seq - max(0, taken))
        self._remember()

    def _remember(self) -> None:
        # The batch is in the store by now: a cache that cannot be written must not make the
        # upload look failed (its retry would find the number taken and drop the batch's record).
        # Until the file can be written, numbering rests on the store and the trainer's floor.
        try:
            self.remember.write(self.run, self.next_seq, self.left, self.pending)
        except OSError as e:
            if not self.trouble:
                log.error("cannot record the next sequence number in %s (%s); uploads go on, numbered from the "
                          "store and the trainer's floor until the file can be written", self.remember.path, e)
            self.trouble = f"cache: {type(e).__name__}: {e}"
            return
        if self.trouble:
            log.info("the next sequence number is recorded in %s again", self.remember.path)
        self.trouble = ""


def write_floors(store: ObjectStore, run: str, floors: dict[str, int], private_key: Any) -> None:
    """Sign, per worker, the number above every one the trainer settled (``RolloutReader.next_numbers``);
    at most 4096 workers, those with the highest floors."""
    top = dict(sorted(sorted(floors.items(), key=lambda kv: (-kv[1], kv[0]))[:_MAX_WORKERS]))
    store.put(f"{run}/sequence.json", sign_document(_KIND, {"format": _FORMAT, "run": run, "next": top,
                                                           "time": time.time()}, private_key))


def read_floor(store: ObjectStore, run: str, public_key: Any, worker_id: str) -> int:
    """``worker_id``'s floor in the verified ``<run>/sequence.json`` (0 when absent).

    Raises:
        SignatureError: the document does not verify or is malformed.
        stoa.transport.store.StoreError: the store failed.
    """
    key = f"{run}/sequence.json"
    body = read_signed(store, key, _KIND, public_key, expect={"run": run}, max_bytes=_MAX_BYTES)
    if body is None:
        return 0
    floors, t = body.get("next"), body.get("time")
    if body.get("format") != _FORMAT or not isinstance(floors, dict) or len(floors) > _MAX_WORKERS \
            or isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise SignatureError(f"{key}: not a {_FORMAT} document")
    n = floors.get(worker_id, 0)
    if not layout.is_next_seq(n):  # a bad entry costs its own worker, never the others' floors
        raise SignatureError(f"{key}: bad entry for {worker_id[:64]!r}")
    return n


def catch_up(writer: RememberingWriter, store: ObjectStore, run: str, public_key: Any) -> str | None:
    """Move ``writer`` up to the trainer's floor for its worker; returns what happened when it moved
    (some of its numbers were already settled: batches uploaded under them were skipped), else None."""
    try:
        floor = read_floor(store, run, public_key, writer.worker_id)
    except SignatureError as e:  # a planted document must not stall the worker: its own numbers stand
        log.warning("ignoring %s/sequence.json: %s", run, e)
        return None
    if floor <= writer.next_seq:
        return None
    was = writer.next_seq
    writer.skip_to(floor)
    return (f"the trainer has settled this worker's sequence numbers below {floor}, but it was to upload as "
            f"{was} (its cache or its newest batch in the store was lost): batches under numbers {was}..{floor - 1} "
            f"are skipped by the trainer; continuing at {floor}")
