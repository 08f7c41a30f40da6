"""How OpenMP threads wait between parallel regions: set in the environment before torch loads
its OpenMP runtime (libgomp reads it once, then).

torch runs ~35 small ops per decoder layer, each a parallel region, so a decode step is a
thousand barriers. What idle threads do there decides a CPU engine's speed:

* **spin, then sleep** (:func:`dedicated`, the default for a process alone on its cores:
  ``GOMP_SPINCOUNT=2000``, tens of microseconds): the next op finds its threads awake.
* **sleep at once** (:func:`shared_env`, ``OMP_WAIT_POLICY=PASSIVE``, for processes that share
  the machine's cores with each other, as the local launcher's trainer and workers do): every op
  pays a wake-up, but a spinning thread never burns the time slice another process needs.

Measured speeds of each policy, alone and beside a busy process: docs/rollout.md, "Threads".

Whatever the user set (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``) is kept. Other OpenMP runtimes
(Intel's, LLVM's) read their own variables (``KMP_BLOCKTIME``) and are left alone.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["SPIN", "dedicated", "shared_env"]

SPIN = "2000"
"""``GOMP_SPINCOUNT`` for a process alone on its cores: busy-wait iterations before a thread sleeps."""

_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_ours: set[str] = set()  # the variables this process set itself (not the user's)


def dedicated() -> None:
    """In this process, before torch loads: threads spin :data:`SPIN` iterations at a barrier, then
    sleep (unless the user chose a wait policy or spin count)."""
    if not any(v in os.environ for v in _VARS):
        os.environ["GOMP_SPINCOUNT"] = SPIN
        _ours.add("GOMP_SPINCOUNT")


def shared_env(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """``env`` (a child's environment, copied from this process's) for a process that shares the
    machine's cores with its siblings: idle threads sleep at once (unless the user chose)."""
    if not any(v in env and v not in _ours for v in _VARS):
        env.pop("GOMP_SPINCOUNT", None)
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env
