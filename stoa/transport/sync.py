"""What following the weight chain returns, raises and checks: :class:`SyncResult`, the background
:class:`StateCheck`, the errors both sides of :mod:`stoa.transport.chain` raise (:class:`ChainError`,
:class:`IntegrityError`, :class:`PointerError`, :class:`StalePointer`) and the small checks the
publisher and the subscribers (:mod:`stoa.transport.subscriber`) share.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stoa.transport import pulse
from stoa.transport.manifest import Manifest
from stoa.transport.signing import SignatureError
from stoa.transport.store import StoreError

__all__ = [
    "SYNC_CHECKS",
    "SYNC_ERRORS",
    "ChainError",
    "IntegrityError",
    "PointerError",
    "StalePointer",
    "StateCheck",
    "SyncResult",
]

State = dict[str, np.ndarray]


class ChainError(RuntimeError):
    """The version chain cannot be read or written as asked; the message says why."""


class IntegrityError(ChainError):
    """Payloads or states do not match their signed hashes and no intact route is left."""


class PointerError(ChainError, SignatureError):
    """The pointer does not verify (garbled, forged, another run) and no version was seen before."""


class StalePointer(PointerError):
    """A validly signed pointer that the run's key itself has superseded: the store holds newer
    signed manifests built past it (a rolled-back pointer). A new subscriber refuses it and
    waits; the publisher rewrites it to the newest intact manifest."""


SYNC_CHECKS = ("now", "background")
"""How :meth:`~stoa.transport.subscriber.WeightSubscriber.sync` checks a result against the
signed state hash (its ``check``)."""
SYNC_ERRORS = (ChainError, StoreError)
"""What :meth:`~stoa.transport.subscriber.WeightSubscriber.sync` / ``head`` raise when the
store's contents or the store itself fail. None of them harms the held weights: keep serving
them, retry with backoff, and after repeated failures re-join with ``sync(None)``."""


def sha256_hex(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def shown_key(key: str) -> str:
    """An untrusted key, bounded and escaped for a report."""
    return repr(key[:200]) + ("..." if len(key) > 200 else "")


def summary(problems: list[str], n: int = 6) -> str:
    """The first ``n`` problems on one line, and how many more there are."""
    return "; ".join(problems[:n]) + (f"; and {len(problems) - n} more" if len(problems) > n else "")


def check_state(state: Any) -> None:
    if not isinstance(state, dict) or not state:
        raise TypeError("a weight state is a non-empty dict[str, numpy.ndarray]")
    for k, v in state.items():
        if not isinstance(k, str) or not isinstance(v, np.ndarray):
            raise TypeError(f"state entry {k!r}: expected str -> numpy.ndarray, got {type(v).__name__}")


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays have the same dtype, shape and raw bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a).reshape(-1).view(np.uint8), np.ascontiguousarray(b).reshape(-1).view(np.uint8))


@dataclass
class SyncResult:
    """The outcome of :meth:`~stoa.transport.subscriber.WeightSubscriber.sync`.

    Attributes:
        version: the version now held.
        state: the state of ``version``. With ``apply_inplace=True`` and a compatible state,
            this is the very dict (and arrays) that was passed in, updated in place.
        bytes_read: every byte fetched from the store (pointer, manifests, payloads).
        applied: what was applied, in order: ``(version, "anchor" | "delta")``.
        changed_names: names whose arrays may differ from the state passed in (every name
            when none was passed).
        inplace: whether ``state`` is the caller's dict (updated in place, or untouched when it
            already held the head).
        problems: corrupted, forged or missing objects that were detected and routed around, and
            pointers that were ignored (older than a version already seen).
        manifest: the signed manifest of ``version`` (None when the held state was kept
            because the store's pointer is older than it).
        manifest_sha256: sha256 of that manifest object.
        check: the state's hash check when it still runs in the background (``check="background"``
            and deltas written in place); None when the state was verified before ``sync``
            returned. Call ``check.wait()`` before using anything made with this state outside
            the worker.
    """

    version: int
    state: State
    bytes_read: int
    applied: list[tuple[int, str]] = field(default_factory=list)
    changed_names: list[str] = field(default_factory=list)
    inplace: bool = False
    problems: list[str] = field(default_factory=list)
    manifest: Manifest | None = None
    manifest_sha256: str | None = None
    check: StateCheck | None = None

    @property
    def message(self) -> str:
        """One line for a log: what was done and what went wrong (never empty)."""
        how = " + ".join(f"{k} {v}" for v, k in self.applied) if self.applied else "nothing to apply"
        text = f"at version {self.version} ({how}, {self.bytes_read} bytes read"
        return text + (f"; {len(self.problems)} problem(s): {summary(self.problems, 2)})" if self.problems else ")")


class StateCheck:
    """The signed state hash of a state already written in place, computed in a background thread.

    Created by ``WeightSubscriber.sync(..., check="background")``. The arrays must not be written
    until the check is done (the subscriber's next sync waits for it first). hashlib releases the
    interpreter lock while hashing, so the caller's thread runs on meanwhile.
    """

    def __init__(self, state: State, expect: str, version: int):
        self.version, self._state, self._expect = version, state, expect
        self.error: IntegrityError | None = None
        self.seconds: float | None = None
        """Wall seconds the hash took (None while it runs)."""
        self.cpu_seconds: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"stoa-state-check-{version}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            got = pulse.state_hash(self._state)
            if got != self._expect:
                self.error = IntegrityError(
                    f"the state written in place for version {self.version} hashes to {got[:12]}..., not the signed "
                    f"{self._expect[:12]}... (the held state was not what it claimed, or was changed)")
        except Exception as e:  # noqa: BLE001 - reported to whoever waits
            self.error = IntegrityError(f"the state of version {self.version} could not be checked: "
                                        f"{type(e).__name__}: {e}")
        finally:
            self.cpu_seconds, self.seconds = time.thread_time() - c0, time.perf_counter() - t0
            self._state = None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the check: True when it passed, False if ``timeout`` passed first; raises
        :class:`IntegrityError` when the state does not match the signed hash."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        if self.error is not None:
            raise self.error
        return True


class RouteCorrupt(Exception):
    """A route of a sync (``(version, "anchor" | "delta" | "have")``) met a corrupt, missing or
    wrong object: the subscriber bans that route and plans another."""

    def __init__(self, route: tuple[int, str], msg: str):
        super().__init__(msg)
        self.route = route
