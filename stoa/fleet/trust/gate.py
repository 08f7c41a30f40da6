"""The trainer's gate for untrusted workers: identity, verification, audit, accounting and bans.

One :class:`TrustGate` per trainer, owned by its :class:`stoa.fleet.intake.Intake`. In the order a
batch meets it:

1. **Identity** (:meth:`TrustGate.admit`, the rollout reader's callback): the batch's seal names
   a key; the roster (``stoa.transport.identity``) says whether that key may upload as that
   worker id. ``[trust] mode = "enrolled"``: only enrolled keys; ``"open"``: any key, bound to
   its worker id by its first *accepted* batch (a refused or junk batch binds nothing, so nobody
   takes an id without doing the work). Banned keys and impersonations are refused. Keys without
   accepted work ("newcomers") are reviewed at most ``newcomers_per_poll`` batches a poll (the
   intake keeps the rest waiting), and when the roster is full a binding idle for
   ``idle_expiry_hours`` makes room, so a flood of throwaway keys neither fills the roster nor
   eats the trainer's time.
2. **Review** (:meth:`TrustGate.review`, after the run's own bounds in
   :mod:`stoa.fleet.trust.admission`): replay every episode (:mod:`stoa.fleet.trust.replay`);
   re-derive sampled tokens from the assigned seed (a copy is not its sender's draws); score a sample with
   the learner and audit its log-probs (:mod:`stoa.fleet.trust.audit`), spot-checking suspicious
   ones with the int8 policy of the claimed version. A failed check rejects the whole batch with
   the reason.
3. **Accounting**: per key, batches accepted and rejected (by category), episodes trained,
   audit statistics, spot-checks, ban. A key is banned when a spot-check confirms forged
   log-probs, or after ``ban_after`` rejected batches; the ban goes into the signed roster and
   the ledger (:mod:`stoa.fleet.trust.ledger`), and the intake drops the key's queued batches.

Groups are scoped to the key that sealed them (:func:`scoped`), so one worker's group ids never
collide with another's, and :meth:`TrustGate.max_groups` caps one key's share of a step.
The gate's state (records, audit statistics, group fingerprints) is plain JSON for the
trainer's checkpoint; the roster itself lives in the store. ``<run>/trust.json`` (signed) is
the per-worker report ``stoa status`` shows.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from stoa.fleet.trust.audit import AuditConfig, LogprobAudit, episode_stats, spot_check
from stoa.fleet.trust.planted import count_planted
from stoa.fleet.trust.replay import layout_digest
from stoa.transport.identity import Ban, BatchSeal, Roster, WorkerEntry, read_roster, write_roster
from stoa.transport.signing import SignatureError, read_signed, sign_document
from stoa.transport.store import LocalStore, ObjectStore, StoreError

if TYPE_CHECKING:
    from stoa.fleet.trust.assign import Assignment
    from stoa.fleet.trust.ledger import Ledger
    from stoa.fleet.trust.replay import Replayer
    from stoa.transport.exchange import Batch, Rejection
    from stoa.types import Episode

__all__ = ["FloatScorer", "Int8Scorer", "TrustConfig", "TrustGate", "WorkerRecord", "distinct_rows", "group_episodes",
           "group_fingerprint", "read_trust_report", "sampling_pick", "scoped"]

log = logging.getLogger("stoa.trust")

STRIKE_CATEGORIES = ("replay", "duplicate", "invalid", "audit", "sampling", "assignment")
"""Rejections that count toward ``ban_after``: the sender is known and the content is its fault. A
refused key (not enrolled yet, banned, impersonating) is not struck: its batches are never read."""
_REPORT_KIND = "trust-report"
_ROSTER_REFRESH_S = 2.0
_REPORT_EVERY_S = 2.0
_MAX_REPORT_WORKERS = 2048
_MAX_HOLDS = 20
_MAX_RECORDS = 8192
"""Records beyond this: those of keys with no accepted batch and no ban, seen longest ago, are
forgotten (a throwaway key's record is a few hundred bytes; a flood of them must stay bounded)."""


@dataclass(frozen=True)
class TrustConfig:
    """Who may upload rollouts and how the trainer checks what they upload (``[trust]``; ``docs/trust.md``)."""

    mode: Literal["open", "enrolled"] = "open"
    """``open``: any worker key, bound to its worker id by its first accepted batch; ``enrolled``:
    only keys enrolled in the run's signed roster (``stoa enroll``)."""
    replay: bool = True
    """Replay every episode through the trainer's own environment before training on it (tasks
    that declare ``replayable``); a mismatch rejects the batch."""
    audit: AuditConfig = AuditConfig()
    """The log-prob audit and its spot-checks (``[trust.audit]``)."""
    ban_after: int = 2
    """Rejected batches from one key (replay, duplicate, invalid, ...) before it is banned; 0 = never."""
    max_worker_share: float = 1.0
    """Most of one optimizer step's groups that may come from one worker key (1.0 = no cap)."""
    max_hashes: int = 16384
    """Accepted batch and group hashes remembered to refuse copies (bounded memory, checkpointed;
    a copy older than ``trainer.max_lag`` versions is dropped as stale anyway)."""
    newcomers_per_poll: int = 4
    """Batches reviewed per poll from keys with no accepted work yet, one per key, chosen at random
    (the others wait, at most 64 per allowed batch); enrolled keys and keys with accepted work are
    never held back."""
    idle_expiry_hours: float = 24.0
    """In an open run, a key bound by its work but with no accepted batch for this long loses its
    binding when the roster is full and a newcomer's accepted work needs the room."""

    def __post_init__(self) -> None:
        if self.ban_after < 0:
            raise ValueError("trust.ban_after must be >= 0")
        if not 0 < self.max_worker_share <= 1:
            raise ValueError("trust.max_worker_share must lie in (0, 1]")
        if self.max_hashes < 1:
            raise ValueError("trust.max_hashes must be >= 1")
        if self.newcomers_per_poll < 1:
            raise ValueError("trust.newcomers_per_poll must be >= 1")
        if not self.idle_expiry_hours > 0:
            raise ValueError("trust.idle_expiry_hours must be > 0")


class FloatScorer(Protocol):
    """The trainer's float policy (a :class:`stoa.backends.learner.Learner` is one)."""

    def logprobs(self, episodes: Sequence[Episode], temperature: float | None = 1.0, *,
                 model_only: bool = False) -> list[np.ndarray]:
        """Per-episode log-probs aligned with ``Episode.tokens()`` (``temperature=None``: each
        episode's own; ``model_only``: model tokens only, 0 elsewhere)."""
        ...


class Int8Scorer(Protocol):
    """The int8 policies workers sampled from (:class:`stoa.fleet.policies.HeldPolicies` is one)."""

    def score(self, version: int, episodes: Sequence[Episode]) -> list[np.ndarray] | None:
        """Prefill log-probs of ``version``'s int8 policy, aligned with ``Episode.tokens()``; None
        when that version's weights are no longer held."""
        ...

    def sampling_margins(self, version: int, episodes: Sequence[Episode],
                         seeds: Sequence[int]) -> list[np.ndarray] | None:
        """``RolloutEngine.sampling_margins`` under ``version``'s int8 policy; None when not held."""
        ...


def scoped(key_id: str, group_id: str) -> str:
    """A group id in its sender's namespace (``<key id>/<group id>``; the raw id when unsigned)."""
    return f"{key_id}/{group_id}" if key_id else group_id


@dataclass
class WorkerRecord:
    """What the trainer knows of one worker key."""

    worker_id: str
    accepted_batches: int = 0
    accepted_episodes: int = 0
    trained_episodes: int = 0
    rejected_batches: int = 0
    rejected_episodes: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    """Rejected batches by category (``replay``, ``duplicate``, ``audit``, ``invalid``, ``refused``, ...)."""
    strikes: int = 0
    """Rejections that count toward a ban (:data:`STRIKE_CATEGORIES`)."""
    spot_checks: int = 0
    spot_check_failures: int = 0
    last_reason: str = ""
    banned: str = ""
    """Why the key is banned ("" if it is not)."""
    last_seen: float = 0.0
    last_accepted: float = 0.0
    """When its last batch was accepted (0: never)."""
    batches_seen: int = 0
    """Batches of this key the intake read (any outcome)."""
    max_seq: int = -1
    """Its highest sequence number read."""
    taken_by_others: int = 0
    """Its worker id's numbers held by objects it did not seal (planted by others; not its gaps)."""

    @property
    def withheld(self) -> int:
        """Sequence numbers up to :attr:`max_seq` of which no batch came (withheld, or lost in a crash)."""
        return max(0, self.max_seq + 1 - self.batches_seen - self.taken_by_others)


def _takes(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` accepts keyword ``name``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def distinct_rows(eps: Sequence[Episode]) -> tuple[list[Episode], list[int]]:
    """``(distinct, of)``: one episode per distinct (tokens, temperature), and the index in
    ``distinct`` of each episode of ``eps`` (what the audit scores once)."""
    row: dict[tuple[bytes, float], int] = {}
    distinct: list[Episode] = []
    of = []
    for e in eps:
        k = (layout_digest(e), float(e.temperature))
        if k not in row:
            row[k] = len(distinct)
            distinct.append(e)
        of.append(row[k])
    return distinct, of


def sampling_pick(eps: Sequence[Episode], rng: np.random.Generator, n_random: int) -> list[int]:
    """Which episodes of a batch the sampling check re-derives: ``n_random`` drawn with ``rng``,
    and every episode whose tokens repeat another's (a variant copy, or an honest
    near-deterministic sample)."""
    seen: dict[bytes, int] = {}
    dup = []
    for i, e in enumerate(eps):
        d = layout_digest(e)
        if d in seen:
            dup += [seen[d], i]
        seen.setdefault(d, i)
    drawn = rng.permutation(len(eps))[:n_random].tolist()
    return sorted(set(dup) | set(drawn))


def group_episodes(episodes: Sequence[Episode]) -> dict[str, list[Episode]]:
    """A batch's episodes by group id, in order of first appearance."""
    groups: dict[str, list[Episode]] = {}
    for ep in episodes:
        groups.setdefault(ep.group_id, []).append(ep)
    return groups


def group_fingerprint(episodes: Sequence[Episode]) -> str | None:
    """The multiset of a group's token sequences, or None when they are all alike (an honest
    near-deterministic group may repeat; such a group carries no advantage anyway)."""
    digests = sorted(layout_digest(e) for e in episodes)
    if len(set(digests)) < 2:
        return None
    return hashlib.sha256(b"".join(digests)).hexdigest()[:32]


class TrustGate:
    """See the module docstring.

    Args:
        cfg: the run's ``[trust]`` section.
        store, run, private_key: where the roster and the report live, and the run's signing key.
        ledger: where bans are recorded (None: nowhere, for tests).
        replayer: replays episodes through the run's environment (None, or ``cfg.replay`` off, or
            a task that is not replayable: no replay).
        float_scorer: the learner, for the audit's log pi (None or ``cfg.audit.enabled`` off: no audit).
        int8: the held int8 policies, for spot-checks (None: suspicion is logged, never confirmed).
        assign: a batch's assigned work (:mod:`stoa.fleet.trust.assign`); given, a spot-check also
            re-derives every sampled token from the assigned seed.
        roster_copy: a local folder (the trainer's run folder) keeping the newest roster seen, so a
            stale ``workers.json`` put back while the trainer is down cannot undo a ban or a
            binding: revisions never go back, across restarts too.
        seed: only for tests that need the same choices twice. By default which episodes are
            audited and when a random spot-check comes are drawn from the operating system's
            entropy, so nothing public (the run's seed is in its world-readable config) predicts them.
    """

    def __init__(self, cfg: TrustConfig, store: ObjectStore, run: str, private_key: Any, *,
                 ledger: Ledger | None = None, replayer: Replayer | None = None,
                 float_scorer: FloatScorer | None = None, int8: Int8Scorer | None = None,
                 assign: Callable[[Batch], Assignment] | None = None, roster_copy: Path | None = None,
                 seed: int | None = None):
        self.cfg, self.store, self.run, self.key = cfg, store, run, private_key
        self.ledger = ledger
        self.audit = LogprobAudit(cfg.audit)
        self.records: dict[str, WorkerRecord] = {}
        self.anonymous: dict[str, dict[str, int]] = {}
        self.fingerprints: dict[str, str] = {}  # group fingerprint -> key id, oldest first
        self.roster = Roster(run)
        self._copy = None if roster_copy is None else LocalStore(roster_copy)
        if self._copy is not None:
            try:
                self.roster = read_roster(self._copy, run, private_key.public_key())
            except (SignatureError, StoreError) as e:
                log.warning("ignoring the kept copy of the roster: %s", e)
        self._round = 0
        self.version = 0
        self.rng = np.random.default_rng(seed)  # None: fresh OS entropy
        self._roster_read = self._report_written = 0.0
        self._roster_dirty = False
        self._new_bans: list[str] = []
        self._holds: dict[str, int] = {}  # batch key -> polls it was held for a contested group
        self._expired: set[str] = set()  # first-use bindings let expire for room (kept out of the roster)
        self.seconds = {"replay": 0.0, "audit": 0.0, "spot_check": 0.0, "sampling": 0.0}
        self.counts = {"spot_checks": 0, "episodes_replayed": 0, "episodes_audited": 0, "sampled_tokens_checked": 0,
                       "sampled_tokens_ambiguous": 0, "sampling_violations": 0}
        if replayer is not None and cfg.replay and not replayer.replayable:
            log.warning("the task is not replayable (TextEnv.replayable = False): episodes are audited only")
        self.replayer = replayer if cfg.replay and replayer is not None and replayer.replayable else None
        self.float_scorer = float_scorer if cfg.audit.enabled else None
        self._model_only = self.float_scorer is not None and _takes(self.float_scorer.logprobs, "model_only")
        self.int8 = int8 if cfg.audit.enabled else None
        self.assign = assign

    # -- identity ---------------------------------------------------------------------------------
    def refresh(self, force: bool = False) -> None:
        """Re-read the roster (``stoa enroll`` / ``stoa ban`` edit it live), keeping our own bans and bindings."""
        now = time.time()
        if not force and now - self._roster_read < _ROSTER_REFRESH_S and not self._roster_dirty:
            return
        self._roster_read = now
        try:
            stored = read_roster(self.store, self.run, self.key.public_key())
        except (SignatureError, StoreError) as e:
            log.warning("the roster does not read (%s); keeping the one in memory", e)
            return
        merged = stored
        gone = {k for k in self._expired if k in merged.enrolled and merged.enrolled[k].source == "first-use"}
        if gone:  # bindings this trainer let expire stay expired
            merged = merged.without(gone)
        for kid, ban in self.roster.banned.items():
            if kid not in merged.banned:
                merged = merged.with_ban(kid, ban)
        for kid, entry in self.roster.enrolled.items():
            if kid not in merged.enrolled and merged.key_for(entry.worker_id) is None and entry.source == "first-use":
                try:
                    merged = merged.with_entry(kid, entry)
                except ValueError as e:  # a full roster: that binding is lost, the key's record keeps its work
                    log.warning("cannot keep the binding of key %s: %s", kid, e)
        for kid, ban in merged.banned.items():  # bans made by hand (stoa ban) reach the records too
            rec = self.records.get(kid)
            if rec is not None and not rec.banned:
                rec.banned = ban.reason or "banned by hand"
                self._new_bans.append(kid)
        if stored.revision < self.roster.revision:  # a stale roster put back: ours is newer, whatever it lacks
            log.warning("the store's roster (revision %d) is older than one this trainer has seen (%d); "
                        "rewriting it with every ban and binding kept", stored.revision, self.roster.revision)
        if merged != stored or stored.revision < self.roster.revision:
            rev = max(stored.revision, self.roster.revision) + 1  # revisions never go back
            merged = Roster(merged.run, merged.enrolled, merged.banned, rev, time.time())
            try:
                write_roster(self.store, self.run, merged, self.key)
            except StoreError as e:
                log.warning("could not write the roster (%s); will retry", e)
                self.roster = merged
                return
        self.roster, self._roster_dirty = merged, False
        if self._copy is not None:  # the newest roster seen, kept beside the trainer (restarts start from it)
            try:
                write_roster(self._copy, self.run, merged, self.key)
            except (StoreError, OSError) as e:
                log.warning("could not keep a copy of the roster (%s)", e)

    def admit(self, seal: BatchSeal) -> str | None:
        """Whether the seal's key may upload as the seal's worker id (the reader's ``admit``)."""
        kid, wid = seal.key_id, seal.worker_id
        ban = self.roster.banned.get(kid)
        if ban is not None or (kid in self.records and self.records[kid].banned):
            return f"key {kid} is banned: {(ban.reason if ban else self.records[kid].banned)[:300]}"
        entry = self.roster.enrolled.get(kid)
        if entry is not None:
            if entry.worker_id != wid:
                return (f"key {kid} is bound to worker id {entry.worker_id!r} in this run, not {wid!r}: restart "
                        f"the worker with --id {entry.worker_id} (or without --id)")
            return None
        bound = self.roster.key_for(wid)
        if bound is not None:
            return f"worker id {wid!r} belongs to key {bound}; this batch is signed by key {kid} (impersonation)"
        if self.cfg.mode == "enrolled":
            return f"key {kid} is not enrolled in this run (stoa enroll); mode is 'enrolled'"
        return None  # open run: reviewed; bound to ``wid`` only if accepted (:meth:`_bind`)

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

    def _bind(self, b: Batch) -> str | None:
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
            self._expired.add(idle)
            self.roster = self.roster.without({idle}).with_entry(b.key_id, new)
        self._roster_dirty = True
        self._expired.discard(b.key_id)
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

    # -- accounting -------------------------------------------------------------------------------
    def _record(self, kid: str, worker_id: str) -> WorkerRecord:
        rec = self.records.get(kid)
        if rec is None:
            rec = self.records[kid] = WorkerRecord(worker_id)
        rec.last_seen = time.time()
        return rec

    def reject(self, kid: str, worker_id: str, category: str, reason: str, episodes: int = 0) -> None:
        """Count a rejected batch against its sender; ban it after ``ban_after`` strikes."""
        if not kid:
            per = self.anonymous.setdefault(worker_id or "?", {})
            per[category] = per.get(category, 0) + 1
            return
        rec = self._record(kid, worker_id)
        rec.rejected_batches += 1
        rec.rejected_episodes += episodes
        rec.rejected[category] = rec.rejected.get(category, 0) + 1
        rec.last_reason = reason[:300]
        if category in STRIKE_CATEGORIES:
            rec.strikes += 1
            if self.cfg.ban_after and rec.strikes >= self.cfg.ban_after and not rec.banned:
                self.ban(kid, f"{rec.strikes} rejected batches; last: {reason[:200]}")

    def record_rejections(self, rejected: Sequence[Rejection]) -> None:
        """Fold a poll's quarantined objects (``PollReport.rejected``) into the records."""
        for r in rejected:
            self.reject(r.key_id or "", r.worker_id or "", r.category, r.reason)
        count_planted(self.records, rejected)  # numbers planted under a worker id are not its key's gaps

    def ban(self, kid: str, reason: str, version: int = -1) -> None:
        """Ban a key: the records refuse it at once; the signed roster tells the worker. Never raises."""
        rec = self.records.get(kid) or self._record(kid, "")
        if rec.banned:
            return
        rec.banned = reason[:500]
        try:
            self.roster = self.roster.with_ban(kid, Ban(rec.worker_id, reason[:256], time.time(),
                                                        version if version >= 0 else self.version))
            self._roster_dirty = True
        except ValueError as e:  # a full ban list: the records (checkpointed) still refuse the key
            log.warning("key %s is banned, but the roster cannot list it (%s)", kid, e)
        self._new_bans.append(kid)
        self.audit.forget(kid)
        if self.ledger is not None:
            self.ledger.write(banned=kid, worker=rec.worker_id, reason=reason[:500])
        log.warning("banned worker %s (key %s): %s", rec.worker_id, kid, reason)
        self.refresh(force=True)
        self.write_report(force=True)

    def take_new_bans(self) -> list[str]:
        """Keys banned since the last call (the trainer drops their queued batches)."""
        out, self._new_bans = self._new_bans, []
        return out

    def is_banned(self, kid: str) -> bool:
        return bool(kid) and (kid in self.roster.banned or bool(self.records.get(kid, WorkerRecord("")).banned))

    def saw(self, kid: str, worker_id: str, seq: int) -> None:
        """A batch of ``kid`` with sequence number ``seq`` reached the intake (withholding accounting)."""
        if kid:
            rec = self._record(kid, worker_id)
            rec.batches_seen += 1
            rec.max_seq = max(rec.max_seq, seq)

    def withholding(self) -> dict[str, tuple[float, bool]]:
        """Per key ``(withheld rate, flagged)``: a key is flagged when its rate leaves the fleet's
        range (median + ``audit.worker_mads`` x max(MAD, 0.05)) over keys with 8 or more numbers.
        A flag says "look", never "ban": a gap is also what a crash mid-cohort leaves."""
        rates = {k: r.withheld / (r.max_seq + 1) for k, r in self.records.items() if r.max_seq >= 0}
        ripe = [v for k, v in rates.items() if self.records[k].max_seq >= 7]
        if not ripe:
            return {k: (v, False) for k, v in rates.items()}
        med = float(np.median(ripe))
        limit = med + self.cfg.audit.worker_mads * max(float(np.median(np.abs(np.array(ripe) - med))), 0.05)
        return {k: (v, self.records[k].max_seq >= 7 and v > limit) for k, v in rates.items()}

    def trained(self, batch: Batch, episodes: int) -> None:
        self._record(batch.key_id, batch.worker_id).trained_episodes += episodes

    def max_groups(self, groups_per_step: int) -> int:
        """Most groups one key may contribute to a step."""
        return max(1, math.floor(self.cfg.max_worker_share * groups_per_step + 1e-9))

    # -- review -----------------------------------------------------------------------------------
    def review(self, batches: Sequence[Batch], trainer_version: int) -> list[tuple[str, str] | None]:
        """For each batch, ``(category, reason)`` to reject it, None to admit it, or ``("hold", why)``:
        review it again with the next poll (see the module docstring).

        An accepted batch binds its unbound key to its worker id (open runs, :meth:`_bind`). Only
        a gate without assigned work compares groups across keys (:meth:`_fingerprint`): when two
        batches of one poll from different keys carry the same group, the key with fewer strikes,
        then more accepted batches, keeps it; on a tie both are held until their records differ,
        for at most ``_MAX_HOLDS`` polls, after which both are refused."""
        self._round += 1
        self.version = trainer_version
        verdicts: list[tuple[str, str] | None] = [None] * len(batches)
        for i, b in enumerate(batches):
            self._record(b.key_id, b.worker_id)
            if self.is_banned(b.key_id):
                verdicts[i] = ("refused", f"key {b.key_id} is banned")
            elif self.replayer is not None:
                verdicts[i] = self._guarded(self._replay, b)
        if self.assign is None:  # with assigned work a copy is caught as not the copier's work (see _fingerprint)
            self._fingerprint(batches, verdicts)
        for i, b in enumerate(batches):
            if verdicts[i] is None and self.float_scorer is not None:
                verdicts[i] = self._guarded(self._audit, b, trainer_version)
            if verdicts[i] is None and self.int8 is not None and self.assign is not None and b.key_id:
                verdicts[i] = self._guarded(self._draws, b)
        for i, b in enumerate(batches):
            if verdicts[i] is None and b.key_id and (why := self._bind(b)):
                verdicts[i] = ("refused", why)
            v = verdicts[i]
            if v is None or v[0] != "hold":
                self._holds.pop(b.key, None)
            if v is None:
                rec = self._record(b.key_id, b.worker_id)
                rec.accepted_batches += 1
                rec.accepted_episodes += len(b.episodes)
                rec.last_accepted = time.time()
                if self.assign is None:
                    self._remember(b)
        self._forget_strangers()
        return verdicts

    def _forget_strangers(self) -> None:
        """Keep the records bounded (:data:`_MAX_RECORDS`): forget keys that never had a batch
        accepted and are not banned, seen longest ago first."""
        if len(self.records) <= _MAX_RECORDS:
            return
        idle = sorted((r.last_seen, k) for k, r in self.records.items()
                      if not r.accepted_batches and not r.banned and k not in self.roster.enrolled)
        for _, k in idle[: len(self.records) - _MAX_RECORDS]:
            del self.records[k]
            self.audit.forget(k)

    @staticmethod
    def _guarded(check: Callable[..., tuple[str, str] | None], *args: Any) -> tuple[str, str] | None:
        """A check that fails on a stranger's batch rejects the batch; it never stops the trainer."""
        try:
            return check(*args)
        except Exception as e:
            return "invalid", f"checking the batch failed ({check.__name__}): {type(e).__name__}: {str(e)[:300]}"

    def _replay(self, b: Batch) -> tuple[str, str] | None:
        t0 = time.perf_counter()
        bad = self.replayer.check_all(b.episodes)  # type: ignore[union-attr]
        self.seconds["replay"] += time.perf_counter() - t0
        self.counts["episodes_replayed"] += len(b.episodes)
        if not bad:
            return None
        i, why = bad[0]
        ep = b.episodes[i]
        return "replay", (f"replay: {len(bad)} of {len(b.episodes)} episodes do not match the environment; episode {i} "
                          f"(group {ep.group_id[:48]!r}, item {ep.item_index}): {why}")

    def _fingerprint(self, batches: Sequence[Batch], verdicts: list[tuple[str, str] | None]) -> None:
        """Refuse groups whose episodes were taken from another key (only when work is not assigned).

        With assigned work (the trainer's case) this is not done: a copy relabelled as the
        copier's own work fails the assignment or the sampling check, and two honest keys whose
        near-deterministic policy plays the same item alike (which happens once a policy has
        converged) would otherwise be struck for copying each other."""
        holder: dict[str, int] = {}  # fingerprint -> batch index in this poll
        for i, b in enumerate(batches):
            if verdicts[i] is not None:
                continue
            for gid, eps in group_episodes(b.episodes).items():
                fp = group_fingerprint(eps)
                if fp is None:
                    continue
                owner = self.fingerprints.get(fp)
                if owner is not None and owner != b.key_id:
                    verdicts[i] = ("duplicate", (f"duplicate: group {gid[:48]!r} has the same episodes as a group "
                                                 f"taken earlier from worker {self._name(owner)!r} (copied)"))
                    break
                j = holder.get(fp)
                if j is not None and batches[j].key_id != b.key_id:
                    rank_j, rank_i = self._standing(batches[j]), self._standing(b)
                    if rank_i == rank_j:
                        for k in (i, j):
                            n = self._holds[batches[k].key] = self._holds.get(batches[k].key, 0) + 1
                            verdicts[k] = (("hold", "contested group: held until the senders' records differ")
                                           if n <= _MAX_HOLDS else
                                           ("duplicate", f"duplicate: a group contested with another worker for {n} polls"))
                        break
                    first, second = (j, i) if rank_j < rank_i else (i, j)
                    verdicts[second] = ("duplicate", (f"duplicate: a group of this batch has the same episodes as "
                                                      f"worker {batches[first].worker_id!r}'s batch in the same poll"))
                    if second == i:
                        break
                holder[fp] = i

    def _standing(self, b: Batch) -> tuple[int, int]:
        """Lower is more trusted: (strikes, -accepted batches)."""
        rec = self.records.get(b.key_id)
        return (rec.strikes, -rec.accepted_batches) if rec else (0, 0)

    def _name(self, kid: str) -> str:
        rec = self.records.get(kid)
        return rec.worker_id if rec else kid

    def _remember(self, b: Batch) -> None:
        for eps in group_episodes(b.episodes).values():
            fp = group_fingerprint(eps)
            if fp is not None:
                self.fingerprints[fp] = b.key_id
        while len(self.fingerprints) > self.cfg.max_hashes:
            del self.fingerprints[next(iter(self.fingerprints))]

    def _audit(self, b: Batch, trainer_version: int) -> tuple[str, str] | None:
        eps = b.episodes
        n = max(1, math.ceil(self.cfg.audit.fraction * len(eps)))
        pick = sorted(self.rng.choice(len(eps), size=min(n, len(eps)), replace=False).tolist())
        t0 = time.perf_counter()
        lps = self._float_logprobs([eps[i] for i in pick])
        self.seconds["audit"] += time.perf_counter() - t0
        self.counts["episodes_audited"] += len(pick)
        staleness = trainer_version - b.version
        stats = [episode_stats(lp, eps[i]) for i, lp in zip(pick, lps)]
        suspicious = [(i, why) for i, st in zip(pick, stats) if (why := self.audit.episode_verdict(staleness, st))]
        why_worker = self.audit.worker_verdict(b.key_id, extra=(staleness, stats))
        verdict = None
        if suspicious or why_worker or self.rng.random() < self.cfg.audit.random_spot_check:
            reason = suspicious[0][1] if suspicious else why_worker or "random spot-check"
            verdict = self._spot_check(b, [i for i, _ in suspicious], reason)
        if verdict is None:  # what passed (a spot-check, if any) shapes the worker's statistics and the fleet's range
            for st in stats:
                self.audit.observe(b.key_id, staleness, st)
        return verdict

    def _float_logprobs(self, eps: list[Episode]) -> list[np.ndarray]:
        """The learner's log pi of ``eps`` at their model tokens. Episodes with the same tokens and
        temperature (a converged policy repeats itself) share one scored row; each keeps its own
        claims, which the audit compares one episode at a time."""
        distinct, of = distinct_rows(eps)
        kw = {"model_only": True} if self._model_only else {}  # a scorer without it scores every token
        lps = self.float_scorer.logprobs(distinct, temperature=None, **kw)  # type: ignore[union-attr]
        return [lps[j] for j in of]

    def _spot_check(self, b: Batch, first: list[int], reason: str) -> tuple[str, str] | None:
        """Re-score some episodes with the int8 policy of the claimed version: their log-probs
        token by token, and (when the batch's work was assigned) every token against the draw the
        sampling rule makes from the assigned seed. A confirmed mismatch bans the key."""
        if self.int8 is None:
            return None
        rest = [i for i in self.rng.permutation(len(b.episodes)).tolist() if i not in first]
        pick = (first + rest)[: self.cfg.audit.spot_check_episodes]
        eps = [b.episodes[i] for i in pick]
        t0 = time.perf_counter()
        scored = self.int8.score(b.version, eps)
        if scored is None:  # never accepted unchecked: a forger would claim exactly such a version
            return "unverifiable", (f"{reason}; the spot-check cannot be made: version {b.version}'s int8 weights "
                                    "are neither held nor rebuildable from the weight chain")
        result = spot_check(lambda _: scored, eps, self.audit.config)
        drawn = None if result.confirmed or self.assign is None else self._sampling(b, eps)
        self.seconds["spot_check"] += time.perf_counter() - t0
        self.counts["spot_checks"] += 1
        rec = self._record(b.key_id, b.worker_id)
        rec.spot_checks += 1
        if not result.confirmed and drawn is None:
            log.info("spot-check of %s (%s): %s", b.key, reason, result.detail)
            return None
        rec.spot_check_failures += 1
        why = f"log-prob audit: {reason}; spot-check: {result.detail if result.confirmed else drawn}"
        self.ban(b.key_id, why)
        return ("audit" if result.confirmed else "sampling"), why

    def _draws(self, b: Batch) -> tuple[str, str] | None:
        """Every batch: ``audit.sampling_episodes`` random episodes, and every episode whose tokens
        repeat another's in the batch (a variant copy, or an honest near-deterministic sample),
        re-derived from the assigned seed; a token the rule did not draw bans the key."""
        pick = sampling_pick(b.episodes, self.rng, self.cfg.audit.sampling_episodes)
        t0 = time.perf_counter()
        eps, seed = [b.episodes[i] for i in pick], self.assign(b).seed  # type: ignore[misc]
        margins = self.int8.sampling_margins(b.version, eps, [seed] * len(eps))  # type: ignore[union-attr]
        if margins is None:  # never accepted unchecked
            return "unverifiable", (f"the sampling check cannot be made: version {b.version}'s int8 weights are "
                                    "neither held nor rebuildable from the weight chain")
        why = self._sampling(b, eps, margins)
        self.seconds["sampling"] += time.perf_counter() - t0
        if why is None:
            return None
        rec = self._record(b.key_id, b.worker_id)
        rec.spot_check_failures += 1
        self.ban(b.key_id, why)
        return "sampling", why

    def _sampling(self, b: Batch, eps: list[Episode], margins: list[np.ndarray] | None = None) -> str | None:
        """Why some of ``eps``' tokens are not the ones the sampling rule draws from the batch's
        assigned seed under the claimed version's int8 weights (``margins``, computed here when
        not given), or None."""
        if margins is None:
            seed = self.assign(b).seed  # type: ignore[misc]
            margins = self.int8.sampling_margins(b.version, eps, [seed] * len(eps))  # type: ignore[union-attr]
            if margins is None:  # only after the log-prob re-score of the same version succeeded
                return None
        band = self.cfg.audit.sampling_band
        flat = np.concatenate(margins) if margins else np.zeros(0)
        self.counts["sampled_tokens_checked"] += int(flat.size)
        self.counts["sampled_tokens_ambiguous"] += int((np.abs(flat) <= band).sum())
        bad = [(e, int((m < -band).sum()), int(m.size)) for e, m in zip(eps, margins) if (m < -band).any()]
        if not bad:
            return None
        self.counts["sampling_violations"] += sum(n for _, n, _ in bad)
        e, n, total = bad[0]
        return (f"sampling: {len(bad)} of {len(eps)} episodes hold tokens the sampling rule does not draw from the "
                f"assigned seed at temperature {e.temperature:g}, top_p {e.top_p:g} (group {e.group_id[:40]!r} sample "
                f"{e.sample_index}: {n} of {total} tokens further than {band:g} outside their slice of the CDF)")

    def calibrate(self, episodes: Sequence[Episode], trainer_logprobs: Sequence[np.ndarray]) -> float:
        """The int8-versus-float floor, from the trainer's own int8 episodes at one version."""
        floor = self.audit.calibrate([episode_stats(lp, ep) for ep, lp in zip(episodes, trainer_logprobs)])
        log.info("audit calibrated: int8-vs-float mean |log pi - log mu| (99th percentile per episode) %.4f", floor)
        return floor

    # -- reports ----------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """``trust/...`` metrics for the trainer's train rows (cumulative counts and seconds)."""
        recs = self.records.values()
        out: dict[str, float] = {
            "trust/workers": float(len(self.records)),
            "trust/banned_workers": float(sum(bool(r.banned) for r in recs)),
            "trust/withheld_batches": float(sum(r.withheld for r in recs)),
            "trust/withholding_flagged": float(sum(f for _, f in self.withholding().values())),
            "trust/accepted_batches": float(sum(r.accepted_batches for r in recs)),
            "trust/rejected_batches": float(sum(r.rejected_batches for r in recs)
                                            + sum(sum(d.values()) for d in self.anonymous.values())),
            **{f"trust/{k}_s": round(v, 4) for k, v in self.seconds.items()},
            **{f"trust/{k}": float(v) for k, v in self.counts.items()},
        }
        cats: dict[str, int] = {}
        for r in recs:
            for c, n in r.rejected.items():
                cats[c] = cats.get(c, 0) + n
        for d in self.anonymous.values():
            for c, n in d.items():
                cats[c] = cats.get(c, 0) + n
        out.update({f"trust/rejected/{c}": float(n) for c, n in sorted(cats.items())})
        if self.audit.floor is not None:
            out["trust/audit_floor"] = self.audit.floor
        f = self.audit.fleet("0")
        if f is not None:
            out["trust/audit_median_s0"] = f[0]
        return out

    def report(self, version: int) -> dict[str, Any]:
        recs = sorted(self.records.items(), key=lambda kv: -kv[1].last_seen)[:_MAX_REPORT_WORKERS]
        held = self.withholding()
        return {"run": self.run, "version": version, "time": time.time(), "mode": self.cfg.mode,
                "floor": self.audit.floor,
                "workers": {kid: {**asdict(r), "audit": self.audit.summary(kid), "withheld": r.withheld,
                                  "withheld_rate": round(held.get(kid, (0.0, False))[0], 4),
                                  "withholding_flagged": held.get(kid, (0.0, False))[1]} for kid, r in sorted(recs)},
                "anonymous": {w: d for w, d in list(self.anonymous.items())[:_MAX_REPORT_WORKERS]}}

    def write_report(self, version: int = -1, force: bool = False) -> None:
        """Put the signed per-worker report at ``<run>/trust.json`` (at most every 2 s unless forced)."""
        now = time.time()
        if not force and now - self._report_written < _REPORT_EVERY_S:
            return
        self._report_written = now
        self.version = version if version >= 0 else self.version
        try:
            self.store.put(f"{self.run}/trust.json", sign_document(_REPORT_KIND, self.report(self.version), self.key))
        except StoreError as e:
            log.warning("could not write the trust report: %s", e)

    # -- state ------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"records": {k: asdict(r) for k, r in self.records.items()}, "anonymous": self.anonymous,
                "audit": self.audit.state(), "fingerprints": list(self.fingerprints.items())}

    def restore(self, state: dict[str, Any]) -> None:
        self.records = {k: WorkerRecord(**r) for k, r in state.get("records", {}).items()}
        self.anonymous = {w: dict(d) for w, d in state.get("anonymous", {}).items()}
        self.audit.restore(state.get("audit", {}))
        self.fingerprints = {fp: kid for fp, kid in state.get("fingerprints", [])}
        self.refresh(force=True)


def read_trust_report(store: ObjectStore, run: str, public_key: Any = None) -> dict[str, Any] | None:
    """The trainer's per-worker report (verified when ``public_key`` is given), or None."""
    key = f"{run}/trust.json"
    if public_key is not None:
        return read_signed(store, key, _REPORT_KIND, public_key, expect={"run": run})
    import json

    try:
        return json.loads(json.loads(store.get(key, max_bytes=4 << 20))["body"])
    except Exception:
        return None
