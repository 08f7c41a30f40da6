"""The worker process: int8 rollouts from the newest weights, uploaded as write-once batches.

Loop (``stoa worker --invite FILE``, or ``--store URL --run NAME --public-key KEY``)::

    verify and read the run (signed config + model files); join from the weights kept in the
    cache by the last session (caught up by deltas), else from the newest anchor + deltas
    until the run is finished, the worker is banned, a limit is reached or the user stops it:
        between cohorts: if the pointer moved, catch up (deltas applied live, or a newer anchor)
        if this version already got rollout.cohorts_per_version cohorts from us, or too many of
        our batches wait for the trainer: wait
        make the work assigned to its next sequence number (stoa.fleet.trust.assign): its prompts,
            group ids and sampling seed follow from the run seed, its key and the number
        play group_size samples of each with the int8 engine; upload them as one batch
        heartbeat; every ~30 s a progress line

A cohort never spans a weight swap, so every episode of a batch carries one policy version.
Every batch is sealed with the worker's own key, which the trainer checks against the run's
roster (:mod:`stoa.transport.identity`).

**The store never ends a worker.** A store that fails, or holds a hostile object, costs a retry
after a capped backoff (0.5 s doubling to 60 s, jittered) with a warning line saying what failed
and what the worker keeps doing; the held weights keep serving. What ends it (exit status):

* ``0`` the run finished, ``max_batches`` were uploaded, the time limit passed, or the user
  stopped it (SIGINT / SIGTERM finish the current upload first; a second SIGINT stops at once);
* ``2`` a configuration error: a run config that does not verify under the given public key, a
  model the worker cannot load (the message names it), or a worker id the run's roster gives to
  another key, or a key the roster binds to another id (a restart under a new ``--id``: the
  message names the id to use);
* ``3`` the run's roster bans this worker's key;
* ``4`` no such run: the store holds other runs (named in the message), or none appeared within
  ``wait_seconds``;
* ``5`` the store could not be reached at all within ``wait_seconds`` of starting.

On the way out the worker saves its verified weights in its cache folder, so the next start with
the same key (and so the same id and cache) catches up by deltas instead of a full anchor.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stoa.fleet.config import import_env_module
from stoa.fleet.parity import join_check
from stoa.fleet.run import Heartbeat, fetch_run, write_heartbeat
from stoa.fleet.trust.assign import Assignment, assignment
from stoa.transport.chain import SYNC_ERRORS, PointerError, StateCheck, WeightSubscriber
from stoa.transport.exchange import RolloutWriter, SequenceTaken, is_finished, read_progress
from stoa.transport.identity import load_or_create_worker_key, read_ban, read_roster, read_salt
from stoa.transport.sequence import RememberingWriter, SequenceFile, catch_up
from stoa.transport.signing import SignatureError, key_id, load_public_key
from stoa.transport.store import KeyNotFound, ObjectStore, StoreError

if TYPE_CHECKING:
    from stoa.backends.engine import RolloutEngine
    from stoa.types import Episode

__all__ = ["EXIT_BANNED", "EXIT_CONFIG", "EXIT_NO_RUN", "EXIT_OK", "EXIT_UNREACHABLE", "Worker", "WorkerExit",
           "find_runs"]

log = logging.getLogger("stoa.worker")

EXIT_OK, EXIT_CONFIG, EXIT_BANNED, EXIT_NO_RUN, EXIT_UNREACHABLE = 0, 2, 3, 4, 5
BANNED_EXIT = EXIT_BANNED
"""Exit status of a worker whose key the run's roster bans (kept for older callers)."""
_ROSTER_EVERY_S = 10.0
_BACKOFF_MAX_S = 60.0
_MAX_TRUST_REPORT = 4 << 20
_MAX_RUNS_LISTED = 20
_STATE_FILE, _STATE_META = "weights.safetensors", "weights.json"


