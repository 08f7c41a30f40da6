"""What every section of a run config shares: the error it raises and its bounds check.

A run config (:mod:`stoa.fleet.config`) is one table per component, and each table is a frozen
dataclass in the ``section`` module of the room that uses it: ``[rollout]`` in
:mod:`stoa.fleet.worker.section`; ``[model]``, ``[trainer]``, ``[eval]``, ``[warmstart]`` and
``[pulse]`` in :mod:`stoa.fleet.trainer.section`; ``[trust]`` and ``[trust.audit]`` in
:mod:`stoa.fleet.trust.section`; ``[fleet]`` in :mod:`stoa.fleet.operator.section`; ``[env]`` in
:mod:`stoa.fleet.task`. Each checks its own bounds at construction with :func:`check`;
:mod:`stoa.fleet.config` assembles them. A section is a leaf: it imports this module and leaf
types, nothing that runs, so reading a config loads no process. This module imports only :mod:`stoa.errors`.
"""

from __future__ import annotations

from stoa.errors import ExpectedFailure

__all__ = ["ConfigError", "check"]


class ConfigError(ExpectedFailure, ValueError):
    """The run configuration is invalid; the message names the key."""

    exit_code = 2


def check(cond: bool, msg: str) -> None:
    """Raise :class:`ConfigError` with ``msg`` unless ``cond``."""
    if not cond:
        raise ConfigError(msg)
