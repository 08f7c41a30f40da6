"""What every section of a run config shares: the error it raises and its bounds check.

A run config (:mod:`stoa.fleet.config`) is one table per component, and each table is a frozen
dataclass that lives beside the code that uses it: ``[rollout]`` in :mod:`stoa.fleet.worker`,
``[trainer]``, ``[eval]`` and ``[model]`` in :mod:`stoa.fleet.trainer`, ``[env]`` in
:mod:`stoa.fleet.task`, ``[warmstart]`` in :mod:`stoa.fleet.warmstart`, ``[pulse]`` in
:mod:`stoa.fleet.publishing`, ``[fleet]`` in :mod:`stoa.fleet.local`, ``[trust]`` in
:mod:`stoa.fleet.trust.gate`. Each checks its own bounds at construction with :func:`check`;
:mod:`stoa.fleet.config` assembles them. This module imports nothing of Stoa, so every home can
use it without importing the assembly.
"""

from __future__ import annotations

__all__ = ["ConfigError", "check"]


class ConfigError(ValueError):
    """The run configuration is invalid; the message names the key."""


def check(cond: bool, msg: str) -> None:
    """Raise :class:`ConfigError` with ``msg`` unless ``cond``."""
    if not cond:
        raise ConfigError(msg)