class WorkerExit(Exception):
    """Ends :meth:`Worker.run` with ``code`` and a one-line ``message`` for the user."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def find_runs(store: ObjectStore, limit: int = _MAX_RUNS_LISTED) -> list[str]:
    """Names of the runs a store holds (prefixes with a ``config.json`` beside ``current.json``
    or ``model/``), at most ``limit``. Lists the whole store: for error messages only."""
    keys = store.list("")
    runs = {k[: -len("/config.json")] for k in keys if k.endswith("/config.json") and "/model/" not in k}
    return sorted(r for r in runs if r)[:limit]


class Worker:
    """One rollout worker. ``run()`` loops until the run finishes, the worker is banned,
    ``max_batches`` are uploaded, ``max_seconds`` pass, or a signal; returns the exit status.

    Args:
        store: the object store of the fleet.
        run: the run name (store prefix).
        public_key: the run's ed25519 public key (hex, raw bytes, PEM or a file path); checked here.
        worker_id: unique id of this worker (``[A-Za-z0-9._-]``, 1-64 characters).
        cache_dir: local folder for the run's model files and the weights kept between sessions.
        max_batches: stop after this many uploads (None: until the run finishes).
        wait_seconds: how long to wait, at start, for the store to answer and for the run's signed
            config to appear (exit 5 / 4 after that). Once the config exists the trainer is alive
            (perhaps warm-starting for a long while): the worker waits for the first weights
            until they come, the run finishes, or a signal arrives.
        private_key: this worker's ed25519 key (a key object or a file); None: ``cache_dir/worker.key``,
            made on first use.
        max_seconds: stop (exit 0) after this many seconds of running.
        progress_every: seconds between progress lines.
        keep_weights: save the verified weights in ``cache_dir`` on the way out, and start from
            them next time.
    """

    backoff_base_s = 0.5
    """First wait after a failure; doubles per consecutive failure up to :attr:`backoff_max_s`."""
    backoff_max_s = _BACKOFF_MAX_S

    def __init__(self, store: ObjectStore, run: str, public_key: Any, worker_id: str, cache_dir: Path,
                 max_batches: int | None = None, wait_seconds: float = 600.0, private_key: Any = None,
                 max_seconds: float | None = None, progress_every: float = 30.0, keep_weights: bool = True):
        from stoa.fleet.invite import check_worker_id  # before anything is written under a path it names

        self.store, self.run_name = store, run
        self.public_key = load_public_key(public_key)
        self.worker_id, self.cache_dir = check_worker_id(worker_id), Path(cache_dir)
        self.private_key = load_or_create_worker_key(self.cache_dir / "worker.key") if private_key is None else private_key
        if isinstance(self.private_key, (str, os.PathLike)):
            self.private_key = load_or_create_worker_key(self.private_key)
        self.key_id = key_id(self.private_key.public_key())
        self.max_batches, self.wait_seconds, self.max_seconds = max_batches, wait_seconds, max_seconds
        self.progress_every, self.keep_weights = progress_every, keep_weights
        self._stop = False
        self._stop_event = threading.Event()
        self._stop_reason = ""
        self.episodes = self.batches = self.sync_bytes = 0
        self.episodes_per_s = self.tokens_per_s = 0.0
        self.host = socket.gethostname()
        self.writer: RolloutWriter | None = None
        self.engine: RolloutEngine | None = None
        self.sub: WeightSubscriber | None = None
        self._check: StateCheck | None = None  # the background hash check of the weights last synced
        self._last_status, self._last_beat = "", 0.0
        self._failures, self._trouble, self._trouble_since = 0, "", 0.0
        self._last_progress = 0.0
        self._taken = 0  # the newest count of our batches taken, from a verified progress document
        self._head: int | None = None
        self._repair = False  # the live weights failed their check and are not repaired yet
        self._started = time.time()
        self._signals = 0
        self._salt: str | None = None  # this key's assignment salt, once the run publishes it (trust.assign)
        self._salt_read = 0.0

    # -- stopping ---------------------------------------------------------------------------------
    def request_stop(self, signum: Any = None, *_: Any) -> None:
        self._signals += 1
        if self._signals > 1 and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self._stop:
            self._stop_reason = self._stop_reason or "stopped by a signal"
            if signum is not None:
                log.warning("stopping: finishing the current cohort's upload (Ctrl-C again to stop at once)")
        self._stop = True
        self._stop_event.set()

    def _sleep(self, seconds: float) -> None:
        self._stop_event.wait(max(0.0, seconds))

    def _stop_for(self, reason: str) -> None:
        self._stop_reason = reason
        self._stop = True
        self._stop_event.set()

    # -- store trouble ----------------------------------------------------------------------------
    def _backoff(self, what: str, e: BaseException) -> None:
        """Note a failure and wait the next capped, jittered delay (interrupted by a stop)."""
        self._failures += 1
        if not self._trouble:
            self._trouble_since = time.time()
        self._trouble = f"{what}: {type(e).__name__}: {str(e)[:300] or 'no detail'}"
        delay = min(self.backoff_max_s, self.backoff_base_s * 2 ** min(self._failures - 1, 10)) * (0.5 + random.random())
        held = f"; keeping version {self.engine.version}" if self.engine is not None else ""
        log.warning("%s (failure %d, for %.0fs); retrying in %.1fs%s", self._trouble, self._failures,
                    time.time() - self._trouble_since, delay, held)
        self._sleep(delay)

    def _recovered(self) -> None:
        if self._trouble:
            log.info("store reachable again after %.0fs (%d failures)", time.time() - self._trouble_since,
                     self._failures)
        self._failures, self._trouble = 0, ""

    # -- reporting --------------------------------------------------------------------------------
    def _beat(self, status: str) -> None:
        now = time.time()
        if status == self._last_status and status == "waiting" and now - self._last_beat < 2.0:
            return  # an idle worker reports every 2 s, not every poll
        self._last_status, self._last_beat = status, now
        e = self.engine
        write_heartbeat(self.store, self.run_name, Heartbeat(
            self.worker_id, max(e.version, 0) if e else 0, status, self.episodes, self.batches, self.episodes_per_s,
            self.tokens_per_s, e.mode if e else "", self.host, time.time(), self.sync_bytes))

    def _trainer_view(self) -> str:
        """Accepted / rejected counts for this worker's key from the trainer's signed trust report."""
        from stoa.fleet.trust.records import read_trust_report

        try:
            report = read_trust_report(self.store, self.run_name, self.public_key, max_bytes=_MAX_TRUST_REPORT)
        except (SignatureError, StoreError) as e:
            return f"trainer report unreadable ({type(e).__name__})"
        rec = report.workers.get(self.key_id) if report is not None else None
        if rec is None:
            return "trainer: none of ours judged yet"
        text = f"trainer: {rec.accepted_batches} accepted, {rec.rejected_batches} rejected"
        return text + (f" (last: {rec.last_reason[:120]})" if rec.rejected_batches and rec.last_reason else "")

    def progress_line(self) -> str:
        """One line: version, lag, uploads, the trainer's verdicts, speed, store state."""
        e = self.engine
        v = e.version if e is not None else None
        lag = "?" if v is None or self._head is None else str(max(0, self._head - v))
        store = f"store trouble for {time.time() - self._trouble_since:.0f}s" if self._trouble else "store ok"
        return (f"version {v if v is not None else '-'} (lag {lag}) | {self.batches} batches uploaded | "
                f"{self._trainer_view()} | {self.tokens_per_s:.0f} tok/s | {store}")

    def _maybe_progress(self) -> None:
        if time.time() - self._last_progress >= self.progress_every:
            self._last_progress = time.time()
            log.info("%s", self.progress_line())

    # -- decisions --------------------------------------------------------------------------------
    def _outstanding(self, writer: RolloutWriter) -> int:
        """Own batches uploaded but not yet taken by the trainer. Counted against the newest
        verified progress document this worker saw: a missing, forged or replayed older one
        counts as "nothing more taken", so the worker waits (fails closed) instead of racing on."""
        try:
            progress = read_progress(self.store, self.run_name, self.public_key)
        except SignatureError as e:
            log.warning("progress.json does not verify (%s); counting only what was taken before", e)
            progress = None
        if progress is not None:
            self._taken = max(self._taken, progress.taken.get(self.worker_id, 0))
        return max(0, writer.next_seq - self._taken)

    def _roster_says(self) -> WorkerExit | None:
        """Why the run's signed roster stops this worker, or None: its key is banned, its key is
        bound to another worker id (a restart under a new ``--id``), or its id belongs to another
        key. A roster that does not verify is ignored."""
        try:
            roster = read_roster(self.store, self.run_name, self.public_key)
        except SignatureError as e:
            log.warning("workers.json does not verify (%s); ignoring it", e)
            return None
        try:  # bans are one document per key (stoa.transport.identity), not roster entries
            ban = read_ban(self.store, self.run_name, self.key_id, self.public_key)
        except SignatureError as e:
            log.warning("this key's ban document does not verify (%s); ignoring it", e)
            ban = None
        if ban is not None:
            log.error("this worker's key %s is banned from run %s: %s", self.key_id, self.run_name, ban.reason)
            return WorkerExit(EXIT_BANNED, f"this worker's key {self.key_id} is banned from run {self.run_name!r}; "
                                           "stopping")
        entry = roster.enrolled.get(self.key_id)
        if entry is not None and entry.worker_id != self.worker_id:
            return WorkerExit(EXIT_CONFIG, f"this worker's key {self.key_id} is bound to worker id "
                                           f"{entry.worker_id!r} in run {self.run_name!r}, so batches sent as "
                                           f"{self.worker_id!r} are refused: start it with --id {entry.worker_id} "
                                           "(or without --id)")
        owner = roster.key_for(self.worker_id)
        if owner is not None and owner != self.key_id:
            return WorkerExit(EXIT_CONFIG, f"worker id {self.worker_id!r} belongs to another key ({owner}) in run "
                                           f"{self.run_name!r}: start this worker with another --id (or without --id)")
        return None

    def _finished(self) -> bool:
        """Whether the trainer marked the run finished: only a marker that verifies under the run's
        key counts (anyone with write access to the store could plant one)."""
        return is_finished(self.store, self.run_name, self.public_key)

    def make_engine(self, model_dir: Path, state: dict, version: int, rc: Any) -> RolloutEngine:
        """The worker's int8 engine for the run's weights."""
        from stoa.backends.engine import EngineConfig, make_engine

        return make_engine(model_dir, rc.engine, state=state, version=version, mode=rc.engine_mode,
                           config=EngineConfig(max_batch=rc.max_batch), worker_id=self.worker_id)

    def finish_cohort(self, episodes: list[Episode]) -> list[Episode]:
        """What the worker uploads of a cohort: exactly what the engine returned. (A subclass may
        change it; ``stoa.testing.adversaries`` does, to test the trainer's checks.)"""
        return episodes

    # -- joining ----------------------------------------------------------------------------------
    def _fetch_run(self) -> tuple[Any, Path] | None:
        """The verified run config and model folder, waiting for them within ``wait_seconds``."""
        t0, reached, last_note = time.time(), False, 0.0
        while not self._stop:
            try:
                got = fetch_run(self.store, self.run_name, self.public_key, self.cache_dir / "model")
                self._recovered()
                return got
            except KeyNotFound:
                reached = True
                # Another run's name and nothing under ours (an enrolled roster counts): a typo.
                runs = [] if self.store.list(f"{self.run_name.strip('/')}/") else find_runs(self.store)
                if runs and self.run_name not in runs:
                    raise WorkerExit(EXIT_NO_RUN, f"no run {self.run_name!r} in {self.store}; runs found there: "
                                                  f"{', '.join(runs)}") from None
                if time.time() - t0 > self.wait_seconds:
                    raise WorkerExit(EXIT_NO_RUN, f"no run {self.run_name!r} appeared in {self.store} within "
                                                  f"{self.wait_seconds:.0f}s (the store holds no runs)") from None
                if time.time() - last_note > self.progress_every:
                    last_note = time.time()
                    log.info("waiting for run %r to appear in %s (the trainer publishes it when it starts)",
                             self.run_name, self.store)
                self._sleep(2.0)
            except SignatureError as e:
                raise WorkerExit(EXIT_CONFIG, f"run {self.run_name!r} does not verify under the public key given "
                                              f"(wrong key for this run, or the store was tampered with): {e}") from None
            except ValueError as e:
                raise WorkerExit(EXIT_CONFIG, f"run {self.run_name!r} cannot be used: {e}") from None
            except (StoreError, OSError) as e:
                if not reached and time.time() - t0 > self.wait_seconds:
                    raise WorkerExit(EXIT_UNREACHABLE, f"cannot reach the store {self.store} "
                                                       f"({type(e).__name__}: {e}); check its URL, your network "
                                                       "and the credentials in your environment") from None
                self._backoff("reading the run config", e)
        return None

    def _first_weights(self, rc: Any) -> Any:
        """The first synced state (from the weights kept by the last session when they are still
        on the chain), waiting for the first publish; None if stopped first."""
        assert self.sub is not None
        kept = self._load_kept()
        last_note = 0.0
        while not self._stop:
            try:
                head = self.sub.head()
                if head is None:
                    if self._finished():
                        self._stop_for("the run finished before publishing weights")
                        return None
                    if time.time() - last_note > self.progress_every:
                        last_note = time.time()
                        log.info("waiting for the trainer's first weights of run %r", self.run_name)
                    self._sleep(0.5)
                    continue
                self._head = head
                res = self.sub.sync(kept, version=max(0, head - rc.lag) if rc.lag else None)
                self._recovered()
                self.sync_bytes += res.bytes_read
                if kept is not None:
                    how = ("the kept weights were current" if not res.applied else
                           " + ".join(f"{k} {v}" for v, k in res.applied))
                    log.info("resumed from the weights kept at version %d: %s (%d bytes)", kept[0], how,
                             res.bytes_read)
                return res
            except PointerError as e:  # a stale or unreadable pointer: wait for the trainer's next word
                self._backoff("the run's pointer", e)
            except (*SYNC_ERRORS, OSError) as e:
                self._backoff("joining the weight chain", e)
        return None

    def _load_kept(self) -> tuple[int, dict] | None:
        """The weights the last session saved, if any and readable (verified by the first sync)."""
        meta, path = self.cache_dir / _STATE_META, self.cache_dir / _STATE_FILE
        if not self.keep_weights or not meta.exists() or not path.exists():
            return None
        try:
            from stoa.transport import pulse

            m = json.loads(meta.read_text())
            if m.get("run") != self.run_name:
                return None
            return int(m["version"]), pulse.decode_state(path.read_bytes())
        except Exception as e:  # a damaged cache costs one anchor, nothing else
            log.warning("ignoring the weights kept in %s (%s: %s)", self.cache_dir, type(e).__name__, e)
            return None

    def _save_kept(self) -> str:
        """Save the verified live weights for the next session; says what it did."""
        e = self.engine
        if not self.keep_weights or e is None:
            return ""
        try:
            if self._check is not None and not self._check.wait():
                return ""
            from stoa.transport import pulse

            blob = pulse.encode_state({k: np.asarray(v) for k, v in e.state.items()})
            tmp = self.cache_dir / f".{_STATE_FILE}.tmp"
            tmp.write_bytes(blob)
            tmp.replace(self.cache_dir / _STATE_FILE)
            (self.cache_dir / _STATE_META).write_text(json.dumps({"run": self.run_name, "version": e.version}))
            return f"weights of version {e.version} kept in {self.cache_dir} for a quick restart"
        except Exception as err:  # noqa: BLE001 - saving is a convenience; never hide the exit reason
            log.warning("could not keep the weights (%s: %s)", type(err).__name__, err)
            return ""

    # -- syncing ----------------------------------------------------------------------------------
    def _sync(self, version: int | None = None) -> None:
        """Catch up to the head (or to ``version``, for a forced lag) between cohorts, writing verified
        deltas (or a newer anchor) into the live weights. Raises on failure (the caller backs off);
        the engine keeps the weights it had.

        Deltas are written as soon as their payloads verify; the signed hash of the resulting state
        is checked in the background while the worker generates (``check="background"``), and
        :meth:`_weights_verified` holds the cohort's upload until it passed."""
        assert self.engine is not None and self.sub is not None
        problems: list[str] = []

        def write(state: dict) -> tuple[int, list[str]]:
            res = self.sub.sync((self.engine.version, state), apply_inplace=True, version=version, check="background")
            self.sync_bytes += res.bytes_read
            problems.extend(res.problems)
            self._check = res.check
            if not res.inplace:
                raise WorkerExit(EXIT_CONFIG, f"version {res.version} changes the weight layout; restart the worker")
            return res.version, res.changed_names

        self.engine.update_inplace(write)
        for p in problems:
            log.warning("weight sync: %s", p)

    def _weights_verified(self, version: int | None) -> bool:
        """Whether the weights the last cohort was generated with passed their background hash
        check (waiting for it). If not, they are repaired from the store (verified before writing)
        and False tells the caller to drop that cohort."""
        check, self._check = self._check, None
        if check is None:
            return True
        try:
            return check.wait()
        except SYNC_ERRORS as e:
            log.error("the weights of version %d did not verify after the in-place update (%s); dropping the "
                      "cohort generated with them and repairing the weights from the store", check.version, e)
            self._repair = True  # until a sync succeeds, nothing is generated with these weights
            self._sync(version)
            self._repair = False
            return False

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> int:
        old = {s: signal.signal(s, self.request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        code = EXIT_OK
        try:
            code = self._run()
        except WorkerExit as e:
            log.error("%s", e.message)
            code = e.code
        except KeyboardInterrupt:
            self._stop_reason = "stopped at once by a second Ctrl-C (the cohort in progress was dropped)"
        finally:
            kept = ""
            if self.engine is not None:
                try:
                    self._beat("stopped")
                except Exception as e:  # a dying store must not hide the real exit reason
                    log.warning("could not write the final heartbeat: %s", e)
                kept = self._save_kept()
            for s, h in old.items():
                signal.signal(s, h)
        if self.engine is not None:
            try:
                log.info("%s", self.progress_line())
            except Exception:  # noqa: BLE001 - a last report must not change the exit
                pass
        if code == EXIT_OK:
            log.info("%s: %d batches (%d episodes) uploaded this session as %s (key %s)%s", self._stop_reason or
                     "done", self.batches, self.episodes, self.worker_id, self.key_id, f"; {kept}" if kept else "")
        return code

    def _run(self) -> int:
        from stoa.backends.engine import RolloutRequest
        import stoa.envs

        got = self._fetch_run()
        if got is None:
            return EXIT_OK
        cfg, model_dir = got
        log.info("run %s: env %s%s, kwargs %s; model files verified in %s", self.run_name, cfg.env.id,
                 f" (imports module {cfg.env.module!r})" if cfg.env.module else "",
                 json.dumps(cfg.env.kwargs, sort_keys=True)[:500], model_dir)
        try:
            import_env_module(cfg.env)
        except Exception as e:
            raise WorkerExit(EXIT_CONFIG, f"the run's environment module cannot be imported here: "
                                          f"{type(e).__name__}: {e}") from None
        self.sub = WeightSubscriber(self.store, self.run_name, self.public_key)
        rc = cfg.rollout
        res = self._first_weights(rc)
        if res is None:
            return EXIT_OK
        self.engine = self.make_engine(model_dir, res.state, res.version, rc)
        refused = join_check(self.engine, model_dir)  # this machine's framework may read the config otherwise
        if refused:
            raise WorkerExit(EXIT_CONFIG, refused)
        log.info("worker %s (key %s) joined run %s at version %d (%s mode, %d bytes); a progress line every %.0fs",
                 self.worker_id, self.key_id, self.run_name, res.version, self.engine.mode, res.bytes_read,
                 self.progress_every)
        make_env = lambda: stoa.envs.make(cfg.env.id, split=cfg.env.train_split, **cfg.env.kwargs)
        n_items = len(make_env().unwrapped)
        writer: RolloutWriter | None = None
        roster_read = 0.0
        cohorts_at: dict[int, int] = {}
        pending: tuple[list, int, int] | None = None  # a cohort whose upload failed: retried first
        self._last_progress = time.time()
        while not self._stop and (self.max_batches is None or self.batches < self.max_batches):
            if self.max_seconds is not None and time.time() - self._started > self.max_seconds:
                self._stop_for(f"time limit of {self.max_seconds / 3600:.2f} h reached")
                break
            try:
                if writer is None:
                    writer = self.writer = RememberingWriter(self.store, self.run_name, self.worker_id, self.private_key,
                                                             SequenceFile(self.cache_dir / "sequence.json"))
                if pending is not None:
                    try:
                        self._upload(writer, *pending, cohorts_at)
                    except SequenceTaken as e:
                        log.warning("%s; dropping the cohort made for it", e)
                    pending = None
                    continue
                if self._finished():
                    self._stop_for("the run finished")
                    break
                if time.time() - roster_read > _ROSTER_EVERY_S:
                    stop = self._roster_says()
                    if stop is not None:
                        raise stop
                    moved = catch_up(writer, self.store, self.run_name, self.public_key)
                    if moved:
                        log.warning("%s", moved)
                    roster_read = time.time()
                head = self.sub.head()
                self._head = head
                if head is not None and (head - rc.lag > self.engine.version or head < self.engine.version
                                         or self._repair):
                    self._sync(head - rc.lag if rc.lag else None)
                    self._repair = False
                self._recovered()
                self._maybe_progress()
                if ((rc.cohorts_per_version and cohorts_at.get(self.engine.version, 0) >= rc.cohorts_per_version)
                        or (rc.max_outstanding and self._outstanding(writer) >= rc.max_outstanding)):
                    self._beat("waiting")
                    self._sleep(rc.poll_seconds)
                    continue
                writer.skip_taken()  # a number someone planted ahead of us costs no cohort
            except WorkerExit:
                raise
            except (*SYNC_ERRORS, SignatureError, OSError) as e:
                self._backoff("talking to the store", e)
                continue
            # The work of our next sequence number is assigned (stoa.fleet.trust.assign): items, group ids, seed.
            seq = writer.next_seq
            work = self.assigned(cfg.seed, writer.key_id, seq, n_items, rc.groups_per_cohort)
            requests = [RolloutRequest(i, g, rc.group_size) for i, g in zip(work.items, work.group_ids)]
            sampling = self.sampling(rc, work.seed)
            t0 = time.time()
            episodes = self.finish_cohort(self.engine.rollout(make_env, requests, sampling))
            dt = max(time.time() - t0, 1e-9)
            try:
                if not episodes or not self._weights_verified(self.engine.version if rc.lag else None):
                    continue  # the number stays ours: its work is made again with repaired weights
                self.episodes_per_s = len(episodes) / dt
                self.tokens_per_s = sum(e.num_model_tokens for e in episodes) / dt
                pending = (episodes, self.engine.version, seq)
                self._upload(writer, *pending, cohorts_at)
                pending = None
                self._recovered()
            except SequenceTaken as e:  # someone planted an object at our number: its work is void
                log.warning("%s; dropping the cohort made for it", e)
                pending = None
            except WorkerExit:
                raise
            except (*SYNC_ERRORS, SignatureError, OSError) as e:
                self._backoff("uploading a batch" if pending is not None else "repairing the weights", e)
        if self._stop and not self._stop_reason:
            self._stop_reason = "stopped"
        if self.max_batches is not None and self.batches >= self.max_batches:
            self._stop_reason = self._stop_reason or f"uploaded the {self.max_batches} batches asked for"
        return EXIT_OK

    def sampling(self, rc: Any, seed: int) -> Any:
        """How a cohort samples: the run's settings, the assigned seed (an adversary may override it)."""
        from stoa.backends.engine import SamplingConfig

        return SamplingConfig(temperature=rc.temperature, top_p=rc.top_p, max_turn_tokens=rc.max_turn_tokens,
                              max_episode_tokens=rc.max_episode_tokens, seed=seed)

    def assigned(self, run_seed: int, key_id: str, seq: int, n_items: int, groups: int) -> Assignment:
        """The work this key owes as sequence number ``seq`` (an adversary may override it): salted
        once the run has published this key's salt, probation work until then (trust.assign)."""
        if self._salt is None and time.time() - self._salt_read > 2.0:
            self._salt_read = time.time()
            try:
                self._salt = read_salt(self.store, self.run_name, key_id, self.public_key)
            except (SignatureError, StoreError) as e:  # probation work meanwhile: checked, never trained on
                log.warning("this key's assignment salt does not read (%s); making probation work", e)
        return assignment(run_seed, key_id, seq, n_items, groups, self._salt)

    def _upload(self, writer: RolloutWriter, episodes: list, version: int, seq: int,
                cohorts_at: dict[int, int]) -> None:
        writer.upload(episodes, version, seq=seq)  # a retry after a failure finds its own object, never a duplicate
        cohorts_at[version] = cohorts_at.get(version, 0) + 1
        self.batches += 1
        self.episodes += len(episodes)
        self._beat("generating")
