"""The worker's side of the rollout exchange: :class:`RolloutWriter` uploads its episode batches
as write-once objects under ``<run>/rollouts/<worker_id>/`` (names: :mod:`stoa.transport.rollout_keys`).

A writer numbers its uploads with a per-worker sequence number and creates each object with
``put_if_absent`` (never overwriting, so two processes sharing a worker id cannot clobber each
other). Objects appear whole or not at all (atomic rename in a LocalStore; S3 puts are atomic
per object). A writer given the worker's key *seals* each batch (:mod:`stoa.transport.identity`:
the worker's signature over the batch's sha256, its worker id, the run, the sequence number and
the version) and continues its numbering after its own newest sealed object, so objects planted
under its name (a huge sequence number) cannot stop it. What the trainer has settled of its
uploads it learns from the signed progress file (:class:`stoa.transport.control.Progress`).
"""

from __future__ import annotations

from typing import Any

from stoa.transport import layout
from stoa.transport.control import Progress
from stoa.transport.identity import SealError, open_sealed, seal_batch
from stoa.transport.rollout_keys import BATCH_NAME, check_run, check_worker, held_numbers, rollout_key
from stoa.transport.signing import key_id, load_private_key
from stoa.transport.store import KeyNotFound, ObjectStore, ObjectTooLarge, StoreError
from stoa.types import DEFAULT_LIMITS, Episode, encode_episodes

__all__ = ["RolloutWriter", "SequenceTaken"]

_MAX_PENDING = 64  # a writer's own uploads it remembers as not yet settled
_MAX_PROBES = 64  # own-newest search of a sealing writer: objects read at most
_MAX_UPLOAD_TRIES = 64  # each try lists past every number taken at that moment


class SequenceTaken(StoreError):
    """The sequence number a batch was made for is held by another object (see ``RolloutWriter.upload``)."""


