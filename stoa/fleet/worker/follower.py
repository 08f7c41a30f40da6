"""Following a run's weight chain: the one piece ``stoa worker`` and ``--follow-only`` share.

:class:`LiveWeights` holds one run's weights as a machine follows them, through the production
subscriber (:class:`stoa.transport.chain.WeightSubscriber`: every object verified, every result
checked against the signed state hash):

* :meth:`~LiveWeights.join`: the first state, from the weights the last session kept in the
  cache folder when they are still on the run's chain (caught up by deltas), else from the
  newest anchor and its deltas;
* :meth:`~LiveWeights.catch_up` / :meth:`~LiveWeights.follow`: newer versions written into the
  live arrays in place (those of a rollout engine, or of a :class:`HeldState`), their state hash
  checked in the background;
* :meth:`~LiveWeights.verified`: waits for that check; weights that fail it are repaired from
  the store, and whatever was made with them is void;
* :meth:`~LiveWeights.keep`: the verified weights saved for the next session's join.

:class:`Follower` is a sync-only follower built on it: it generates nothing, applies every
version the trainer publishes and records what each sync cost, so a benchmark or a test can put
many of them on emulated links (``stoa.testing.links``) beside real workers: 14 followers fit on
two cores where 14 MLX workers would not.

Use it in-process (``Follower(...).run(stop=event)`` in a thread), as a subprocess
(``python -m stoa.fleet.worker.follower --store URL --run RUN --public-key KEY --out records.jsonl``),
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from stoa.transport.chain import SYNC_CHECKS, SYNC_ERRORS, StateCheck, SyncResult, WeightSubscriber
from stoa.transport.store import ObjectStore, StoreError

__all__ = ["Follower", "FollowerConfig", "HeldState", "LayoutChanged", "LiveWeights", "SyncRecord", "WeightHolder"]

log = logging.getLogger(__name__)

KEPT_STATE, KEPT_META = "weights.safetensors", "weights.json"
"""Files of the weights a session keeps in its cache folder for the next one."""


class WeightHolder(Protocol):
    """Where followed weights live: a rollout engine (:class:`stoa.backends.engine.RolloutEngine`
    has exactly these members), or a :class:`HeldState`."""

    version: int

    @property
    def state(self) -> dict[str, np.ndarray]: ...

    def update_inplace(self, write: Callable[[dict[str, np.ndarray]], tuple[int, Sequence[str]]]) -> list[str]:
        """Call ``write(state)`` on the live arrays; set :attr:`version` to the version it returns."""


class HeldState:
    """A state held as writeable numpy arrays (what a follower holds where a worker has an engine)."""

    def __init__(self, version: int, state: dict[str, np.ndarray]):
        self.version = version
        self.state = {k: a if a.flags.writeable and a.flags.c_contiguous else np.array(a, order="C", copy=True)
                      for k, a in state.items()}

    def update_inplace(self, write: Callable[[dict[str, np.ndarray]], tuple[int, Sequence[str]]]) -> list[str]:
        version, changed = write(self.state)
        self.version = version
        return list(changed)


class LayoutChanged(RuntimeError):
    """A newer version has another weight layout (names, shapes or dtypes), so it cannot be
    written into the live arrays; ``result`` holds it as fresh arrays."""

    def __init__(self, result: SyncResult):
        super().__init__(f"version {result.version} changes the weight layout")
        self.result = result


class LiveWeights:
    """One run's weights as a machine follows them (see the module docstring).

    Args:
        store, run, public_key: the run's object store, key prefix and public key.
        keep_dir: the cache folder whose kept weights :meth:`join` starts from and where
            :meth:`keep` saves them; None: neither.
        check: how a catch-up is checked against the signed state hash (``"background"``: the
            weights are usable when written and hashed beside, :meth:`verified` waits for it;
            ``"now"``: hashed before anything is written).
        label: the prefix of the warnings this piece logs (the problems a sync routed around).

    Attributes:
        live: the holder of the live weights (set by the caller from :meth:`join`'s state).
        newest: the newest head read (None: none yet, or nothing published).
        bytes_read: every byte the subscriber fetched.
        damaged: the live weights failed their check and are not repaired yet.
    """

    def __init__(self, store: ObjectStore, run: str, public_key: Any, keep_dir: Path | None = None,
                 check: str = "background", label: str = "weight sync"):
        if check not in SYNC_CHECKS:
            raise ValueError(f"check must be one of {SYNC_CHECKS}, not {check!r}")
        self.sub = WeightSubscriber(store, run, public_key)
        self.run, self.keep_dir, self.check, self.label = run, keep_dir, check, label
        self.live: WeightHolder | None = None
        self.newest: int | None = None
        self.bytes_read = 0
        self.damaged = False
        self._pending: StateCheck | None = None
        self._target: int | None = None  # the version the last catch-up aimed at (None: the head)
        self._kept: tuple[int, dict] | None = None
        self._kept_read = False

    @property
    def pending(self) -> StateCheck | None:
        """The background hash check of the weights last written, while nobody waited for it."""
        return self._pending

    def head(self) -> int | None:
        """The newest version the run's key signed (None: nothing published yet)."""
        self.newest = self.sub.head()
        return self.newest

    def join(self, version: int | None = None) -> SyncResult:
        """The first state, verified: the weights kept in ``keep_dir`` caught up when they are
        still on the run's chain, else the newest anchor and the deltas after it. ``version``:
        an older version on the head's chain instead (a study's forced lag).

        Raises:
            SYNC_ERRORS: nothing was published yet, nothing intact leads there, or the store failed.
        """
        if not self._kept_read:  # read once: a join retried after a store failure reuses it
            self._kept, self._kept_read = self._load_kept(), True
        kept = self._kept
        res = self.sub.sync(kept, version=version)
        self._note(res)
        self._kept = None
        if kept is not None:
            how = "the kept weights were current" if not res.applied else " + ".join(f"{k} {v}" for v, k in res.applied)
            log.info("resumed from the weights kept at version %d: %s (%d bytes)", kept[0], how, res.bytes_read)
        return res

    def catch_up(self, version: int | None = None) -> SyncResult:
        """Bring :attr:`live` to the head (or to ``version``, older on its chain), in place:
        verified deltas, or a newer anchor copied into the arrays. With ``check="background"``
        the state hash of the result runs beside (:meth:`verified` waits for it).

        Raises:
            SYNC_ERRORS: the store failed or nothing intact leads there (the live weights are unchanged).
            LayoutChanged: the newer version does not fit the live arrays (they are unchanged).
        """
        assert self.live is not None, "join first, and set live"
        got: list[SyncResult] = []

        def write(state: dict[str, np.ndarray]) -> tuple[int, list[str]]:
            res = self.sub.sync((self.live.version, state), apply_inplace=True, version=version, check=self.check)
            got.append(res)
            self._note(res)
            if not res.inplace:
                raise LayoutChanged(res)
            return res.version, res.changed_names

        self.live.update_inplace(write)
        self.damaged, self._target = False, version
        return got[0]

    def follow(self, lag: int = 0) -> int | None:
        """Read the head and catch up when the live weights are not at ``head - lag`` (or are
        damaged); returns the head (None: nothing published). Raises as :meth:`catch_up`."""
        head = self.head()
        v = self.live.version if self.live is not None else None
        if head is not None and v is not None and (head - lag > v or head < v or self.damaged):
            self.catch_up(head - lag if lag else None)
        return head

    def verified(self, repair: bool = True) -> bool:
        """Whether the weights the last catch-up wrote match the signed state hash (waiting for
        the check). When they do not, they are marked :attr:`damaged` and, with ``repair``,
        caught up again from the store at once (verified before anything is written): False
        says that anything made with them is void.

        Raises:
            SYNC_ERRORS: the repair failed (the next :meth:`follow` repairs); without
                ``repair``, the failed check itself.
            LayoutChanged: as :meth:`catch_up`.
        """
        check, self._pending = self._pending, None
        if check is None:
            return True
        try:
            return check.wait()
        except SYNC_ERRORS as e:
            self.damaged = True  # until a catch-up succeeds, nothing is made with these weights
            if not repair:
                raise
            log.error("the weights of version %d did not verify after the in-place update (%s); dropping what was "
                      "made with them and repairing the weights from the store", check.version, e)
            self.catch_up(self._target)
            return False

    def keep(self) -> str:
        """Save the live weights (once their check passed) in ``keep_dir`` for the next session's
        :meth:`join`; says what it did ("" when nothing was kept: saving is a convenience, a
        failure is a warning)."""
        live = self.live
        if self.keep_dir is None or live is None:
            return ""
        try:
            if self._pending is not None and not self._pending.wait():
                return ""
            from stoa.transport import pulse

            blob = pulse.encode_state({k: np.asarray(v) for k, v in live.state.items()})
            (self.keep_dir / KEPT_META).unlink(missing_ok=True)  # no meta: no kept weights, until both are whole
            for name, data in ((KEPT_STATE, blob),
                               (KEPT_META, json.dumps({"run": self.run, "version": live.version}).encode())):
                tmp = self.keep_dir / f".{name}.tmp"
                try:
                    tmp.write_bytes(data)
                    tmp.replace(self.keep_dir / name)
                finally:
                    tmp.unlink(missing_ok=True)  # a full disk leaves no half-written file behind
            return f"weights of version {live.version} kept in {self.keep_dir} for a quick restart"
        except Exception as err:  # noqa: BLE001 - never hide the reason a session ends
            log.warning("could not keep the weights (%s: %s)", type(err).__name__, err)
            return ""

    def _load_kept(self) -> tuple[int, dict] | None:
        """The weights the last session kept, if any and readable (verified by the sync that uses them)."""
        if self.keep_dir is None:
            return None
        meta, path = self.keep_dir / KEPT_META, self.keep_dir / KEPT_STATE
        if not meta.exists() or not path.exists():
            return None
        try:
            from stoa.transport import pulse

            m = json.loads(meta.read_text())
            if m.get("run") != self.run:
                return None
            return int(m["version"]), pulse.decode_state(path.read_bytes())
        except Exception as e:  # noqa: BLE001 - a damaged cache costs one anchor, nothing else
            log.warning("ignoring the weights kept in %s (%s: %s)", self.keep_dir, type(e).__name__, e)
            return None

    def _note(self, res: SyncResult) -> None:
        self.bytes_read += res.bytes_read
        self._pending = res.check
        for p in res.problems:
            log.warning("%s: %s", self.label, p)


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
    """Follows a run's signed chain and holds its newest state (a dict of numpy arrays), through
    :class:`LiveWeights`.

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
        self.weights = LiveWeights(store, run, public_key, check=config.check, label=name)
        self.records: list[SyncRecord] = []
        self.failures: list[_Failure] = []
        self.polls = 0
        self._failed_in_row = 0  # failures in a row: drives the backoff, reset by any successful poll
        self._unrecorded = 0  # failures since the last record: reported as recovered by the next one
        self._chain_failures = 0  # integrity/signature failures in a row: these lead to a rejoin

    @property
    def version(self) -> int | None:
        """The version held (None before the first join)."""
        return self.weights.live.version if self.weights.live is not None else None

    @property
    def state(self) -> dict[str, np.ndarray] | None:
        """The state held (None before the first join)."""
        return self.weights.live.state if self.weights.live is not None else None

    def poll(self) -> SyncRecord | None:
        """One attempt: join if nothing is held (or after repeated failures), else catch up in place.

        Returns the record when the held version moved, None when nothing was published yet or
        the follower already holds the head. Raises what the subscriber raises
        (:data:`stoa.transport.chain.SYNC_ERRORS`); the held state is then unchanged, or, when
        its check failed, damaged and repaired by the next poll.
        """
        self.polls += 1
        rejoin = self.state is None or self._chain_failures >= self.config.rejoin_after
        if self.state is None and self.weights.head() is None:
            return None
        t0, w0, c0 = time.perf_counter(), time.time(), time.thread_time()
        before = self.version
        res = self._join() if rejoin else self._catch_up()
        seconds, cpu = time.perf_counter() - t0, time.thread_time() - c0
        if res.check is not None:
            self.weights.verified(repair=False)
            cpu += res.check.cpu_seconds or 0.0
        verified = time.perf_counter() - t0
        if res.version == before and not res.applied:
            self._failed_in_row = self._chain_failures = 0
            return None
        rec = SyncRecord(
            kind="join" if rejoin else "sync", t_start=w0, t_end=time.time(), from_version=before,
            to_version=res.version, seconds=seconds, verified_seconds=verified, cpu_seconds=cpu,
            bytes_read=res.bytes_read,
            deltas=sum(1 for _, k in res.applied if k == "delta"), anchor=any(k == "anchor" for _, k in res.applied),
            lag_s=time.time() - res.manifest.created if getattr(res, "manifest", None) is not None else float("nan"),
            failures=self._unrecorded, problems=len(res.problems))
        self._failed_in_row = self._chain_failures = self._unrecorded = 0
        self.records.append(rec)
        return rec

    def _join(self) -> SyncResult:
        res = self.weights.join()
        self.weights.live = HeldState(res.version, res.state)
        return res

    def _catch_up(self) -> SyncResult:
        try:
            return self.weights.catch_up()
        except LayoutChanged as e:  # a follower holds plain arrays: it takes the new layout as it comes
            self.weights.live = HeldState(e.result.version, e.result.state)
            return e.result

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
