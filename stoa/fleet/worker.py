"""The worker process: int8 rollouts from the newest weights, uploaded as write-once batches.

Loop (``stoa worker --store URL --run NAME --public-key KEY``)::

    verify and read the run (signed config + model files); join from the newest anchor + deltas
    until the run is finished or a signal arrives:
        between cohorts: if the pointer moved, catch up (deltas applied live, or a newer anchor)
        if this version already got rollout.cohorts_per_version cohorts from us: wait for a newer one
        draw groups_per_cohort prompts from this worker's own seeded stream
        play group_size samples of each with the int8 engine; upload them as one batch
        heartbeat

A cohort never spans a weight swap, so every episode of a batch carries one policy version.
Every batch is sealed with the worker's own key (``--key``; by default ``<cache>/worker.key``,
made on first start), which the trainer checks against the run's roster
(:mod:`stoa.transport.identity`); a worker whose key the roster bans stops.
SIGTERM / SIGINT finish the current cohort's upload (objects appear whole or not at all) and exit.
"""

from __future__ import annotations

import hashlib
import logging
import random
import secrets
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stoa.fleet.config import import_env_module
from stoa.fleet.run import Heartbeat, fetch_run, write_heartbeat
from stoa.transport.chain import SYNC_ERRORS, StateCheck, WeightSubscriber
from stoa.transport.exchange import RolloutWriter, is_finished, read_progress
from stoa.transport.identity import load_or_create_worker_key, read_roster
from stoa.transport.signing import SignatureError
from stoa.transport.store import KeyNotFound, ObjectStore

if TYPE_CHECKING:
    from stoa.backends.engine import RolloutEngine
    from stoa.types import Episode

__all__ = ["Worker"]

log = logging.getLogger("stoa.worker")

_SYNC_ATTEMPTS = 8
"""Tries of one catch-up (backoff 0.5 s doubling to 30 s, jittered) before the worker gives up."""
_ROSTER_EVERY_S = 10.0
BANNED_EXIT = 3
"""Exit status of a worker whose key the run's roster bans."""


