"""Following a run's signed weight chain: :class:`WeightSubscriber` (the worker's side of
:mod:`stoa.transport.chain`, where the layout, commit order and guarantees are described): the
pointer it trusts, the manifests it verifies and caches, and the cheapest verified route from the
state it holds to the head. What a sync returns and raises is :mod:`stoa.transport.sync`; a
pipeline stage follows with :class:`stoa.transport.share_subscriber.ShareSubscriber`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Any

import numpy as np

from stoa.transport import pulse
from stoa.transport.manifest import MAX_MANIFEST_BYTES, MAX_POINTER_BYTES, Layout, Manifest, Payload, Pointer, check_version
from stoa.transport.signing import SignatureError, load_public_key, open_document
from stoa.transport.store import KeyNotFound, ObjectStore, ObjectTooLarge
from stoa.transport.sync import (
    SYNC_CHECKS,
    ChainError,
    IntegrityError,
    PointerError,
    RouteCorrupt,
    StalePointer,
    State,
    StateCheck,
    SyncResult,
    check_state,
    same_bytes,
    sha256_hex,
    summary,
)

__all__ = ["WeightSubscriber"]

log = logging.getLogger(__name__)

# Verified manifests a subscriber keeps (by content hash): the newest, at most this many and this
# many stored bytes. A parsed manifest takes about 5x its stored bytes in memory; a sync walks at
# most the versions since an anchor, so a miss only costs a re-read. (Bounded by 64 MB of stored
# bytes alone, a small model's follower grew ~5.7 KB a version until the bound: a soak publishing
# ~2 versions a second grew its trainer and workers by 15-25 MB an hour.)
_CACHE_ENTRIES = 256
_CACHE_BYTES = 16 << 20
_SYNC_ATTEMPTS = 16  # each failed attempt bans one route or follows a moved pointer
_FRESH_PROBES = 8  # manifests above a new subscriber's first pointer read to check it is current
_DESCENT_STEPS = 4096


class WeightSubscriber:
    """A worker's side: follows a run's signed chain.

    Args:
        store: the run's object store.
        run: the run's key prefix.
        public_key: the run's ed25519 public key (object, raw bytes, hex, PEM, or a file path).

    Keep one subscriber for the life of a worker: it remembers the newest pointer it verified
    (heads never go back), which manifest the state it last returned belongs to, and the
    manifests it verified (by content hash, so a follow-up sync reads only what is new; the
    newest ``manifest_cache_entries`` of them).
    """

    manifest_cache_entries = _CACHE_ENTRIES

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

    def newest_pointer(self, problems: list[str]) -> Pointer | None:
        """The store's pointer, unless the run's key already signed a newer one that this
        subscriber saw (an older pointer put back) or, for a new subscriber, newer manifests."""
        best = self._best
        try:
            p = self._read_pointer()
        except PointerError as e:
            if best is None:
                raise
            problems.append(f"{e}; staying with version {best.version}")
            return best
        if p is None:
            if best is not None:
                problems.append(f"{self._keys.pointer} is missing; staying with version {best.version}")
            return best
        if best is None:
            self._check_fresh(p)
        elif (p.version, p.manifest_sha256) != (best.version, best.manifest_sha256):
            if p.created > best.created and p.version < best.version:
                problems.append(f"the run's key published version {p.version} after version {best.version} (the "
                                "trainer restarted from an older state): following it")
            elif p.created > best.created and p.version == best.version:
                problems.append(f"the run's key signed another manifest for version {p.version} after the one "
                                "already seen (a fork after a restart): following the newer one")
            elif p.created <= best.created and not (p.version > best.version and self._descends(p, best)):
                what = "older than" if p.version < best.version else "signed before"
                problems.append(f"{self._keys.pointer} names version {p.version}, {what} version {best.version} "
                                "already seen: a rolled-back pointer, ignored")
                return best
        self._best = p
        return p

    def _check_fresh(self, p: Pointer) -> None:
        """For a subscriber that saw no pointer yet: refuse ``p`` if the run's key signed manifests
        after it that were built past it (the pointer was put back). One manifest signed after
        the pointer and built on it is a publish in progress, not a rollback."""
        later: list[Manifest] = []
        versions = sorted({v for k in self.store.list(self._keys.weights)
                           if (v := self._keys.version_of(k)) is not None and v > p.version}, reverse=True)
        for v in versions[:_FRESH_PROBES]:
            try:
                m = self.fetch_manifest(v)[0]
            except (KeyNotFound, ChainError, SignatureError):
                continue  # not the run key's word: cannot lower the bound
            if m.created > p.created:
                later.append(m)
        if len(later) > 1 or (later and later[0].parent_manifest_sha256 != p.manifest_sha256):
            raise StalePointer(
                f"{self._keys.pointer} names version {p.version}, but the run's key signed version "
                f"{max(m.version for m in later)} after it: the pointer was rolled back. Refusing to start from "
                "it; waiting for the trainer to publish again (or ask the operator)")

    def _descends(self, p: Pointer, best: Pointer) -> bool:
        """Whether ``p``'s manifest chain passes through ``best``'s (a newer version whose publisher's
        clock stepped back is still followed)."""
        problems: list[str] = []
        m, sha = self.pinned_manifest(p.version, p.manifest_sha256, problems), p.manifest_sha256
        for _ in range(_DESCENT_STEPS):
            if m is None or m.version < best.version:
                return False
            if m.version == best.version:
                return sha == best.manifest_sha256
            if m.parent is None or m.parent_manifest_sha256 is None:
                return False
            sha = m.parent_manifest_sha256
            m = self.pinned_manifest(m.parent, sha, problems)
        return False

    def head(self) -> int | None:
        """The newest committed version, or None if nothing was published yet.

        Pointers are ordered by the run key's signature time (``Pointer.created``): one signed
        before the newest seen is ignored (a rollback; see :attr:`last_problems`), and so is an
        unreadable one once a version was seen. A newer-signed pointer at a lower or equal version
        (the trainer restarted from an older state: a fork) is followed, and :meth:`sync` then
        replaces the held state, so an old state never serves under a reused label.

        Raises:
            StalePointer: no version was seen before and the store holds newer signed manifests
                built past the pointer (it was rolled back).
            PointerError: the pointer does not verify and no version was seen before.
            stoa.transport.store.StoreError: the store failed.
        """
        problems: list[str] = []
        p = self.newest_pointer(problems)
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
        while len(self._cache) > 1 and (self._cache_bytes > _CACHE_BYTES
                                        or len(self._cache) > self.manifest_cache_entries):
            _, (_, n) = self._cache.popitem(last=False)
            self._cache_bytes -= n

    def fetch_manifest(self, version: int, expect_sha256: str | None = None) -> tuple[Manifest, str]:
        """Read, verify and parse ``version``'s manifest object; returns it and its sha256.

        Raises KeyNotFound, SignatureError, or IntegrityError (not the object ``expect_sha256`` names).
        """
        key = self._keys.manifest(version)
        try:
            blob = self._get(key, MAX_MANIFEST_BYTES)
        except ObjectTooLarge as e:
            raise IntegrityError(f"{key}: {e.size} bytes, over the {MAX_MANIFEST_BYTES}-byte manifest limit") from None
        sha = sha256_hex(blob)
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

    def pinned_manifest(self, version: int, sha: str, problems: list[str]) -> Manifest | None:
        """The manifest of ``version`` whose object hashes to ``sha`` (cached), or None if it is
        gone (retention) or not intact after a second read (reported)."""
        if sha in self._cache:
            self._cache.move_to_end(sha)
            m = self._cache[sha][0]
            return m if m.version == version else None
        for attempt in range(2):
            try:
                return self.fetch_manifest(version, sha)[0]
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
        return self.fetch_manifest(check_version(version))[0]

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
        staleness, ``rollout.lag``, or the version a worker's batch number is bound to); it is
        reached by the same verified route, also from a held state newer than it, and ignored
        when it is not older than the head.

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
        replaced through an anchor like a new worker's. A pointer signed before the newest
        one seen is ignored (see :meth:`head`); if the head the run's key signed last is older than
        ``have`` (a restart from an older state), ``have`` is from another branch and is replaced
        through an anchor too.

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
            check_state(have[1])
        self._read = 0
        problems: list[str] = []
        self._settle(problems)
        banned: set[tuple[int, str]] = set()
        tried: set[str] = set()
        for _ in range(_SYNC_ATTEMPTS):
            ptr = self.newest_pointer(problems)
            if ptr is None:
                raise ChainError(f"run {self.run!r} has no published weights yet ({self._keys.pointer} is missing)")
            head = ptr.version
            if have is not None and have[0] > head and (have[0], "have") not in banned:
                problems.append(f"the newest version the run's key signed is {head}, older than the held version "
                                f"{have[0]}: the held state is from another branch; re-joining from an anchor")
                banned.add((have[0], "have"))
            held_sha = self._held[1] if have is not None and self._held and self._held[0] == have[0] else None
            older = version is not None and version < head  # asked for an older version than the head
            if have is not None and have[0] == head and held_sha == ptr.manifest_sha256 and not older:
                return SyncResult(head, have[1], self._read, [], [], True, problems,
                                  self._cache.get(held_sha, (None,))[0], held_sha)
            target = self.pinned_manifest(head, ptr.manifest_sha256, problems)
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
                if held_sha is None and self._matches(have[1], target):
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
            except RouteCorrupt as e:
                banned.add(e.route)
                problems.append(str(e))
            except KeyNotFound as e:
                problems.append(f"{e} (deleted by retention while syncing); planning again")
        raise IntegrityError(f"could not sync run {self.run!r}: {summary(problems) or 'no intact route'}")

    def _matches(self, state: State, m: Manifest) -> bool:
        """Whether a state handed in is the one ``m`` signs."""
        return pulse.state_hash(state) == m.state_hash

    def _anchor_cost(self, m: Manifest) -> int:
        """Bytes a route through ``m``'s anchor fetches for it."""
        return m.anchor.bytes  # type: ignore[union-attr]

    def _ancestor(self, ptr: Pointer, target: Manifest, version: int, problems: list[str]) -> tuple[Pointer, Manifest]:
        """The manifest of ``version`` on the chain that ends at ``target`` (parent hashes walked
        down), with a pointer-like record naming it."""
        m, sha = target, ptr.manifest_sha256
        while m.version > version:
            if m.parent is None or m.parent_manifest_sha256 is None:
                raise IntegrityError(f"version {version} is not on the chain of version {ptr.version}")
            sha = m.parent_manifest_sha256
            nxt = self.pinned_manifest(m.parent, sha, problems)
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
                c = cost + self._anchor_cost(m)
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
            nxt = self.pinned_manifest(m.parent, sha, problems)
            if nxt is None:
                break
            m = nxt
        if best is None:
            raise IntegrityError(f"no intact route to version {target.version} of run {self.run!r}"
                                 + (f" (problems: {summary(problems)})" if problems else ""))
        return best[1], best[2], chain

    def _payload(self, m: Manifest, kind: str, problems: list[str]) -> bytes:
        entry: Payload = getattr(m, kind)
        key = self._keys.payload(m.version, kind)
        for attempt in range(2):
            try:
                blob = self._get(key, entry.bytes)
            except ObjectTooLarge as e:
                raise RouteCorrupt((m.version, kind), f"{key}: {e.size} bytes, the signed manifest says {entry.bytes} "
                                                  "(not downloaded); routing around it") from None
            except KeyNotFound:  # deleted by retention under us: ban this route so the next plan differs
                raise RouteCorrupt((m.version, kind), f"{key} is gone (retention deleted it while syncing); "
                                                  "planning another route") from None
            if len(blob) == entry.bytes and sha256_hex(blob) == entry.sha256:
                return blob
            msg = (f"{key}: {len(blob)} bytes with sha256 {sha256_hex(blob)[:12]}..., the signed manifest says "
                   f"{entry.bytes} bytes with {entry.sha256[:12]}... (corrupted or truncated)")
            if attempt == 0:
                problems.append(msg + "; fetching again")
            log.warning("%s", msg)
        raise RouteCorrupt((m.version, kind), msg + "; routing around it")

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
                    raise RouteCorrupt(route, f"deltas from held version {have[0]} do not apply: {e}") from None
                return SyncResult(head, have[1], self._read, [(v, "delta") for v in deltas], changed, True,
                                  problems, target, sha, StateCheck(have[1], target.state_hash, head))
            if inplace:
                try:
                    changed = pulse.apply_deltas_verified(have[1], blobs, target.state_hash)
                except pulse.PulseError as e:
                    raise RouteCorrupt(route, f"deltas from held version {have[0]} do not lead to version {head}: "
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
                raise RouteCorrupt(route, f"anchor {anchor} does not decode although its hash matched: {e}") from None
            applied.append((anchor, "anchor"))
            changed_set = set(state)
        for v, blob in zip(deltas, blobs):
            try:
                changed_set.update(pulse.apply_delta_inplace(state, blob))
            except pulse.PulseError as e:
                raise RouteCorrupt(route, f"delta {v} does not apply: {e}{claimed}") from None
            applied.append((v, "delta"))
        if pulse.state_hash(state) != target.state_hash:
            raise RouteCorrupt(route, f"state after {applied} does not match the signed state hash of version "
                                  f"{head}{claimed}")
        used_inplace = False
        if anchor is not None and have is not None:
            old = have[1]
            changed_set = {n for n in state if n not in old or not same_bytes(old[n], state[n])}
            changed_set |= set(old) - set(state)
            if inplace and set(old) == set(state) and all(
                    old[n].shape == state[n].shape and old[n].dtype == state[n].dtype and old[n].flags.writeable
                    for n in state):
                for n in changed_set:
                    np.copyto(old[n], state[n])
                state, used_inplace = old, True
        return SyncResult(head, state, self._read, applied, sorted(changed_set), used_inplace, problems, target, sha)
