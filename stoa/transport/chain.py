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

**Heads never go back.** Pointers are ordered by when the run's key signed them
(``Pointer.created``). A subscriber remembers the newest pointer it verified; a pointer signed
before it, even a validly signed one put back by anyone with write access to the store, is
reported and ignored. A newer-signed pointer at a lower or equal version (the trainer restarted
from an older state: a fork) is followed, and the held state, which belongs to the other branch,
is replaced through an anchor: one label never names two states on one worker. A subscriber
also remembers which manifest the state it returned belongs to: if the chain it later follows
does not pass through that manifest, the held state is not used as a base. A brand-new
subscriber lists the manifests above the pointer and refuses the pointer
(:class:`StalePointer`) when the run's key signed newer manifests built past it; only an
attacker who can also delete those manifests can still roll a newcomer back (see
``docs/transport.md``). The publisher rewrites such a pointer to the newest intact manifest.

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

**Shares.** With ``shares=True`` (the default) each manifest also signs the state hash of every
share of the state (one per decoder layer, the embeddings, the head: :mod:`stoa.transport.shares`)
and, for an anchor, its safetensors header's size and sha256 (format ``stoa.weights.manifest/3``).
A pipeline stage follows the chain with :class:`ShareSubscriber`: the same checks, but it
range-reads only its share of an anchor and verifies exactly the tensors it holds. Whole-model
subscribers ignore the shares and still read ``/2`` manifests.

**Retention.** :meth:`WeightPublisher.gc` keeps the versions from the ``keep_anchors``-th newest
anchor on the chain up to the pointer and deletes older versions and orphans (uncommitted
leftovers below the pointer). Keys under ``weights/`` that are not this layout are skipped and
reported, never deleted and never an error.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stoa.transport import pulse, shares, tensorfile
from stoa.transport.manifest import Layout, Manifest, Payload, Pointer, Shares, check_version
from stoa.transport.signing import SignatureError, load_private_key, sign_document
from stoa.transport.store import KeyNotFound, ObjectStore, StoreError, validate_key
from stoa.transport.subscriber import (  # noqa: F401 - re-exported: the chain's one import path
    SYNC_CHECKS,
    SYNC_ERRORS,
    ChainError,
    IntegrityError,
    PointerError,
    ShareSubscriber,
    StalePointer,
    StateCheck,
    SyncResult,
    WeightSubscriber,
    State,
    check_state,
    sha256_hex,
    shown_key,
)

__all__ = [
    "SYNC_CHECKS",
    "SYNC_ERRORS",
    "ChainError",
    "IntegrityError",
    "PointerError",
    "PublishResult",
    "Retention",
    "StalePointer",
    "StateCheck",
    "ShareSubscriber",
    "SyncResult",
    "WeightPublisher",
    "WeightSubscriber",
]

log = logging.getLogger(__name__)

