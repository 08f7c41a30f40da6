"""The trainer's side of the rollout exchange: :class:`RolloutReader` finds, validates and hands
out the workers' batches (:mod:`stoa.transport.rollout_writer` uploads them), each exactly once,
and quarantines the ones it refuses.

The reader lists new objects under ``<run>/rollouts/``, validates them with
:func:`stoa.types.decode_episodes` plus the naming checks (each episode's ``policy_version`` and
``worker_id`` must match the key: :mod:`stoa.transport.rollout_keys`) and returns them in order;
an invalid object is moved to ``quarantine/<worker_id>/`` (or ``quarantine/_misnamed/``) with a
``.reason.json`` saying why and counted, never raised. Keys it cannot even address (not a valid
store key: an empty segment, a control character, over 1024 bytes) are skipped and reported. A
sealed batch must verify and match its name; the caller's :class:`Admission` (the trainer's
roster as it stands, handed to each :meth:`RolloutReader.poll`) may refuse a seal before the
payload is decoded. The reader holds no trust policy: who may upload and what counts as a copy
is the caller's (:mod:`stoa.fleet.intake`). A reader built with ``hand_back=True`` quarantines
nothing by itself: it lists its refusals in ``last_report.rejected`` and the caller settles each
with :meth:`RolloutReader.quarantine`. One poll reads at most :class:`PollLimits` worth of
objects; the rest waits. Its bookkeeping (:meth:`RolloutReader.state`) is plain JSON: save it in
the trainer checkpoint together with the model, :meth:`RolloutReader.restore` it after a
restart, and every batch is delivered to the training step exactly once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import zstandard

from stoa.transport import layout
from stoa.transport.control import MAX_SETTLED_LISTED, Progress
from stoa.transport.identity import BatchSeal, SealError, is_sealed, open_sealed
from stoa.transport.rollout_keys import check_run, check_worker, parse_rollout_key, shown
from stoa.transport.store import KeyNotFound, ObjectStore, ObjectTooLarge, StoreError, validate_key
from stoa.transport.turns import in_turns
from stoa.types import DEFAULT_LIMITS, Episode, EpisodeError, Limits, Verdict, decode_episodes

__all__ = ["Admission", "Batch", "PollLimits", "PollReport", "Rejection", "RolloutReader"]

log = logging.getLogger(__name__)

_STATE_FORMAT = "stoa.rollout_reader.v1"
_MAX_EXAMPLES = 8


_DEFER = object()


def _declared_size(payload: bytes) -> int:
    """What an episode payload decodes to, as its zstd frame declares it (-1: not declared);
    the decoder then holds it to that. A payload that is not a batch is left to the decoder."""
    if len(payload) >= 6 and payload[:4] == b"STEP" and payload[5] == 1:
        try:
            return zstandard.frame_content_size(memoryview(payload)[6:])
        except zstandard.ZstdError:
            return 0
    return max(0, len(payload) - 6)


@dataclass(frozen=True)
class Batch:
    """One validated upload.

    Attributes:
        key: the object's key (unique; the id of the batch).
        worker_id: the worker that uploaded it.
        version: the policy version that sampled every episode in it.
        episodes: the decoded, validated episodes.
        seq: the worker's sequence number of this upload.
        key_id: the key id of the worker key that sealed it ("" for an unsealed batch).
        sha256: hex sha256 of the episode batch bytes (the payload).
        public_key: the sealing key, 64 hex characters ("" for an unsealed batch).
    """

    key: str
    worker_id: str
    version: int
    episodes: list[Episode] = field(repr=False)
    seq: int = 0
    key_id: str = ""
    sha256: str = ""
    public_key: str = ""


@dataclass(frozen=True)
class Rejection:
    """One object a poll refused (``PollReport.rejected``): quarantined already, or, by a reader
    built with ``hand_back=True``, waiting for the caller's :meth:`RolloutReader.quarantine`."""

    key: str
    worker_id: str | None
    """The worker id in the object's name (None for a misnamed object)."""
    key_id: str | None
    """The key that sealed it, when the seal verified (the sender is then known)."""
    category: str
    """``"signature"`` (the seal does not verify or match the name), ``"invalid"`` (the codec),
    ``"size"``, ``"misnamed"``, or the category of the admission's verdict (:data:`stoa.types.Category`)."""
    reason: str
    parsed: tuple[str, int, int] | None = field(default=None, repr=False, compare=False)
    """``(worker, seq, version)`` from the object's name (None for a misnamed object)."""
    stored: bytes | None = field(default=None, repr=False, compare=False)
    """The stored bytes, kept for the quarantine copy (None: not downloaded, over the size limit)."""


