"""Rollout exchange: workers upload episode batches, the trainer consumes each exactly once.

Layout under a run (``<run>`` is any valid key prefix)::

    <run>/rollouts/<worker_id>/s<seq:012d>-v<version:012d>.episodes   write-once batches
    <run>/quarantine/<worker_id>/<name>                                 invalid batches, moved
    <run>/quarantine/<worker_id>/<name>.reason.json                     why, as JSON
    <run>/quarantine/_misnamed/<path with / as %2F>[.reason.json]       stray names under rollouts/

A worker's :class:`RolloutWriter` numbers its uploads with a per-worker sequence number and
creates each object with ``put_if_absent`` (never overwriting, so two processes sharing a
worker id cannot clobber each other). Objects appear whole or not at all (atomic rename in a
LocalStore; S3 puts are atomic per object).

The trainer's :class:`RolloutReader` lists new objects, validates them with
:func:`stoa.types.decode_episodes` plus the naming checks (each episode's ``policy_version`` and
``worker_id`` must match the key) and returns them in order; an invalid object is moved to the
quarantine prefix with a reason and counted, never raised. Its bookkeeping (:meth:`state`) is
plain JSON: save it in the trainer checkpoint together with the model, :meth:`restore` it after
a restart, and every batch is delivered to the training step exactly once.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from stoa.transport.store import KeyNotFound, ObjectStore, validate_key
from stoa.types import DEFAULT_LIMITS, Episode, EpisodeError, Limits, decode_episodes, encode_episodes

__all__ = ["Batch", "RolloutReader", "RolloutWriter", "rollout_key"]

_WORKER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_NAME_RE = re.compile(r"s(\d{12})-v(\d{12})\.episodes")
_MAX_NUM = 10**12 - 1
_STATE_FORMAT = "stoa.rollout_reader.v1"


def _check_worker(worker_id: str) -> str:
    if not isinstance(worker_id, str) or not _WORKER_RE.fullmatch(worker_id):
        raise ValueError(f"worker id {worker_id!r} must be 1-64 characters of [A-Za-z0-9._-], not starting with . _ or -")
    return worker_id


def _check_run(run: str) -> str:
    return validate_key(run.strip("/"))


def rollout_key(run: str, worker_id: str, seq: int, version: int) -> str:
    """The object key of a worker's ``seq``-th batch, sampled with weights ``version``."""
    if not (0 <= seq <= _MAX_NUM and 0 <= version <= _MAX_NUM):
        raise ValueError(f"seq {seq} and version {version} must lie in [0, 10^12)")
    return f"{_check_run(run)}/rollouts/{_check_worker(worker_id)}/s{seq:012d}-v{version:012d}.episodes"


@dataclass(frozen=True)
class Batch:
    """One validated upload.

    Attributes:
        key: the object's key (unique; the id of the batch).
        worker_id: the worker that uploaded it.
        version: the policy version that sampled every episode in it.
        episodes: the decoded, validated episodes.
        seq: the worker's sequence number of this upload.
    """

    key: str
    worker_id: str
    version: int
    episodes: list[Episode] = field(repr=False)
    seq: int = 0


