"""Who may upload: the trainer's side of the signed roster, the bans and the assignment salts
(``stoa.transport.identity``).

``[trust] mode = "enrolled"``: only enrolled keys; ``"open"``: any key, bound to its worker id
by its first *accepted* batch (a refused or junk batch binds nothing, so nobody takes an id
without doing the work). Banned keys and impersonations are refused. Keys without accepted work
("newcomers") are reviewed at most ``newcomers_per_poll`` batches a poll, and when the roster is
full a binding idle for ``idle_expiry_hours`` makes room, so a flood of throwaway keys neither
fills the roster nor eats the trainer's time. Revisions never go back: a kept copy beside the
trainer means a stale ``workers.json`` put back while it is down undoes no binding.

Bans are not in the roster: each is one small signed document (``<run>/bans/<key id>.json``,
written once), and the trainer appends each to ``bans.jsonl`` in its own folder, which it reads
back on every start, so no restart (from any checkpoint) forgets a ban and no number of bans
makes the roster unreadable. A key gets its assignment salt (``<run>/salts/<key id>.json``) once
it has standing: enrolled, or with accepted work (:mod:`stoa.fleet.trust.assign`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from stoa.fleet.trust.section import TrustConfig
from stoa.transport import layout
from stoa.transport.identity import (
    Ban,
    BatchSeal,
    Roster,
    WorkerEntry,
    list_bans,
    read_roster,
    write_ban,
    write_roster,
    write_salt,
)
from stoa.transport.signing import SignatureError
from stoa.transport.store import LocalStore, ObjectStore, StoreError
from stoa.types import Verdict

if TYPE_CHECKING:
    from stoa.fleet.trust.records import Records, WorkerRecord
    from stoa.transport.exchange import Batch

__all__ = ["Admission", "Membership"]

log = logging.getLogger("stoa.trust")

_ROSTER_REFRESH_S = 2.0
_BANS_REREAD_S = 60.0  # the store's ban documents are listed again at least this often (bans by hand)


@dataclass(frozen=True)
class Admission:
    """Who may upload, as the roster stands when a poll starts: the value the trainer's reader
    applies to each object's seal before decoding it (``RolloutReader.poll(admission=...)``).
    Built by :meth:`Membership.admission` over read-only views of the roster and the bans; the
    reader calls nothing else of the trust room's, and nothing changes them during a poll.
    """

    mode: Literal["open", "enrolled"]
    roster: Roster
    bans: Mapping[str, str]
    """Key id -> why it is banned (every ban made, logged or read)."""
    records: Mapping[str, WorkerRecord]
    """The gate's records (a key banned in its record is refused too)."""
    redraws: bool = False
    """Whether every token of a sealed batch is re-derived from its assigned seed (an int8
    re-score and ``audit.every_episode``): its groups then need no copy print
    (:meth:`stoa.fleet.intake.copies.Copies.sift`)."""

    def screen(self, seal: BatchSeal | None) -> Verdict | None:
        """The refusal of an object before it is decoded (``unsigned``: no seal; ``refused``: a
        key the roster refuses, :meth:`refusal`), or None to read it."""
        if seal is None:
            return Verdict("unsigned", "unsigned batch: this run takes only batches sealed with a worker key")
        why = self.refusal(seal)
        return None if why is None else Verdict("refused", why)

    def refusal(self, seal: BatchSeal) -> str | None:
        """Why the seal's key may not upload as the seal's worker id, or None."""
        kid, wid = seal.key_id, seal.worker_id
        rec = self.records.get(kid)
        why = self.bans.get(kid) or (rec.banned if rec is not None else "")
        if why:
            return f"key {kid} is banned: {why[:200]}"
        entry = self.roster.enrolled.get(kid)
        if entry is not None:
            if entry.worker_id != wid:
                return (f"key {kid} is bound to worker id {entry.worker_id!r} in this run, not {wid!r}: restart "
                        f"the worker with --id {entry.worker_id} (or without --id)")
            return None
        bound = self.roster.key_for(wid)
        if bound is not None:
            return f"worker id {wid!r} belongs to key {bound}; this batch is signed by key {kid} (impersonation)"
        if self.mode == "enrolled":
            return f"key {kid} is not enrolled in this run (stoa enroll); mode is 'enrolled'"
        return None  # open run: reviewed; bound to ``wid`` only if accepted (:meth:`Membership.bind`)


