"""The trainer's intake: everything between the store's rollout batches and an optimizer step.

A batch's route, and the file that owns each step::

    store  -> RolloutReader.poll          stoa/transport/exchange.py   size, codec, token ranges, seal;
                                                                       a sealed batch's key checked
                                                                       against the roster (TrustGate.admit)
           -> version and run bounds      here: not newer than the trainer's, not staler than max_lag
                                          stoa/fleet/trust/admission.py  sampling settings, reward range,
                                                                       metric types, task id
           -> assigned work               stoa/fleet/trust/assign.py    items, group ids and samples are the
                                                                       key's assignment for its number
           -> TrustGate.review            stoa/fleet/trust/gate.py      replay (trust/replay.py), copies,
                                                                       log-prob audit and int8 spot-checks
                                                                       (trust/audit.py)
           -> pool                        here                         whole groups, scoped to their key
           -> take                        here                         staleness and reuse gates,
                                                                       per-key share of a step

Every refusal goes through :meth:`Intake.reject`, which quarantines the batch in the store (so a
restart never retries it), strikes its key, writes the ledger and emits an event row, together.
The trainer speaks to the intake in a few verbs: :meth:`~Intake.take` groups for a step,
:meth:`~Intake.trained` or :meth:`~Intake.blame` after it, :meth:`~Intake.state` /
:meth:`~Intake.restore` for checkpoints, :meth:`~Intake.metrics` for its rows.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stoa.fleet.trust import FloatScorer, Ledger, TrustGate, batch_problem, group_episodes, scoped
from stoa.fleet.trust.assign import Assignment, assignment, assignment_problem
from stoa.transport.exchange import Batch, RolloutReader, write_progress
from stoa.transport.sequence import write_floors
from stoa.transport.store import StoreError

if TYPE_CHECKING:
    from stoa.fleet.config import RunConfig
    from stoa.fleet.policies import HeldPolicies
    from stoa.transport.store import ObjectStore
    from stoa.types import Episode

__all__ = ["Intake", "IntakeCounters", "Taken"]

log = logging.getLogger("stoa.trainer")

_PROGRESS_EVERY_S = 5.0


@dataclass
class IntakeCounters:
    dropped_stale_groups: int = 0
    dropped_reused_groups: int = 0
    dropped_malformed_groups: int = 0
    future_version_batches: int = 0
    rejected_batches: int = 0


@dataclass(frozen=True)
class Taken:
    """The groups of one optimizer step: ``groups[i]`` came in ``batches[i]``; each group's
    ``group_id`` is scoped to the key that sealed it (:func:`stoa.fleet.trust.scoped`)."""

    batches: tuple[Batch, ...]
    groups: tuple[list[Episode], ...]

    @property
    def episodes(self) -> list[Episode]:
        return [e for g in self.groups for e in g]


class Intake:
    """Reads, checks and pools the fleet's batches for one trainer (see the module docstring).

    Args:
        cfg: the run config (``[rollout]`` sampling settings, ``[trainer]`` gates, ``[trust]``).
        store, private_key: the fleet's store and the run's signing key (roster, progress, reports).
        vocab_size: every token id must lie below it (the learner's).
        metric_types: the task's declared metric types (``TextEnv.metric_types``).
        ledger: the trainer's ledger.
        float_scorer: the learner (the audit's log pi; finds the batch to blame when a step fails).
        int8: the held int8 policies (spot-checks; replay's text codec).
        make_env: builds the run's training environment (replay).
        event: called with an event row's fields for every rejection and ban (the metrics log).
        roster_copy: where the gate keeps the newest roster it has seen (see :class:`TrustGate`).
    """

    def __init__(self, cfg: RunConfig, store: ObjectStore, private_key: Any, *, vocab_size: int,
                 metric_types: dict[str, Any], ledger: Ledger, float_scorer: FloatScorer, int8: HeldPolicies,
                 make_env: Callable[[], Any], event: Callable[..., Any] = lambda **_: None,
                 roster_copy: Path | None = None):
        from stoa.fleet.trust.replay import Replayer

        self.cfg, self.store, self.key = cfg, store, private_key
        self.metric_types, self.ledger, self.float_scorer, self.event = metric_types, ledger, float_scorer, event
        rc = cfg.rollout
        replayer = (Replayer(make_env, int8.codec, max_turn_tokens=rc.max_turn_tokens,
                             max_episode_tokens=rc.max_episode_tokens) if cfg.trust.replay else None)
        self.n_items = len(make_env().unwrapped)
        self.gate = TrustGate(cfg.trust, store, cfg.name, private_key, ledger=ledger, replayer=replayer,
                              float_scorer=float_scorer, int8=int8, assign=self.assigned, roster_copy=roster_copy)
        self.gate.refresh(force=True)
        self.reader = RolloutReader(store, cfg.name, vocab_size=vocab_size, admit=self.gate.admit, require_seal=True,
                                    max_hashes=cfg.trust.max_hashes)
        self.pool: list[tuple[Batch, dict[str, list[Episode]]]] = []
        self.held: list[Batch] = []  # batches the gate reviews again (contested groups)
        self.waiting: list[Batch] = []  # newcomers' batches past this poll's quota (trust.newcomers_per_poll)
        self.used_groups: set[str] = set()
        self.counters = IntakeCounters()
        self._progress_written = 0.0

    # -- the verbs ---------------------------------------------------------------------------------
    def take(self, version: int) -> Taken | None:
        """Poll the store, check what came, and return ``trainer.groups_per_step`` eligible groups
        (oldest first), or None while there are not enough yet."""
        self._poll(version)
        return self._choose(version)

    def reject(self, batch: Batch, reason: str, category: str = "invalid") -> None:
        """Refuse a batch everywhere at once: quarantine (a restart never retries it), the sender's
        record (strikes, bans), the ledger and an event row."""
        self.reader.quarantine(batch, reason)
        self.counters.rejected_batches += 1
        self.gate.reject(batch.key_id, batch.worker_id, category, reason, len(batch.episodes))
        self.ledger.write(rejected=batch.key, reason=reason[:500])
        self.event(event="rejected", batch=batch.key, worker=batch.worker_id, key_id=batch.key_id, category=category,
                   reason=reason[:500])
        log.warning("quarantined %s: %s", batch.key, reason)

    def trained(self, taken: Taken) -> None:
        """The step over ``taken`` succeeded: its groups are used, its senders credited."""
        for batch, g in zip(taken.batches, taken.groups):
            self.used_groups.add(g[0].group_id)
            self.gate.trained(batch, len(g))

    def blame(self, taken: Taken, error: Exception) -> None:
        """A learner step over ``taken`` failed: reject the batches whose episodes the learner
        cannot take, put the other groups back; if no batch alone fails, reject every batch of the step."""
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
        bad = {b.key for b, _ in guilty}
        for batch, reason in guilty:
            self.pool = [(b, g) for b, g in self.pool if b.key != batch.key]
            self.reject(batch, reason[:2000])
        # The innocent groups go back to the front of the pool, as they were (ids unscoped again).
        back: dict[str, tuple[Batch, dict[str, list[Episode]]]] = {}
        for batch, g in zip(taken.batches, taken.groups):
            if batch.key not in bad:
                cut = len(batch.key_id) + 1 if batch.key_id else 0
                raw = [dataclasses.replace(e, group_id=e.group_id[cut:]) for e in g]
                back.setdefault(batch.key, (batch, {}))[1][raw[0].group_id] = raw
        self.pool = list(back.values()) + self.pool

    def assigned(self, batch: Batch) -> Assignment:
        """The work ``batch`` owes: its sealing key's assignment for its sequence number."""
        rc = self.cfg.rollout
        return assignment(self.cfg.seed, batch.key_id, batch.seq, self.n_items, rc.groups_per_cohort)

    # -- polling and checks ------------------------------------------------------------------------
    def _poll(self, version: int) -> None:
        cfg = self.cfg
        self.gate.refresh()
        batches = self.reader.poll()
        self.gate.record_rejections(self.reader.last_report.rejected)
        # What was taken, per worker (signed): workers throttle on it (rollout.max_outstanding) and
        # wait while it is missing, so it is rewritten every few seconds even when nothing came.
        if batches or time.time() - self._progress_written > _PROGRESS_EVERY_S:
            try:
                write_progress(self.store, cfg.name, self.reader.progress(), self.key)
                write_floors(self.store, cfg.name, self.reader.next_numbers(), self.key)  # no number reused
                self._progress_written = time.time()
            except StoreError as e:
                log.warning("could not write the progress document (%s); will retry", e)
        admitted: list[Batch] = []
        for batch in batches:
            self.gate.saw(batch.key_id, batch.worker_id, batch.seq)  # every number that came counts, whatever its fate
            if batch.version > version:  # not a strike: a tampered store can show a label the trainer never reached
                self.reject(batch, f"policy version {batch.version} is newer than the trainer's "
                                   f"{version}: not produced by this run's weights", "future")
                self.counters.future_version_batches += 1
                continue
            if self._stale(batch, version):  # never trained: dropped before any check
                continue
            try:
                why = batch_problem(batch.episodes, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                    group_size=cfg.rollout.group_size, reward_range=cfg.trainer.reward_range,
                                    env_id=cfg.env.id, metric_types=self.metric_types)
                category = "invalid"
                if why is None and batch.key_id:
                    why = assignment_problem(batch.episodes, self.assigned(batch), cfg.rollout.group_size)
                    category = "assignment"
            except Exception as e:  # whatever a stranger's batch breaks, it is the batch's fault
                why, category = f"checking the batch failed: {type(e).__name__}: {e}", "invalid"
            if why:
                self.reject(batch, why if category == "invalid" else f"not the assigned work: {why}", category)
                continue
            admitted.append(batch)
        admitted, self.held = self._newcomers(self.held + admitted, version), []
        for batch, verdict in zip(admitted, self.gate.review(admitted, version)):
            if verdict is not None and verdict[0] == "hold":  # a contested group: judged again next poll
                self.held.append(batch)
            elif verdict is not None:
                self.reject(batch, verdict[1], verdict[0])
            else:
                self.pool.append((batch, group_episodes(batch.episodes)))
        for kid in self.gate.take_new_bans():  # a banned key's queued batches are never trained on
            reason = self.gate.records[kid].banned
            self.event(event="banned", key_id=kid, worker=self.gate.records[kid].worker_id, reason=reason[:500])
            for batch in [b for b, _ in self.pool if b.key_id == kid]:
                self.pool = [(b, g) for b, g in self.pool if b.key != batch.key]
                self.reject(batch, f"worker key {kid} was banned: {reason[:300]}", "banned")

    def _newcomers(self, batches: list[Batch], version: int) -> list[Batch]:
        """``batches`` and the waiting ones, less the newcomers' batches past this poll's quota
        (:meth:`TrustGate.pace_newcomers`), which wait for a later poll: at most 64 per allowed
        batch, the newest versions kept (the others are refused, not struck)."""
        now, wait = self.gate.pace_newcomers([b for b in self.waiting if not self._stale(b, version)] + batches)
        cap = 64 * self.cfg.trust.newcomers_per_poll
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
        self.ledger.write(dropped={"stale": stale})
        return True

    def _choose(self, version: int) -> Taken | None:
        tc, G = self.cfg.trainer, self.cfg.rollout.group_size
        chosen: list[tuple[int, str]] = []
        dropped: dict[str, list[str]] = {"reused": [], "stale": [], "malformed": []}
        cap, per_key = self.gate.max_groups(tc.groups_per_step), Counter()
        for b_i, (batch, groups) in enumerate(self.pool):
            for gid, eps in list(groups.items()):
                sgid = scoped(batch.key_id, gid)  # group ids live in their sender's namespace
                why = ("reused" if sgid in self.used_groups else "stale" if version - batch.version > tc.max_lag
                       else "malformed" if len(eps) != G or len({e.sample_index for e in eps}) != G else None)
                if why:
                    dropped[why].append(sgid)
                    del groups[gid]
                elif len(chosen) < tc.groups_per_step and per_key[batch.key_id] < cap:
                    chosen.append((b_i, gid))
                    per_key[batch.key_id] += 1
        self.counters.dropped_reused_groups += len(dropped["reused"])
        self.counters.dropped_stale_groups += len(dropped["stale"])
        self.counters.dropped_malformed_groups += len(dropped["malformed"])
        if any(dropped.values()):
            self.ledger.write(dropped={k: v for k, v in dropped.items() if v})
        if len(chosen) < tc.groups_per_step:
            self.pool = [(b, g) for b, g in self.pool if g]
            return None
        out = [(self.pool[b_i][0], self.pool[b_i][1].pop(gid)) for b_i, gid in chosen]
        self.pool = [(b, g) for b, g in self.pool if g]
        return Taken(tuple(b for b, _ in out),
                     tuple([dataclasses.replace(e, group_id=scoped(b.key_id, e.group_id)) for e in g] for b, g in out))

    # -- reports -----------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """``dropped/...`` and ``trust/...`` figures for the trainer's rows (cumulative)."""
        c = self.counters
        return {"dropped/stale_groups": c.dropped_stale_groups, "dropped/reused_groups": c.dropped_reused_groups,
                "dropped/quarantined_batches": self.reader.quarantined, "dropped/rejected_batches": c.rejected_batches,
                **self.gate.metrics()}

    def write_report(self, version: int, force: bool = False) -> None:
        """The signed per-worker report (``<run>/trust.json``) that ``stoa status`` shows (at most
        every 2 s unless ``force``)."""
        self.gate.write_report(version, force=force)

    @property
    def audit_floor(self) -> float | None:
        return self.gate.audit.floor

    def calibrate(self, episodes: list[Episode], trainer_logprobs: list[np.ndarray]) -> float:
        """Set the audit's int8-versus-float floor (see :meth:`TrustGate.calibrate`)."""
        return self.gate.calibrate(episodes, trainer_logprobs)

    # -- checkpoints -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """JSON-ready state for a checkpoint: pooled and held batches stay unconsumed, so a restart
        from it delivers them again (:meth:`RolloutReader.state`)."""
        pending = [b for b, g in self.pool if g] + self.held + self.waiting
        pending_groups = {scoped(b.key_id, gid) for b, g in self.pool for gid in g}
        pending_used = sorted(gid for b, _ in self.pool for gid in {scoped(b.key_id, e.group_id) for e in b.episodes}
                              if gid in self.used_groups and gid not in pending_groups)
        return {"reader": self.reader.state(pending=pending), "used_groups": pending_used,
                "counters": asdict(self.counters), "trust": self.gate.state()}

    def restore(self, state: dict[str, Any]) -> None:
        self.reader.restore(state["reader"])
        self.used_groups = set(state["used_groups"])
        self.counters = IntakeCounters(**state["counters"])
        if state.get("trust"):
            self.gate.restore(state["trust"])

    def prune(self, state: dict[str, Any]) -> None:
        """Delete consumed batches that ``state`` (a checkpoint's) no longer needs from the store."""
        self.reader.prune(state["reader"])