class RolloutWriter:
    """Uploads a worker's episode batches as write-once objects.

    Args:
        store: the run's object store.
        run: the run's key prefix.
        worker_id: this worker's id (1-64 of ``[A-Za-z0-9._-]``).

    The next sequence number continues after the worker's newest object in the store (in
    ``rollouts/`` or ``quarantine/``; :meth:`RolloutReader.prune` always leaves a worker's newest
    batch), so a restarted worker never reuses one.
    """

    def __init__(self, store: ObjectStore, run: str, worker_id: str):
        self.store, self.run, self.worker_id = store, _check_run(run), _check_worker(worker_id)
        self._prefix = f"{self.run}/rollouts/{self.worker_id}/"
        seqs = [int(m.group(1)) for where in (self._prefix, f"{self.run}/quarantine/{self.worker_id}/")
                for k in store.list(where) if (m := _NAME_RE.fullmatch(k.rpartition("/")[2]))]
        self.next_seq = max(seqs) + 1 if seqs else 0

    def upload(self, episodes: list[Episode], policy_version: int) -> str:
        """Encode and upload one batch; return its key.

        Every episode must carry ``policy_version`` and this writer's ``worker_id`` (raises
        ``ValueError`` otherwise; the reader would quarantine such a batch). If another process
        already took a sequence number, the next free one is used. If a store error leaves it
        unknown whether the object landed, call ``upload`` again with the same batch: it finds
        its own object and returns its key instead of uploading a duplicate.
        """
        if not episodes:
            raise ValueError("refusing to upload an empty batch")
        for i, ep in enumerate(episodes):
            if ep.policy_version != policy_version:
                raise ValueError(f"episode {i} has policy_version {ep.policy_version}, batch is for {policy_version}")
            if ep.worker_id != self.worker_id:
                raise ValueError(f"episode {i} has worker_id {ep.worker_id!r}, this writer is {self.worker_id!r}")
        blob = encode_episodes(episodes)
        for _ in range(1000):
            seq = self.next_seq
            key = rollout_key(self.run, self.worker_id, seq, policy_version)
            # The name carries the version, so look for the sequence number under any version.
            taken = self.store.list(f"{self._prefix}s{seq:012d}-")
            if not taken:
                if self.store.put_if_absent(key, blob):  # on an exception, next_seq stays for the retry
                    self.next_seq = seq + 1
                    return key
                taken = [key]
            self.next_seq = seq + 1
            if key in taken and self._get_quiet(key) == blob:
                return key  # an earlier attempt of this upload landed
        raise RuntimeError(f"worker {self.worker_id!r}: no free sequence number after 1000 tries")

    def _get_quiet(self, key: str) -> bytes | None:
        try:
            return self.store.get(key)
        except KeyNotFound:
            return None