class RolloutWriter:
    """Uploads a worker's episode batches as write-once objects.

    Args:
        store: the run's object store.
        run: the run's key prefix.
        worker_id: this worker's id (1-64 of ``[A-Za-z0-9._-]``).
        private_key: the worker's ed25519 key; given, every batch is sealed with it
            (:func:`stoa.transport.identity.seal_batch`).

    Numbering continues after the worker's newest object in ``rollouts/`` or ``quarantine/`` (a
    worker also keeps it in its cache: :class:`stoa.transport.sequence.RememberingWriter`), counting
    only objects sealed with its own key (among the 64 newest names) when it seals. Numbers others'
    objects hold are skipped, all at once (one listing), so planted objects cannot exhaust them.
    """

    def __init__(self, store: ObjectStore, run: str, worker_id: str, private_key: Any = None):
        self.store, self.run, self.worker_id = store, check_run(run), check_worker(worker_id)
        self._key = None if private_key is None else load_private_key(private_key)
        self.key_id = "" if self._key is None else key_id(self._key.public_key())
        self._prefix = layout.rollouts(self.run, self.worker_id)
        self._qprefix = layout.quarantine(self.run, self.worker_id)
        # A reason file counts too: an oversized batch is quarantined as its reason alone.
        found = sorted(((int(m.group(1)), k) for where in (self._prefix, self._qprefix) for k in store.list(where)
                        if (m := BATCH_NAME.fullmatch(k.rpartition("/")[2].removesuffix(".reason.json")))), reverse=True)
        self.next_seq = self._own_newest(found) + 1
        self.pending: list[int] = []
        """Numbers of its own uploads not yet seen settled by the trainer (:meth:`settle`), at most
        the 64 newest: what the worker throttles on, whatever others hold under its id."""

    def settle(self, progress: Progress) -> int:
        """Drop from :attr:`pending` what ``progress`` says the trainer settled; returns how many remain."""
        self.pending = progress.unsettled(self.worker_id, self.pending)
        return len(self.pending)

    def skip_taken(self) -> int:
        """Step :attr:`next_seq` past numbers objects hold now (call it before making a number's work)."""
        self.next_seq = self._next_free(self.next_seq - 1)
        return self.next_seq

    def _own_newest(self, found: list[tuple[int, str]]) -> int:
        """The newest sequence number of our own objects among ``found`` (newest first), or -1."""
        if self._key is None:
            return found[0][0] if found else -1
        for seq, key in found[:_MAX_PROBES]:
            if key.endswith(".reason.json"):
                continue  # an unread oversized object; we never upload one
            try:
                seal, _ = open_sealed(self.store.get(key, max_bytes=DEFAULT_LIMITS.max_bytes), key)
            except (SealError, StoreError):
                continue
            if seal.key_id == self.key_id and seal.worker_id == self.worker_id:
                return seq
        # None of ours among the newest names: start at the oldest of them (the upload steps past it).
        return found[min(len(found), _MAX_PROBES) - 1][0] - 1 if len(found) > _MAX_PROBES else -1

    def upload(self, episodes: list[Episode], policy_version: int, seq: int | None = None) -> str:
        """Encode and upload one batch; return its key.

        Every episode must carry ``policy_version`` and this writer's ``worker_id`` (raises
        ``ValueError`` otherwise). A number another object took is skipped; with ``seq`` (the work
        assigned to that number, ``stoa.fleet.trust.assign``) the batch goes under exactly that
        number or :class:`SequenceTaken` is raised (:attr:`next_seq` moves past the taken ones).
        After a store error, call ``upload`` again with the same batch: it finds its own object.
        """
        if not episodes:
            raise ValueError("refusing to upload an empty batch")
        for i, ep in enumerate(episodes):
            if ep.policy_version != policy_version:
                raise ValueError(f"episode {i} has policy_version {ep.policy_version}, batch is for {policy_version}")
            if ep.worker_id != self.worker_id:
                raise ValueError(f"episode {i} has worker_id {ep.worker_id!r}, this writer is {self.worker_id!r}")
        payload = encode_episodes(episodes)
        wanted = seq
        for _ in range(_MAX_UPLOAD_TRIES):
            if wanted is not None and self.next_seq != wanted:
                raise SequenceTaken(f"sequence number {wanted} of worker {self.worker_id!r} was taken by another object")
            seq = self.next_seq
            key = rollout_key(self.run, self.worker_id, seq, policy_version)
            blob = payload if self._key is None else seal_batch(
                payload, run=self.run, worker_id=self.worker_id, seq=seq, version=policy_version, private_key=self._key)
            # The name carries the version, so look for the sequence number under any version; a
            # number whose object was quarantined is settled in the reader, so it is taken too.
            taken = self.store.list(f"{self._prefix}s{seq:012d}-") or self.store.list(f"{self._qprefix}s{seq:012d}-")
            if not taken:
                if self.store.put_if_absent(key, blob):  # on an exception, next_seq stays for the retry
                    return self._uploaded(key, seq)
                taken = [key]
            if key in taken and self._is_ours(key, payload, len(blob)):
                return self._uploaded(key, seq)  # an earlier attempt of this upload landed
            self.next_seq = self._next_free(seq)
        raise StoreError(f"worker {self.worker_id!r}: sequence number {self.next_seq} was taken under it "
                         f"{_MAX_UPLOAD_TRIES} times in a row (another process with this worker id?)")

    def _uploaded(self, key: str, seq: int) -> str:
        self.next_seq = seq + 1
        self.pending = [n for n in self.pending if n != seq][-(_MAX_PENDING - 1):] + [seq]
        return key

    def _next_free(self, seq: int) -> int:
        """The smallest number above ``seq`` no object holds, from one listing of each prefix."""
        taken = held_numbers(self.store, self.run, self.worker_id, seq)
        nxt = seq + 1
        while nxt in taken:
            nxt += 1
        if nxt > layout.MAX_SEQ:
            raise StoreError(f"worker {self.worker_id!r}: no sequence number left below 10^12")
        return nxt

    def _is_ours(self, key: str, payload: bytes, size: int) -> bool:
        """Whether ``key`` holds this very batch (an earlier attempt of this upload)."""
        try:
            blob = self.store.get(key, max_bytes=size)
            if self._key is None:
                return blob == payload
            seal, got = open_sealed(blob, key)
        except (KeyNotFound, ObjectTooLarge, SealError):  # a bigger object is not ours; never download it
            return False
        return seal.key_id == self.key_id and got == payload