@dataclass(frozen=True)
class PollLimits:
    """What one :meth:`RolloutReader.poll` may take; whatever is left waits for the next poll."""

    max_batches: int = 64
    """Most batches returned per poll, and apart from them, most objects quarantined per poll."""
    max_bytes: int = 256 << 20
    """Most stored bytes read per poll. The first object of a poll may be larger (up to
    ``Limits.max_bytes``), so one big valid batch never blocks the queue."""
    max_decoded_bytes: int = 256 << 20
    """Most decoded (decompressed) payload bytes per poll, what the returned batches hold in
    memory: a small compressed object can decode to ``Limits.max_decompressed_bytes``. An object
    whose zstd frame declares more than what is left waits for the next poll (the first of a poll
    may use the whole budget); one that decodes to more than it declared is quarantined."""

    def __post_init__(self) -> None:
        for name in ("max_batches", "max_bytes", "max_decoded_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"PollLimits.{name} must be an int >= 1, got {v!r}")


@dataclass
class PollReport:
    """What the last :meth:`RolloutReader.poll` did (``reader.last_report``)."""

    returned: int = 0
    """Batches returned."""
    quarantined: int = 0
    """Objects moved to quarantine."""
    bytes_read: int = 0
    """Stored bytes read from the store."""
    decoded_bytes: int = 0
    """Decoded payload bytes of the objects decoded (bounded by ``PollLimits.max_decoded_bytes``)."""
    deferred: int = 0
    """New objects left for a later poll because a cap was reached."""
    skipped: int = 0
    """Listed keys that are not valid store keys (they cannot be read, moved or deleted)."""
    skipped_examples: list[str] = field(default_factory=list)
    """Up to 8 of those keys, escaped and cut to 120 characters."""
    problems: list[str] = field(default_factory=list)
    """One line per quarantined object or failed store operation."""
    rejected: list[Rejection] = field(default_factory=list)
    """The refused objects, with what is known of their sender."""
    listed: list[str] = field(default_factory=list, repr=False)
    """Every key of the poll's listing of the rollouts (new and settled alike)."""


class Admission(Protocol):
    """Who may upload, as the caller's roster stands when a poll starts (the trainer's is
    :class:`stoa.fleet.trust.roster.Admission`): a value :meth:`RolloutReader.poll` applies to
    each object's seal before it decodes the payload."""

    def screen(self, seal: BatchSeal | None) -> Verdict | None:
        """The refusal of an object sealed with ``seal`` (None: not sealed), or None to read it."""
        ...


class RolloutReader:
    """Finds, validates and hands out new rollout batches, each exactly once.

    Args:
        store: the run's object store.
        run: the run's key prefix.
        vocab_size: if given, every token id must lie in ``[0, vocab_size)``.
        limits: decoding bounds for untrusted bytes (see :class:`stoa.types.Limits`); an object
            over ``limits.max_bytes`` is quarantined without being downloaded.
        poll_limits: per-poll caps (see :class:`PollLimits`).
        hand_back: list refusals in ``last_report.rejected`` without quarantining them; the
            caller settles each with :meth:`quarantine` (the trainer's intake does, so that every
            refusal takes one path). False: :meth:`poll` quarantines them itself.

    Bookkeeping: per worker, the highest sequence number ``done`` below which every batch was
    consumed (or quarantined), plus the consumed numbers above it (gaps happen when uploads
    land out of order).
    :meth:`state` returns it as JSON-ready data; :meth:`progress` is the part workers may see.
    """

    def __init__(self, store: ObjectStore, run: str, vocab_size: int | None = None, limits: Limits = DEFAULT_LIMITS,
                 poll_limits: PollLimits = PollLimits(), hand_back: bool = False):
        self.store, self.run = store, check_run(run)
        self.vocab_size, self.limits, self.poll_limits = vocab_size, limits, poll_limits
        self.hand_back = hand_back
        self._prefix = layout.rollouts(self.run)
        self._done: dict[str, int] = {}  # worker -> every seq < done is settled
        self._extra: dict[str, set[int]] = {}  # worker -> settled seqs >= done
        self.consumed = 0
        self.quarantined = 0
        self.last_report = PollReport()

    @property
    def last_problems(self) -> list[str]:
        """The last poll's problems (``last_report.problems``)."""
        return self.last_report.problems

    # -- bookkeeping ----------------------------------------------------------------------------
    def _settled(self, worker: str, seq: int) -> bool:
        return seq < self._done.get(worker, 0) or seq in self._extra.get(worker, ())

    def _settle(self, worker: str, seq: int) -> None:
        if self._settled(worker, seq):
            return
        extra = self._extra.setdefault(worker, set())
        extra.add(seq)
        done = self._done.get(worker, 0)
        while done in extra:
            extra.discard(done)
            done += 1
        self._done[worker] = done

    def state(self, pending: Iterable[Batch] = ()) -> dict:
        """JSON-serializable bookkeeping of what was consumed; save it with the trainer checkpoint.

        ``pending``: batches already returned by :meth:`poll` but not yet trained on; the state
        leaves them unconsumed, so a restart from it delivers them again.
        """
        done, extra = dict(self._done), {w: set(s) for w, s in self._extra.items()}
        for b in pending:  # unsettle: everything from b.seq up that was below `done` moves to `extra`
            d = done.get(b.worker_id, 0)
            if b.seq < d:
                extra.setdefault(b.worker_id, set()).update(range(b.seq + 1, d))
                done[b.worker_id] = b.seq
            else:
                extra.get(b.worker_id, set()).discard(b.seq)
        return {
            "format": _STATE_FORMAT,
            "run": self.run,
            "workers": {w: {"done": done.get(w, 0), "extra": sorted(extra.get(w, ()))}
                        for w in sorted(set(done) | set(extra))},
            "consumed": self.consumed,
            "quarantined": self.quarantined,
        }

    def restore(self, state: dict) -> None:
        """Resume from :meth:`state` output (e.g. loaded from a checkpoint). Validates it (a
        ``hashes`` list, which older states carry, is left to the caller)."""
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ValueError(f"not a rollout reader state (format must be {_STATE_FORMAT!r})")
        if state.get("run") != self.run:
            raise ValueError(f"state is for run {state.get('run')!r}, this reader reads {self.run!r}")
        done, extra = {}, {}
        for w, d in state.get("workers", {}).items():
            check_worker(w)
            if not (isinstance(d, dict) and isinstance(d.get("done"), int) and isinstance(d.get("extra"), list)
                    and all(isinstance(s, int) and s > d["done"] for s in d["extra"]) and d["done"] >= 0):
                raise ValueError(f"malformed state entry for worker {w!r}: {d!r}")
            done[w], extra[w] = d["done"], set(d["extra"])
        self._done, self._extra = done, extra
        self.consumed, self.quarantined = int(state.get("consumed", 0)), int(state.get("quarantined", 0))

    def progress(self) -> Progress:
        """Batches taken (consumed or quarantined) per worker, and which, for
        :func:`~stoa.transport.control.write_progress`."""
        workers = sorted(set(self._done) | set(self._extra))
        top = {w: tuple(sorted(heapq.nlargest(MAX_SETTLED_LISTED, self._extra.get(w, ())))) for w in workers}
        return Progress({w: self._done.get(w, 0) + len(self._extra.get(w, ())) for w in workers}, time.time(),
                        {w: (self._done.get(w, 0), top[w]) for w in workers})

    def settled_between(self, worker: str, after: int, below: int) -> set[int]:
        """The worker's numbers in ``(after, below)`` that this reader settled (consumed or
        quarantined): remembered when the store no longer holds their objects (pruned, deleted)."""
        done = self._done.get(worker, 0)
        return set(range(max(after + 1, 0), min(done, below))) | {s for s in self._extra.get(worker, ()) if after < s < below}

    def next_numbers(self) -> dict[str, int]:
        """Per worker, the number above every settled one (:func:`stoa.transport.sequence.write_floors`)."""
        return {w: max([self._done.get(w, 0)] + [s + 1 for s in self._extra.get(w, ())])
                for w in sorted(set(self._done) | set(self._extra))}

    # -- polling --------------------------------------------------------------------------------
    def _parse(self, key: str) -> tuple[str, int, int] | None:
        return parse_rollout_key(self.run, key)

    def poll(self, max_batches: int | None = None, max_bytes: int | None = None, *,
             admission: Admission | None = None) -> list[Batch]:
        """Return new valid batches, oldest policy version first (then worker, then sequence); what a
        capped poll reads is chosen with the workers taking turns (:func:`stoa.transport.turns.in_turns`).

        ``admission`` screens every object's seal (the verified :class:`~stoa.transport.identity.BatchSeal`,
        already checked against its name; None for an unsealed one) before its payload is decoded:
        a :class:`~stoa.types.Verdict` refuses it unread (None: every sealed or unsealed object is read).

        Each returned batch counts as consumed at once (see :meth:`state`). At most ``max_batches``
        batches (and apart, as many quarantined objects) and ``max_bytes`` stored bytes (defaults from
        :attr:`poll_limits`); the rest waits for a later poll. Invalid objects are quarantined,
        keys that are not valid store keys are skipped; both are reported in
        :attr:`last_report`. This method does not raise on bad data, and a store error on one
        object leaves it for the next poll (reported) instead of raising.
        """
        n_cap = self.poll_limits.max_batches if max_batches is None else max_batches
        b_cap = self.poll_limits.max_bytes if max_bytes is None else max_bytes
        rep = self.last_report = PollReport()
        pending, strays = [], []
        rep.listed = self.store.list(self._prefix)
        for key in rep.listed:
            try:
                validate_key(key)
            except ValueError:
                rep.skipped += 1
                if len(rep.skipped_examples) < _MAX_EXAMPLES:
                    rep.skipped_examples.append(shown(key))
                continue
            parsed = self._parse(key)
            if parsed is None:
                strays.append(key)
            elif not self._settled(parsed[0], parsed[1]):
                pending.append((parsed[2], parsed[0], parsed[1], key))
        if rep.skipped:
            log.warning("rollouts/: skipped %d key(s) that are not valid store keys, e.g. %s",
                        rep.skipped, ", ".join(rep.skipped_examples[:3]))
        work = [(key, (worker, seq, version)) for version, worker, seq, key in in_turns(pending)]
        work += [(key, None) for key in strays]  # honest batches first, then clean-up
        loaded: list[tuple[Batch, bytes]] = []
        handled = junk = 0  # objects read that may be returned; quarantined ones have a budget of their own
        d_cap = self.poll_limits.max_decoded_bytes
        for i, (key, parsed) in enumerate(work):
            if max(handled, junk) >= n_cap or (
                    handled + junk and (rep.bytes_read >= b_cap or rep.decoded_bytes >= d_cap)):
                rep.deferred = len(work) - i
                break
            cap = self.limits.max_bytes if not handled + junk else min(self.limits.max_bytes, b_cap - rep.bytes_read)
            try:
                blob = self.store.get(key, max_bytes=cap)
            except KeyNotFound:
                continue  # deleted under us (another reader quarantined it); nothing to settle
            except ObjectTooLarge as e:
                if e.size <= self.limits.max_bytes:  # valid size, over this poll's budget
                    rep.deferred = len(work) - i
                    break
                junk += 1
                self._quarantine_safely(key, parsed, f"{e.size} bytes, over the {self.limits.max_bytes}-byte "
                                                     "limit (deleted unread)", None, rep, "size")
                continue
            except StoreError as e:
                junk += 1
                rep.problems.append(f"{shown(key)}: store error, left for the next poll: {e}")
                continue
            rep.bytes_read += len(blob)
            if parsed is None:
                junk += 1
                self._quarantine_safely(key, None, "object name is not <worker>/s<seq>-v<version>.episodes", blob, rep,
                                        "misnamed")
                continue
            batch = self._load(key, *parsed, blob, rep, admission)
            if batch is _DEFER:
                rep.deferred = len(work) - i
                break
            junk += batch is None
            if batch is not None:
                handled += 1
                loaded.append((batch, blob))
        out = [b for b, _ in sorted(loaded, key=lambda bb: (bb[0].version, bb[0].worker_id, bb[0].seq))]
        for b in out:
            self._settle(b.worker_id, b.seq)
            self.consumed += 1
        rep.returned = len(out)
        return out

    def _open(self, key: str, worker: str, seq: int, version: int, blob: bytes,
              admission: Admission | None) -> tuple[bytes, str, str, str, str | None]:
        """(payload, signer key id or "", signer public key or "", category, reason) of an object:
        the seal checks and the admission's screen, before any decoding. ``reason`` None means
        it may be decoded."""
        kid = pub = ""
        if is_sealed(blob):
            try:
                seal, blob = open_sealed(blob, key)
            except SealError as e:
                return blob, "", "", "signature", str(e)
            named = (self.run, worker, seq, version)
            if (seal.run, seal.worker_id, seal.seq, seal.version) != named:
                return blob, "", "", "signature", (
                    f"sealed for run {seal.run[:80]!r}, worker {seal.worker_id[:64]!r}, seq {seal.seq}, version "
                    f"{seal.version}; its name says {named[1:]} in run {self.run!r} (copied or renamed)")
            kid, pub = seal.key_id, seal.public_key
        else:
            seal = None
        try:
            verdict = admission.screen(seal) if admission is not None else None
        except Exception as e:  # the caller's policy failing must not crash the poll
            verdict = Verdict("refused", f"checking the worker key failed: {type(e).__name__}: {e}")
        if verdict is not None:
            return blob, kid, pub, verdict.category, verdict.reason
        return blob, kid, pub, "", None

    def _load(self, key: str, worker: str, seq: int, version: int, blob: bytes, rep: PollReport,
              admission: Admission | None = None) -> Any:
        """The batch, None if it was quarantined, or ``_DEFER`` when its decoded size does not fit
        what is left of this poll's budget."""
        stored = blob
        blob, kid, pub, category, why = self._open(key, worker, seq, version, blob, admission)
        if why is None:
            budget = self.poll_limits.max_decoded_bytes
            declared = _declared_size(blob)
            if declared > budget:
                category, why = "size", f"decodes to {declared} bytes, over the {budget}-byte per-poll budget"
            elif rep.decoded_bytes and declared > budget - rep.decoded_bytes:
                return _DEFER
        if why is not None:
            self._quarantine_safely(key, (worker, seq, version), why, stored, rep, category, kid or None)
            return None
        allow = min(self.limits.max_decompressed_bytes, budget - rep.decoded_bytes if declared < 0 else max(declared, 1))
        rep.decoded_bytes += allow
        try:
            episodes = decode_episodes(blob, vocab_size=self.vocab_size,
                                       limits=dataclasses.replace(self.limits, max_decompressed_bytes=allow))
            if not episodes:
                raise EpisodeError("empty batch")
            for i, ep in enumerate(episodes):
                if ep.policy_version != version:
                    raise EpisodeError(f"episode {i}: policy_version {ep.policy_version} != {version} in the object name")
                if ep.worker_id != worker:
                    raise EpisodeError(f"episode {i}: worker_id {ep.worker_id!r} != {worker!r} in the object name")
        except Exception as e:  # untrusted bytes: whatever breaks the decoder quarantines, never crashes
            reason = str(e) if isinstance(e, EpisodeError) else f"{type(e).__name__}: {e}"
            self._quarantine_safely(key, (worker, seq, version), reason, stored, rep, "invalid", kid or None)
            return None
        return Batch(key, worker, version, episodes, seq, kid, hashlib.sha256(blob).hexdigest(), pub)

    def _quarantine_safely(self, key: str, parsed: tuple[str, int, int] | None, reason: str,
                           blob: bytes | None, rep: PollReport, category: str = "invalid",
                           kid: str | None = None) -> None:
        refused = Rejection(key, parsed[0] if parsed else None, kid, category, reason[:4096], parsed, blob)
        if self.hand_back:
            rep.rejected.append(refused)
        elif self.quarantine(refused, reason):
            rep.rejected.append(dataclasses.replace(refused, stored=None))

    def quarantine(self, item: Batch | Rejection, reason: str) -> bool:
        """Move an object to the quarantine prefix with ``reason``: a batch that :meth:`poll`
        returned but the caller refused, or one of ``last_report.rejected`` (``hand_back``).
        Returns False when a refused object could not be moved (it stays, and the next poll
        meets it again); a store error moving a returned batch is raised."""
        if isinstance(item, Rejection):
            try:
                self._quarantine(item.key, item.parsed, reason, item.stored, self.last_report)
            except StoreError as e:  # the object stays where it is; the next poll tries again
                self.last_report.problems.append(f"{shown(item.key)}: could not quarantine ({reason}): {e}")
                return False
            listed = self.last_report.rejected
            for i, r in enumerate(listed):  # the report keeps no stored bytes once they are in the quarantine
                if r is item:
                    listed[i] = dataclasses.replace(item, stored=None)
            return True
        batch = item
        try:
            blob = self.store.get(batch.key, max_bytes=self.limits.max_bytes)
        except KeyNotFound:
            blob = None
        if blob is not None:
            self._quarantine(batch.key, (batch.worker_id, batch.seq, batch.version), reason, blob, self.last_report)
        self.consumed -= 1
        return True

    def _quarantine(self, key: str, parsed: tuple[str, int, int] | None, reason: str,
                    blob: bytes | None, rep: PollReport) -> None:
        """Copy (when ``blob`` is given), explain, then delete: a crash in between re-quarantines it."""
        if parsed is not None:  # a validated worker id and fixed-length name
            dest = layout.quarantined(self.run, parsed[0], key.rpartition("/")[2])
        else:  # never build a key from an untrusted name; the reason file keeps the name
            digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
            dest = layout.misnamed(self.run, digest[:32])
        if blob is not None:
            self.store.put(dest, blob)
        self.store.put(dest + ".reason.json", json.dumps(
            {"key": key[:1024], "reason": reason[:4096], "bytes": None if blob is None else len(blob),
             "copied": blob is not None, "time": time.time()}, indent=1).encode())
        self.store.delete(key)
        if parsed is not None:
            self._settle(parsed[0], parsed[1])
        self.quarantined += 1
        rep.quarantined += 1
        rep.problems.append(f"{shown(key)}: {reason}")

    def prune(self, state: dict | None = None) -> int:
        """Delete consumed batches (those settled in ``state``, default the current state).

        Call it with the state saved in a checkpoint once that checkpoint is durable, so a
        restart from it never needs the deleted objects. Keeps listings short. Each worker's
        newest batch stays, so a restarted writer continues its numbering. Returns the number
        of objects deleted.
        """
        ref = RolloutReader(self.store, self.run)
        ref.restore(state if state is not None else self.state())
        newest: dict[str, str] = {}
        settled = []
        for key in self.store.list(self._prefix):  # sorted: a worker's newest batch comes last
            try:
                validate_key(key)
            except ValueError:
                continue
            parsed = self._parse(key)
            if parsed is not None:
                newest[parsed[0]] = key
                if ref._settled(parsed[0], parsed[1]):
                    settled.append(key)
        doomed = [k for k in settled if k not in newest.values()]
        for key in doomed:
            self.store.delete(key)
        return len(doomed)