class Membership:
    """The roster, the bans and the salts as the trainer keeps them (see the module docstring).

    Args:
        cfg: ``[trust]``.
        store, run, private_key: where the roster lives, and the run's signing key.
        records: the gate's records (standing, idleness, bans by hand).
        rng: draws whose newcomers are reviewed each poll.
        roster_copy: a local folder of the trainer's own (its run folder's ``roster/``) keeping the
            newest roster seen and every ban (``bans.jsonl``); None: none kept.
    """

    def __init__(self, cfg: TrustConfig, store: ObjectStore, run: str, private_key: Any, records: Records,
                 rng: np.random.Generator, roster_copy: Path | None = None):
        self.cfg, self.store, self.run, self.key, self.records, self.rng = cfg, store, run, private_key, records, rng
        self.roster = Roster(run)
        self.copy = None if roster_copy is None else LocalStore(roster_copy)
        if self.copy is not None:
            try:
                self.roster = read_roster(self.copy, run, private_key.public_key())
            except (SignatureError, StoreError) as e:
                log.warning("ignoring the kept copy of the roster: %s", e)
        self.bans: dict[str, str] = {}
        """Key id -> why it is banned (``code: detail``): every ban made, logged or read; never dropped."""
        self.unwritten: dict[str, Ban] = {}  # bans whose document the store has not taken yet (retried)
        self.salted: set[str] = set()  # keys whose assignment salt this trainer has published
        self.ban_log = None if roster_copy is None else Path(roster_copy) / "bans.jsonl"
        self._read_ban_log()
        self.read_at = self.bans_read_at = 0.0
        self.bans_read_revision = -1
        self.dirty = False
        self.expired: set[str] = set()  # first-use bindings let expire for room (kept out of the roster)

    # -- bans --------------------------------------------------------------------------------------
    def _read_ban_log(self) -> None:
        if self.ban_log is None or not self.ban_log.is_file():
            return
        bad = 0
        with open(self.ban_log, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                    ban = Ban.of(row["worker_id"], row["code"], row["detail"], row["time"], row["version"])
                    self.bans[str(row["key_id"])[:16]] = ban.reason
                except (ValueError, KeyError, TypeError):
                    bad += 1  # a line cut short by a crash mid-append
        if bad:
            log.warning("%s: %d line(s) did not read", self.ban_log, bad)
        log.info("%d ban(s) restored from %s", len(self.bans), self.ban_log)

    def ban(self, kid: str, ban: Ban) -> bool:
        """Ban ``kid``: in memory, in the trainer's ban log, and as its ban document in the store
        (retried at each refresh while the store refuses it). Returns False when it was banned
        already. One small write per ban, whatever the number of bans; never raises."""
        if not self._remember(kid, ban):
            return False
        self.unwritten[kid] = ban
        self._write_bans()
        return True

    def _remember(self, kid: str, ban: Ban) -> bool:
        """Hold ``kid``'s ban in memory and append it to the ban log; False if it was held already."""
        if kid in self.bans:
            return False
        self.bans[kid] = ban.reason
        if self.ban_log is not None:
            try:
                self.ban_log.parent.mkdir(parents=True, exist_ok=True)
                with open(self.ban_log, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"key_id": kid, **vars(ban)}, sort_keys=True) + "\n")
            except OSError as e:
                log.warning("could not log the ban of key %s in %s (%s)", kid, self.ban_log, e)
        return True

    def _write_bans(self) -> None:
        for kid, ban in list(self.unwritten.items()):
            try:
                write_ban(self.store, self.run, kid, ban, self.key)
                del self.unwritten[kid]
            except (StoreError, ValueError) as e:
                log.warning("could not write the ban document of key %s (%s); will retry", kid, e)
                return

    def _read_bans(self, force: bool) -> list[str]:
        """Bans in the store this trainer did not know (``stoa ban``, another trainer's); read at
        start, when someone else wrote the roster, and every minute. Returns their key ids."""
        now = time.time()
        if not force and now - self.bans_read_at < _BANS_REREAD_S:
            return []
        self.bans_read_at = now
        try:
            found, problems = list_bans(self.store, self.run, self.key.public_key(), known=self.bans)
        except StoreError as e:
            log.warning("could not list the ban documents (%s); will retry", e)
            return []
        for p in problems[:3]:
            log.warning("ignoring a ban document: %s", p)
        for kid, ban in found.items():
            self._remember(kid, ban)
        return list(found)

    # -- the roster --------------------------------------------------------------------------------
    def refresh(self, force: bool = False) -> list[str]:
        """Re-read the roster (``stoa enroll`` / ``stoa ban`` edit the run live), keeping our own
        bindings; read the store's bans when someone else wrote; publish the salts of keys with
        standing. Returns the keys banned by hand that the records did not know as banned."""
        now = time.time()
        if not force and now - self.read_at < _ROSTER_REFRESH_S and not self.dirty:
            return []
        self.read_at = now
        self._write_bans()
        try:
            stored = read_roster(self.store, self.run, self.key.public_key())
        except (SignatureError, StoreError) as e:
            log.warning("the roster does not read (%s); keeping the one in memory", e)
            return []
        for kid, ban in stored.legacy_bans.items():  # a stoa.workers/1 roster: its bans become documents
            self.ban(kid, ban)
        new = self._read_bans(force or stored.revision != self.bans_read_revision)
        self.bans_read_revision = stored.revision
        merged = Roster(stored.run, stored.enrolled, stored.revision, stored.time)
        gone = {k for k in self.expired if k in merged.enrolled and merged.enrolled[k].source == "first-use"}
        if gone:  # bindings this trainer let expire stay expired
            merged = merged.without(gone)
        for kid, entry in self.roster.enrolled.items():
            if kid not in merged.enrolled and merged.key_for(entry.worker_id) is None and entry.source == "first-use":
                try:
                    merged = merged.with_entry(kid, entry)
                except ValueError as e:  # a full roster: that binding is lost, the key's record keeps its work
                    log.warning("cannot keep the binding of key %s: %s", kid, e)
        by_hand = []
        for kid in new + list(stored.legacy_bans):  # bans made by hand (stoa ban) reach the records too
            rec = self.records.get(kid)
            if rec is not None and not rec.banned:
                rec.banned = self.bans[kid]
                by_hand.append(kid)
        if stored.revision < self.roster.revision:  # a stale roster put back: ours is newer, whatever it lacks
            log.warning("the store's roster (revision %d) is older than one this trainer has seen (%d); "
                        "rewriting it with every binding kept", stored.revision, self.roster.revision)
        if merged.enrolled != stored.enrolled or stored.legacy_bans or stored.revision < self.roster.revision:
            rev = max(stored.revision, self.roster.revision) + 1  # revisions never go back
            merged = Roster(merged.run, merged.enrolled, rev, time.time())
            try:
                write_roster(self.store, self.run, merged, self.key)
                self.bans_read_revision = rev
            except StoreError as e:
                log.warning("could not write the roster (%s); will retry", e)
                self.roster = merged
                return by_hand
        known, self.roster, self.dirty = self.roster.enrolled, merged, False
        if self.copy is not None:  # the newest roster seen, kept beside the trainer (restarts start from it)
            try:
                write_roster(self.copy, self.run, merged, self.key)
            except (StoreError, OSError) as e:
                log.warning("could not keep a copy of the roster (%s)", e)
        for kid in merged.enrolled:  # a key new in the roster has standing: its worker needs its salt
            if kid not in known:  # (stoa enroll publishes it too; an accepted batch's key gets it at review)
                self.publish_salt(kid)
        return by_hand

    def publish_salt(self, kid: str) -> None:
        """Publish ``kid``'s assignment salt once (the key has standing). Never raises."""
        if kid in self.salted or not layout.KEY_ID.fullmatch(kid or ""):
            return
        try:
            write_salt(self.store, self.run, kid, self.key)
            self.salted.add(kid)
        except (StoreError, ValueError) as e:
            log.warning("could not publish the assignment salt of key %s (%s); will retry", kid, e)

    def admission(self) -> Admission:
        """Who may upload as of now (:class:`Admission`), over read-only views of this state."""
        return Admission(self.cfg.mode, self.roster, MappingProxyType(self.bans), MappingProxyType(self.records))

    def is_banned(self, kid: str) -> bool:
        return bool(kid) and (kid in self.bans or bool(self.records.banned(kid)))

    def established(self, kid: str) -> bool:
        """Whether ``kid`` has standing: in the roster (enrolled, or bound by accepted work) or
        with accepted batches. The others are newcomers (``newcomers_per_poll``)."""
        rec = self.records.get(kid)
        return kid in self.roster.enrolled or (rec is not None and rec.accepted_batches > 0)

    def pace_newcomers(self, batches: Sequence[Batch]) -> tuple[list[Batch], list[Batch]]:
        """``(review now, wait)``: every batch of a key with standing (:meth:`established`) or
        unsealed, and at most ``newcomers_per_poll`` of the others, one per key (its lowest
        sequence number), the keys drawn from operating-system entropy. A flood of fresh keys
        costs the trainer a bounded number of full reviews per poll, and cannot predict whose
        turn it is."""
        now, by_key = [], {}
        for b in batches:
            if not b.key_id or self.established(b.key_id) or self.is_banned(b.key_id):  # the ban: refused cheaply
                now.append(b)
            else:
                by_key.setdefault(b.key_id, []).append(b)
        keys, wait = list(by_key), []
        self.rng.shuffle(keys)
        for i, k in enumerate(keys):
            mine = sorted(by_key[k], key=lambda b: b.seq)
            if i < self.cfg.newcomers_per_poll:
                now.append(mine.pop(0))
            wait += mine
        return now, wait

    def bind(self, b: Batch) -> str | None:
        """Bind an accepted batch's unbound key to its worker id (open runs); why not, or None.
        (A batch without its seal's public key, built by hand, binds nothing.)"""
        if not b.public_key:
            return None
        entry = self.roster.enrolled.get(b.key_id)
        if entry is not None:
            return None if entry.worker_id == b.worker_id else (
                f"key {b.key_id} was bound to worker id {entry.worker_id!r} while this batch waited")
        owner = self.roster.key_for(b.worker_id)
        if owner is not None:
            return f"worker id {b.worker_id!r} was bound to key {owner} by its accepted work first"
        if self.cfg.mode != "open":
            return f"key {b.key_id} is not enrolled in this run"
        new = WorkerEntry(b.public_key, b.worker_id, time.time(), "first-use")
        try:
            self.roster = self.roster.with_entry(b.key_id, new)
        except ValueError:
            idle = self._idle_binding()
            if idle is None:  # the work is still taken: only the id stays unprotected until there is room
                log.warning("the roster is full (no binding idle for %g h): worker %s (key %s) is accepted but its "
                            "id is not bound", self.cfg.idle_expiry_hours, b.worker_id, b.key_id)
                return None
            log.info("roster full: key %s (idle) loses its binding to worker id %r", idle,
                     self.roster.enrolled[idle].worker_id)
            self.expired.add(idle)
            self.roster = self.roster.without({idle}).with_entry(b.key_id, new)
        self.dirty = True
        self.expired.discard(b.key_id)
        log.info("open run: worker %s bound to key %s by its first accepted batch", b.worker_id, b.key_id)
        return None

    def _idle_binding(self) -> str | None:
        """The first-use binding whose key's last accepted batch is oldest, if older than
        ``idle_expiry_hours`` (enrolled keys never expire)."""
        cutoff = time.time() - 3600 * self.cfg.idle_expiry_hours
        idle = [(self.records[k].last_accepted if k in self.records else 0.0, k)
                for k, e in self.roster.enrolled.items() if e.source == "first-use"]
        oldest = min(idle, default=None)
        return oldest[1] if oldest is not None and oldest[0] < cutoff else None
