"""Sync-only followers: workers that follow the weight chain and generate nothing.

A :class:`Follower` joins a run from its newest anchor and then applies every version the
trainer publishes into a live numpy state, through exactly the production subscriber path
(:class:`stoa.transport.chain.WeightSubscriber`: ``sync(None)`` to join, then
``sync((version, state), apply_inplace=True, check=...)``, every object verified and the result
checked against the signed state hash, in the background by default as ``stoa worker`` does).
It records what each sync cost, so a benchmark or a test can put many of them on emulated links
(``stoa.testing.links``) beside real workers: 14 followers fit on two cores where 14 MLX workers
would not.

Use it in-process (``Follower(...).run(stop=event)`` in a thread), as a subprocess
(``python -m stoa.fleet.follower --store URL --run RUN --public-key KEY --out records.jsonl``),
or as ``stoa worker --follow-only``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from stoa.transport.chain import SYNC_CHECKS, SYNC_ERRORS, WeightSubscriber
from stoa.transport.store import ObjectStore, StoreError

__all__ = ["Follower", "FollowerConfig", "SyncRecord"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FollowerConfig:
    """How a follower polls and backs off."""

    poll_s: float = 1.0
    """Seconds between polls of the pointer while in sync."""
    backoff_base_s: float = 0.5
    """First wait after a failed sync; doubles per consecutive failure (full jitter)."""
    backoff_max_s: float = 30.0
    """Longest wait between failed attempts."""
    rejoin_after: int = 3
    """Consecutive chain failures (not store failures: an outage is waited out) after which the
    next attempt joins afresh from an anchor."""
    check: str = "background"
    """How a sync's result is checked against the signed state hash (``WeightSubscriber.sync``'s
    ``check``): ``"background"`` (as ``stoa worker`` does: the weights are usable when written, the
    hash runs beside; the follower then waits for it) or ``"now"`` (hashed before anything is
    written)."""

    def __post_init__(self) -> None:
        if self.check not in SYNC_CHECKS:
            raise ValueError(f"check must be one of {SYNC_CHECKS}, not {self.check!r}")
        if self.poll_s <= 0 or self.backoff_base_s <= 0 or self.backoff_max_s < self.backoff_base_s:
            raise ValueError("poll_s and backoff_base_s must be > 0 and backoff_max_s >= backoff_base_s")
        if self.rejoin_after < 1:
            raise ValueError("rejoin_after must be >= 1")


@dataclass(frozen=True)
class SyncRecord:
    """One sync that moved the follower to a newer version."""

    kind: str
    """``"join"`` (from nothing, or a rejoin after failures) or ``"sync"``."""
    t_start: float
    """Unix time the successful attempt started."""
    t_end: float
    """Unix time the new version was applied and verified."""
    from_version: int | None
    to_version: int
    seconds: float
    """Duration of the successful ``sync`` call: until the new weights were written and usable."""
    verified_seconds: float
    """From the start of the call until the state's hash check passed (``seconds`` when it was
    checked before the call returned)."""
    cpu_seconds: float
    """CPU time of the calling thread in that call plus the background check's (verification and
    applying; on a busy machine the rest of ``verified_seconds`` is network and waiting for a core)."""
    bytes_read: int
    deltas: int
    """Deltas applied."""
    anchor: bool
    """Whether an anchor was downloaded."""
    lag_s: float
    """``t_end`` minus the version's signed publish time (the publisher's clock)."""
    failures: int
    """Failed attempts since the previous record, recovered by this one (a failure followed by a
    poll that found nothing new is still counted here, in the next record)."""
    problems: int
    """Problems the subscriber detected and routed around in this sync."""

    @property
    def versions_jumped(self) -> int:
        return self.to_version - (self.from_version if self.from_version is not None else self.to_version)


@dataclass
class _Failure:
    t: float
    error: str


class Follower:
    """Follows a run's signed chain and holds its newest state (a dict of numpy arrays).

    Args:
        store: the run's object store (often an S3Store behind an emulated link).
        run: the run's key prefix.
        public_key: the run's public key (anything ``load_public_key`` takes).
        config: polling and backoff.
        name: a label for logs and records.
    """

    def __init__(self, store: ObjectStore, run: str, public_key: Any, config: FollowerConfig = FollowerConfig(),
                 name: str = "follower"):
        self.store, self.run_name, self.config, self.name = store, run, config, name
        self.sub = WeightSubscriber(store, run, public_key)
        self.version: int | None = None
        self.state: dict[str, np.ndarray] | None = None
        self.records: list[SyncRecord] = []
        self.failures: list[_Failure] = []
        self.polls = 0
        self._failed_in_row = 0  # failures in a row: drives the backoff, reset by any successful poll
        self._unrecorded = 0  # failures since the last record: reported as recovered by the next one
        self._chain_failures = 0  # integrity/signature failures in a row: these lead to a rejoin

    def poll(self) -> SyncRecord | None:
        """One attempt: join if nothing is held (or after repeated failures), else sync in place.

        Returns the record when the held version moved, None when nothing was published yet or
        the follower already holds the head. Raises what the subscriber raises
        (:data:`stoa.transport.chain.SYNC_ERRORS`); the held state is then unchanged.
        """
        self.polls += 1
        rejoin = self.state is None or self._chain_failures >= self.config.rejoin_after
        if self.state is None and self.sub.head() is None:
            return None
        t0, w0, c0 = time.perf_counter(), time.time(), time.thread_time()
        have = None if rejoin else (self.version, self.state)
        res = self.sub.sync(have, apply_inplace=not rejoin, check=self.config.check)
        seconds, cpu = time.perf_counter() - t0, time.thread_time() - c0
        if res.check is not None:
            try:
                res.check.wait()
            except SYNC_ERRORS:
                self.version = res.version  # the arrays hold a damaged state: the next sync repairs it
                raise
            cpu += res.check.cpu_seconds or 0.0
        verified = time.perf_counter() - t0
        if res.version == self.version and not res.applied:
            self._failed_in_row = self._chain_failures = 0
            return None
        if not res.inplace:
            res_state = {k: a if a.flags.writeable and a.flags.c_contiguous else np.array(a, order="C", copy=True)
                         for k, a in res.state.items()}
        else:
            res_state = res.state
        rec = SyncRecord(
            kind="join" if rejoin else "sync", t_start=w0, t_end=time.time(), from_version=self.version,
            to_version=res.version, seconds=seconds, verified_seconds=verified, cpu_seconds=cpu,
            bytes_read=res.bytes_read,
            deltas=sum(1 for _, k in res.applied if k == "delta"), anchor=any(k == "anchor" for _, k in res.applied),
            lag_s=time.time() - res.manifest.created if getattr(res, "manifest", None) is not None else float("nan"),
            failures=self._unrecorded, problems=len(res.problems))
        self.version, self.state = res.version, res_state
        self._failed_in_row = self._chain_failures = self._unrecorded = 0
        self.records.append(rec)
        for p in res.problems:
            log.warning("%s: %s", self.name, p)
        return rec

    def run(self, stop: threading.Event | None = None, duration_s: float | None = None,
            until_version: int | None = None, max_polls: int = 1_000_000,
            on_record: Any = None) -> None:
        """Poll until ``stop`` is set, ``duration_s`` passed, ``until_version`` is held, or
        ``max_polls`` attempts were made. Failures are recorded and retried with backoff."""
        stop = stop or threading.Event()
        deadline = None if duration_s is None else time.monotonic() + duration_s
        for _ in range(max_polls):
            if stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
                return
            if until_version is not None and self.version is not None and self.version >= until_version:
                return
            try:
                rec = self.poll()
                if rec is not None and on_record is not None:
                    on_record(rec)
                wait = 0.0 if rec is not None else self.config.poll_s
            except SYNC_ERRORS as e:
                self._failed_in_row += 1
                self._unrecorded += 1
                self._chain_failures = 0 if isinstance(e, StoreError) else self._chain_failures + 1
                self.failures.append(_Failure(time.time(), f"{type(e).__name__}: {e}"))
                cap = min(self.config.backoff_max_s, self.config.backoff_base_s * 2 ** min(self._failed_in_row - 1, 30))
                wait = random.uniform(0.5 * cap, cap)  # jitter: a fleet recovering together spreads out
                log.warning("%s: sync failed (%s); retrying in %.1f s", self.name, self.failures[-1].error[:300], wait)
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.monotonic()))
            if wait:
                stop.wait(wait)

    def summary(self) -> dict:
        """Counts and totals over the records so far (JSON-ready)."""
        syncs = [r for r in self.records if r.kind == "sync"]
        return {
            "name": self.name, "version": self.version, "polls": self.polls, "records": len(self.records),
            "joins": sum(r.kind == "join" for r in self.records),
            "bytes_read": sum(r.bytes_read for r in self.records),
            "failures": len(self.failures),
            "failures_recovered": sum(r.failures for r in self.records),
            "sync_seconds": [r.seconds for r in syncs],
            "verified_seconds": [r.verified_seconds for r in syncs],
        }


def main(argv: list[str] | None = None) -> int:
    """Run one follower as a process; one JSON line per record (and per failure) to --out or stdout."""
    from stoa.transport.store import open_store

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--store", required=True, help="object store URL (a path or s3://bucket/prefix?endpoint=...)")
    ap.add_argument("--run", required=True, help="the run's key prefix")
    ap.add_argument("--public-key", required=True, help="the run's public key: hex or a .pub file")
    ap.add_argument("--name", default="follower")
    ap.add_argument("--poll", type=float, default=1.0, help="seconds between polls when in sync")
    ap.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    ap.add_argument("--until-version", type=int, default=None, help="stop once this version is held")
    ap.add_argument("--out", default=None, help="JSON-lines file for records (default stdout)")
    ap.add_argument("--check", choices=SYNC_CHECKS, default="background",
                    help="hash the synced state beside (as stoa worker does) or before writing it")
    ap.add_argument("--read-timeout", type=float, default=None, help="S3 read timeout in seconds (progress-based)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.name} %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    from stoa.transport.store import S3Config

    s3 = S3Config(read_timeout_s=args.read_timeout) if args.read_timeout else S3Config()
    f = Follower(open_store(args.store, s3_config=s3), args.run, args.public_key,
                 FollowerConfig(poll_s=args.poll, check=args.check), name=args.name)
    out = open(args.out, "a", buffering=1) if args.out else sys.stdout
    stop = threading.Event()
    import signal

    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    seen_failures = 0

    def emit(rec: SyncRecord | None = None) -> None:
        nonlocal seen_failures
        for fl in f.failures[seen_failures:]:
            out.write(json.dumps({"type": "failure", "name": args.name, **asdict(fl)}) + "\n")
        seen_failures = len(f.failures)
        if rec is not None:
            out.write(json.dumps({"type": "record", "name": args.name, **asdict(rec)}) + "\n")

    out.write(json.dumps({"type": "start", "name": args.name, "t": time.time()}) + "\n")
    try:
        f.run(stop=stop, duration_s=args.duration, until_version=args.until_version, on_record=emit)
    except KeyboardInterrupt:
        pass
    finally:
        emit()
        out.write(json.dumps({"type": "summary", **{k: v for k, v in f.summary().items() if k != "sync_seconds"}}) + "\n")
        if out is not sys.stdout:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
