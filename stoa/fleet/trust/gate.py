"""The trainer's gate for untrusted workers: the one object the intake asks for verdicts.

One :class:`TrustGate` per trainer, owned by its :class:`stoa.fleet.intake.Intake`, which asks
it in a few verbs with typed results and passes values, never callbacks:

* what to read: :meth:`TrustGate.admission` (who may upload), after :meth:`TrustGate.refresh`
  and :meth:`TrustGate.bind` (the new tickets' bindings);
* what a batch is worth: :meth:`TrustGate.judge`, one :class:`~stoa.fleet.trust.bounds.Judgement`
  per batch (train, probation, drop, reject), the run's bounds
  (:mod:`~stoa.fleet.trust.bounds`), newcomer pacing and the review applied, every refusal
  already counted against its key;
* what to settle: :meth:`TrustGate.refused` (a refusal the intake made itself: an undecodable
  object, a copy, a batch the learner cannot take) and :meth:`TrustGate.trained`.

Its state lives in three modules, each owning one kind:

* :mod:`~stoa.fleet.trust.roster` (:class:`~stoa.fleet.trust.roster.Membership`): who may upload,
  newcomer pacing, binding by accepted work, expiry;
* :mod:`~stoa.fleet.trust.records` (:class:`~stoa.fleet.trust.records.Records`): per key, batches
  accepted and rejected by category, strikes, bans, withholding, and the signed
  :class:`~stoa.fleet.trust.records.TrustReport`;
* :mod:`~stoa.fleet.trust.review` (:class:`~stoa.fleet.trust.review.Review`): replay, the log-prob
  audit, spot-checks and the sampling check, each returning a typed
  :class:`~stoa.types.Verdict` and changing nothing else.

The gate also decides a *fresh* key's standing (one binding at a time until its first accepted
salted batch; a bound number it leaves undelivered costs its standing, and it makes
``trust.probation_batches`` probation batches again: :mod:`stoa.fleet.trust.binding`), kept in
the records and announced in the signed bindings document.

The gate applies verdicts: a confirmed forgery bans its key, ``ban_after`` strikes ban it too;
the ban goes into the key's signed ban document, the trainer's ban log and the ledger
(:mod:`stoa.fleet.trust.ledger`), and the intake drops the key's queued batches. Groups are scoped to the key that sealed them
(:func:`scoped`), and :func:`max_groups` caps one key's share of a step. The gate's
state (records, audit statistics) is plain JSON for the trainer's checkpoint; the roster itself
lives in the store.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from stoa.fleet.trust.binding import MAX_AHEAD, MAX_LOST_LISTED, Binder, free_between
from stoa.fleet.trust.bounds import Bounds, Judgement, RunBounds, scoped
from stoa.fleet.trust.planted import count_planted
from stoa.fleet.trust.records import REPORT_KIND, Records, TrustReport, build_report, public_reason
from stoa.fleet.trust.review import FloatScorer, Int8Scorer, Review
from stoa.fleet.trust.roster import Admission, Membership
from stoa.fleet.trust.section import TrustConfig
from stoa.transport import layout
from stoa.transport.exchange import Rejection, held_numbers
from stoa.transport.identity import Ban, Roster
from stoa.transport.signing import sign_document
from stoa.transport.store import ObjectStore, StoreError
from stoa.types import Category, Verdict

if TYPE_CHECKING:
    from stoa.fleet.trust.assign import Assignment
    from stoa.fleet.trust.ledger import Ledger
    from stoa.fleet.trust.replay import Replayer
    from stoa.transport.exchange import Batch
    from stoa.types import Episode

__all__ = ["Judged", "Settled", "TrustGate", "group_episodes", "max_groups", "scoped"]

log = logging.getLogger("stoa.trust")

_REPORT_EVERY_S = 2.0
_NEWCOMER_BACKLOG = 64
"""Newcomers' batches kept waiting per allowed batch (``trust.newcomers_per_poll``)."""
_HELD_LIST_EVERY_S = 10.0
"""How often a key's far ticket may make the trainer list its worker id's objects (a worker re-tickets every 30 s)."""
_MAX_COUNTED = 4096


def group_episodes(episodes: Sequence[Episode]) -> dict[str, list[Episode]]:
    """A batch's episodes by group id, in order of first appearance."""
    groups: dict[str, list[Episode]] = {}
    for ep in episodes:
        groups.setdefault(ep.group_id, []).append(ep)
    return groups


