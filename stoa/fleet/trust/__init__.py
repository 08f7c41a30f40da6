"""The trainer's checks of what strangers upload, in the order a batch meets them.

* :mod:`~stoa.fleet.trust.admission`: the run's own bounds (sampling settings, reward range,
  metric types, task id), before anything is scored;
* :mod:`~stoa.fleet.trust.gate`: identity (the roster), replay, copies, the audit and its
  spot-checks, per-key accounting and bans (:class:`TrustGate`, configured by :class:`TrustConfig`);
* :mod:`~stoa.fleet.trust.replay`: episodes re-played through the trainer's own environment;
* :mod:`~stoa.fleet.trust.audit`: behaviour log-probs against the learner's and the int8 policy's;
* :mod:`~stoa.fleet.trust.ledger`: the record of every group's fate;
* :mod:`~stoa.fleet.trust.planted`: numbers planted under a worker's id are not its gaps.

:class:`stoa.fleet.intake.Intake` strings them together between the store and the training pool;
``docs/trust.md`` says what each defends against.
"""

from stoa.fleet.trust.admission import batch_problem, episode_metric_means
from stoa.fleet.trust.audit import AuditConfig, LogprobAudit, SpotCheck, TokenStats, episode_stats, spot_check
from stoa.fleet.trust.gate import (
    FloatScorer, Int8Scorer, TrustConfig, TrustGate, WorkerRecord, group_episodes, group_fingerprint, read_trust_report,
    scoped,
)
from stoa.fleet.trust.ledger import Ledger

__all__ = [
    "AuditConfig", "FloatScorer", "Int8Scorer", "Ledger", "LogprobAudit", "SpotCheck", "TokenStats", "TrustConfig",
    "TrustGate", "WorkerRecord", "batch_problem", "episode_metric_means", "episode_stats", "group_episodes",
    "group_fingerprint",
    "read_trust_report", "scoped", "spot_check",
]
