"""The :class:`Intake`: polls the store, checks what came, pools it, and refuses in one way.

Every refusal, the reader's included, goes through :meth:`Intake.reject`, which quarantines the
object in the store (so a restart never retries it), counts it against its sender's key
(strikes, bans), writes the ledger and emits an event row, together.

**A batch's version is bound.** A worker holding several versions' weights could make its
assigned batch under each and upload the one it prefers. So a salted batch is accepted only under
the version (and with the beacon) the trainer bound to its number when the worker ticketed it
(:mod:`stoa.fleet.trust.binding`); every poll binds the new tickets first. A probation batch,
never trained, keeps the older rule: it must claim at least (a) every version its key's
lower-numbered batches claimed, and (b) the trainer's version at the last listing of the store
before any of those batches appeared in it, less ``rollout.lag``. A batch below that floor is
dropped unread (``behind``), like a stale one, and both count as withheld numbers, never as
delivered work.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stoa.fleet.config import RunConfig
from stoa.fleet.intake.copies import Copies
from stoa.fleet.intake.pool import Pool, Taken
from stoa.fleet.trust.admission import batch_problem
from stoa.fleet.trust.assign import Assignment, assignment, assignment_problem, is_probation
from stoa.fleet.trust.binding import MAX_AHEAD, Binder, free_between
from stoa.fleet.trust.gate import TrustGate, scoped
from stoa.fleet.trust.ledger import Ledger
from stoa.fleet.trust.records import public_reason
from stoa.fleet.trust.review import FloatScorer
from stoa.transport.exchange import Batch, Rejection, RolloutReader, held_numbers, write_progress
from stoa.transport.identity import assignment_salt
from stoa.transport.sequence import write_floors
from stoa.transport.store import StoreError

if TYPE_CHECKING:
    from stoa.fleet.trainer.policies import HeldPolicies
    from stoa.transport.store import ObjectStore
    from stoa.types import Category, Episode

__all__ = ["Intake", "IntakeCounters"]

log = logging.getLogger("stoa.trainer")

_PROGRESS_EVERY_S = 5.0
_HELD_LIST_EVERY_S = 10.0
"""How often a key's far ticket may make the trainer list its worker id's objects (a worker re-tickets every 30 s)."""
_NEWCOMER_BACKLOG = 64
"""Newcomers' batches kept waiting per allowed batch (``trust.newcomers_per_poll``)."""


@dataclass
class IntakeCounters:
    dropped_stale_groups: int = 0
    dropped_reused_groups: int = 0
    dropped_malformed_groups: int = 0
    dropped_behind_groups: int = 0
    """Groups of batches below their key's version floor (see the module docstring)."""
    probation_batches: int = 0
    """Accepted batches of probation work (checked, never trained: :mod:`stoa.fleet.trust.assign`)."""
    future_version_batches: int = 0
    rejected_batches: int = 0
    """Decoded batches refused (the reader's refusals of undecodable objects are counted in its
    ``quarantined``)."""


