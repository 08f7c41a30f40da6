"""The worker process: int8 rollouts from the newest weights, uploaded as write-once batches.

:meth:`Worker.run` (``stoa worker --invite FILE``, or ``--store URL --run NAME --public-key KEY``)::

    fetch and verify the run (signed config + model files); import the code of its task
    join the weights (stoa.fleet.worker.follower.LiveWeights): those the last session kept in the cache,
        caught up by deltas, else the newest anchor + deltas (waiting for the first publish)
    start the rig's engine on them (stoa.fleet.worker.rig: checked against the run's model,
        wrapped by wrap_engine)
    until the run is finished, the worker is banned, a limit is reached or the user stops it:
        a batch whose upload failed is retried first
        between cohorts: heed the roster; if the pointer moved, catch the weights up (deltas
            written live, their hash checked beside); if this version already got
            rollout.cohorts_per_version cohorts from us, or too many of our batches wait for the
            trainer: wait
        make the work the next sequence number owes, as the trust layer's Duty orders it
            (stoa.fleet.trust.duty: tickets, the number's binding, the key's salt), with the
            weights brought to exactly the bound version
        play group_size samples of each with the engine
        once the weights they were made with passed their check, upload them as one batch (else
            the weights are repaired, the cohort dropped, and the number's work made again)
        heartbeat; every ~30 s a progress line

A cohort never spans a weight swap, so every episode of a batch carries one policy version.
Every batch is sealed with the worker's own key, which the trainer checks against the run's
roster (:mod:`stoa.transport.identity`).

**The store never ends a worker.** A store that fails, or holds a hostile object, costs a retry
after a capped backoff (0.5 s doubling to 60 s, jittered) with a warning line saying what failed
and what the worker keeps doing; the held weights keep serving. What ends it (exit status):

* ``0`` the run finished, ``max_batches`` were uploaded, the time limit passed, or the user
  stopped it (SIGINT / SIGTERM / SIGHUP finish the current upload first; a second SIGINT stops at
  once; in ``stoa worker`` a cohort still in progress 20 s after the signal is abandoned, exit
  ``143``: its batch never committed, and the next session generates that number again);
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

import contextlib
import logging
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from stoa.fleet import lifetime
from stoa.fleet.config import RunConfig
from stoa.fleet.run import Heartbeat, fetch_run, write_heartbeat
from stoa.fleet.task import EnvConfig
from stoa.fleet.trust.duty import Duty
from stoa.fleet.worker.follower import LayoutChanged, LiveWeights
from stoa.fleet.worker.invite import check_worker_id
from stoa.fleet.worker.rig import Rig, WholeModel
from stoa.fleet.worker.section import RolloutConfig
from stoa.fleet.worker.standing import (EXIT_BANNED, EXIT_CONFIG, EXIT_NO_RUN, EXIT_OK, EXIT_UNREACHABLE, WorkerExit,
                                        find_runs, import_task, roster_word, trainer_view)
from stoa.transport.chain import SYNC_ERRORS, PointerError, SyncResult
from stoa.transport.exchange import RolloutWriter, SequenceTaken, is_finished, read_progress
from stoa.transport.identity import load_or_create_worker_key
from stoa.transport.sequence import RememberingWriter, SequenceFile, catch_up
from stoa.transport.signing import SignatureError, key_id, load_public_key
from stoa.transport.store import KeyNotFound, ObjectStore, StoreError

if TYPE_CHECKING:
    from stoa.backends.engine import RolloutEngine, RolloutRequest, SamplingConfig
    from stoa.types import Episode

__all__ = ["EXIT_BANNED", "EXIT_CONFIG", "EXIT_NO_RUN", "EXIT_OK", "EXIT_UNREACHABLE", "CohortPlan", "Worker", "WorkerExit",
           "find_runs"]

log = logging.getLogger("stoa.worker")

_ROSTER_EVERY_S = 10.0
_BACKOFF_MAX_S = 60.0
_STORE_TROUBLE = (*SYNC_ERRORS, SignatureError, OSError)
"""What a failing or hostile store raises: it costs a backoff, never the session."""
_T = TypeVar("_T")

WrapEngine = Callable[["RolloutEngine", "Worker"], "RolloutEngine"]
"""``wrap_engine(engine, worker) -> engine``: see :class:`Worker`."""


@dataclass(frozen=True)
class CohortPlan:
    """The work one sequence number owes (:mod:`stoa.fleet.trust.assign`), ready for the engine."""

    seq: int
    requests: list[RolloutRequest]
    sampling: SamplingConfig
    carry: bool = False
    """Its number taken by another's object, the batch goes under the next free one (``Order.carry``)."""


