"""Rollout exchange: workers upload episode batches, the trainer consumes each exactly once;
and the two control files the trainer writes for workers (progress, run finished).

This module is the exchange's one import path; each job lives in its own module:

* :mod:`stoa.transport.rollout_keys`: the batch keys (``rollouts/<worker_id>/s<seq>-v<version>.episodes``;
  :mod:`stoa.transport.layout` names every key of a run): :func:`rollout_key`,
  :func:`parse_rollout_key`, :func:`held_numbers`.
* :mod:`stoa.transport.rollout_writer`: the worker's :class:`RolloutWriter` (write-once, sealed,
  numbered uploads) and :class:`SequenceTaken`.
* :mod:`stoa.transport.rollout_reader`: the trainer's :class:`RolloutReader` (polling within
  :class:`PollLimits`, validation, the caller's :class:`Admission`, quarantine under
  ``quarantine/<worker_id>/`` or ``quarantine/_misnamed/`` with a ``.reason.json``, exactly-once
  bookkeeping) and its records :class:`Batch`, :class:`Rejection`, :class:`PollReport`.
* :mod:`stoa.transport.control`: the signed ``progress.json`` (:class:`Progress`,
  :func:`write_progress`, :func:`read_progress`) and ``finished.json`` (:func:`mark_finished`,
  :func:`is_finished`).

What workers upload is validated, never trusted (a worker's signature says who sent it, not
that it is right); what the trainer tells them (:class:`Progress`, the finished marker) is
signed with the run's key and verified.
"""

from __future__ import annotations

from stoa.transport.control import Progress, is_finished, mark_finished, read_progress, write_progress
from stoa.transport.rollout_keys import held_numbers, parse_rollout_key, rollout_key
from stoa.transport.rollout_reader import Admission, Batch, PollLimits, PollReport, Rejection, RolloutReader
from stoa.transport.rollout_writer import RolloutWriter, SequenceTaken

__all__ = [
    "Admission", "Batch", "PollLimits", "PollReport", "Progress", "Rejection", "RolloutReader", "RolloutWriter", "SequenceTaken",
    "held_numbers", "is_finished", "mark_finished", "parse_rollout_key", "read_progress", "rollout_key",
    "write_progress",
]