_MAX_METADATA_BYTES = 256 << 10

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
        shares: sign per-share hashes (:mod:`stoa.transport.shares`) in every manifest, so a
            pipeline stage can follow the chain for its layers only (:class:`ShareSubscriber`).
            Manifests then have format ``stoa.weights.manifest/3``, which releases before it
            refuse; False writes the ``/2`` format they read.

    A publisher that starts on a run that already has versions resumes from the pointer: it
    syncs the head state from the store (verifying it) to diff the next version against,
    through its one :class:`WeightSubscriber` (:attr:`subscriber`), which it also uses for
    :meth:`head`, pointer repair and retention. A pointer that does not verify (garbled,
    forged) is rewritten to the newest intact manifest. The publisher keeps a private copy of
    the last published state.
    """

    def __init__(self, store: ObjectStore, run: str, private_key: Any, anchor_every: int = 50,
                 anchor_if_delta_over: float = 0.5, keep_anchors: int | None = 2, keep_seconds: float = 600.0,
                 shares: bool = True):
        if not isinstance(anchor_every, int) or anchor_every < 1:
            raise ValueError(f"anchor_every must be an int >= 1, got {anchor_every!r}")
        if not 0 < anchor_if_delta_over <= 1:
            raise ValueError(f"anchor_if_delta_over must lie in (0, 1], got {anchor_if_delta_over}")
        if keep_anchors is not None and keep_anchors < 1:
            raise ValueError("keep_anchors must be >= 1 or None")
        if not keep_seconds >= 0:
            raise ValueError(f"keep_seconds must be >= 0, got {keep_seconds}")
        self.keep_seconds, self.shares = float(keep_seconds), bool(shares)
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
                _, sha = self.subscriber.fetch_manifest(v)
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
        check_state(state)
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
        h, signed = self._hashes(state, anchor)
        man = Manifest(
            self.run, version, None if prev is None else prev.version, None if prev is None else prev.manifest_sha256,
            h, depth, version if anchor is not None else prev.manifest.anchor_version,  # type: ignore[union-attr]
            None if anchor is None else Payload(len(anchor), sha256_hex(anchor)),
            None if delta is None else Payload(len(delta), sha256_hex(delta)),
            full_bytes, len(state), meta, time.time(), signed)
        manifest = sign_document("manifest", man.to_body(), self._key)
        pointer = sign_document("pointer", Pointer(self.run, version, sha256_hex(manifest), time.time()).to_body(), self._key)
        written = 0
        for kind, blob in (("anchor", anchor), ("delta", delta)):
            if blob is not None:
                self.store.put(self._keys.payload(version, kind), blob)
                written += len(blob)
        self.store.put(self._keys.manifest(version), manifest)
        self.store.put(self._keys.pointer, pointer)
        written += len(manifest) + len(pointer)
        self._prev = _Published(version, {k: np.array(v, copy=True, order="C") for k, v in state.items()},
                                man, sha256_hex(manifest))
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

    def _hashes(self, state: State, anchor: bytes | None) -> tuple[str, Shares | None]:
        """The state hash and, when this publisher signs shares, each share's (one pass)."""
        if not self.shares:
            return pulse.state_hash(state), None
        h, per = pulse.state_hashes(state, shares.share_of)
        if len(per) > shares.MAX_SHARES:
            log.warning("the state has %d shares (over %d); publishing without per-share hashes",
                        len(per), shares.MAX_SHARES)
            return h, None
        hdr = None
        if anchor is not None:
            n = 8 + tensorfile.header_length(anchor[:8])
            hdr = Payload(n, sha256_hex(anchor[:n]))
        return h, Shares(shares.SHARE_RULE, per, hdr)

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
        ptr = sub.newest_pointer(problems)
        skipped: list[str] = []
        if ptr is None:
            return Retention([], skipped)
        keep, anchors, now = set(), 0, time.time()
        m = sub.pinned_manifest(ptr.version, ptr.manifest_sha256, problems)
        while m is not None:
            keep.add(m.version)
            if m.anchor is not None:
                anchors += 1
                if anchors >= keep_anchors and now - m.created >= keep_seconds:
                    break
            if m.parent is None:
                break
            m = sub.pinned_manifest(m.parent, m.parent_manifest_sha256, problems)  # type: ignore[arg-type]
        if anchors < keep_anchors:
            return Retention([], skipped)  # too few anchors yet (or a broken walk): everything may still be needed
        doomed: dict[int, list[str]] = {}
        for key in self.store.list(self._keys.weights):
            try:
                validate_key(key)
            except ValueError as e:
                skipped.append(f"{shown_key(key)}: not a valid key ({e}); skipped")
                continue
            ver = self._keys.version_of(key)
            if ver is None:
                skipped.append(f"{shown_key(key)}: not <version:012d>/<manifest.json|anchor.safetensors|delta.pulse>; "
                               "skipped")
            elif ver <= ptr.version and ver not in keep:
                doomed.setdefault(ver, []).append(key)
        deleted = []
        for ver in sorted(doomed):
            for key in sorted(doomed[ver], key=lambda k: not k.endswith("manifest.json")):
                self.store.delete(key)
                deleted.append(key)
        return Retention(deleted, skipped)