@dataclass(frozen=True)
class _Batch:
    """A cohort's episodes waiting for their upload (retried first after a failure)."""

    episodes: list[Episode]
    version: int
    seq: int
    carry: bool = False


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
        wrap_engine: ``wrap_engine(engine, worker) -> engine``, the one seam for changing what the
            worker does with its engine, as a Gymnasium wrapper changes an env: the engine built
            on the joined weights (and checked against the run's model) is replaced by what this
            returns, and every rollout and every weight update goes through it
            (:class:`stoa.backends.engine.EngineWrapper` delegates whatever it does not
            override). The dishonest workers of :mod:`stoa.testing.adversaries` are wrappers; None:
            the engine as built.
        rig: the weights and engine under the loop (:mod:`stoa.fleet.worker.rig`); None: the
            whole model in one engine (a pipeline's driver brings its own).
    """

    backoff_base_s = 0.5
    """First wait after a failure; doubles per consecutive failure up to :attr:`backoff_max_s`."""
    backoff_max_s = _BACKOFF_MAX_S

    def __init__(self, store: ObjectStore, run: str, public_key: Any, worker_id: str, cache_dir: Path,
                 max_batches: int | None = None, wait_seconds: float = 600.0, private_key: Any = None,
                 max_seconds: float | None = None, progress_every: float = 30.0, keep_weights: bool = True,
                 wrap_engine: WrapEngine | None = None, rig: Rig | None = None):
        self.store, self.run_name = store, run
        self.public_key = load_public_key(public_key)
        self.worker_id, self.cache_dir = check_worker_id(worker_id), Path(cache_dir)  # before a path names it
        self.private_key = load_or_create_worker_key(self.cache_dir / "worker.key") if private_key is None else private_key
        if isinstance(self.private_key, (str, os.PathLike)):
            self.private_key = load_or_create_worker_key(self.private_key)
        self.key_id = key_id(self.private_key.public_key())
        self.max_batches, self.wait_seconds, self.max_seconds = max_batches, wait_seconds, max_seconds
        self.progress_every, self.keep_weights, self.wrap_engine = progress_every, keep_weights, wrap_engine
        self.rig: Rig = WholeModel() if rig is None else rig
        self.exit_code = EXIT_OK
        self._stop = False
        self._stop_event = threading.Event()
        self._stop_reason = ""
        self.episodes = self.batches = 0
        self.episodes_per_s = self.tokens_per_s = 0.0
        self.generated_tokens, self.generating_s = 0, 0.0  # model tokens of delivered cohorts, their rollout seconds
        self.host = socket.gethostname()
        self.writer: RememberingWriter | None = None
        self.engine: RolloutEngine | None = None
        self.weights: LiveWeights | None = None
        self._pending: _Batch | None = None  # a batch whose upload failed: retried first
        self._cohorts_at: dict[int, int] = {}  # cohorts uploaded per weight version
        self._last_status, self._last_beat = "", 0.0
        self._failures, self._trouble, self._trouble_since = 0, "", 0.0
        self._last_progress = self._roster_read = 0.0
        self._taken = 0  # the newest count of our batches taken, from a verified progress document
        self._by_number = False  # the trainer's progress says which numbers it settled: throttle on our own uploads
        self._started = time.time()
        self._signals = 0
        self.duty: Duty | None = None  # what our numbers owe (the trust layer's side: tickets, bindings, salt)

    @property
    def sync_bytes(self) -> int:
        """Bytes read from the weight chain this session."""
        return self.weights.bytes_read if self.weights is not None else 0

    # -- the story --------------------------------------------------------------------------------
    def run(self) -> int:
        """Join the run, then make and upload one cohort per turn until something ends the session
        (the module docstring says what); returns the exit status."""
        with self._session():
            joined = self._fetch_run()  # the signed run config and the model files, verified
            if joined is None:
                return self.exit_code
            cfg, model_dir = joined
            rc = cfg.rollout
            import_task(self.run_name, cfg, model_dir)  # what registers the run's task
            first = self._first_weights(cfg, model_dir)  # the kept weights caught up, else an anchor; waits for one
            if first is None:
                return self.exit_code
            self.engine = self._start_engine(model_dir, first, cfg)
            make_env, n_items = self._task(cfg.env)
            self.duty = Duty(self.store, self.run_name, self.private_key, self.public_key, run_seed=cfg.seed,
                             n_items=n_items, groups=rc.groups_per_cohort, max_lag=cfg.trainer.max_lag)
            self._last_progress = time.time()
            while self._more_to_do():
                if self._pending is not None:  # a batch whose upload failed goes first
                    self._retrying("talking to the store", self._upload_pending)
                elif self._retrying("talking to the store", self._ready, rc):
                    cohort = self._retrying("binding our next number", self._cohort, rc)
                    if cohort is not None:  # the work our next number owes, with the weights it is bound to
                        episodes, seconds = self._generate(make_env, cohort)
                        self._deliver(cohort, episodes, seconds)  # dropped if its weights failed their check
        return self.exit_code

    @contextlib.contextmanager
    def _session(self) -> Iterator[None]:
        """Around a session: SIGINT / SIGTERM ask for a stop; a :class:`WorkerExit`, a changed weight
        layout or a second Ctrl-C end it with their exit status; on the way out the final
        heartbeat, the weights kept for the next session, and a last word."""
        old = {s: signal.signal(s, self.request_stop) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        kept = ""
        try:
            yield
        except WorkerExit as e:
            log.error("%s", e.message)
            self.exit_code = e.code
        except LayoutChanged as e:
            log.error("%s; restart the worker", e)
            self.exit_code = EXIT_CONFIG
        except KeyboardInterrupt:
            self._stop_reason = "stopped at once by a second Ctrl-C (the cohort in progress was dropped)"
        finally:
            kept = self._leave()
            for s, h in old.items():
                signal.signal(s, h)
        if self.engine is not None:
            try:
                log.info("%s", self.progress_line())
            except Exception:  # noqa: BLE001 - a last report must not change the exit
                pass
        if self.exit_code == EXIT_OK:
            log.info("%s: %d batches (%d episodes) uploaded this session as %s (key %s)%s", self._stop_reason or
                     "done", self.batches, self.episodes, self.worker_id, self.key_id, f"; {kept}" if kept else "")
        if self.generating_s:
            log.info("generated %d model tokens in %.2f s of rollouts: %.1f tokens/s", self.generated_tokens,
                     self.generating_s, self.generated_tokens / self.generating_s)

    def _leave(self) -> str:
        """The final heartbeat, the weights kept for the next session (says what was kept), and
        the rig's own way out."""
        kept = ""
        if self.engine is not None and self.weights is not None:
            try:
                self.beat("stopped")
            except Exception as e:  # a dying store must not hide the real exit reason
                log.warning("could not write the final heartbeat: %s", e)
            kept = self.weights.keep()
        self.rig.leave(self)
        return kept

    # -- stopping ---------------------------------------------------------------------------------
    def request_stop(self, signum: Any = None, *_: Any) -> None:
        self._signals += 1
        if signum is not None:
            lifetime.stop_requested()  # in `stoa worker`: exit within the bound even mid-cohort
        if self._signals > 1 and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self._stop:
            self._stop_reason = self._stop_reason or "stopped by a signal"
            if signum is not None:
                log.warning("stopping: finishing the current cohort's upload (Ctrl-C again to stop at once)")
        self._stop = True
        self._stop_event.set()

    @property
    def stopped(self) -> bool:
        """Whether a stop was asked for (a signal, :meth:`stop_for`)."""
        return self._stop

    def sleep(self, seconds: float) -> None:
        self._stop_event.wait(max(0.0, seconds))

    def stop_for(self, reason: str) -> None:
        self._stop_reason = reason
        self._stop = True
        self._stop_event.set()

    def _more_to_do(self) -> bool:
        """Whether to make another cohort: not stopped, the batches asked for not all uploaded,
        the time limit not reached (otherwise the reason is noted)."""
        done = self.max_batches is not None and self.batches >= self.max_batches
        if not (self._stop or done) and self.max_seconds is not None and time.time() - self._started > self.max_seconds:
            self.stop_for(f"time limit of {self.max_seconds / 3600:.2f} h reached")
        if self._stop and not self._stop_reason:
            self._stop_reason = "stopped"
        if done:
            self._stop_reason = self._stop_reason or f"uploaded the {self.max_batches} batches asked for"
        return not (self._stop or done)

    # -- store trouble ----------------------------------------------------------------------------
    def _retrying(self, what: str, step: Callable[..., _T], *args: Any) -> _T | None:
        """``step(*args)``; a failing or hostile store costs a backoff (and None), never the session."""
        try:
            return step(*args)
        except _STORE_TROUBLE as e:
            self.backoff(what, e)
            return None

    def backoff(self, what: str, e: BaseException) -> None:
        """Note a failure and wait the next capped, jittered delay (interrupted by a stop)."""
        self._failures += 1
        if not self._trouble:
            self._trouble_since = time.time()
        self._trouble = f"{what}: {type(e).__name__}: {str(e)[:300] or 'no detail'}"
        delay = min(self.backoff_max_s, self.backoff_base_s * 2 ** min(self._failures - 1, 10)) * (0.5 + random.random())
        held = f"; keeping version {self.engine.version}" if self.engine is not None else ""
        log.warning("%s (failure %d, for %.0fs); retrying in %.1fs%s", self._trouble, self._failures,
                    time.time() - self._trouble_since, delay, held)
        if self._failures == 1 and self.engine is not None:
            with contextlib.suppress(Exception):  # the trainer sees the trouble when the store takes it
                self._last_beat = 0.0
                self.beat(self._last_status or "waiting")
        self.sleep(delay)

    def recovered(self) -> None:
        if self._trouble:
            log.info("store reachable again after %.0fs (%d failures)", time.time() - self._trouble_since,
                     self._failures)
        self._failures, self._trouble = 0, ""

    # -- reporting --------------------------------------------------------------------------------
    def beat(self, status: str) -> None:
        now = time.time()
        if status == self._last_status and status == "waiting" and now - self._last_beat < 2.0:
            return  # an idle worker reports every 2 s, not every poll
        self._last_status, self._last_beat = status, now
        e = self.engine
        stats = getattr(self.store, "stats", None)  # an S3 store counts its client's retries
        retries = int(stats.get("retries", 0)) if isinstance(stats, dict) else 0
        write_heartbeat(self.store, self.run_name, Heartbeat(
            self.worker_id, max(e.version, 0) if e else 0, status, self.episodes, self.batches, self.episodes_per_s,
            self.tokens_per_s, e.mode if e else "", self.host, time.time(), self.sync_bytes, retries,
            (self._trouble or (self.writer.trouble if self.writer else ""))[:200]))

    def progress_line(self) -> str:
        """One line: version, lag, uploads, the trainer's verdicts, speed, store state."""
        e = self.engine
        v = e.version if e is not None else None
        head = self.weights.newest if self.weights is not None else None
        lag = "?" if v is None or head is None else str(max(0, head - v))
        store = f"store trouble for {time.time() - self._trouble_since:.0f}s" if self._trouble else "store ok"
        return (f"version {v if v is not None else '-'} (lag {lag}) | {self.batches} batches uploaded | "
                f"{trainer_view(self.store, self.run_name, self.public_key, self.key_id)} | "
                f"{self.tokens_per_s:.0f} tok/s | {store}")

    def _maybe_progress(self) -> None:
        if time.time() - self._last_progress >= self.progress_every:
            self._last_progress = time.time()
            log.info("%s", self.progress_line())

    # -- joining ----------------------------------------------------------------------------------
    def _fetch_run(self) -> tuple[RunConfig, Path] | None:
        """The verified run config and model folder, waiting for them within ``wait_seconds``."""
        t0, reached, last_note = time.time(), False, 0.0
        while not self._stop:
            try:
                got = fetch_run(self.store, self.run_name, self.public_key, self.cache_dir / "model")
                self.recovered()
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
                self.sleep(2.0)
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
                self.backoff("reading the run config", e)
        return None

    def _first_weights(self, cfg: RunConfig, model_dir: Path) -> SyncResult | None:
        """The state to start from (:meth:`LiveWeights.join`, through the rig's follower), waiting
        for the trainer's first publish; None if stopped first."""
        self.weights = self.rig.weights(self, cfg, model_dir)
        lag, last_note = cfg.rollout.lag, 0.0
        while not self._stop:
            try:
                head = self.weights.head()
                if head is None:
                    if self.finished():
                        self.stop_for("the run finished before publishing weights")
                        return None
                    if time.time() - last_note > self.progress_every:
                        last_note = time.time()
                        log.info("waiting for the trainer's first weights of run %r", self.run_name)
                    self.sleep(0.5)
                    continue
                res = self.weights.join(max(0, head - lag) if lag else None)
                self.recovered()
                return res
            except PointerError as e:  # a stale or unreadable pointer: wait for the trainer's next word
                self.backoff("the run's pointer", e)
            except (*SYNC_ERRORS, OSError) as e:
                self.backoff("joining the weight chain", e)
        return None

    def _start_engine(self, model_dir: Path, first: SyncResult, cfg: RunConfig) -> RolloutEngine:
        """The rig's engine on the joined weights, wrapped by ``wrap_engine``; the weights are
        followed into it from now on."""
        engine = self.rig.engine(self, cfg, model_dir, first)
        if self.wrap_engine is not None:
            engine = self.wrap_engine(engine, self)
        assert self.weights is not None
        self.weights.live = engine
        self.recovered()
        return engine

    def _task(self, env: EnvConfig) -> tuple[Callable[[], Any], int]:
        """The factory of the run's training environment, and how many items it has."""
        make_env = lambda: env.make(env.train_split)  # noqa: E731
        return make_env, len(make_env().unwrapped)

    # -- between cohorts --------------------------------------------------------------------------
    def _ready(self, rc: RolloutConfig) -> bool:
        """Between cohorts: whether to make one now. No (after a wait) when the run finished, this
        version got ``rollout.cohorts_per_version`` cohorts from us, or ``rollout.max_outstanding``
        of our batches wait for the trainer. On the way: the roster's word (every 10 s), the
        trainer's sequence floor, and the weights caught up to the head (or repaired). The rig is
        asked first (:meth:`Rig.ready`)."""
        if not self.rig.ready(self):
            return False
        if self.writer is None:
            self.writer = RememberingWriter(self.store, self.run_name, self.worker_id, self.private_key,
                                            SequenceFile(self.cache_dir / "sequence.json"))
        if self.finished():
            self.stop_for("the run finished")
            return False
        if time.time() - self._roster_read > _ROSTER_EVERY_S:
            self._heed_roster()
        assert self.weights is not None and self.engine is not None and self.duty is not None
        if self.duty.on_probation():  # no salt yet, or standing lost: probation work, at the version followed
            self.weights.follow(rc.lag)
            at = self.engine.version
        else:  # bound work: the weights go to each number's bound version, never past it (_cohort)
            head = self.weights.head()
            at = self.engine.version if head is None else max(0, head - rc.lag)
        self.recovered()
        self._maybe_progress()
        if ((rc.cohorts_per_version and self._cohorts_at.get(at, 0) >= rc.cohorts_per_version)
                or (rc.max_outstanding and self._outstanding(self.writer) >= rc.max_outstanding)):
            self.beat("waiting")
            self.sleep(rc.poll_seconds)
            return False
        self.writer.skip_taken()  # a number someone planted ahead of us costs no cohort
        return True

    def _heed_roster(self) -> None:
        """Stop when the run's roster says so; continue at the trainer's sequence floor."""
        stop = roster_word(self.store, self.run_name, self.public_key, self.key_id, self.worker_id)
        if stop is not None:
            raise stop
        assert self.writer is not None
        moved = catch_up(self.writer, self.store, self.run_name, self.public_key)
        if moved:
            log.warning("%s", moved)
            self._outstanding(self.writer)  # the newest count taken
            self.writer.count_unsettled_as_left(self._taken)
        self._roster_read = time.time()

    def finished(self) -> bool:
        """Whether the trainer marked the run finished: only a marker that verifies under the run's
        key counts (anyone with write access to the store could plant one)."""
        return is_finished(self.store, self.run_name, self.public_key)

    def _outstanding(self, writer: RolloutWriter) -> int:
        """Own batches uploaded but not yet taken by the trainer: the numbers of our own uploads
        that the progress document does not list as settled (``writer.pending``), so objects
        others put under our id (which the writer skips, and the trainer may never settle) hold
        nothing back. A trainer whose document lists no numbers gives only counts: then numbers
        used, less those this worker left without uploading (``writer.left``: the trainer never
        settles them), less the count taken. Counted against the newest verified progress
        document this worker saw: a missing, forged or replayed older one counts as "nothing more
        taken", so the worker waits (fails closed) instead of racing on."""
        try:
            progress = read_progress(self.store, self.run_name, self.public_key)
        except SignatureError as e:
            log.warning("progress.json does not verify (%s); counting only what was taken before", e)
            progress = None
        if progress is not None:
            self._taken = max(self._taken, progress.taken.get(self.worker_id, 0))
            if progress.settled is not None:
                self._by_number = True
                writer.settle(progress)
        if self._by_number:
            return len(writer.pending)
        return max(0, writer.next_seq - getattr(writer, "left", 0) - self._taken)

    # -- one cohort -------------------------------------------------------------------------------
    def _cohort(self, rc: RolloutConfig) -> CohortPlan | None:
        """The work of our next sequence number, as the trust layer's :class:`Duty` orders it,
        with the weights brought to the version it is bound to. None (after a short wait) while
        the number is not bound yet, or when its binding can only make a stale batch (the
        numbers are then left: a gap)."""
        from stoa.backends.engine import RolloutRequest

        assert self.writer is not None and self.weights is not None and self.engine is not None
        assert self.duty is not None
        order = self.duty.next(self.writer.next_seq, self.weights.newest)
        if order.skip_to is not None:
            log.warning("%s", order.reason)
            self.writer.skip_to(order.skip_to, left=True)
            return None
        if order.work is None:
            self.beat("waiting")
            self.sleep(rc.poll_seconds)
            return None
        if order.version is not None and (self.engine.version != order.version or self.weights.damaged):
            self.weights.catch_up(order.version)
        work = order.work
        return CohortPlan(order.seq, [RolloutRequest(i, g, rc.group_size) for i, g in zip(work.items, work.group_ids)],
                          rc.sampling(work.seed), order.carry)

    def _generate(self, make_env: Callable[[], Any], cohort: CohortPlan) -> tuple[list[Episode], float]:
        """The cohort's episodes (one weight version for all) and the seconds they took."""
        assert self.engine is not None
        t0 = time.time()
        try:
            episodes = self.engine.rollout(make_env, cohort.requests, cohort.sampling)
        except OSError as e:
            if self.rig.failed(self, cohort.seq, e):  # the rig's failure: the cohort is void
                return [], 1e-9
            raise
        return episodes, max(time.time() - t0, 1e-9)

    def _deliver(self, cohort: CohortPlan, episodes: list[Episode], seconds: float) -> None:
        """Upload a cohort made with weights that passed their check. One made with weights that
        failed it is dropped (the weights are repaired first) and its number stays ours: its work
        is made again."""
        assert self.weights is not None and self.engine is not None
        if not episodes or not self._retrying("repairing the weights", self.weights.verified):
            return
        tokens = sum(e.num_model_tokens for e in episodes)
        self.episodes_per_s, self.tokens_per_s = len(episodes) / seconds, tokens / seconds
        self.generated_tokens += tokens
        self.generating_s += seconds
        self._pending = _Batch(episodes, self.engine.version, cohort.seq, cohort.carry)
        self._retrying("uploading a batch", self._upload_pending)

    def _upload_pending(self) -> None:
        """Upload the batch in hand under its number (a retry after a failure finds its own object,
        never a duplicate); a number someone else took voids its work."""
        batch, writer = self._pending, self.writer
        assert batch is not None and writer is not None
        try:
            writer.upload(batch.episodes, batch.version, seq=batch.seq)
        except SequenceTaken as e:  # someone planted an object at our number
            if not batch.carry:
                log.warning("%s; dropping the cohort made for it", e)
                self._pending = None
                return
            log.warning("%s; this new key's bound work goes under the next free number", e)
            writer.upload(batch.episodes, batch.version)
        self._pending = None
        self._cohorts_at[batch.version] = self._cohorts_at.get(batch.version, 0) + 1
        self.batches += 1
        self.episodes += len(batch.episodes)
        self.beat("generating")
        self.recovered()