class Intake:
    """Reads, checks and pools the fleet's batches for one trainer (see ``docs/architecture.md``).

    Args:
        cfg: the run config (``[rollout]`` sampling settings, ``[trainer]`` gates, ``[trust]``).
        store, private_key: the fleet's store and the run's signing key (roster, progress, reports).
        vocab_size: every token id must lie below it (the learner's).
        metric_types: the task's declared metric types (``TextEnv.metric_types``).
        ledger: the trainer's ledger.
        float_scorer: the learner (the audit's log pi and its floor; finds the batch to blame
            when a step fails).
        int8: the held int8 policies (spot-checks; replay's text codec).
        make_env: builds the run's training environment (replay).
        event: called with an event row's fields for every refusal and ban (the metrics log).
        roster_copy: where the gate keeps the newest roster it has seen (see :class:`TrustGate`).
    """

    def __init__(self, cfg: RunConfig, store: ObjectStore, private_key: Any, *, vocab_size: int,
                 metric_types: dict[str, Any], ledger: Ledger, float_scorer: FloatScorer, int8: HeldPolicies | None,
                 make_env: Callable[[], Any], event: Callable[..., Any] = lambda **_: None,
                 roster_copy: Path | None = None):
        from stoa.fleet.trust.replay import Replayer

        self.cfg, self.store, self.key = cfg, store, private_key
        self.metric_types, self.ledger, self.float_scorer, self.event = metric_types, ledger, float_scorer, event
        rc = cfg.rollout
        replayer = (Replayer(make_env, int8.codec, max_turn_tokens=rc.max_turn_tokens,
                             max_episode_tokens=rc.max_episode_tokens) if cfg.trust.replay and int8 else None)
        self.n_items = len(make_env().unwrapped)
        self.gate = TrustGate(cfg.trust, store, cfg.name, private_key, ledger=ledger, replayer=replayer,
                              float_scorer=float_scorer, int8=int8, roster_copy=roster_copy)
        self.gate.refresh(force=True)
        self.listed: dict[str, int] = {}  # object key -> the trainer's version at the listing before it appeared
        self._list_version = -1  # the trainer's version at the last listing (-1: none yet)
        self._salts: dict[str, str] = {}
        self._held_listed: dict[str, float] = {}  # key id -> when its worker id's objects were last listed
        self.binder = Binder(store, cfg.name, private_key)
        self.binder.recover()  # a restart keeps every binding a worker may have seen
        self.reader = RolloutReader(store, cfg.name, vocab_size=vocab_size, hand_back=True)
        self.copies = Copies(cfg.trust.max_hashes)
        self.pool = Pool()
        self.waiting: list[Batch] = []  # newcomers' batches past this poll's quota (trust.newcomers_per_poll)
        self.used_groups: set[str] = set()
        self.counters = IntakeCounters()
        self._progress_written = 0.0

    # -- the verbs ---------------------------------------------------------------------------------
    def take(self, version: int) -> Taken | None:
        """Poll the store, check what came, and return ``trainer.groups_per_step`` eligible groups
        (oldest first), or None while there are not enough yet."""
        self._poll(version)
        tc = self.cfg.trainer
        taken, dropped = self.pool.choose(version, tc.groups_per_step, self.cfg.rollout.group_size, tc.max_lag,
                                          self.gate.max_groups(tc.groups_per_step), self.used_groups)
        self.counters.dropped_reused_groups += len(dropped["reused"])
        self.counters.dropped_stale_groups += len(dropped["stale"])
        self.counters.dropped_malformed_groups += len(dropped["malformed"])
        if any(dropped.values()):
            self.ledger.write(dropped={k: v for k, v in dropped.items() if v})
        return taken

    def settle(self, taken: Taken, error: Exception | None = None) -> None:
        """After the learner's step over ``taken``: with no ``error`` its groups are used and its
        senders credited; with one, the batches whose episodes the learner cannot take are
        refused and the other groups go back to the pool (if no batch alone fails, every batch
        of the step is refused)."""
        if error is None:
            for batch, g in zip(taken.batches, taken.groups):
                self.used_groups.add(g[0].group_id)
                self.gate.trained(batch, len(g))
            return
        by_batch: dict[str, tuple[Batch, list[list[Episode]]]] = {}
        for batch, g in zip(taken.batches, taken.groups):
            by_batch.setdefault(batch.key, (batch, []))[1].append(g)
        guilty = []
        for batch, groups in by_batch.values():
            try:
                lps = self.float_scorer.logprobs([e for g in groups for e in g])
                if not all(np.isfinite(lp).all() for lp in lps):
                    raise ValueError("non-finite trainer log-probs")
            except Exception as e:
                guilty.append((batch, f"the learner cannot take it: {type(e).__name__}: {e}"))
        if not guilty:
            guilty = [(b, f"a learner step over this and {len(by_batch) - 1} other batch(es) failed: "
                          f"{type(error).__name__}: {error}") for b, _ in by_batch.values()]
        for batch, reason in guilty:
            self.pool.remove(batch.key)
            self.reject(batch, reason[:2000])
        self.pool.put_back(taken, [b.key for b, _ in guilty])

    def reject(self, item: Batch | Rejection, reason: str = "", category: Category = "invalid") -> None:
        """Refuse a batch, or an object the reader refused, everywhere at once: quarantine (a
        restart never retries it), the sender's record (strikes, bans), the ledger and an event
        row. A reader's refusal carries its own reason and category (``reason`` and ``category``
        are for a batch)."""
        if isinstance(item, Rejection):
            reason, category = item.reason, item.category  # type: ignore[assignment]
            kid, worker, episodes = item.key_id or "", item.worker_id or "", 0
        else:
            kid, worker, episodes = item.key_id, item.worker_id, len(item.episodes)
        if not self.reader.quarantine(item, public_reason(category, reason)):  # the store's copy is public
            return  # it stays in the store; the next poll meets it again
        if isinstance(item, Batch):
            self.counters.rejected_batches += 1
        self.gate.reject(kid, worker, category, reason, episodes)
        self.ledger.write(rejected=item.key, category=category, reason=reason[:500])
        self.event(event="rejected", batch=item.key, worker=worker, key_id=kid, category=category,
                   reason=reason[:500])
        log.warning("quarantined %s: %s", item.key, reason)

    def assigned(self, batch: Batch) -> Assignment:
        """The work ``batch`` owes: its sealing key's assignment for its sequence number, salted
        with the key's secret salt, or its probation work when it presents itself as such
        (:mod:`stoa.fleet.trust.assign`)."""
        rc = self.cfg.rollout
        salt = beacon = None
        if not is_probation(batch.episodes, batch.key_id, batch.seq):
            salt = self._salts.get(batch.key_id)
            if salt is None:
                if len(self._salts) > 16384:
                    self._salts.clear()
                salt = self._salts[batch.key_id] = assignment_salt(self.key, self.cfg.name, batch.key_id)
            bound = self.binder.bound_to(batch.key_id, batch.seq)
            beacon = bound.beacon if bound is not None else None
        return assignment(self.cfg.seed, batch.key_id, batch.seq, self.n_items, rc.groups_per_cohort, salt, beacon)

    def calibrate(self, episodes: list[Episode]) -> float | None:
        """Set the audit's int8-versus-float floor from the trainer's own int8 ``episodes`` (scored
        here by the learner they were quantized from) when the audit needs one; returns it, or
        None when nothing was set."""
        if not self.cfg.trust.audit.enabled or self.gate.audit.floor is not None:
            return None
        return self.gate.calibrate(episodes, self.float_scorer.logprobs(episodes, temperature=None))

    # -- polling and checks ------------------------------------------------------------------------
    def _poll(self, version: int) -> None:
        self.gate.refresh()
        self._bind(version)
        batches = self.reader.poll(admission=self.gate.admission())  # unsealed and refused keys: never decoded
        self._listed(self.reader.last_report.listed, version)
        for refused in self.reader.last_report.rejected:
            self.reject(refused)
        self.gate.planted(self.reader.last_report.rejected)
        batches, copies = self.copies.sift(batches, drawn=lambda b: self.gate.checks.draws_every_episode(b.key_id))
        for batch, why in copies:
            self.reject(batch, why, "duplicate")
        self._write_progress(bool(batches))
        kept = {b.key for b in sorted(batches, key=lambda b: (b.key_id, b.seq)) if self._bounded(b, version)}
        admitted = self._newcomers([b for b in batches if b.key in kept], version)
        work = [self.assigned(b) for b in admitted]
        for batch, owed, verdict in zip(admitted, work, self.gate.review(admitted, version, work)):
            if verdict is not None:
                self.reject(batch, verdict.reason, verdict.category)
            elif owed.probation:  # checked and credited, never trained on
                self.counters.probation_batches += 1
                self.ledger.write(probation=batch.key)
            else:
                skip = self.gate.untrained.get(batch.key)  # groups holding an unverifiable episode
                self.pool.add(dataclasses.replace(batch, episodes=[e for e in batch.episodes if e.group_id not in skip])
                              if skip else batch)
        for kid, worker, reason in self.gate.take_new_bans():  # a banned key's queued batches are never trained on
            self.event(event="banned", key_id=kid, worker=worker, reason=reason[:500])
            for batch in self.pool.of_key(kid):
                self.pool.remove(batch.key)
                self.reject(batch, f"worker key {kid} was banned: {reason[:300]}", "banned")

    def _bind(self, version: int) -> None:
        """Bind the new tickets of keys with standing to ``version`` (less ``rollout.lag``) and
        their fresh beacons (:mod:`stoa.fleet.trust.binding`); drop the bindings that can only
        make stale batches. Refused tickets are quarantined by the binder, and noted here."""
        self.binder.prune(version - self.cfg.trainer.max_lag)
        reread = [False]

        def reread_once(kid: str) -> None:
            if not self.gate.established(kid) and not reread[0]:  # enrolled since the roster was last read?
                reread[0] = True
                self.gate.refresh(force=True)

        def standing(kid: str) -> bool:
            reread_once(kid)
            return self.gate.established(kid) and not self.gate.is_banned(kid)

        def held(kid: str, after: int, below: int) -> set[int]:
            reread_once(kid)  # its worker id is in the roster
            return self._held(kid, after, below)

        for kid, where, reason in self.binder.poll(max(0, version - self.cfg.rollout.lag), standing, held):
            self.ledger.write(refused_ticket=where, key_id=kid, reason=reason[:500])
            self.event(event="ticket_refused", ticket=where, key_id=kid, reason=reason[:500])

    def _held(self, kid: str, after: int, below: int) -> set[int]:
        """The numbers in ``(after, below)`` held under ``kid``'s worker id, by anyone's object: in
        the store now (what the worker's writer skipped), or settled by the reader (their objects
        may be pruned or deleted since). The binder does not count them against the key's lookahead."""
        entry, rec = self.gate.roster.enrolled.get(kid), self.gate.records.get(kid)
        worker = entry.worker_id if entry is not None else rec.worker_id if rec is not None else ""
        if not worker:
            return set()
        held = self.reader.settled_between(worker, after, below)
        if free_between(after, below, held) < MAX_AHEAD:
            return held  # what the reader has read is enough: no listing
        now = time.monotonic()
        if now - self._held_listed.get(kid, -_HELD_LIST_EVERY_S) < _HELD_LIST_EVERY_S:
            return held  # one listing a key every few seconds, however many far tickets it writes
        if len(self._held_listed) > 4096:
            self._held_listed.clear()
        self._held_listed[kid] = now
        try:
            held |= held_numbers(self.store, self.cfg.name, worker, after, below)
        except (StoreError, ValueError) as e:
            log.warning("could not list worker %s's numbers (%s); counting only those already read", worker, e)
        return held

    def _binding_problem(self, batch: Batch) -> str | None:
        """Why a salted ``batch`` is not made under its number's binding, or None (probation
        work needs no binding)."""
        if not batch.key_id or is_probation(batch.episodes, batch.key_id, batch.seq):
            return None
        bound = self.binder.bound_to(batch.key_id, batch.seq)
        if bound is None:
            return (f"number {batch.seq} of key {batch.key_id} was never bound to a version (a worker tickets a "
                    "number and makes it only once the trainer's bindings name it)")
        if batch.version != bound.version:
            return f"it claims version {batch.version}, but its number was bound to version {bound.version}"
        return None

    def _listed(self, keys: list[str], version: int) -> None:
        """The reader's listing of the rollouts at the trainer's ``version``: every object new since
        the previous listing was uploaded after it, when the version of that listing was already
        published (the floor of its key's later batches, :meth:`_floor`)."""
        present = set(keys)
        self.listed = {k: v for k, v in self.listed.items() if k in present}
        for k in keys:
            self.listed.setdefault(k, self._list_version)
        self._list_version = version

    def _write_progress(self, fresh: bool) -> None:
        """What was taken, per worker (signed): workers throttle on it (rollout.max_outstanding) and
        wait while it is missing, so it is rewritten every few seconds even when nothing came."""
        if fresh or time.time() - self._progress_written > _PROGRESS_EVERY_S:
            try:
                write_progress(self.store, self.cfg.name, self.reader.progress(), self.key)
                write_floors(self.store, self.cfg.name, self.reader.next_numbers(), self.key)  # no number reused
                self._progress_written = time.time()
            except StoreError as e:
                log.warning("could not write the progress document (%s); will retry", e)

    def _bounded(self, batch: Batch, version: int) -> bool:
        """Whether ``batch`` keeps to the run's own bounds (version, staleness, its key's version
        floor, sampling settings, rewards, metrics, task, assigned work); a batch that does not is
        refused or dropped here. Only a batch that passes the version checks counts as delivered
        for withholding: a stale, future or behind one leaves its number a gap."""
        cfg = self.cfg
        if batch.version > version:  # not a strike: a tampered store can show a label the trainer never reached
            self.reject(batch, f"policy version {batch.version} is newer than the trainer's "
                               f"{version}: not produced by this run's weights", "future")
            self.counters.future_version_batches += 1
            return False
        floor = self._floor(batch)
        if self._stale(batch, version):  # never trained: dropped before any check
            return False
        if batch.version < floor:
            self._drop(batch, "behind", f"version {batch.version} is below {floor}, which its key held already")
            return False
        self.gate.saw(batch.key_id, batch.worker_id, batch.seq)  # a number delivered in time, whatever its fate
        category: Category = "invalid"
        try:
            why = batch_problem(batch.episodes, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                group_size=cfg.rollout.group_size, reward_range=cfg.trust.reward_range,
                                env_id=cfg.env.id, metric_types=self.metric_types)
            if why is None and batch.key_id:
                category = "assignment"
                why = self._binding_problem(batch) or assignment_problem(batch.episodes, self.assigned(batch),
                                                                          cfg.rollout.group_size)
        except Exception as e:  # whatever a stranger's batch breaks, it is the batch's fault
            why, category = f"checking the batch failed: {type(e).__name__}: {e}", "invalid"
        if why:
            self.reject(batch, why if category == "invalid" else f"not the assigned work: {why}", category)
            return False
        return True

    def _floor(self, batch: Batch) -> int:
        """The lowest version ``batch`` may claim (see the module docstring), after noting what
        ``batch`` itself says of its key's later batches; a pooled later batch of the key below
        the new floor (read first, under a poll's caps) is dropped now."""
        if not batch.key_id:
            return -1
        listed = self.listed.pop(batch.key, -1)
        if not is_probation(batch.episodes, batch.key_id, batch.seq):
            listed = -1  # bound work: its version was fixed by the trainer when its number was due
        mine = max(batch.version, listed - self.cfg.rollout.lag if listed >= 0 else -1)
        floor = self.gate.version_floor(batch.key_id, batch.worker_id, batch.seq, mine)
        for later in self.pool.of_key(batch.key_id):
            if later.seq > batch.seq and later.version < mine:
                self.pool.remove(later.key)
                self.gate.unsaw(batch.key_id)  # it was counted as delivered: now a gap
                self._drop(later, "behind", f"version {later.version} is below {mine}, which its key held already")
        return floor

    def _drop(self, batch: Batch, why: str, detail: str) -> None:
        """Drop ``batch`` without a strike (its groups counted and in the ledger under ``why``)."""
        groups = sorted({scoped(batch.key_id, e.group_id) for e in batch.episodes})
        self.counters.dropped_behind_groups += len(groups)
        self.ledger.write(dropped={why: groups}, batch=batch.key, reason=detail)
        log.info("dropped %s (%s): %s", batch.key, why, detail)

    def _newcomers(self, batches: list[Batch], version: int) -> list[Batch]:
        """``batches`` and the waiting ones, less the newcomers' batches past this poll's quota
        (:meth:`TrustGate.pace_newcomers`), which wait for a later poll: at most 64 per allowed
        batch, the newest versions kept (the others are refused, not struck)."""
        now, wait = self.gate.pace_newcomers([b for b in self.waiting if not self._stale(b, version)] + batches)
        cap = _NEWCOMER_BACKLOG * self.cfg.trust.newcomers_per_poll
        wait.sort(key=lambda b: b.version)
        for b in wait[:-cap] if len(wait) > cap else []:
            self.reject(b, f"more than {cap} batches from keys without accepted work are waiting; this one is "
                           "refused (trust.newcomers_per_poll)", "refused")
        self.waiting = wait[-cap:]
        return now

    def _stale(self, batch: Batch, version: int) -> bool:
        """Whether ``batch`` is more than ``trainer.max_lag`` versions behind ``version``; if so its
        groups are counted and written to the ledger as dropped (stale)."""
        if version - batch.version <= self.cfg.trainer.max_lag:
            return False
        stale = sorted({scoped(batch.key_id, e.group_id) for e in batch.episodes})
        self.counters.dropped_stale_groups += len(stale)
        self.gate.late(batch.key_id, batch.worker_id)
        self.ledger.write(dropped={"stale": stale})
        return True

    # -- reports -----------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """``dropped/...`` and ``trust/...`` figures for the trainer's rows (cumulative)."""
        c = self.counters
        return {"dropped/stale_groups": c.dropped_stale_groups, "dropped/reused_groups": c.dropped_reused_groups,
                "dropped/behind_groups": c.dropped_behind_groups, "trust/probation_batches": c.probation_batches,
                "dropped/quarantined_batches": self.reader.quarantined, "dropped/rejected_batches": c.rejected_batches,
                "trust/bound_numbers": self.binder.bound_total, "trust/refused_tickets": self.binder.tickets_refused,
                **self.gate.metrics()}

    def report(self, version: int, force: bool = False) -> None:
        """Put the signed per-worker report (``<run>/trust.json``) that ``stoa status`` shows (at
        most every 2 s unless ``force``)."""
        self.gate.write_report(version, force=force)

    # -- checkpoints -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """JSON-ready state for a checkpoint: pooled and waiting batches stay unconsumed, so a
        restart from it delivers them again (:meth:`RolloutReader.state`)."""
        pending = self.pool.batches() + self.waiting
        waiting_groups = self.pool.waiting_groups()
        pending_used = sorted(gid for b in self.pool.batches() for gid in {scoped(b.key_id, e.group_id)
                                                                           for e in b.episodes}
                              if gid in self.used_groups and gid not in waiting_groups)
        return {"reader": self.reader.state(pending=pending), "hashes": self.copies.state(pending),
                "used_groups": pending_used, "counters": asdict(self.counters), "trust": self.gate.state(),
                "bindings": self.binder.state()}

    def restore(self, state: dict[str, Any]) -> None:
        self.reader.restore(state["reader"])
        self.copies.restore(state.get("hashes", state["reader"].get("hashes", [])))  # older states keep them there
        self.used_groups = set(state["used_groups"])
        self.counters = IntakeCounters(**state["counters"])
        if state.get("trust"):
            self.gate.restore(state["trust"])
        self.binder.restore(state.get("bindings", {}))

    def prune(self, state: dict[str, Any]) -> None:
        """Delete consumed batches that ``state`` (a checkpoint's) no longer needs from the store."""
        self.reader.prune(state["reader"])
