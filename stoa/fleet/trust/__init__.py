"""The trainer's checks of what strangers upload, in the order a batch meets them.

* :mod:`~stoa.fleet.trust.admission`: the run's own bounds (sampling settings, reward range,
  metric types, task id), before anything is scored;
* :mod:`~stoa.fleet.trust.assign`: the work each key's n-th batch owes (salted per key; probation
  work before the key's salt is published);
* :mod:`~stoa.fleet.trust.gate`: the :class:`TrustGate` (configured by :class:`TrustConfig`) over
  three kinds of state: :mod:`~stoa.fleet.trust.roster` (who may upload, bans, assignment salts),
  :mod:`~stoa.fleet.trust.records` (per-key accounting, bans, the signed :class:`TrustReport`) and
  :mod:`~stoa.fleet.trust.review` (replay, audit, spot-checks, the sampling check, as
  :class:`Verdict` values);
* :mod:`~stoa.fleet.trust.replay`: episodes re-played through the trainer's own environment;
* :mod:`~stoa.fleet.trust.audit`: behaviour log-probs against the learner's and the int8 policy's;
* :mod:`~stoa.fleet.trust.ledger`: the record of every group's fate;
* :mod:`~stoa.fleet.trust.planted`: numbers planted under a worker's id are not its gaps.

:class:`stoa.fleet.intake.Intake` strings them together between the store and the training pool (the
route is described once, in ``docs/architecture.md``);
``docs/trust.md`` says what each defends against.
"""

from stoa.fleet.trust.admission import batch_problem, episode_metric_means
from stoa.fleet.trust.audit import AuditConfig, LogprobAudit, SpotCheck, TokenStats, episode_stats, spot_check
from stoa.fleet.trust.gate import TrustConfig, TrustGate, group_episodes, scoped
from stoa.fleet.trust.ledger import Ledger
from stoa.fleet.trust.records import (
    STRIKE_CATEGORIES,
    Records,
    TrustReport,
    WorkerRecord,
    WorkerReport,
    public_reason,
    read_trust_report,
)
from stoa.fleet.trust.review import FloatScorer, Int8Scorer, Review, Verdict, distinct_rows, sampling_pick

__all__ = [
    "STRIKE_CATEGORIES", "AuditConfig", "FloatScorer", "Int8Scorer", "Ledger", "LogprobAudit", "Records", "Review",
    "SpotCheck", "TokenStats", "TrustConfig", "TrustGate", "TrustReport", "Verdict", "WorkerRecord", "WorkerReport",
    "batch_problem", "distinct_rows", "episode_metric_means", "episode_stats", "group_episodes", "public_reason",
    "read_trust_report", "sampling_pick", "scoped", "spot_check",
]
