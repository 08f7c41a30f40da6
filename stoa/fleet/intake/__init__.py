"""The trainer's intake: everything between the store's rollout batches and an optimizer step.

One :class:`Intake` per trainer owns the route and every refusal on it; the route of a batch,
and the module that owns each step, is described once in ``docs/architecture.md``
("A batch's route"). The trainer speaks to it in a few verbs: :meth:`Intake.take` groups for a
step, :meth:`Intake.settle` after it, :meth:`Intake.state` / :meth:`Intake.restore` /
:meth:`Intake.prune` for checkpoints, :meth:`Intake.report` and :meth:`Intake.metrics` for what
it did. Its parts:

* :mod:`~stoa.fleet.intake.intake`: the :class:`Intake` (poll, bounds, review, one ``reject``);
* :mod:`~stoa.fleet.intake.copies`: every duplicate check (payload hashes, per-sender group prints);
* :mod:`~stoa.fleet.intake.pool`: whole groups waiting for a step, and the choice of a step's groups.
"""

from stoa.fleet.intake.intake import Intake, IntakeCounters
from stoa.fleet.intake.pool import Taken

__all__ = ["Intake", "IntakeCounters", "Taken"]
