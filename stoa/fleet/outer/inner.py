"""``stoa trainer --outer-rank i``: a trainer of the run that is not its coordinator.

It holds no key of the run, only its public key and the trainers' outer secret. Its loop::

    fetch the run's signed config and model files; refuse a config other than the run's
    join: the newest float base the coordinator wrote (then every merged step after it)
    until the run's finished marker:
        beat (the version it holds, the items it trained)
        train each item dealt to it for this version: one optimizer step each, its own AdamW
        after outer.inner_steps items: send theta_v - theta (int8 + error feedback, MAC'd)
        when the merged step from v appears: theta_{v+1} = theta_v + merged (the coordinator's
            own arithmetic, so every trainer holds the same weights); its residual counts only
            when the merge included it
        behind the newest base (it slept, or restarted): join again from it

Killed or late, it is dropped from the round; its items go back to the coordinator's pool and it
joins again from the store when it comes back.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from stoa.errors import ExpectedFailure
from stoa.fleet.config import RunConfig
from stoa.fleet.metrics import MetricsSink
from stoa.fleet.outer.codec import UpdateError, encode_update, fp32_bytes, l2_norm
from stoa.fleet.outer.exchange import OuterExchange
from stoa.fleet.run import fetch_run
from stoa.fleet.task import import_env_module
from stoa.fleet.trainer.learning import learn_step
from stoa.transport import tensorfile
from stoa.transport.exchange import is_finished
from stoa.transport.signing import load_public_key
from stoa.transport.store import KeyNotFound, ObjectStore

__all__ = ["ConfigMismatch", "InnerTrainer"]

log = logging.getLogger("stoa.trainer")

_BEAT_S = 0.5


class ConfigMismatch(ExpectedFailure, ValueError):
    """This trainer's config is not the run's (signed) config."""

    exit_code = 2


def _plain(row: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and math.isfinite(float(v))}


class InnerTrainer:
    """Rank ``rank`` (>= 1) of ``[outer] trainers``; ``run()`` does everything (see the module docstring)."""

    def __init__(self, cfg: RunConfig, store: ObjectStore, run_dir: Path, rank: int, public_key: Any, secret: bytes):
        if not 0 < rank < cfg.outer.trainers:
            raise ConfigMismatch(f"--outer-rank {rank} is not in 1..{cfg.outer.trainers - 1} (outer.trainers)")
        self.cfg, self.store, self.run_dir, self.rank = cfg, store, Path(run_dir), rank
        self.public_key = load_public_key(public_key)
        self.exchange = OuterExchange(store, cfg.name, secret, self.public_key)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.learner: Any = None
        self.version = -1
        self.base: dict[str, np.ndarray] = {}
        self.residual: dict[str, np.ndarray] | None = None
        self.pending: dict[str, np.ndarray] | None = None
        self.trained: dict[int, dict[str, float]] = {}
        self.failed: dict[int, str] = {}
        self.sent = False
        self.counts = {"items": 0, "updates": 0, "merges": 0, "joins": 0}
        self._beaten = 0.0
        self._stop = False

    def request_stop(self, signum: Any = None, *_: Any) -> None:
        """Stop after the current item (a signal handler); in ``stoa trainer`` within the stop bound."""
        if signum is not None:
            from stoa.fleet import lifetime

            lifetime.stop_requested()
        self._stop = True

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        import_env_module(cfg.env)
        task = cfg.env.make(cfg.env.train_split).unwrapped
        self.success_metric, self.metric_types = task.success_metric, dict(task.metric_types)
        self.sink = MetricsSink(self.run_dir, tensorboard=False, wandb=False)
        model_dir = self._fetch()
        t0 = time.time()
        if not self._join(model_dir):
            return self._end("stopped", t0)
        checked = 0.0
        while not self._stop:
            if time.time() - checked > 1.0:
                checked = time.time()
                if is_finished(self.store, cfg.name, self.public_key):
                    return self._end("finished", t0)
            if not self._tick():
                time.sleep(cfg.trainer.poll_seconds)
        return self._end("stopped", t0)

    def _end(self, how: str, t0: float) -> dict[str, Any]:
        row = self.sink.log("event", self.version, event=how, rank=self.rank, seconds=time.time() - t0, **self.counts,
                            **{f"bytes/{k}": v for k, v in self.exchange.bytes.items()})
        self.sink.close()
        return row

    # -- joining -------------------------------------------------------------------------------
    def _fetch(self) -> Path:
        """The run's model files (wait until the coordinator published them); refuse another config."""
        said = 0.0
        while True:
            try:
                run_cfg, model_dir = fetch_run(self.store, self.cfg.name, self.public_key, self.run_dir / "model")
                break
            except KeyNotFound:
                if time.time() - said > 30:
                    log.info("waiting for the run %r to be published", self.cfg.name)
                    said = time.time()
                if self._stop:
                    raise ExpectedFailure("stopped before the run was published") from None
                time.sleep(1.0)
        mine, theirs = self.cfg.to_dict(), run_cfg.to_dict()
        differ = sorted(k for k in mine if k != "objective" and mine[k] != theirs.get(k))
        if differ or mine["objective"].get("kind") != theirs["objective"].get("kind"):
            raise ConfigMismatch(f"this trainer's config differs from the run's in {differ or ['objective']}; "
                                 "every trainer of a run runs the run's config")
        return model_dir

    def _join(self, model_dir: Path | None = None) -> bool:
        """Hold the newest base's weights (build the learner from it on the first join)."""
        while not self._stop:
            newest = self.exchange.newest_base()
            if newest is not None:
                try:
                    state = self.exchange.base(newest)
                    break
                except (UpdateError, KeyNotFound) as e:  # pruned under us: the next listing has a newer one
                    log.warning("base v%d: %s", newest, e)
            self._beat(force=True)
            time.sleep(1.0)
        else:
            return False
        if self.learner is None:
            from stoa.backends.learner import make_learner

            assert model_dir is not None
            (model_dir / "model.safetensors").write_bytes(tensorfile.encode(state, {"format": "pt"}))
            lc = self.cfg.learner.config
            lc = dataclasses.replace(lc, seed=self.cfg.seed + self.rank, threads=self.cfg.trainer.threads or lc.threads)
            self.learner = make_learner(self.cfg.learner.kind, model_dir, lc)
            self.shapes = {k: tuple(v.shape) for k, v in state.items()}
        else:
            self.learner.load_weights(state)
        self.base, self.version, self.residual, self.pending = state, newest, None, None
        self._round()
        self.counts["joins"] += 1
        self.sink.log("event", newest, event="outer_joined", rank=self.rank)
        log.info("trainer %d joined at v%d", self.rank, newest)
        return True

    def _round(self) -> None:
        self.trained, self.failed, self.sent = {}, {}, False
        self._beat(force=True)

    def _beat(self, force: bool = False) -> None:
        if force or time.time() - self._beaten > _BEAT_S:
            self.exchange.beat(self.rank, self.version, len(self.trained) + len(self.failed))
            self._beaten = time.time()

    # -- the round -------------------------------------------------------------------------------
    def _tick(self) -> bool:
        ex = self.exchange
        try:
            got = ex.merged(self.version, self.shapes)
        except UpdateError as e:
            log.warning("merged step from v%d refused: %s", self.version, e)
            got = None
        if got is not None:
            meta, step = got
            if self.rank in meta["included"] and self.pending is not None:
                self.residual = self.pending
            self.pending = None
            self.base = {k: self.base[k] + step[k] for k in self.base}
            self.learner.load_weights(self.base)
            self.version = meta["to_version"]
            self.counts["merges"] += 1
            self._round()
            return True
        newest = ex.newest_base()
        if newest is not None and newest > self.version:
            return self._join()
        self._beat()
        if self.sent:
            return False
        try:
            items = ex.work(self.version, self.rank, set(self.trained) | set(self.failed), self.learner.vocab_size)
        except (UpdateError, ValueError) as e:
            log.warning("work for v%d refused: %s", self.version, e)
            return False
        for index, episodes in items:
            self._train(index, episodes)
            self._beat(force=True)
        if len(self.trained) + len(self.failed) >= self.cfg.outer.inner_steps:
            self._send()
        return bool(items)

    def _train(self, index: int, episodes: list) -> None:
        t0 = time.time()
        try:
            rollout, learned = learn_step(self.cfg, self.learner, episodes, self.version, self.success_metric,
                                          self.metric_types)
        except Exception as e:  # the coordinator's intake finds the batch to blame
            log.warning("item %d of v%d: the learner failed (%s: %s)", index, self.version, type(e).__name__, e)
            self.failed[index] = f"{type(e).__name__}: {e}"
            return
        row = _plain({**rollout, **learned})
        self.trained[index] = row
        self.counts["items"] += 1
        self.sink.log("inner", self.version, rank=self.rank, item=index, seconds=time.time() - t0, **row)

    def _send(self) -> None:
        oc = self.cfg.outer
        now = {k: np.array(v, np.float32) for k, v in self.learner.iter_weights("float32")}
        enc = encode_update({k: self.base[k] - now[k] for k in self.base}, self.residual, compress=oc.compress,
                            block=oc.block, topk=oc.topk)
        self.pending = enc.residual
        n = self.exchange.put_update(self.version, self.rank, enc, {
            "items": sorted(self.trained), "failed": {str(k): v[:500] for k, v in self.failed.items()},
            "norm": l2_norm(enc.decoded), "fp32_bytes": fp32_bytes(self.shapes),
            "metrics": [self.trained[i] for i in sorted(self.trained)]})
        self.sent = True
        self.counts["updates"] += 1
        self.sink.log("outer_update", self.version, rank=self.rank, bytes=n, fp32_bytes=fp32_bytes(self.shapes))