class Worker:
    """One rollout worker. ``run()`` loops until the run finishes, ``max_batches`` are uploaded, or a signal.

    Args:
        store: the object store of the fleet.
        run: the run name (store prefix).
        public_key: the run's ed25519 public key (hex, raw bytes, PEM or a file path).
        worker_id: unique id of this worker (``[A-Za-z0-9._-]``, 1-64 characters).
        cache_dir: local folder for the run's model files.
        max_batches: stop after this many uploads (None: until the run finishes).
        wait_seconds: how long to wait for the run's signed config to appear before giving up. Once
            it exists the trainer is alive (perhaps warm-starting for a long while): the worker then
            waits for the first weights until they come, the run finishes, or a signal arrives.
        private_key: this worker's ed25519 key (a key object or a file); None: ``cache_dir/worker.key``,
            made on first use.
    """

    def __init__(self, store: ObjectStore, run: str, public_key: Any, worker_id: str, cache_dir: Path,
                 max_batches: int | None = None, wait_seconds: float = 600.0, private_key: Any = None):
        self.store, self.run_name, self.public_key = store, run, public_key
        self.worker_id, self.cache_dir = worker_id, Path(cache_dir)
        self.private_key = load_or_create_worker_key(self.cache_dir / "worker.key") if private_key is None else private_key
        self.key_id = ""
        self.max_batches, self.wait_seconds = max_batches, wait_seconds
        self._stop = False
        self.episodes = self.batches = self.sync_bytes = 0
        self.episodes_per_s = self.tokens_per_s = 0.0
        self.host = socket.gethostname()
        self.engine: RolloutEngine | None = None
        self.sub: WeightSubscriber | None = None
        self._check: StateCheck | None = None  # the background hash check of the weights last synced
        self._last_status, self._last_beat = "", 0.0

    def request_stop(self, *_: Any) -> None:
        self._stop = True

    def _beat(self, status: str) -> None:
        now = time.time()
        if status == self._last_status and status == "waiting" and now - self._last_beat < 2.0:
            return  # an idle worker reports every 2 s, not every poll
        self._last_status, self._last_beat = status, now
        e = self.engine
        write_heartbeat(self.store, self.run_name, Heartbeat(
            self.worker_id, max(e.version, 0) if e else 0, status, self.episodes, self.batches, self.episodes_per_s,
            self.tokens_per_s, e.mode if e else "", self.host, time.time(), self.sync_bytes))

    def _wait_for(self, what: str, ready, deadline: bool = True) -> Any:
        t0 = last_log = time.time()
        while not self._stop:
            try:
                value = ready()
                if value is not None:
                    return value
            except KeyNotFound:
                pass
            if deadline and time.time() - t0 > self.wait_seconds:
                raise TimeoutError(f"waited {self.wait_seconds:.0f}s for {what} of run {self.run_name!r}")
            if not deadline and self._finished():
                return None
            if time.time() - last_log > 60:
                log.info("still waiting for %s (%.0fs)", what, time.time() - t0)
                last_log = time.time()
            time.sleep(0.5)
        return None

    def _outstanding(self, writer: RolloutWriter) -> int:
        """Own batches uploaded but not yet taken by the trainer (from its signed progress document)."""
        try:
            progress = read_progress(self.store, self.run_name, self.public_key)
        except SignatureError as e:
            log.warning("progress.json does not verify (%s); not throttling on it", e)
            return 0
        return 0 if progress is None else progress.outstanding(self.worker_id, writer.next_seq)

    def _banned(self) -> bool:
        """Whether the run's roster bans this worker's key (a roster that does not verify is ignored)."""
        try:
            ban = read_roster(self.store, self.run_name, self.public_key).banned.get(self.key_id)
        except SignatureError as e:
            log.warning("workers.json does not verify (%s); ignoring it", e)
            return False
        if ban is not None:
            log.error("this worker's key %s is banned from run %s: %s", self.key_id, self.run_name, ban.reason)
        return ban is not None

    def make_engine(self, model_dir: Path, state: dict, version: int, rc: Any) -> RolloutEngine:
        """The worker's int8 engine for the run's weights."""
        from stoa.backends.engine import EngineConfig, make_engine

        return make_engine(model_dir, rc.engine, state=state, version=version, mode=rc.engine_mode,
                           config=EngineConfig(max_batch=rc.max_batch), worker_id=self.worker_id)

    def finish_cohort(self, episodes: list[Episode]) -> list[Episode]:
        """What the worker uploads of a cohort: exactly what the engine returned. (A subclass may
        change it; ``stoa.testing.adversaries`` does, to test the trainer's checks.)"""
        return episodes

    def _finished(self) -> bool:
        """Whether the trainer marked the run finished: only a marker that verifies under the run's
        key counts (anyone with write access to the store could plant one)."""
        return is_finished(self.store, self.run_name, self.public_key)

    def _sync(self, version: int | None = None) -> None:
        """Catch up to the head (or to ``version``, for a forced lag) between cohorts, writing verified
        deltas (or a newer anchor) into the live weights. A failed sync is retried with backoff; the
        engine keeps the weights it had.

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
                raise RuntimeError(f"version {res.version} changes the weight layout; restart the worker")
            return res.version, res.changed_names

        for attempt in range(_SYNC_ATTEMPTS):
            try:
                self.engine.update_inplace(write)
                break
            except (*SYNC_ERRORS, OSError) as e:
                delay = min(30.0, 0.5 * 2 ** attempt) * (0.5 + random.random())
                log.warning("weight sync failed (%s: %s); retrying in %.1fs", type(e).__name__, e or "no detail", delay)
                if attempt == _SYNC_ATTEMPTS - 1 or self._stop:
                    raise
                time.sleep(delay)
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
            self._sync(version)
            return False

    def run(self) -> int:
        from stoa.backends.engine import RolloutRequest, SamplingConfig
        import stoa.envs

        old = {s: signal.signal(s, self.request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            got = self._wait_for("the signed run config", lambda: fetch_run(self.store, self.run_name, self.public_key,
                                                                           self.cache_dir / "model"))
            if got is None:
                return 0
            cfg, model_dir = got
            import_env_module(cfg.env)
            self.sub = WeightSubscriber(self.store, self.run_name, self.public_key)
            if self._wait_for("the first weights", self.sub.head, deadline=False) is None:
                return 0
            rc = cfg.rollout
            head = self.sub.head() or 0
            res = self.sub.sync(None, version=max(0, head - rc.lag) if rc.lag else None)
            self.sync_bytes += res.bytes_read
            self.engine = self.make_engine(model_dir, res.state, res.version, rc)
            log.info("worker %s joined run %s at version %d (%s mode, %d bytes)", self.worker_id, self.run_name,
                     res.version, self.engine.mode, res.bytes_read)
            make_env = lambda: stoa.envs.make(cfg.env.id, split=cfg.env.train_split, **cfg.env.kwargs)
            n_items = len(make_env().unwrapped)
            # Each worker draws its own prompt stream: seeded by the run seed and its id.
            wid = int.from_bytes(hashlib.sha256(self.worker_id.encode()).digest()[:8], "little")
            rng = np.random.default_rng([cfg.seed, wid])
            writer = RolloutWriter(self.store, self.run_name, self.worker_id, private_key=self.private_key)
            self.key_id, roster_read = writer.key_id, 0.0
            cohorts_at: dict[int, int] = {}
            session = secrets.token_hex(4)  # group ids stay unique across restarts of this worker id
            self._beat("generating")
            while not self._stop and (self.max_batches is None or self.batches < self.max_batches):
                if self._finished():
                    break
                if time.time() - roster_read > _ROSTER_EVERY_S:
                    roster_read = time.time()
                    if self._banned():
                        return BANNED_EXIT
                head = self.sub.head()
                if head is not None and head - rc.lag > self.engine.version:
                    self._sync(head - rc.lag if rc.lag else None)
                if ((rc.cohorts_per_version and cohorts_at.get(self.engine.version, 0) >= rc.cohorts_per_version)
                        or (rc.max_outstanding and self._outstanding(writer) >= rc.max_outstanding)):
                    self._beat("waiting")
                    time.sleep(rc.poll_seconds)
                    continue
                requests = [RolloutRequest(int(i), f"{self.worker_id}-{session}-{self.batches}-{j}",
                                           rc.group_size)
                            for j, i in enumerate(rng.integers(n_items, size=rc.groups_per_cohort))]
                sampling = SamplingConfig(temperature=rc.temperature, top_p=rc.top_p, max_turn_tokens=rc.max_turn_tokens,
                                          max_episode_tokens=rc.max_episode_tokens,
                                          seed=int(rng.integers(2**62)))
                t0 = time.time()
                episodes = self.finish_cohort(self.engine.rollout(make_env, requests, sampling))
                dt = max(time.time() - t0, 1e-9)
                if not episodes or not self._weights_verified(self.engine.version if rc.lag else None):
                    continue
                writer.upload(episodes, self.engine.version)
                cohorts_at[self.engine.version] = cohorts_at.get(self.engine.version, 0) + 1
                self.batches += 1
                self.episodes += len(episodes)
                self.episodes_per_s = len(episodes) / dt
                self.tokens_per_s = sum(e.num_model_tokens for e in episodes) / dt
                self._beat("generating")
            return 0
        finally:
            if self.engine is not None:
                try:
                    self._beat("stopped")
                except Exception as e:  # a dying store must not hide the real exit reason
                    log.warning("could not write the final heartbeat: %s", e)
            for s, h in old.items():
                signal.signal(s, h)
