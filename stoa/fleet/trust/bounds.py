"""What a batch must keep to before it is reviewed, and the typed judgement the gate returns.

:class:`Bounds` holds a batch to the run's own bounds, in this order: its version (not newer
than the trainer's: ``future``; not more than ``trainer.max_lag`` behind: dropped as ``stale``;
not below its key's version floor: dropped as ``behind``), then its contents (sampling
settings, rewards, metrics, task: :func:`~stoa.fleet.trust.admission.batch_problem`) and, for
a sealed batch, its number's binding and its assigned work (``assignment``). Only a batch that
passes the version checks counts as delivered for withholding: a stale, future or behind one
leaves its number a gap. A fresh key's salted batch at a number never bound delivers its open
bound number below it, with that number's version and work (:meth:`Binder.carry`).

**A key's version floor.** A worker holding several versions' weights could make its assigned
batch under each and upload the one it prefers. A salted batch is held to the version (and the
beacon) the trainer bound to its number (:mod:`stoa.fleet.trust.binding`). A probation batch,
never trained, keeps an older rule: it must claim at least (a) every version its key's
lower-numbered batches claimed, and (b) the trainer's version at the last listing of the store
before it appeared there, less ``rollout.lag``. A pooled later batch of the key below a floor
that an earlier batch raises is taken back (``behind``).

:class:`Judgement` is what one batch is worth to the trainer: train on it (less the groups
that hold an unverifiable episode), credit it as probation work, drop it without a strike, or
reject it with a :class:`~stoa.types.Verdict`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from stoa.fleet.trust.admission import batch_problem
from stoa.fleet.trust.assign import Assignment, assignment, assignment_problem, is_probation
from stoa.transport.identity import assignment_salt
from stoa.types import Verdict

if TYPE_CHECKING:
    from stoa.fleet.config import RunConfig
    from stoa.fleet.trust.binding import Binder
    from stoa.fleet.trust.records import Records
    from stoa.transport.exchange import Batch

__all__ = ["Bounds", "Judgement", "RunBounds", "scoped"]

Action = Literal["train", "probation", "drop", "reject"]

_MAX_SALTS = 16384


def scoped(key_id: str, group_id: str) -> str:
    """A group id in its sender's namespace (``<key id>/<group id>``; the raw id when unsigned)."""
    return f"{key_id}/{group_id}" if key_id else group_id


@dataclass(frozen=True)
class RunBounds:
    """The run's own bounds on every batch, read once from its config."""

    seed: int
    env_id: str
    n_items: int
    metric_types: dict[str, Any]
    group_size: int
    groups_per_cohort: int
    temperature: float
    top_p: float
    reward_range: tuple[float, float]
    lag: int
    """``rollout.lag``: how far behind the trainer a bound number's version is."""
    max_lag: int
    """``trainer.max_lag``: how far behind the trainer a batch may be and still be trained on."""

    @classmethod
    def of(cls, cfg: RunConfig, n_items: int, metric_types: dict[str, Any]) -> RunBounds:
        rc = cfg.rollout
        return cls(cfg.seed, cfg.env.id, n_items, metric_types, rc.group_size, rc.groups_per_cohort,
                   rc.temperature, rc.top_p, cfg.trust.reward_range, rc.lag, cfg.trainer.max_lag)


@dataclass(frozen=True)
class Judgement:
    """What one batch is worth (see the module docstring)."""

    batch: Batch
    action: Action
    verdict: Verdict | None = None
    """``reject``: why (its category and reason)."""
    dropped: Literal["", "stale", "behind"] = ""
    """``drop``: why, in one word (the ledger's)."""
    detail: str = ""
    """``drop``: why, in words (``behind`` only)."""
    untrained: frozenset[str] = field(default_factory=frozenset)
    """``train``: ids of the groups not to train on (they hold an unverifiable episode)."""

    def groups(self) -> list[str]:
        """The batch's group ids in its sender's namespace, sorted."""
        return sorted({scoped(self.batch.key_id, e.group_id) for e in self.batch.episodes})


def _reject(batch: Batch, category: Any, reason: str) -> Judgement:
    return Judgement(batch, "reject", Verdict(category, reason))


