"""The signed weight-version chain: how the trainer publishes weights and workers follow them.

Layout and documents: :mod:`stoa.transport.manifest` (``<run>/current.json`` pointer,
``<run>/weights/<version:012d>/{manifest.json, anchor.safetensors, delta.pulse}``).

Each version has an anchor, a delta from its ``parent`` version, or both (a scheduled anchor
keeps its delta so workers already on the chain need not download the full state). Anchors are
written every ``anchor_every`` versions, when the layout changes, and whenever the delta would
not be much smaller than the state. A :class:`~stoa.transport.manifest.Manifest` names its
parent version and the sha256 of the parent's manifest object, the sha256 and size of each
payload and the :func:`stoa.transport.pulse.state_hash` of the state it describes. The signed
:class:`~stoa.transport.manifest.Pointer` pins the head manifest's sha256, so the chain from the
pointer down is hash-linked: a reader that starts at the pointer can only ever meet the exact
objects the publisher committed.

**Commit order.** The publisher writes payloads, then the manifest, then the pointer. Readers
start at the pointer and only walk down parent links, so a crash at any moment leaves only
complete versions visible; objects above the pointer are uncommitted and are overwritten by the
next publish.

**Signatures.** Manifests and the pointer are documents of kinds ``"manifest"`` and
``"pointer"`` signed with the run's key (:mod:`stoa.transport.signing`), each naming its run
and version. Workers refuse anything unsigned, signed by another key, for another run or
version, or whose payload hashes do not match.

**Heads never go back.** A subscriber remembers the newest pointer it verified. An older
pointer, even a validly signed one (a rollback by anyone with write access to the store), and
a different pointer at the same version (a fork after a rollback and a publisher restart) are
reported and ignored. A subscriber also remembers which manifest the state it returned belongs
to: if the chain it later follows does not pass through that manifest, the held state is not
used as a base, and the sync re-plans from an anchor. A brand-new subscriber cannot tell a
rolled-back pointer from an old run (see ``docs/transport.md``).

**Sync.** :meth:`WeightSubscriber.sync` moves a worker from the version it holds to the head
by deltas or by jumping to a newer anchor, whichever moves fewer bytes; a new worker, or one
whose held state is ruled out, starts from the newest usable anchor. A payload whose size or
sha256 differs from the signed manifest is re-fetched once, then routed around (reported in
``SyncResult.problems``); the result is checked against the signed state hash before it
replaces anything: deltas written into live arrays (``apply_inplace``) are verified first.
With ``check="background"`` a follow-up sync of a verified held state writes the deltas (each
payload already verified against its signed hash) at once and checks the signed state hash in a
background thread (:class:`StateCheck`): the worker generates while the hash runs, and uploads
nothing made with those weights until the check passed. A failed check re-plans the next sync from
the store as for a state that is not what it claims.

**Retention.** :meth:`WeightPublisher.gc` keeps the versions from the ``keep_anchors``-th newest
anchor on the chain up to the pointer and deletes older versions and orphans (uncommitted
leftovers below the pointer). Keys under ``weights/`` that are not this layout are skipped and
reported, never deleted and never an error.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stoa.transport import pulse
from stoa.transport.manifest import (
    MAX_MANIFEST_BYTES,
    MAX_POINTER_BYTES,
    Layout,
    Manifest,
    Payload,
    Pointer,
    check_version,
)
from stoa.transport.signing import SignatureError, load_private_key, load_public_key, open_document, sign_document
from stoa.transport.store import KeyNotFound, ObjectStore, ObjectTooLarge, StoreError, validate_key

__all__ = [
    "SYNC_CHECKS",
    "SYNC_ERRORS",
    "ChainError",
    "IntegrityError",
    "PointerError",
    "PublishResult",
    "Retention",
    "StateCheck",
    "SyncResult",
    "WeightPublisher",
    "WeightSubscriber",
]

log = logging.getLogger(__name__)

State = dict[str, np.ndarray]
_MAX_METADATA_BYTES = 256 << 10
_CACHE_BYTES = 64 << 20  # verified manifests a subscriber keeps, by content hash
_SYNC_ATTEMPTS = 16  # each failed attempt bans one route or follows a moved pointer


class ChainError(RuntimeError):
    """The version chain cannot be read or written as asked; the message says why."""


class IntegrityError(ChainError):
    """Payloads or states do not match their signed hashes and no intact route is left."""


class PointerError(ChainError, SignatureError):
    """The pointer does not verify (garbled, forged, another run) and no version was seen before."""


SYNC_ERRORS = (ChainError, StoreError)
SYNC_CHECKS = ("now", "background")
"""How :meth:`WeightSubscriber.sync` checks a result against the signed state hash (its ``check``)."""
"""What :meth:`WeightSubscriber.sync` / ``head`` raise when the store's contents or the store
itself fail. None of them harms the held weights: keep serving them, retry with backoff, and
after repeated failures re-join with ``sync(None)``."""


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _shown(key: str) -> str:
    """An untrusted key, bounded and escaped for a report."""
    return repr(key[:200]) + ("..." if len(key) > 200 else "")


def _summary(problems: list[str], n: int = 6) -> str:
    return "; ".join(problems[:n]) + (f"; and {len(problems) - n} more" if len(problems) > n else "")


def _check_state(state: Any) -> None:
    if not isinstance(state, dict) or not state:
        raise TypeError("a weight state is a non-empty dict[str, numpy.ndarray]")
    for k, v in state.items():
        if not isinstance(k, str) or not isinstance(v, np.ndarray):
            raise TypeError(f"state entry {k!r}: expected str -> numpy.ndarray, got {type(v).__name__}")


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a).reshape(-1).view(np.uint8), np.ascontiguousarray(b).reshape(-1).view(np.uint8))


# ---------------------------------------------------------------------------------------------
# Publisher
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PublishResult:
    """What one :meth:`WeightPublisher.publish` did.

    Attributes:
        version: the published version.
        kind: ``"anchor"`` if a full state was written (possibly with a delta beside it), else ``"delta"``.
        bytes_written: all bytes put to the store (payloads, manifest, pointer).
        full_state_bytes: bytes of the state's arrays (what a full checkpoint moves), for comparison.
        delta_bytes: size of the delta payload, or None if none was written.
        anchor_bytes: size of the anchor payload, or None if none was written.
        seconds: wall time of the publish.
        state_hash: :func:`pulse.state_hash` of the published state.
        problems: what retention skipped or could not do (the version is committed regardless).
    """

    version: int
    kind: str
    bytes_written: int
    full_state_bytes: int
    delta_bytes: int | None
    anchor_bytes: int | None
    seconds: float
    state_hash: str
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Retention:
    """What :meth:`WeightPublisher.gc` did: keys deleted, and keys it skipped (with why)."""

    deleted: list[str]
    skipped: list[str]


@dataclass(frozen=True)
class _Published:
    version: int
    state: State
    manifest: Manifest
    manifest_sha256: str


class WeightPublisher:
    """The trainer's side: publishes weight states as signed versions.

    Args:
        store: the run's object store.
        run: the run's key prefix.
        private_key: the run's ed25519 private key (object, raw bytes, PEM, or a file path).
        anchor_every: write a full anchor at least every this many versions (>= 1).
        anchor_if_delta_over: write an anchor instead of a delta when the delta is larger than
            this fraction of the state's bytes (in (0, 1]).
        keep_anchors: after each anchor, :meth:`gc` keeps this many newest anchors and what
            follows them; None keeps everything.
        keep_seconds: :meth:`gc` also keeps every version published within this many seconds
            (and the anchor they descend from), so a follower on a slow link is not left holding a
            plan whose anchor was deleted mid-download (anchors every version make that likely).

    A publisher that starts on a run that already has versions resumes from the pointer: it
    syncs the head state from the store (verifying it) to diff the next version against,
    through its one :class:`WeightSubscriber` (:attr:`subscriber`), which it also uses for
    :meth:`head`, pointer repair and retention. A pointer that does not verify (garbled,
    forged) is rewritten to the newest intact manifest. The publisher keeps a private copy of
    the last published state.
    """

    def __init__(self, store: ObjectStore, run: str, private_key: Any, anchor_every: int = 50,
                 anchor_if_delta_over: float = 0.5, keep_anchors: int | None = 2, keep_seconds: float = 600.0):
        if not isinstance(anchor_every, int) or anchor_every < 1:
            raise ValueError(f"anchor_every must be an int >= 1, got {anchor_every!r}")
        if not 0 < anchor_if_delta_over <= 1:
            raise ValueError(f"anchor_if_delta_over must lie in (0, 1], got {anchor_if_delta_over}")
        if keep_anchors is not None and keep_anchors < 1:
            raise ValueError("keep_anchors must be >= 1 or None")
        if not keep_seconds >= 0:
            raise ValueError(f"keep_seconds must be >= 0, got {keep_seconds}")
        self.keep_seconds = float(keep_seconds)
        self.store, self._keys = store, Layout(run)
        self.run = self._keys.run
        self._key = load_private_key(private_key)
        self.public_key = self._key.public_key()
        self.anchor_every, self.anchor_if_delta_over, self.keep_anchors = anchor_every, anchor_if_delta_over, keep_anchors
        self.subscriber = WeightSubscriber(store, run, self.public_key)
        self._prev: _Published | None = None
        self._floor: int | None = None  # committed head; new versions must exceed it
        self._resumed = False

    def head(self) -> int | None:
        """The committed version the pointer names (None before the first publish).

        A pointer that does not verify is repaired first (rewritten to the newest intact manifest).
        """
        try:
            return self.subscriber.head()
        except PointerError as e:
            return self._repair_pointer(e)

    def _resume(self) -> None:
        self._floor = self.head()
        if self._floor is not None:
            try:
                res = self.subscriber.sync(None)
                assert res.manifest is not None and res.manifest_sha256 is not None  # a join always reads it
                self._prev = _Published(res.version, res.state, res.manifest, res.manifest_sha256)
                self._floor = max(self._floor, res.version)
                log.info("publisher for %s resumed at version %d", self.run, res.version)
            except (ChainError, SignatureError) as e:
                log.warning("cannot rebuild head version %d (%s); the next version will be a fresh anchor",
                            self._floor, e)
        self._resumed = True

    def _repair_pointer(self, why: Exception) -> int | None:
        """Point at the newest intact manifest: every manifest we signed names a complete version."""
        versions = sorted({v for k in self.store.list(self._keys.weights) if (v := self._keys.version_of(k)) is not None})
        for v in reversed(versions):
            try:
                _, sha = self.subscriber._fetch(v)
            except (KeyNotFound, ChainError, SignatureError):
                continue
            self.store.put(self._keys.pointer, sign_document(
                "pointer", Pointer(self.run, v, sha, time.time()).to_body(), self._key))
            log.warning("%s; rewrote the pointer to version %d", why, v)
            return v
        if not versions:
            log.warning("%s; no versions to point at, the next publish writes a new pointer", why)
            return None
        raise IntegrityError(f"{why}; and no intact manifest to repair it from") from None

    def publish(self, version: int, state: State, metadata: dict | None = None) -> PublishResult:
        """Publish ``state`` as ``version`` (greater than every committed version).

        Writes the payload(s), then the signed manifest, then the pointer. ``metadata`` (small
        JSON, e.g. the optimizer step or the resolved config's hash) is signed into the manifest.
        Retention runs after an anchor; whatever it skips or fails at is reported in
        ``PublishResult.problems``, never raised once the version is committed.
        """
        t0 = time.perf_counter()
        check_version(version)
        _check_state(state)
        if not self._resumed:
            self._resume()
        if self._floor is not None and version <= self._floor:
            raise ChainError(f"version {version} is not newer than the committed head {self._floor}; "
                             f"publish {self._floor + 1} or later")
        meta = dict(metadata or {})
        try:
            meta_text = json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"metadata must be JSON-serializable: {e}") from None
        if len(meta_text) > _MAX_METADATA_BYTES:
            raise ValueError("metadata is too large for a manifest (keep it under 256 KiB)")

        prev = self._prev
        full_bytes = sum(a.nbytes for a in state.values())
        delta = None
        if prev is not None:
            try:
                delta = pulse.encode_delta(prev.state, state)
            except pulse.PulseError as e:
                log.info("version %d: no delta (%s); writing an anchor", version, e)
        depth = prev.manifest.depth + 1 if prev is not None and delta is not None else 0
        too_big = delta is not None and len(delta) > self.anchor_if_delta_over * full_bytes
        want_anchor = delta is None or too_big or depth >= self.anchor_every
        if too_big:
            delta = None  # the anchor alone is about as cheap
        anchor = pulse.encode_state(state) if want_anchor else None
        if anchor is not None:
            depth = 0
        h = pulse.state_hash(state)
        man = Manifest(
            self.run, version, None if prev is None else prev.version, None if prev is None else prev.manifest_sha256,
            h, depth, version if anchor is not None else prev.manifest.anchor_version,  # type: ignore[union-attr]
            None if anchor is None else Payload(len(anchor), _sha(anchor)),
            None if delta is None else Payload(len(delta), _sha(delta)),
            full_bytes, len(state), meta, time.time())
        manifest = sign_document("manifest", man.to_body(), self._key)
        pointer = sign_document("pointer", Pointer(self.run, version, _sha(manifest), time.time()).to_body(), self._key)
        written = 0
        for kind, blob in (("anchor", anchor), ("delta", delta)):
            if blob is not None:
                self.store.put(self._keys.payload(version, kind), blob)
                written += len(blob)
        self.store.put(self._keys.manifest(version), manifest)
        self.store.put(self._keys.pointer, pointer)
        written += len(manifest) + len(pointer)
        self._prev = _Published(version, {k: np.array(v, copy=True, order="C") for k, v in state.items()},
                                man, _sha(manifest))
        self._floor = version
        problems: list[str] = []
        if anchor is not None and self.keep_anchors is not None:
            try:
                problems += self.gc(self.keep_anchors, self.keep_seconds).skipped
            except (StoreError, ChainError, SignatureError, ValueError) as e:  # committed: report, never raise
                problems.append(f"retention after version {version} failed: {type(e).__name__}: {e}")
            for p in problems:
                log.warning("%s", p)
        return PublishResult(version, "anchor" if anchor is not None else "delta", written, full_bytes,
                             None if delta is None else len(delta), None if anchor is None else len(anchor),
                             time.perf_counter() - t0, h, problems)

    def gc(self, keep_anchors: int = 2, keep_seconds: float = 0.0) -> Retention:
        """Delete versions no joiner can still need.

        Keeps, along the chain from the pointer down, every version from the
        ``keep_anchors``-th newest anchor up, and further down every version published in the
        last ``keep_seconds`` down to the anchor it descends from; deletes older versions and orphans below the
        pointer (a crash's uncommitted leftovers). Never touches versions above the pointer
        (a publish in progress), nor any key that is not this chain's layout (those are
        reported in ``Retention.skipped``). Manifests go before their payloads, so readers never
        find a manifest whose payload is gone for good.
        """
        if keep_anchors < 1:
            raise ValueError("keep_anchors must be >= 1")
        sub, problems = self.subscriber, []
        ptr = sub._newest(problems)
        skipped: list[str] = []
        if ptr is None:
            return Retention([], skipped)
        keep, anchors, now = set(), 0, time.time()
        m = sub._pinned(ptr.version, ptr.manifest_sha256, problems)
        while m is not None:
            keep.add(m.version)
            if m.anchor is not None:
                anchors += 1
                if anchors >= keep_anchors and now - m.created >= keep_seconds:
                    break
            if m.parent is None:
                break
            m = sub._pinned(m.parent, m.parent_manifest_sha256, problems)  # type: ignore[arg-type]
        if anchors < keep_anchors:
            return Retention([], skipped)  # too few anchors yet (or a broken walk): everything may still be needed
        doomed: dict[int, list[str]] = {}
        for key in self.store.list(self._keys.weights):
            try:
                validate_key(key)
            except ValueError as e:
                skipped.append(f"{_shown(key)}: not a valid key ({e}); skipped")
                continue
            ver = self._keys.version_of(key)
            if ver is None:
                skipped.append(f"{_shown(key)}: not <version:012d>/<manifest.json|anchor.safetensors|delta.pulse>; "
                               "skipped")
            elif ver <= ptr.version and ver not in keep:
                doomed.setdefault(ver, []).append(key)
        deleted = []
        for ver in sorted(doomed):
            for key in sorted(doomed[ver], key=lambda k: not k.endswith("manifest.json")):
                self.store.delete(key)
                deleted.append(key)
        return Retention(deleted, skipped)


# ---------------------------------------------------------------------------------------------
# Subscriber
# ---------------------------------------------------------------------------------------------


@dataclass
class SyncResult:
    """The outcome of :meth:`WeightSubscriber.sync`.

    Attributes:
        version: the version now held.
        state: the state of ``version``. With ``apply_inplace=True`` and a compatible state,
            this is the very dict (and arrays) that was passed in, updated in place.
        bytes_read: every byte fetched from the store (pointer, manifests, payloads).
        applied: what was applied, in order: ``(version, "anchor" | "delta")``.
        changed_names: names whose arrays may differ from the state passed in (every name
            when none was passed).
        inplace: whether ``state`` is the caller's dict (updated in place, or untouched when it
            already held the head).
        problems: corrupted, forged or missing objects that were detected and routed around, and
            pointers that were ignored (older than a version already seen).
        manifest: the signed manifest of ``version`` (None when the held state was kept
            because the store's pointer is older than it).
        manifest_sha256: sha256 of that manifest object.
        check: the state's hash check when it still runs in the background (``check="background"``
            and deltas written in place); None when the state was verified before ``sync``
            returned. Call ``check.wait()`` before using anything made with this state outside
            the worker.
    """

    version: int
    state: State
    bytes_read: int
    applied: list[tuple[int, str]] = field(default_factory=list)
    changed_names: list[str] = field(default_factory=list)
    inplace: bool = False
    problems: list[str] = field(default_factory=list)
    manifest: Manifest | None = None
    manifest_sha256: str | None = None
    check: StateCheck | None = None

    @property
    def message(self) -> str:
        """One line for a log: what was done and what went wrong (never empty)."""
        how = " + ".join(f"{k} {v}" for v, k in self.applied) if self.applied else "nothing to apply"
        text = f"at version {self.version} ({how}, {self.bytes_read} bytes read"
        return text + (f"; {len(self.problems)} problem(s): {_summary(self.problems, 2)})" if self.problems else ")")


class StateCheck:
    """The signed state hash of a state already written in place, computed in a background thread.

    Created by ``WeightSubscriber.sync(..., check="background")``. The arrays must not be written
    until the check is done (the subscriber's next sync waits for it first). hashlib releases the
    interpreter lock while hashing, so the caller's thread runs on meanwhile.
    """

    def __init__(self, state: State, expect: str, version: int):
        self.version, self._state, self._expect = version, state, expect
        self.error: IntegrityError | None = None
        self.seconds: float | None = None
        """Wall seconds the hash took (None while it runs)."""
        self.cpu_seconds: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"stoa-state-check-{version}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            got = pulse.state_hash(self._state)
            if got != self._expect:
                self.error = IntegrityError(
                    f"the state written in place for version {self.version} hashes to {got[:12]}..., not the signed "
                    f"{self._expect[:12]}... (the held state was not what it claimed, or was changed)")
        except Exception as e:  # noqa: BLE001 - reported to whoever waits
            self.error = IntegrityError(f"the state of version {self.version} could not be checked: "
                                        f"{type(e).__name__}: {e}")
        finally:
            self.cpu_seconds, self.seconds = time.thread_time() - c0, time.perf_counter() - t0
            self._state = None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the check: True when it passed, False if ``timeout`` passed first; raises
        :class:`IntegrityError` when the state does not match the signed hash."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        if self.error is not None:
            raise self.error
        return True


class _Corrupt(Exception):
    def __init__(self, route: tuple[int, str], msg: str):
        super().__init__(msg)
        self.route = route


class WeightSubscriber:
    """A worker's side: follows a run's signed chain.

    Args:
        store: the run's object store.
        run: the run's key prefix.
        public_key: the run's ed25519 public key (object, raw bytes, hex, PEM, or a file path).

    Keep one subscriber for the life of a worker: it remembers the newest pointer it verified
    (heads never go back), which manifest the state it last returned belongs to, and the
    manifests it verified (by content hash, so a follow-up sync reads only what is new).
    """

    def __init__(self, store: ObjectStore, run: str, public_key: Any):
        self.store, self._keys = store, Layout(run)
        self.run = self._keys.run
        self.public_key = load_public_key(public_key)
        self._cache: OrderedDict[str, tuple[Manifest, int]] = OrderedDict()  # manifest sha -> (manifest, bytes)
        self._cache_bytes = 0
        self._best: Pointer | None = None  # newest pointer verified
        self._held: tuple[int, str] | None = None  # (version, manifest sha) of the state sync last returned
        self._pending: StateCheck | None = None  # the background check of that state, if any
        self._read = 0
        self.last_problems: list[str] = []
        """Problems the last :meth:`head` met (an ignored or unreadable pointer)."""

    def _get(self, key: str, max_bytes: int) -> bytes:
        b = self.store.get(key, max_bytes=max_bytes)
        self._read += len(b)
        return b

    # -- pointer ----------------------------------------------------------------------------------
    def _read_pointer(self) -> Pointer | None:
        where = self._keys.pointer
        err: SignatureError | None = None
        for _ in range(2):  # a broken transfer is read again once
            try:
                blob = self._get(where, MAX_POINTER_BYTES)
            except KeyNotFound:
                return None
            except ObjectTooLarge as e:
                raise PointerError(f"{where}: {e.size} bytes, over the {MAX_POINTER_BYTES}-byte pointer limit") from None
            try:
                return Pointer.parse(open_document(blob, "pointer", self.public_key, where), run=self.run, where=where)
            except SignatureError as e:
                err = e
        raise PointerError(f"{err}; cannot tell which version is committed")

    def _newest(self, problems: list[str]) -> Pointer | None:
        """The store's pointer, unless it is older than (or forks from) one already seen."""
        best = self._best
        try:
            p = self._read_pointer()
        except PointerError as e:
            if best is None:
                raise
            problems.append(f"{e}; staying with version {best.version}")
            return best
        if p is None or best is None:
            if p is None and best is not None:
                problems.append(f"{self._keys.pointer} is missing; staying with version {best.version}")
            self._best = p or best
            return self._best
        if p.version < best.version:
            problems.append(f"{self._keys.pointer} names version {p.version}, older than version {best.version} "
                            "already seen: a rolled-back pointer, ignored")
            return best
        if p.version == best.version and p.manifest_sha256 != best.manifest_sha256:
            problems.append(f"{self._keys.pointer} names another manifest for version {p.version} than the one "
                            "already seen (a fork after a rollback?); ignored until a newer version")
            return best
        self._best = p
        return p

    def head(self) -> int | None:
        """The newest committed version, or None if nothing was published yet.

        Monotonic for this subscriber: an older or forked pointer is ignored (see
        :attr:`last_problems`), and so is an unreadable one once a version was seen.

        Raises:
            PointerError: the pointer does not verify and no version was seen before.
            stoa.transport.store.StoreError: the store failed.
        """
        problems: list[str] = []
        p = self._newest(problems)
        self.last_problems = problems
        for msg in problems:
            log.warning("%s", msg)
        return None if p is None else p.version

    # -- manifests --------------------------------------------------------------------------------
    def _remember(self, sha: str, m: Manifest, size: int) -> None:
        if sha in self._cache:
            return
        self._cache[sha] = (m, size)
        self._cache_bytes += size
        while self._cache_bytes > _CACHE_BYTES and len(self._cache) > 1:
            _, (_, n) = self._cache.popitem(last=False)
            self._cache_bytes -= n

    def _fetch(self, version: int, expect_sha256: str | None = None) -> tuple[Manifest, str]:
        """Read, verify and parse ``version``'s manifest object; returns it and its sha256.

        Raises KeyNotFound, SignatureError, or IntegrityError (not the object ``expect_sha256`` names).
        """
        key = self._keys.manifest(version)
        try:
            blob = self._get(key, MAX_MANIFEST_BYTES)
        except ObjectTooLarge as e:
            raise IntegrityError(f"{key}: {e.size} bytes, over the {MAX_MANIFEST_BYTES}-byte manifest limit") from None
        sha = _sha(blob)
        if expect_sha256 is not None and sha != expect_sha256:
            try:  # a forgery is reported as such; anything else as a mismatch
                open_document(blob, "manifest", self.public_key, key)
            except SignatureError as e:
                raise IntegrityError(f"{e} (not the manifest its successor names)") from None
            raise IntegrityError(f"{key}: not the manifest its successor names (sha256 {sha[:12]}... "
                                 f"instead of {expect_sha256[:12]}...): replaced since, or a fork")
        if sha in self._cache:
            self._cache.move_to_end(sha)
            return self._cache[sha][0], sha
        body = open_document(blob, "manifest", self.public_key, key)
        m = Manifest.parse(body, run=self.run, version=version, where=key)
        self._remember(sha, m, len(blob))
        return m, sha

    def _pinned(self, version: int, sha: str, problems: list[str]) -> Manifest | None:
        """The manifest of ``version`` whose object hashes to ``sha`` (cached), or None if it is
        gone (retention) or not intact after a second read (reported)."""
        if sha in self._cache:
            self._cache.move_to_end(sha)
            m = self._cache[sha][0]
            return m if m.version == version else None
        for attempt in range(2):
            try:
                return self._fetch(version, sha)[0]
            except KeyNotFound:
                return None
            except (IntegrityError, SignatureError) as e:
                if attempt:
                    problems.append(str(e))
                    log.warning("%s", e)
        return None

    def manifest(self, version: int) -> Manifest:
        """The verified manifest stored for ``version`` (raises KeyNotFound if there is none).

        For inspection: it is whatever the store holds at that version now, checked for
        signature, run and version, but not tied to the chain the pointer names.
        """
        return self._fetch(check_version(version))[0]

    # -- sync -------------------------------------------------------------------------------------
    def _settle(self, problems: list[str]) -> None:
        """Wait for the last background check; a held state that failed it is no longer trusted."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.wait()
        except IntegrityError as e:
            if self._held is not None and self._held[0] == pending.version:
                self._held = None
            problems.append(f"{e}; re-checking the held state against the store")

    def sync(self, have: tuple[int, State] | None = None, apply_inplace: bool = False,
             version: int | None = None, check: str = "now") -> SyncResult:
        """Bring ``have`` (``(version, state)``, or None for a new worker) to the newest version.

        ``version``: stop at this older version of the head's chain instead (a study's forced
        staleness, ``rollout.lag``); it is reached by the same verified route, and ignored when it
        is not older than the head.

        ``check``: ``"now"`` verifies the result before anything is written. ``"background"``
        (with ``apply_inplace``, from a held state this subscriber verified) writes deltas whose
        payloads verified and returns at once, with the state hash still being computed in
        ``SyncResult.check``; if that check fails the held state is damaged, and the next sync
        (which waits for the check first) treats it as not what it claims: it is verified against
        the store and replaced through an anchor if needed.

        Takes whichever route moves fewer bytes: the deltas after ``have``, or a newer anchor
        plus the deltas after it. Every object is verified (signature, size, sha256) before
        use and the result against the head's signed state hash before it replaces anything.
        With ``apply_inplace=True`` deltas are written into ``have``'s arrays once verified (a
        live engine sees them without reloading), and an anchor route copies into them when the
        layout matches. A held state that is not what it claims, or not on the head's chain, is
        replaced through an anchor like a new worker's. If the store's pointer is older than
        ``have`` (rolled back), the held state is returned unchanged and the fact is reported.

        Raises (see :data:`SYNC_ERRORS`; the held state is untouched in every case):
            ChainError: nothing was published yet.
            IntegrityError: nothing intact leads to the head (the problems are listed).
            PointerError: the pointer does not verify and no version was seen before.
            stoa.transport.store.StoreError: the store failed.
        """
        if check not in SYNC_CHECKS:
            raise ValueError(f"check must be one of {SYNC_CHECKS}, not {check!r}")
        if have is not None:
            check_version(have[0], "held version")
            _check_state(have[1])
        self._read = 0
        problems: list[str] = []
        self._settle(problems)
        banned: set[tuple[int, str]] = set()
        tried: set[str] = set()
        for _ in range(_SYNC_ATTEMPTS):
            ptr = self._newest(problems)
            if ptr is None:
                raise ChainError(f"run {self.run!r} has no published weights yet ({self._keys.pointer} is missing)")
            head = ptr.version
            if have is not None and have[0] > head:
                problems.append(f"the newest version in the store is {head}, older than the held version {have[0]}: "
                                "kept the held weights")
                return SyncResult(have[0], have[1], self._read, [], [], True, problems)
            held_sha = self._held[1] if have is not None and self._held and self._held[0] == have[0] else None
            if have is not None and have[0] == head and held_sha == ptr.manifest_sha256:
                return SyncResult(head, have[1], self._read, [], [], True, problems,
                                  self._cache.get(held_sha, (None,))[0], held_sha)
            target = self._pinned(head, ptr.manifest_sha256, problems)
            if target is None:
                if ptr.manifest_sha256 in tried:
                    break
                tried.add(ptr.manifest_sha256)
                problems.append(f"version {head}'s manifest is missing or not intact; reading the pointer again")
                continue
            if version is not None and check_version(version) < head:
                ptr, target = self._ancestor(ptr, target, version, problems)
                head = ptr.version
                if have is not None and have[0] == head and held_sha == ptr.manifest_sha256:
                    return SyncResult(head, have[1], self._read, [], [], True, problems, target, held_sha)
            if have is not None and have[0] == head and (head, "have") not in banned:
                if held_sha is None and pulse.state_hash(have[1]) == target.state_hash:
                    self._held = (head, ptr.manifest_sha256)
                    return SyncResult(head, have[1], self._read, [], [], True, problems, target, ptr.manifest_sha256)
                problems.append(f"the held state is not version {head} as the store has it; re-joining from an anchor")
                banned.add((head, "have"))
            try:
                anchor, deltas, chain = self._plan(target, ptr.manifest_sha256, have, held_sha, banned, problems)
                defer = check == "background" and held_sha is not None
                res = self._execute(ptr, target, anchor, deltas, chain, have, apply_inplace, problems, defer)
                self._held, self._pending = (res.version, ptr.manifest_sha256), res.check
                return res
            except _Corrupt as e:
                banned.add(e.route)
                problems.append(str(e))
            except KeyNotFound as e:
                problems.append(f"{e} (deleted by retention while syncing); planning again")
        raise IntegrityError(f"could not sync run {self.run!r}: {_summary(problems) or 'no intact route'}")

    def _ancestor(self, ptr: Pointer, target: Manifest, version: int, problems: list[str]) -> tuple[Pointer, Manifest]:
        """The manifest of ``version`` on the chain that ends at ``target`` (parent hashes walked
        down), with a pointer-like record naming it."""
        m, sha = target, ptr.manifest_sha256
        while m.version > version:
            if m.parent is None or m.parent_manifest_sha256 is None:
                raise IntegrityError(f"version {version} is not on the chain of version {ptr.version}")
            sha = m.parent_manifest_sha256
            nxt = self._pinned(m.parent, sha, problems)
            if nxt is None:
                raise IntegrityError(f"version {m.parent} (on the way down to {version}) is gone or not intact")
            m = nxt
        if m.version != version:
            raise IntegrityError(f"version {version} is not on the chain of version {ptr.version}")
        return dataclasses.replace(ptr, version=m.version, manifest_sha256=sha), m

    def _plan(self, target: Manifest, target_sha: str, have: tuple[int, State] | None, held_sha: str | None,
              banned: set, problems: list[str]) -> tuple[int | None, list[int], dict[int, Manifest]]:
        """Cheapest route to ``target``: (anchor version or None for "from have", delta versions
        ascending, the manifests on the way by version). Walks down the hash-linked chain."""
        best: tuple[int, int | None, list[int]] | None = None  # (bytes, anchor, deltas)
        have_v = None if have is None or (have[0], "have") in banned else have[0]
        chain: dict[int, Manifest] = {}
        suffix: list[int] = []
        cost, m, sha = 0, target, target_sha
        while True:
            v = m.version
            chain[v] = m
            if have_v is not None and v <= have_v:
                if v == have_v and held_sha in (None, sha):
                    if best is None or cost < best[0]:
                        best = (cost, None, suffix[::-1])
                    break  # anything further down costs more than the deltas from here
                problems.append(f"held version {have_v} is not on the chain of version {target.version}; "
                                "re-planning from an anchor")
                have_v = None
            if m.anchor is not None and (v, "anchor") not in banned:
                c = cost + m.anchor.bytes
                if best is None or c < best[0]:
                    best = (c, v, suffix[::-1])
            if best is not None and have_v is None:
                break  # an older anchor only adds deltas
            if m.delta is None or (v, "delta") in banned or m.parent is None:
                break
            cost += m.delta.bytes
            if best is not None and cost >= best[0]:
                break
            suffix.append(v)
            sha = m.parent_manifest_sha256  # type: ignore[assignment]
            nxt = self._pinned(m.parent, sha, problems)
            if nxt is None:
                break
            m = nxt
        if best is None:
            raise IntegrityError(f"no intact route to version {target.version} of run {self.run!r}"
                                 + (f" (problems: {_summary(problems)})" if problems else ""))
        return best[1], best[2], chain

    def _payload(self, m: Manifest, kind: str, problems: list[str]) -> bytes:
        entry: Payload = getattr(m, kind)
        key = self._keys.payload(m.version, kind)
        for attempt in range(2):
            try:
                blob = self._get(key, entry.bytes)
            except ObjectTooLarge as e:
                raise _Corrupt((m.version, kind), f"{key}: {e.size} bytes, the signed manifest says {entry.bytes} "
                                                  "(not downloaded); routing around it") from None
            except KeyNotFound:  # deleted by retention under us: ban this route so the next plan differs
                raise _Corrupt((m.version, kind), f"{key} is gone (retention deleted it while syncing); "
                                                  "planning another route") from None
            if len(blob) == entry.bytes and _sha(blob) == entry.sha256:
                return blob
            msg = (f"{key}: {len(blob)} bytes with sha256 {_sha(blob)[:12]}..., the signed manifest says "
                   f"{entry.bytes} bytes with {entry.sha256[:12]}... (corrupted or truncated)")
            if attempt == 0:
                problems.append(msg + "; fetching again")
            log.warning("%s", msg)
        raise _Corrupt((m.version, kind), msg + "; routing around it")

    def _execute(self, ptr: Pointer, target: Manifest, anchor: int | None, deltas: list[int],
                 chain: dict[int, Manifest], have: tuple[int, State] | None, inplace: bool,
                 problems: list[str], defer: bool = False) -> SyncResult:
        head, sha = ptr.version, ptr.manifest_sha256
        blobs = [self._payload(chain[v], "delta", problems) for v in deltas]  # all verified before any write
        applied: list[tuple[int, str]] = []
        if anchor is None:
            assert have is not None
            route: tuple[int, str] = (have[0], "have")
            claimed = " (the state passed in was not the version it claimed)"
            if inplace and defer:  # payloads verified; the result is hashed in the background
                try:
                    changed = pulse.apply_deltas_inplace(have[1], blobs)
                except pulse.PulseError as e:
                    raise _Corrupt(route, f"deltas from held version {have[0]} do not apply: {e}") from None
                return SyncResult(head, have[1], self._read, [(v, "delta") for v in deltas], changed, True,
                                  problems, target, sha, StateCheck(have[1], target.state_hash, head))
            if inplace:
                try:
                    changed = pulse.apply_deltas_verified(have[1], blobs, target.state_hash)
                except pulse.PulseError as e:
                    raise _Corrupt(route, f"deltas from held version {have[0]} do not lead to version {head}: "
                                          f"{e}{claimed}") from None
                return SyncResult(head, have[1], self._read, [(v, "delta") for v in deltas], changed, True,
                                  problems, target, sha)
            state = {k: np.array(a, copy=True, order="C") for k, a in have[1].items()}
            changed_set: set[str] = set()
        else:
            route, claimed = (anchor, "anchor"), ""
            try:
                state = pulse.decode_state(self._payload(chain[anchor], "anchor", problems))
            except pulse.PulseError as e:
                raise _Corrupt(route, f"anchor {anchor} does not decode although its hash matched: {e}") from None
            applied.append((anchor, "anchor"))
            changed_set = set(state)
        for v, blob in zip(deltas, blobs):
            try:
                changed_set.update(pulse.apply_delta_inplace(state, blob))
            except pulse.PulseError as e:
                raise _Corrupt(route, f"delta {v} does not apply: {e}{claimed}") from None
            applied.append((v, "delta"))
        if pulse.state_hash(state) != target.state_hash:
            raise _Corrupt(route, f"state after {applied} does not match the signed state hash of version "
                                  f"{head}{claimed}")
        used_inplace = False
        if anchor is not None and have is not None:
            old = have[1]
            changed_set = {n for n in state if n not in old or not _same_bytes(old[n], state[n])}
            changed_set |= set(old) - set(state)
            if inplace and set(old) == set(state) and all(
                    old[n].shape == state[n].shape and old[n].dtype == state[n].dtype and old[n].flags.writeable
                    for n in state):
                for n in changed_set:
                    np.copyto(old[n], state[n])
                state, used_inplace = old, True
        return SyncResult(head, state, self._read, applied, sorted(changed_set), used_inplace, problems, target, sha)
