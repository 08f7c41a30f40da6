"""Following a run's signed weight chain (the workers' side of :mod:`stoa.transport.chain`, where
the layout, commit order and guarantees are described; it re-exports every name).

This module is the subscribers' one import path; each job lives in its own module:

* :mod:`stoa.transport.weight_subscriber`: :class:`WeightSubscriber`, a worker following the
  whole model: the pointer it trusts, the manifests it verifies, the cheapest verified route.
* :mod:`stoa.transport.share_subscriber`: :class:`ShareSubscriber`, a pipeline stage following
  the tensors of its layers only.
* :mod:`stoa.transport.sync`: what a sync returns (:class:`SyncResult`), its background hash
  check (:class:`StateCheck`), :data:`SYNC_CHECKS`, :data:`SYNC_ERRORS`, and the errors both
  sides raise (:class:`ChainError`, :class:`IntegrityError`, :class:`PointerError`,
  :class:`StalePointer`).
"""

from __future__ import annotations

from stoa.transport.share_subscriber import ShareSubscriber
from stoa.transport.sync import (  # noqa: F401 - State, check_state, sha256_hex, shown_key: for stoa.transport.chain
    SYNC_CHECKS,
    SYNC_ERRORS,
    ChainError,
    IntegrityError,
    PointerError,
    StalePointer,
    State,
    StateCheck,
    SyncResult,
    check_state,
    sha256_hex,
    shown_key,
)
from stoa.transport.weight_subscriber import WeightSubscriber

__all__ = [
    "SYNC_CHECKS",
    "SYNC_ERRORS",
    "ChainError",
    "IntegrityError",
    "PointerError",
    "ShareSubscriber",
    "StalePointer",
    "StateCheck",
    "SyncResult",
    "WeightSubscriber",
]