class RolloutReader:
    """Finds, validates and hands out new rollout batches, each exactly once.

    Args:
        store: the run's object store.
        run: the run's key prefix.
        vocab_size: if given, every token id must lie in ``[0, vocab_size)``.
        limits: decoding bounds for untrusted bytes (see :class:`stoa.types.Limits`).

    Bookkeeping: per worker, the highest sequence number ``done`` below which every batch was
    consumed (or quarantined), plus the consumed numbers above it (gaps happen when uploads
    land out of order). :meth:`state` returns it as JSON-ready data.
    """

    def __init__(self, store: ObjectStore, run: str, vocab_size: int | None = None, limits: Limits = DEFAULT_LIMITS):
        self.store, self.run = store, _check_run(run)
        self.vocab_size, self.limits = vocab_size, limits
        self._prefix = f"{self.run}/rollouts/"
        self._done: dict[str, int] = {}  # worker -> every seq < done is settled
        self._extra: dict[str, set[int]] = {}  # worker -> settled seqs >= done
        self.consumed = 0
        self.quarantined = 0
        self.last_problems: list[str] = []

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
        """Resume from :meth:`state` output (e.g. loaded from a checkpoint). Validates it."""
        if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
            raise ValueError(f"not a rollout reader state (format must be {_STATE_FORMAT!r})")
        if state.get("run") != self.run:
            raise ValueError(f"state is for run {state.get('run')!r}, this reader reads {self.run!r}")
        done, extra = {}, {}
        for w, d in state.get("workers", {}).items():
            _check_worker(w)
            if not (isinstance(d, dict) and isinstance(d.get("done"), int) and isinstance(d.get("extra"), list)
                    and all(isinstance(s, int) and s > d["done"] for s in d["extra"]) and d["done"] >= 0):
                raise ValueError(f"malformed state entry for worker {w!r}: {d!r}")
            done[w], extra[w] = d["done"], set(d["extra"])
        self._done, self._extra = done, extra
        self.consumed, self.quarantined = int(state.get("consumed", 0)), int(state.get("quarantined", 0))

    # -- polling --------------------------------------------------------------------------------
    def poll(self, max_batches: int | None = None) -> list[Batch]:
        """Return new valid batches, oldest policy version first (then worker, then sequence).

        Each returned batch counts as consumed at once (see :meth:`state`). With
        ``max_batches``, at most that many are returned and the rest wait for a later poll.
        Invalid objects are quarantined (see :attr:`quarantined`, :attr:`last_problems`);
        this method does not raise on bad data.
        """
        self.last_problems = []
        pending = []
        for key in self.store.list(self._prefix):
            rel = key[len(self._prefix):]
            worker, _, name = rel.partition("/")
            m = _NAME_RE.fullmatch(name)
            if not m or not _WORKER_RE.fullmatch(worker):
                self._quarantine(key, None, None, "object name is not <worker>/s<seq>-v<version>.episodes")
                continue
            seq, version = int(m.group(1)), int(m.group(2))
            if not self._settled(worker, seq):
                pending.append((version, worker, seq, key))
        out = []
        for version, worker, seq, key in sorted(pending):
            if max_batches is not None and len(out) >= max_batches:
                break
            batch = self._load(key, worker, seq, version)
            if batch is not None:
                self._settle(worker, seq)
                self.consumed += 1
                out.append(batch)
        return out

    def _load(self, key: str, worker: str, seq: int, version: int) -> Batch | None:
        try:
            blob = self.store.get(key)
        except KeyNotFound:
            return None  # deleted under us (another reader quarantined it); nothing to settle
        try:
            episodes = decode_episodes(blob, vocab_size=self.vocab_size, limits=self.limits)
            if not episodes:
                raise EpisodeError("empty batch")
            for i, ep in enumerate(episodes):
                if ep.policy_version != version:
                    raise EpisodeError(f"episode {i}: policy_version {ep.policy_version} != {version} in the object name")
                if ep.worker_id != worker:
                    raise EpisodeError(f"episode {i}: worker_id {ep.worker_id!r} != {worker!r} in the object name")
        except Exception as e:  # untrusted bytes: whatever breaks the decoder quarantines, never crashes
            self._quarantine(key, worker, seq, str(e) if isinstance(e, EpisodeError) else f"{type(e).__name__}: {e}", blob)
            return None
        return Batch(key, worker, version, episodes, seq)

    def quarantine(self, batch: Batch, reason: str) -> None:
        """Move a batch that :meth:`poll` returned but the caller found invalid (e.g. a policy
        version from the future) to the quarantine prefix, with ``reason``."""
        self._quarantine(batch.key, batch.worker_id, batch.seq, reason)
        self.consumed -= 1

    def _quarantine(self, key: str, worker: str | None, seq: int | None, reason: str,
                    blob: bytes | None = None) -> None:
        rel = key[len(self._prefix):]
        # A stray name is flattened under a folder no worker id can have, so it collides with nothing.
        dest = f"{self.run}/quarantine/" + (rel if worker is not None else "_misnamed/" + rel.replace("/", "%2F"))
        if blob is None:
            try:
                blob = self.store.get(key)
            except KeyNotFound:
                return
        # Copy, explain, then delete: a crash in between re-quarantines the same object.
        self.store.put(dest, blob)
        self.store.put(dest + ".reason.json", json.dumps(
            {"key": key, "reason": reason, "bytes": len(blob), "time": time.time()}, indent=1).encode())
        self.store.delete(key)
        if worker is not None and seq is not None:
            self._settle(worker, seq)
        self.quarantined += 1
        self.last_problems.append(f"{key}: {reason}")

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
            worker, _, name = key[len(self._prefix):].partition("/")
            m = _NAME_RE.fullmatch(name)
            if m:
                newest[worker] = key
                if ref._settled(worker, int(m.group(1))):
                    settled.append(key)
        doomed = [k for k in settled if k not in newest.values()]
        for key in doomed:
            self.store.delete(key)
        return len(doomed)