class Bounds:
    """The run's bounds on one batch before review (the module docstring).

    Args:
        run: the run's bounds.
        records: the gate's per-key records (withholding counts, version floors).
        binder: the trainer's bindings (what each salted number is bound to).
        private_key, run_name: what each key's assignment salt is derived from.
    """

    def __init__(self, run: RunBounds, records: Records, binder: Binder, private_key: Any, run_name: str):
        self.run, self.records, self.binder = run, records, binder
        self._key, self._run_name = private_key, run_name
        self._salts: dict[str, str] = {}

    def assigned(self, batch: Batch) -> Assignment:
        """The work ``batch`` owes: its sealing key's assignment for its sequence number, salted
        with the key's secret salt and the beacon bound to the number, or its probation work when
        it presents itself as such (:mod:`stoa.fleet.trust.assign`)."""
        r = self.run
        salt = beacon = None
        if not is_probation(batch.episodes, batch.key_id, batch.seq):
            salt = self._salts.get(batch.key_id)
            if salt is None:
                if len(self._salts) > _MAX_SALTS:
                    self._salts.clear()
                salt = self._salts[batch.key_id] = assignment_salt(self._key, self._run_name, batch.key_id)
            bound = self.binder.bound_to(batch.key_id, batch.seq)
            if bound is not None:  # (a fresh key's carried work is its bound number's)
                return assignment(r.seed, batch.key_id, bound.work_seq, r.n_items, r.groups_per_cohort, salt,
                                  bound.beacon)
        return assignment(r.seed, batch.key_id, batch.seq, r.n_items, r.groups_per_cohort, salt, beacon)

    def check(self, batch: Batch, version: int, listed: int,
              pooled: Sequence[Batch]) -> tuple[Judgement | None, list[Judgement]]:
        """``(judgement, taken back)``: how ``batch`` breaks the run's bounds at the trainer's
        ``version`` (None: it keeps to them and goes on to review), and the ``behind`` drops of
        ``pooled`` batches of its key that the floor it raises rules out. ``listed``: the
        trainer's version at the store's last listing before ``batch`` appeared there (-1: not
        known)."""
        r = self.run
        if batch.version > version:  # not a strike: a tampered store can show a label the trainer never reached
            return _reject(batch, "future", f"policy version {batch.version} is newer than the trainer's "
                                            f"{version}: not produced by this run's weights"), []
        floor, back = self._floor(batch, listed, pooled)
        if (stale := self.stale(batch, version)) is not None:  # never trained: dropped before any check
            return stale, back
        if batch.version < floor:
            return Judgement(batch, "drop", dropped="behind",
                             detail=f"version {batch.version} is below {floor}, which its key held already"), back
        if batch.key_id and not is_probation(batch.episodes, batch.key_id, batch.seq) and \
                self.binder.bound_to(batch.key_id, batch.seq) is None:  # a fresh key's bound work past others' junk?
            rec = self.records.get(batch.key_id)
            self.binder.carry(batch.key_id, batch.seq, rec.max_seq if rec is not None else -1)
        self.records.saw(batch.key_id, batch.worker_id, batch.seq)  # a number delivered in time, whatever its fate
        category = "invalid"
        try:
            why = batch_problem(batch.episodes, temperature=r.temperature, top_p=r.top_p, group_size=r.group_size,
                                reward_range=r.reward_range, env_id=r.env_id, metric_types=r.metric_types)
            if why is None and batch.key_id:
                category = "assignment"
                why = self._binding_problem(batch) or assignment_problem(batch.episodes, self.assigned(batch),
                                                                          r.group_size)
        except Exception as e:  # whatever a stranger's batch breaks, it is the batch's fault
            why, category = f"checking the batch failed: {type(e).__name__}: {e}", "invalid"
        if why:
            return _reject(batch, category, why if category == "invalid" else f"not the assigned work: {why}"), back
        return None, back

    def stale(self, batch: Batch, version: int) -> Judgement | None:
        """A ``stale`` drop when ``batch`` is more than ``trainer.max_lag`` versions behind
        ``version`` (its number stays a gap: :meth:`Records.late`), or None."""
        if version - batch.version <= self.run.max_lag:
            return None
        self.records.late(batch.key_id, batch.worker_id)
        return Judgement(batch, "drop", dropped="stale")

    def _floor(self, batch: Batch, listed: int, pooled: Sequence[Batch]) -> tuple[int, list[Judgement]]:
        """The lowest version ``batch`` may claim, after noting what ``batch`` itself says of its
        key's later batches; a pooled later batch of the key below the new floor (read first,
        under a poll's caps) is taken back."""
        if not batch.key_id:
            return -1, []
        if not is_probation(batch.episodes, batch.key_id, batch.seq):
            listed = -1  # bound work: its version was fixed by the trainer when its number was due
        mine = max(batch.version, listed - self.run.lag if listed >= 0 else -1)
        floor = self.records.version_floor(batch.key_id, batch.worker_id, batch.seq, mine)
        back = []
        for later in pooled:
            if later.key_id == batch.key_id and later.seq > batch.seq and later.version < mine:
                self.records.unsee(batch.key_id)  # it was counted as delivered: now a gap
                back.append(Judgement(later, "drop", dropped="behind",
                                      detail=f"version {later.version} is below {mine}, which its key held already"))
        return floor, back

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