def max_groups(cfg: TrustConfig, groups_per_step: int) -> int:
    """Most groups one key may contribute to a step (``trust.max_worker_share``)."""
    return max(1, math.floor(cfg.max_worker_share * groups_per_step + 1e-9))


class Settled(Protocol):
    """What the gate asks of the trainer's reader (:class:`stoa.transport.exchange.RolloutReader`)."""

    def settled_between(self, worker_id: str, after: int, below: int) -> set[int]:
        """The numbers in ``(after, below)`` of ``worker_id`` that the reader settled (read or quarantined)."""
        ...


@dataclass
class Judged:
    """:meth:`TrustGate.judge`'s answer for one poll."""

    judgements: list[Judgement] = field(default_factory=list)
    """In the order the gate reached them: the run's bounds (and pooled batches taken back), the
    waiting batches gone stale, the newcomers' batches past the backlog, then the review."""
    waiting: list[Batch] = field(default_factory=list)
    """Newcomers' batches past this poll's quota, to hand back at the next :meth:`TrustGate.judge`."""
    bans: list[tuple[str, str, str]] = field(default_factory=list)
    """``(key id, worker id, reason)`` of each key banned since the previous judgement (their
    pooled batches, and those admitted in this poll, are rejected among the judgements)."""


def _banned(b: Batch, reason: str) -> Verdict:
    return Verdict("banned", f"worker key {b.key_id} was banned: {reason[:300]}")


class TrustGate:
    """See the module docstring.

    Args:
        cfg: the run's ``[trust]`` section.
        store, run, private_key: where the roster, the bindings and the report live, and the
            run's signing key.
        bounds: the run's own bounds on every batch (needed by :meth:`judge`; None: the gate
            only reviews, for tests).
        ledger: where bans are recorded (None: nowhere, for tests).
        replayer: replays episodes through the run's environment (None, or ``cfg.replay`` off, or
            a task that is not replayable: no replay).
        float_scorer: the learner, for the audit's log pi (None or ``cfg.audit.enabled`` off: no audit).
        int8: the held int8 policies, for spot-checks (None: suspicion is logged, never confirmed).
        roster_copy: a local folder (the trainer's run folder) keeping the newest roster seen, so a
            stale ``workers.json`` put back while the trainer is down cannot undo a ban or a
            binding: revisions never go back, across restarts too.
        seed: only for tests that need the same choices twice. By default which episodes are
            audited and when a random spot-check comes are drawn from the operating system's
            entropy, so nothing public (the run's seed is in its world-readable config) predicts them.
    """

    def __init__(self, cfg: TrustConfig, store: ObjectStore, run: str, private_key: Any, *,
                 bounds: RunBounds | None = None, ledger: Ledger | None = None, replayer: Replayer | None = None,
                 float_scorer: FloatScorer | None = None, int8: Int8Scorer | None = None,
                 roster_copy: Path | None = None, seed: int | None = None):
        self.cfg, self.store, self.run, self.key, self.ledger = cfg, store, run, private_key, ledger
        self.rng = np.random.default_rng(seed)  # None: fresh OS entropy
        self.records = Records(cfg.ban_after)
        self.members = Membership(cfg, store, run, private_key, self.records, self.rng, roster_copy)
        self.checks = Review(cfg.audit, cfg.replay, replayer=replayer, float_scorer=float_scorer, int8=int8,
                             rng=self.rng)
        self.binder = Binder(store, run, private_key)
        self.bounds = None if bounds is None else Bounds(bounds, self.records, self.binder, private_key, run)
        if bounds is not None:
            self.binder.recover()  # a restart keeps every binding a worker may have seen
        self.version = 0
        self.private = roster_copy  # the trainer's own folder: the operator's copy of the report goes there
        self._report_written = 0.0
        self._new_bans: list[str] = []
        self._counted: dict[str, None] = {}  # object keys refused and counted (a refusal met again counts once)
        self._held_listed: dict[str, float] = {}  # key id -> when its worker id's objects were last listed

    @property
    def roster(self) -> Roster:
        return self.members.roster

    @roster.setter
    def roster(self, roster: Roster) -> None:
        self.members.roster = roster

    # -- what to read -----------------------------------------------------------------------------
    def refresh(self, force: bool = False) -> None:
        """Re-read the roster (``stoa enroll`` / ``stoa ban`` edit it live), keeping our own bans and bindings."""
        self._new_bans += self.members.refresh(force)

    def admission(self) -> Admission:
        """Who may upload as of now, for the reader to apply to each seal before decoding
        (:meth:`Membership.admission`), and whether a sealed batch's every token is re-derived
        (its groups then need no copy print)."""
        redraws = self.checks.int8 is not None and self.cfg.audit.every_episode
        return dataclasses.replace(self.members.admission(), redraws=redraws)

    def bind(self, version: int, settled: Settled) -> list[tuple[str, str, str]]:
        """Bind the new tickets of keys with standing to ``version`` (less ``rollout.lag``) and
        their fresh beacons (:mod:`stoa.fleet.trust.binding`), and drop the bindings that can only
        make stale batches. Returns the refused tickets as ``(key id, ticket, reason)`` (already
        quarantined). ``settled``: the trainer's reader, for the numbers a far ticket's key holds."""
        assert self.bounds is not None, "the gate judges batches only when it knows the run's bounds"
        opened = self._open_numbers(self.binder.bound)
        self.binder.prune(version - self.bounds.run.max_lag)
        for kid, n in opened.items():
            if n not in self.binder.bound.get(kid, {}):
                self._lose(kid, n, f"its binding of number {n} expired (more than trainer.max_lag versions "
                                   "behind) before any batch of it came")
        listing = self.binder.listing()
        kids = listing.keys()
        if any(not self.members.established(kid) for kid in kids):
            self.refresh(force=True)  # enrolled since the roster was last read?
        standing = {kid for kid in kids if self.members.established(kid) and not self.members.is_banned(kid)
                    and not self._owes(kid)}
        fresh = {}
        for kid in kids | set(self.binder.bound):
            rec = self.records.get(kid)
            if rec is not None and rec.probation_owed:
                if kid in kids:
                    rec.last_seen = time.time()  # it tickets: keep it named among the lost
            elif rec is None or rec.fresh:
                fresh[kid] = rec.max_seq if rec is not None else -1
        return self.binder.poll(max(0, version - self.bounds.run.lag), standing,
                                lambda kid, after, below: self._held(settled, kid, after, below), listing,
                                fresh=fresh, lost=self.records.lost(MAX_LOST_LISTED))

    # -- what a batch is worth --------------------------------------------------------------------
    def judge(self, batches: Sequence[Batch], version: int, *, listed: Mapping[str, int],
              pooled: Sequence[Batch], waiting: Sequence[Batch]) -> Judged:
        """What each of one poll's ``batches`` (in the reader's order, copies sifted out) is
        worth at the trainer's ``version``, and of the ``waiting`` ones handed back from the
        previous poll (see :class:`Judged`). ``listed``: object key -> the trainer's version at
        the store's last listing before it appeared there; ``pooled``: the batches waiting in
        the training pool (a floor raised now may take some back). Every refusal is counted
        against its key here, in order, so a ban takes effect within the poll."""
        assert self.bounds is not None, "the gate judges batches only when it knows the run's bounds"
        opened = self._open_numbers({b.key_id for b in batches})
        out: list[Judgement] = []
        back: set[str] = set()
        kept: set[str] = set()
        for b in sorted(batches, key=lambda b: (b.key_id, b.seq)):
            j, taken = self.bounds.check(b, version, listed.get(b.key, -1), [p for p in pooled if p.key not in back])
            for t in taken:
                back.add(t.batch.key)
                out.append(t)
            if j is None:
                kept.add(b.key)
            else:
                out.append(self._counted_against(j) if j.action == "reject" else j)
        alive = []
        for b in waiting:
            if (stale := self.bounds.stale(b, version)) is not None:
                out.append(stale)
            else:
                alive.append(b)
        now, wait = self.members.pace_newcomers(alive + [b for b in batches if b.key in kept])
        cap = _NEWCOMER_BACKLOG * self.cfg.newcomers_per_poll
        wait.sort(key=lambda b: b.version)
        for b in wait[:-cap] if len(wait) > cap else []:
            out.append(self._counted_against(Judgement(b, "reject", Verdict(
                "refused", f"more than {cap} batches from keys without accepted work are waiting; this one is "
                           "refused (trust.newcomers_per_poll)"))))
        work = [self.bounds.assigned(b) for b in now]
        untrained: dict[str, set[str]] = {}
        for b, owed, verdict in zip(now, work, self.review(now, version, work, untrained)):
            if verdict is not None:
                out.append(self._counted_against(Judgement(b, "reject", verdict)))
            else:
                out.append(Judgement(b, "probation" if owed.probation else "train",
                                     untrained=frozenset(untrained.get(b.key, ()))))
        bans = self.new_bans()
        why = {kid: reason for kid, _, reason in bans}
        if why:  # a banned key's batches are never trained on: those pooled, and those admitted just now
            for b in [p for p in pooled if p.key not in back]:
                if b.key_id in why:
                    out.append(self._counted_against(Judgement(b, "reject", _banned(b, why[b.key_id]))))
            out = [self._counted_against(Judgement(j.batch, "reject", _banned(j.batch, why[j.batch.key_id])))
                   if j.action == "train" and j.batch.key_id in why else j for j in out]
        for j in out:  # a fresh key's batch at or past its open bound number delivers it, or costs its standing
            b, n = j.batch, opened.get(j.batch.key_id)
            if n is not None and b.seq >= n:
                del opened[b.key_id]
                if j.action != "train":
                    what = {"probation": "probation work", "drop": f"dropped ({j.dropped})",
                            "reject": f"refused ({j.verdict.category if j.verdict else '?'})"}[j.action]
                    self._lose(b.key_id, n, f"its batch at number {b.seq} was {what}, not the bound work of number {n}")
        self.binder.announce(self.records.lost(MAX_LOST_LISTED))  # standing lost or regained: said now
        return Judged(out, wait[-cap:], bans)

    def review(self, batches: Sequence[Batch], trainer_version: int, work: Sequence[Assignment | None] | None = None,
               untrained: dict[str, set[str]] | None = None) -> list[Verdict | None]:
        """The review alone (:meth:`judge` runs it last): for each batch, the
        :class:`~stoa.types.Verdict` that rejects it, or None to admit it. ``work[i]`` is batch
        ``i``'s assigned work (:mod:`stoa.fleet.trust.assign`): given, its draws are re-derived
        from the assigned seed (the sampling check, and with spot-checks) and an accepted
        probation batch is counted as such; None, neither. The checks are the review's
        (:mod:`stoa.fleet.trust.review`); the gate applies what they find (a confirmed forgery
        bans its key; the groups of an episode replay can neither confirm nor refute go to
        ``untrained``, batch key -> group ids, with no strike) and binds an accepted batch's
        unbound key to its worker id (open runs, :meth:`Membership.bind`), which also publishes
        its assignment salt."""
        self.version = trainer_version
        work = list(work) if work is not None else [None] * len(batches)
        untrained = {} if untrained is None else untrained
        verdicts: list[Verdict | None] = [None] * len(batches)
        for i, b in enumerate(batches):
            self.records.touch(b.key_id, b.worker_id)
            if self.members.is_banned(b.key_id):
                verdicts[i] = Verdict("refused", f"key {b.key_id} is banned")
            else:
                verdicts[i], unverifiable = self.checks.replay(b)
                if unverifiable:
                    verdicts[i] = self._unverifiable(b, unverifiable, untrained)
        for i, b in enumerate(batches):
            if verdicts[i] is None:
                verdict, spot_checked = self.checks.check(b, work[i], trainer_version)
                rec = self.records.touch(b.key_id, b.worker_id)
                rec.spot_checks += spot_checked
                if verdict is not None and verdict.ban:
                    rec.spot_check_failures += 1
                    self.ban(b.key_id, public_reason(verdict.category, verdict.reason), code=verdict.category)
                verdicts[i] = verdict
        for i, b in enumerate(batches):
            if verdicts[i] is None and b.key_id and (why := self.members.bind(b)):
                verdicts[i] = Verdict("refused", why)
            if verdicts[i] is None:
                owed = work[i]
                probation = bool(b.key_id) and owed is not None and owed.probation
                dropped = untrained.get(b.key, set())
                kept = sum(e.group_id not in dropped for e in b.episodes)
                if self.records.accept(b.key_id, b.worker_id, kept, probation):
                    log.info("key %s (worker %s) has its standing again (its probation redone)", b.key_id, b.worker_id)
                if not probation or self.records[b.key_id].probation_batches >= self.cfg.probation_batches:
                    self.members.publish_salt(b.key_id)  # its probation is done: its worker may now compute its work
        for k in self.records.forget_strangers(set(self.roster.enrolled)):
            self.checks.audit.forget(k)
        return verdicts

    # -- what to settle ---------------------------------------------------------------------------
    def refused(self, item: Batch | Rejection | None, kid: str, worker_id: str, category: Category, reason: str,
                episodes: int = 0) -> None:
        """Count a refusal against its sender (``item``: the batch, or the reader's refusal of an
        object; None for one with no object): a strike where its category is one, a ban after
        ``ban_after`` strikes. An object met again after a refusal (its quarantine failed, so
        the next poll reads it again) is counted once; a reader's refusal also tells whose
        numbers were planted by another (:func:`stoa.fleet.trust.planted.count_planted`)."""
        if item is not None:
            if item.key in self._counted:
                return
            self._counted[item.key] = None
            while len(self._counted) > _MAX_COUNTED:
                del self._counted[next(iter(self._counted))]
            if isinstance(item, Rejection):
                count_planted(self.records, [item], self.records.planted)
        if self.records.reject(kid, worker_id, category, reason, episodes):
            self.ban(kid, f"{self.records[kid].strikes} rejected batches; last: {public_reason(category, reason)}",
                     code="strikes")

    def trained(self, batch: Batch, episodes: int) -> None:
        """Credit ``batch``'s sender with ``episodes`` trained on."""
        self.records.touch(batch.key_id, batch.worker_id).trained_episodes += episodes

    def new_bans(self) -> list[tuple[str, str, str]]:
        """``(key id, worker id, reason)`` of each key banned since the last call (:meth:`judge`
        hands them out with each judgement)."""
        out, self._new_bans = self._new_bans, []
        return [(k, self.records[k].worker_id, self.records[k].banned) for k in out]

    # -- the gate's own acts ----------------------------------------------------------------------
    def ban(self, kid: str, reason: str, version: int = -1, *, code: str = "banned") -> None:
        """Ban a key: the records refuse it at once; its ban document tells the worker, the
        trainer's ban log keeps it across restarts. ``code`` says why in one word, ``reason``
        becomes the ban's bounded public detail (:class:`~stoa.transport.identity.Ban`). One
        small write per ban, whatever the number of bans. Never raises."""
        rec = self.records.get(kid) or self.records.touch(kid, "")
        if rec.banned or kid in self.members.bans:  # (a record forgotten since, made again: the ban stands)
            rec.banned = rec.banned or self.members.bans[kid]
            return
        ban = Ban.of(rec.worker_id, code, reason, time.time(), version if version >= 0 else self.version)
        rec.banned = ban.reason
        self.members.ban(kid, ban)
        self._new_bans.append(kid)
        self.checks.audit.forget(kid)
        if self.ledger is not None:
            self.ledger.write(banned=kid, worker=rec.worker_id, reason=reason[:500])
        log.warning("banned worker %s (key %s): %s", rec.worker_id, kid, ban.reason)

    def calibrate(self, episodes: Sequence[Episode]) -> float | None:
        """Set the audit's int8-versus-float floor from the trainer's own int8 ``episodes`` (scored
        by the learner they were quantized from) when the audit needs one; returns it, or None
        when nothing was set."""
        scorer = self.checks.float_scorer
        if scorer is None or self.checks.audit.floor is not None:
            return None
        return self.checks.calibrate(episodes, scorer.logprobs(episodes, temperature=None))

    def _counted_against(self, j: Judgement) -> Judgement:
        """``j`` (a rejection), counted against its batch's key."""
        assert j.verdict is not None
        b = j.batch
        self.refused(b, b.key_id, b.worker_id, j.verdict.category, j.verdict.reason, len(b.episodes))
        return j

    def _unverifiable(self, b: Batch, found: list[tuple[int, str]], untrained: dict[str, set[str]]) -> Verdict | None:
        """Note ``b``'s unverifiable episodes against its key (no strike) and set their groups
        apart in ``untrained``; a batch with no other group is refused as ``unverifiable``."""
        self.records.touch(b.key_id, b.worker_id).unverifiable_episodes += len(found)
        groups = {b.episodes[i].group_id for i, _ in found}
        i, why = found[0]
        detail = (f"{len(found)} of {len(b.episodes)} episodes cannot be verified; episode {i} "
                  f"(item {b.episodes[i].item_index}): {why}")
        log.info("batch %s: %s; %d group(s) not trained", b.key, detail, len(groups))
        if groups >= {e.group_id for e in b.episodes}:
            return Verdict("unverifiable", f"replay: {detail}")
        untrained[b.key] = groups
        return None

    def _owes(self, kid: str) -> bool:
        rec = self.records.get(kid)
        return rec is not None and rec.probation_owed > 0

    def _open_numbers(self, kids: Iterable[str]) -> dict[str, int]:
        """The open bound number (:meth:`Binder.open_number`) of each fresh key of ``kids`` with standing."""
        out = {}
        for kid in kids:
            rec = self.records.get(kid)
            if kid and (rec is None or (rec.fresh and not rec.probation_owed)):
                n = self.binder.open_number(kid, rec.max_seq if rec is not None else -1)
                if n is not None:
                    out[kid] = n
        return out

    def _lose(self, kid: str, seq: int, why: str) -> None:
        """A fresh key left its bound number ``seq`` undelivered: it loses its standing and owes
        ``trust.probation_batches`` accepted probation batches (announced in the signed bindings
        document within the poll; no strike)."""
        rec, entry = self.records.get(kid), self.roster.enrolled.get(kid)
        worker = rec.worker_id if rec is not None else entry.worker_id if entry is not None else ""
        if not self.records.lose_standing(kid, worker, seq, self.cfg.probation_batches):
            return
        worker = self.records[kid].worker_id
        log.warning("key %s (worker %s) loses its standing: %s; it makes %d probation batch(es) again", kid, worker,
                    why, self.cfg.probation_batches)
        if self.ledger is not None:
            self.ledger.write(standing_lost=kid, worker=worker, number=seq, reason=why[:500])

    def _held(self, settled: Settled, kid: str, after: int, below: int) -> set[int]:
        """The numbers in ``(after, below)`` held under ``kid``'s worker id, by anyone's object: in
        the store now (what the worker's writer skipped), or settled by the reader (their objects
        may be pruned or deleted since). The binder does not count them against the key's
        lookahead. Asked only for a genuine far ticket of a key with standing."""
        entry, rec = self.roster.enrolled.get(kid), self.records.get(kid)
        worker = entry.worker_id if entry is not None else rec.worker_id if rec is not None else ""
        if not worker:
            return set()
        held = settled.settled_between(worker, after, below)
        if free_between(after, below, held) < MAX_AHEAD:
            return held  # what the reader has read is enough: no listing
        now = time.monotonic()
        if now - self._held_listed.get(kid, -_HELD_LIST_EVERY_S) < _HELD_LIST_EVERY_S:
            return held  # one listing a key every few seconds, however many far tickets it writes
        if len(self._held_listed) > 4096:
            self._held_listed.clear()
        self._held_listed[kid] = now
        try:
            held |= held_numbers(self.store, self.run, worker, after, below)
        except (StoreError, ValueError) as e:
            log.warning("could not list worker %s's numbers (%s); counting only those already read", worker, e)
        return held

    # -- reports ----------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """``trust/...`` metrics for the trainer's train rows (cumulative counts and seconds)."""
        banned = {"trust/banned_workers": float(len(self.members.bans))}  # records of banned keys may be forgotten
        return {**self.records.metrics(self.cfg.audit.worker_mads), **banned, **self.checks.metrics(),
                "trust/bound_numbers": self.binder.bound_total, "trust/refused_tickets": self.binder.tickets_refused}

    def report(self, version: int, operator: bool = False) -> TrustReport:
        """The per-key report: the public one (the store's ``trust.json``: nothing that decides
        whether a batch is checked), or with ``operator`` the whole one (audit means, floor)."""
        return build_report(self.run, version, self.cfg.mode, self.checks.audit.floor, self.records,
                            self.records.withholding(self.cfg.audit.worker_mads), self.checks.audit,
                            len(self.members.bans), operator)

    def write_report(self, version: int = -1, force: bool = False) -> None:
        """Put the signed public report at ``<run>/trust.json``, and the operator's copy in the
        trainer's own folder (``roster_copy``/``trust.json``), at most every 2 s unless forced."""
        now = time.time()
        if not force and now - self._report_written < _REPORT_EVERY_S:
            return
        self._report_written = now
        self.version = version if version >= 0 else self.version
        try:
            self.store.put(layout.trust_report(self.run),
                           sign_document(REPORT_KIND, self.report(self.version).to_body(), self.key))
        except StoreError as e:
            log.warning("could not write the trust report: %s", e)
        if self.private is not None:
            try:
                self.private.mkdir(parents=True, exist_ok=True)
                tmp = self.private / ".trust.json.tmp"
                tmp.write_text(json.dumps(self.report(self.version, operator=True).to_body(), allow_nan=False))
                tmp.replace(self.private / "trust.json")
            except (OSError, ValueError) as e:
                log.warning("could not write the operator's trust report: %s", e)

    # -- state ------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {**self.records.state(), "audit": self.checks.audit.state(), "bindings": self.binder.state()}

    def restore(self, state: dict[str, Any]) -> None:
        self.records.restore(state)
        self.checks.audit.restore(state.get("audit", {}))
        self.binder.restore(state.get("bindings", {}))
        self.refresh(force=True)
