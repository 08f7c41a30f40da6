"""The trainer process: validated episodes in, optimizer steps, PULSE versions out.

Loop (``stoa trainer CONFIG --store URL``)::

    check that the learner, the int8 scorer and the engine run one model (stoa.fleet.parity)
    publish the run (signed config + model files); warm start (optional); publish version 0
    evaluate version 0 with the int8 policy
    until trainer.steps RL steps:
        poll new episode batches (validated; bad ones quarantined with a reason)
        pool whole groups; drop groups older than max_lag versions (staleness gate) and groups
            already trained on (reuse gate)
        when groups_per_step groups are ready: advantages -> objective step -> version += 1
        quantize the new weights to int8 and publish them (a delta, or an anchor every K)
        evaluate every eval.every versions; checkpoint every trainer.checkpoint_every steps
    evaluate and checkpoint the final version; mark the run finished

SIGINT, SIGTERM or SIGHUP (:meth:`Trainer.request_stop`) stops it after the current step: it writes
the trust report and a checkpoint and returns without marking the run finished, so ``--resume``
continues it (a second SIGINT stops at once). In ``stoa trainer`` the wait is bounded
(:mod:`stoa.fleet.lifetime`): a step still running :data:`~stoa.fleet.lifetime.STOP_BOUND_S` seconds
after the signal is abandoned, and ``--resume`` redoes it from the newest checkpoint.

Versions are publication counters: version v is the policy after v weight updates *as
published*. After a crash the trainer resumes from its newest checkpoint and publishes the next
version above the checkpoint's, the store's head and the newest version its run folder recorded
as published (:mod:`stoa.fleet.trainer.publishing`: the store is not trusted, so a deleted or rolled-back
pointer never makes a label repeat), and re-delivers exactly the batches
its checkpoint had not trained on (``RolloutReader.state(pending=...)``): no episode is lost or
counted twice. ``<run_dir>/ledger.jsonl`` records the fate of every group (trained at which step,
or dropped and why) and a marker per checkpoint; on resume it is cut back to the checkpoint's
marker, so it always describes exactly the training the current weights contain.

Under ``torchrun`` (several ranks, Megatron learner) this loop runs on rank 0 alone and its
learner calls are mirrored to the other ranks (:mod:`stoa.fleet.trainer.distributed`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from stoa.errors import ExpectedFailure
from stoa.fleet import lifetime
from stoa.fleet.config import RunConfig
from stoa.fleet.intake import Intake, Taken
from stoa.fleet.metrics import MetricsSink, peak_rss_mib
from stoa.fleet.parity import check_floor, check_trainer
from stoa.fleet.run import delete_heartbeat, publish_run, read_heartbeats
from stoa.fleet.trainer.fleetwatch import FleetWatch, store_metrics
from stoa.fleet.trainer.learning import learn_step, successes
from stoa.fleet.task import import_env_module
from stoa.fleet.trainer.policies import HeldPolicies
from stoa.fleet.trainer.publishing import PublishedRecord, next_version, publish_once
from stoa.fleet.trust.admission import episode_metric_means
from stoa.fleet.trust.ledger import Ledger
from stoa.transport import layout
from stoa.transport.chain import PublishResult, WeightPublisher
from stoa.transport.exchange import mark_finished
from stoa.transport.signing import SignatureError, read_signed, sign_document
from stoa.transport.store import ObjectStore
from stoa.types import Episode

if TYPE_CHECKING:
    from stoa.fleet.outer.coordinator import Coordinator
    from stoa.fleet.trainer.distributed import Ranks

__all__ = ["StartRefused", "Trainer", "eval_metrics", "learn_step", "peak_rss_gib", "prepare_model", "successes"]

log = logging.getLogger("stoa.trainer")

WATCH_IDLE_S = 5.0
"""While it waits for rollouts, the trainer looks at its fleet's heartbeats this often (and after every step)."""


def peak_rss_gib() -> float:
    """This process's own peak resident memory so far, in GiB (:func:`stoa.fleet.metrics.peak_rss_mib`)."""
    return round(peak_rss_mib() / 1024, 3)


class StartRefused(ExpectedFailure, RuntimeError):
    """This start would clobber a live run (weights already published, or published under
    another key); nothing was written to the store."""


def prepare_model(cfg: RunConfig, run_dir: Path) -> Path:
    """The run's starting HF folder: ``model.path``, or a tiny model built (deterministically) for
    the task, its tokenizer trained on the environment's ``tokenizer_texts()``."""
    if cfg.model.path:
        from stoa.models.hfconfig import load

        path = Path(cfg.model.path).expanduser()
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.path {path} is not a Hugging Face folder (no config.json)")
        load(path)  # refuses a model some stack would not run as written (ModelConfigError)
        return path
    out = run_dir / "model"
    if (out / "model.safetensors").exists():
        return out
    from stoa.models.tiny import build_tiny

    import_env_module(cfg.env)
    env = cfg.env.make(cfg.env.train_split).unwrapped
    texts = env.tokenizer_texts()
    if texts is None:
        raise ValueError(f"{cfg.env.id} supplies no tokenizer_texts(), so no tiny model can be built for it; "
                         "set model.path to a Hugging Face folder")
    tmp = run_dir / ".model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny(tmp, texts, dataclasses.replace(cfg.model.tiny, seed=cfg.seed + cfg.model.tiny.seed))
    tmp.replace(out)
    return out


def eval_metrics(episodes: list[Episode], samples: int, success_metric: str | None,
                 metric_types: dict[str, Any]) -> dict[str, float]:
    """pass@1 (mean success over every sample), pass@k (any of the k samples of an item), mean
    reward, and the mean of every declared numeric or bool metric of the evaluation episodes; a
    metric that only some episodes carry (a mixture's ``correct_<task>``) also gets its count, as
    ``eval/<metric>.n`` (what an interval on its mean needs)."""
    ok = successes(episodes, success_metric)
    by_q: dict[str, list[float]] = {}
    for e, v in zip(episodes, ok):
        by_q.setdefault(e.group_id, []).append(v)
    means = episode_metric_means(episodes, metric_types, "eval")
    counts = {f"{k}.n": float(n) for k in means
              if (n := sum(k[len("eval/"):] in e.metrics for e in episodes)) < len(episodes)}
    return {
        "eval/pass@1": float(ok.mean()),
        f"eval/pass@{samples}": float(np.mean([max(v) for v in by_q.values()])),
        "eval/mean_reward": float(np.mean([e.reward for e in episodes])),
        "eval/questions": float(len(by_q)),
        **means, **counts,
    }


@dataclass
class _Counters:
    episodes_trained: int = 0
    groups_trained: int = 0
    zero_variance_groups: int = 0
    flat_steps: int = 0  # steps in a row (up to the last) without a group whose rewards differ
    no_signal_steps: int = 0
    failed_steps: int = 0
    staleness: dict[str, int] = field(default_factory=dict)


class Trainer:
    """One run's trainer. ``run()`` does everything; see the module docstring.

    Args:
        cfg: the run config.
        store: the object store the fleet meets in.
        run_dir: local folder for checkpoints, metrics, logs and the built model.
        private_key: the run's ed25519 signing key.
        resume: continue from the newest checkpoint in ``run_dir`` (if any).
        on_row: called with every metrics row (for a live view).
        ranks: under torchrun, rank 0's :class:`stoa.fleet.trainer.distributed.Ranks` (the learner's
            calls are mirrored to the other ranks); None in a single process.
        outer_secret: with ``[outer] trainers > 1``, the secret the run's trainers share
            (:func:`stoa.fleet.outer.exchange.read_secret`); this trainer is their coordinator.
    """

    def __init__(self, cfg: RunConfig, store: ObjectStore, run_dir: Path, private_key: Any, resume: bool = False,
                 on_row: Callable[[dict], None] | None = None, ranks: Ranks | None = None,
                 outer_secret: bytes | None = None):
        self.cfg, self.store, self.run_dir = cfg, store, Path(run_dir)
        self.fleet = FleetWatch(cfg.trainer.silent_after_s)
        self._watched = 0.0
        self.ranks = ranks
        self.run_name = cfg.name
        self.key = private_key
        self.resume = resume
        self.on_row = on_row
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(cfg.to_json() + "\n")
        self.sink = MetricsSink(self.run_dir)
        self.published = PublishedRecord(self.run_dir)  # trusted: what this trainer has published
        self.ledger = Ledger(self.run_dir / "ledger.jsonl", lambda: {"rl_step": self.rl_step, "version": self.version})
        self.counters = _Counters()
        self.version = 0
        self.rl_step = 0
        self.state: dict[str, np.ndarray] | None = None
        self.quantize_s = 0.0  # export + quantize seconds of the last publish
        self._t0 = time.time()
        self._stop = False
        self._signals = 0
        self.outer: Coordinator | None = None
        self.outer_secret = outer_secret

    def request_stop(self, signum: Any = None, *_: Any) -> None:
        """Stop after the current step (a signal handler; a second SIGINT stops at once)."""
        self._signals += 1
        if signum is not None:
            lifetime.stop_requested()  # in `stoa trainer`: exit within the bound even mid-step
        if self._signals > 1 and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self._stop and signum is not None:
            log.warning("stopping after the current step: a checkpoint, no finished marker "
                        "(Ctrl-C again to stop at once)")
        self._stop = True

    # -- helpers ------------------------------------------------------------------------------
    def _log(self, kind: str, **metrics: Any) -> dict:
        row = self.sink.log(kind, self.version, **metrics)
        if self.on_row:
            self.on_row(row)
        return row

    def _make_env(self, split: str, **over: Any):
        return self.cfg.env.make(split, **over)

    def _learner_config(self, **over: Any):
        lc = self.cfg.learner.config
        threads = self.cfg.trainer.threads or lc.threads
        return dataclasses.replace(lc, **{"seed": self.cfg.seed, "threads": threads, **over})

    # -- phases -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from stoa.backends.learner import make_learner

        cfg = self.cfg
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and self.ranks is None:
            raise RuntimeError("under torchrun the trainer runs through stoa.fleet.trainer.distributed.run_ranks "
                               "(as `stoa trainer` does), which makes every rank follow rank 0")
        import_env_module(cfg.env)
        task = self._make_env(cfg.env.train_split).unwrapped
        self.metric_types = dict(task.metric_types)
        self.success_metric = task.success_metric
        self.publisher = WeightPublisher(self.store, self.run_name, self.key, anchor_every=cfg.pulse.anchor_every)
        checkpoint = self._checkpoint_to_resume()  # refuses a second start of a live run before writing anything
        self._log("event", event="started", headline=list(task.headline_metrics), success_metric=self.success_metric)
        self.model_dir = prepare_model(cfg, self.run_dir)
        options = dataclasses.asdict(cfg.learner.megatron) if cfg.learner.kind == "megatron" else {}
        build = self.ranks.make_learner if self.ranks else make_learner  # all ranks build theirs with rank 0
        self.learner = build(cfg.learner.kind, self.model_dir, self._learner_config(), **options)
        self.policies = HeldPolicies(self.model_dir, cfg.rollout, cfg.trainer.max_lag, self.run_dir / "held",
                                     chain=self.publisher.subscriber, scorer=cfg.trainer.int8_scorer,
                                     device=self.learner.config.device, dtype=cfg.pulse.dtype,
                                     prompt_format=cfg.model.prompt_format)
        got = check_trainer(self.model_dir, self.learner, cfg.rollout, self.policies.scorer,
                            self.learner.config.device, cfg.pulse.dtype,
                            cfg.model.prompt_format)  # refuses before anything is published
        self._log("event", event="parity", scorer=self.policies.scorer, **got.metrics())
        publish_run(self.store, self.run_name, cfg, self.model_dir, self.key)
        extra = self._resume(checkpoint) if checkpoint else self._start()
        self.intake = Intake(cfg, self.store, self.key, vocab_size=self.learner.vocab_size,
                             metric_types=self.metric_types, ledger=self.ledger, float_scorer=self.learner,
                             int8=self.policies, make_env=lambda: self._make_env(cfg.env.train_split),
                             event=lambda **row: self._log("event", **row), roster_copy=self.run_dir / "roster")
        if extra is not None:
            self.intake.restore(extra["intake"])
        else:
            self.evaluate()
        if cfg.outer.active:
            self.outer = self._coordinator()
        while self.rl_step < cfg.trainer.steps and not self._stop:
            if not self.step():
                if self.ranks:
                    self.ranks.idle()  # a heartbeat keeps the other ranks' wait under the collective timeout
                if time.time() - self._watched >= WATCH_IDLE_S:
                    self._watch_fleet()  # a trainer waiting on rollouts still says which workers went silent
                time.sleep(cfg.trainer.poll_seconds)
        if self._stop:
            return self._stopped()
        if not self._evaluated(self.version):
            self.evaluate()
        self.intake.report(self.version, force=True)  # the report's last word is the final version
        self.checkpoint()
        mark_finished(self.store, self.run_name, self.key, self.version)
        summary = self._log("event", event="finished", seconds=time.time() - self._t0, **asdict(self.counters),
                            **asdict(self.intake.counters))
        self.sink.close()
        return summary

    def _coordinator(self) -> Coordinator:
        """Rank 0 of ``[outer]``'s trainers (:mod:`stoa.fleet.outer.coordinator`), its round open at this version."""
        import secrets

        from stoa.fleet.outer.coordinator import Coordinator
        from stoa.fleet.outer.exchange import OuterExchange

        if self.cfg.outer.trainers > 1 and not self.outer_secret:
            raise ExpectedFailure("[outer] trainers > 1 needs the run's outer secret (stoa trainer --outer-secret)")
        exchange = OuterExchange(self.store, self.run_name, self.outer_secret or secrets.token_bytes(32),
                                 self.key.public_key(), self.key)

        def refuse(taken: Taken, error: Exception) -> None:
            log.warning("learner step failed (%s: %s); finding the batch to blame", type(error).__name__, error)
            self.intake.settle(taken, error)
            self.counters.failed_steps += 1

        coordinator = Coordinator(self.cfg.outer, exchange, self.learner, self._learn, refuse,
                                  lambda **row: self._log("event", **row))
        coordinator.begin(self.version)
        return coordinator

    def _stopped(self) -> dict[str, Any]:
        """End of a stopped run: what ``--resume`` needs, and no finished marker (workers wait)."""
        for taken in self.outer.abandon() if self.outer is not None else []:
            self.intake.put_back(taken)
        self.intake.report(self.version, force=True)
        self.checkpoint()
        summary = self._log("event", event="stopped", rl_step=self.rl_step, seconds=time.time() - self._t0,
                            **asdict(self.counters), **asdict(self.intake.counters))
        self.sink.close()
        return summary

    def _start(self) -> None:
        """A fresh run: the warm start (if any), then the first version published."""
        from stoa.fleet.trainer.warmstart import warm_start

        self.ledger.cut(None)  # nothing of an earlier attempt survives without a checkpoint
        if self.cfg.warmstart.steps or self.cfg.warmstart.practice_steps:
            warm_start(self.cfg, self.learner, self.model_dir, self._make_env,
                       lambda keep_state=False, **over: self.learner.reset_optimizer(self._learner_config(**over),
                                                                                      keep_state),
                       lambda **row: self._log("warmstart", **row))
        self.learner.reset_optimizer(self._learner_config())
        # --resume without a checkpoint: start over, but never reuse a version
        self.version, lost = next_version(self.published, None, self.publisher.head())
        self._store_lost(lost)
        self._publish()

    def _publish(self, **metadata: Any) -> PublishResult:
        """Quantize the learner's weights to int8, publish them as ``self.version``, hold them for
        spot-checks (:func:`stoa.fleet.trainer.publishing.publish_once`: a label is used once)."""
        from stoa.transport.quant import quantize_state

        t0 = time.perf_counter()
        # One float tensor on the host at a time (a whole float copy is 4 bytes a parameter).
        self.state = quantize_state(self.learner.iter_weights(self.cfg.pulse.dtype), previous=self.state)
        self.quantize_s = time.perf_counter() - t0
        return publish_once(self.published, self.publisher, self.policies, self.version, self.state,
                            {"rl_step": self.rl_step, **metadata})

    def _store_lost(self, lost: str | None) -> None:
        if lost:
            log.warning("%s", lost)
            self._log("event", event="store_lost_versions", detail=lost)

    def _evaluated(self, version: int) -> bool:
        """Whether ``version``'s evaluation is in the store *and* verifies under the run's key."""
        key = layout.evaluation(self.run_name, version)
        try:
            body = read_signed(self.store, key, "eval", self.key.public_key(),
                               expect={"run": self.run_name, "version": version})
        except SignatureError as e:  # a planted or corrupted marker: evaluate again (and overwrite it)
            log.warning("ignoring %s: %s", key, e)
            return False
        return body is not None

    def evaluate(self) -> dict[str, float]:
        """Held-out pass@1 / pass@k / task metrics of the current int8 state (what workers run)."""
        from stoa.backends.engine import RolloutRequest

        cfg, ev = self.cfg, self.cfg.eval
        t0 = time.time()
        engine = self.policies.engine_at(self.version)
        make_env = lambda: self._make_env(cfg.env.eval_split)
        n = min(ev.num_questions, len(make_env().unwrapped))
        requests = [RolloutRequest(i, f"eval-{i}", ev.samples) for i in range(n)]
        episodes = engine.rollout(make_env, requests, cfg.rollout.sampling(cfg.seed + 7919))
        m = eval_metrics(episodes, ev.samples, self.success_metric, self.metric_types)
        m["eval/seconds"] = time.time() - t0
        if (floor := self.intake.calibrate(episodes)) is not None:  # the audit's int8-versus-float floor
            m["trust/audit_floor"] = floor
            check_floor(floor)
        self.store.put(layout.evaluation(self.run_name, self.version), sign_document("eval", {
            "run": self.run_name, "version": self.version, "metrics": m}, self.key))
        self._log("eval", **m)
        log.info("eval v%d: pass@1 %.3f (%d items x %d, %.1fs)", self.version, m["eval/pass@1"], n, ev.samples,
                 m["eval/seconds"])
        return m

    # -- RL -----------------------------------------------------------------------------------
    def step(self) -> bool:
        """One RL step if enough groups are ready (with ``[outer]``, one pass of the outer round:
        :meth:`_outer_step`); returns whether a step was taken.

        Nothing a worker uploaded can make this raise: a batch that fails a check, or on which
        the learner fails, is quarantined with the reason and training goes on."""
        if self.outer is not None:
            return self._outer_step()
        taken = self.intake.take(self.version)
        if taken is None:
            return False
        t0 = time.time()
        try:
            rollout, learn = self._learn(taken)
        except Exception as e:
            log.warning("learner step failed (%s: %s); finding the batch to blame", type(e).__name__, e)
            self.intake.settle(taken, e)
            self.counters.failed_steps += 1
            return False
        self.intake.settle(taken)
        self._count(taken, rollout.pop("groups/zero_variance"))
        self._advanced([taken], rollout, learn, t0)
        return True

    def _outer_step(self) -> bool:
        """Deal or train one step's groups of the outer round (:mod:`stoa.fleet.outer.coordinator`);
        when the round is merged, settle its groups and publish the merged weights."""
        t0 = time.time()
        progressed, merge = self.outer.advance(self.version, lambda: self.intake.take(self.version))
        if merge is None:
            return progressed
        for taken in merge.trained:
            self.intake.settle(taken)
        for taken, error in merge.failed:
            self.intake.settle(taken, error)
        for taken in merge.returned:
            self.intake.put_back(taken)
        zero = int(merge.rollout.pop("groups/zero_variance", 0))
        for i, taken in enumerate(merge.trained):
            self._count(taken, zero if i == 0 else 0)
        self._advanced(merge.trained, merge.rollout, {**merge.learn, **merge.metrics}, t0, outer=merge.summary)
        return True

    def _advanced(self, takens: list[Taken], rollout: dict[str, Any], learn: dict, t0: float, **ledger: Any) -> None:
        """After the weights moved over ``takens``: publish the next version, ledger, log, evaluate, checkpoint."""
        self.rl_step += 1
        self._watch_signal(rollout)
        self.version += 1
        # what `stoa status` shows of learning, signed with the version (the manifest's metadata)
        pub = self._publish(learning={"signal_frac": rollout.get("groups/signal_frac", 0.0),
                                      "flat_steps": self.counters.flat_steps, "reward": rollout.get("reward/mean", 0.0)})
        self.ledger.write(trained=[g[0].group_id for t in takens for g in t.groups],
                          policy_versions=sorted({e.policy_version for t in takens for e in t.episodes}), **ledger)
        fleet = self._watch_fleet()
        now = time.time()
        self._log("train", rl_step=self.rl_step, **rollout, **learn,
                  **{"pulse/bytes": pub.bytes_written, "pulse/full_bytes": pub.full_state_bytes,
                     "pulse/anchor": pub.kind == "anchor", "pulse/seconds": pub.seconds,
                     "pulse/quantize_s": self.quantize_s,
                     "time/step_s": now - t0, "time/elapsed_s": now - self._t0,
                     "throughput/episodes_per_s": self.counters.episodes_trained / (now - self._t0),
                     "memory/peak_rss_gib": peak_rss_gib()},
                  **fleet, **store_metrics(self.store), **self.intake.metrics())
        self.intake.report(self.version)
        if self.version % self.cfg.eval.every == 0 and self.rl_step < self.cfg.trainer.steps:
            self.evaluate()
        if self.rl_step % self.cfg.trainer.checkpoint_every == 0 and self.rl_step < self.cfg.trainer.steps:
            self.checkpoint()

    def _watch_fleet(self) -> dict[str, float]:
        """Read the heartbeats, log what changed in the fleet as events; returns the ``fleet/*`` metrics."""
        beats, _ = read_heartbeats(self.store, self.run_name)
        self._watched = time.time()
        fleet, changes = self.fleet.see(beats, self._watched)
        for change in changes:
            self._log("event", **change)
        for wid in self.fleet.forget(beats, self._watched):  # left long ago: its heartbeat goes
            delete_heartbeat(self.store, self.run_name, wid)
        return fleet

    def _learn(self, taken: Taken) -> tuple[dict[str, Any], dict]:
        """Advantages and one learner step over ``taken``; returns (rollout metrics, learner metrics).

        Raises whatever the learner raises (the caller has the intake find the batch to blame)."""
        tc = self.cfg.trainer
        split = self._mismatch if tc.mismatch_every and (self.rl_step + 1) % tc.mismatch_every == 0 else None
        return learn_step(self.cfg, self.learner, taken.episodes, self.version, self.success_metric,
                          self.metric_types, split)

    def _watch_signal(self, rollout: dict[str, Any]) -> None:
        """Count steps in a row whose every group had equal rewards, and say so in plain words after
        ``trainer.warn_flat_steps`` of them (and at each doubling): such a run learns nothing."""
        c, every = self.counters, self.cfg.trainer.warn_flat_steps
        if rollout["groups/signal_frac"] > 0:
            if every and c.flat_steps >= every:
                self._log("event", event="learning_signal_back", after_steps=c.flat_steps)
            c.flat_steps = 0
            return
        c.flat_steps += 1
        c.no_signal_steps += 1
        rollout["groups/flat_steps"] = c.flat_steps
        n = c.flat_steps
        if not every or n < every or (n // every) & (n // every - 1) or n % every:
            return
        self._log("event", event="no_learning_signal", steps=n, reward=rollout["reward/mean"])
        log.warning("no learning signal for %d steps in a row: in every group all episodes got the same reward "
                    "(mean %.3f), so every advantage was 0 and the weights did not move. RL cannot reinforce "
                    "what the policy never samples: check the version-0 evaluation (does it ever succeed, or "
                    "ever use the behaviour RL should find?), the warm start, rollout.temperature and "
                    "rollout.group_size.", n, rollout["reward/mean"])

    def _count(self, taken: Taken, zero_variance_groups: int) -> None:
        for lag, n in Counter(self.version - e.policy_version for e in taken.episodes).items():
            self.counters.staleness[str(lag)] = self.counters.staleness.get(str(lag), 0) + n
        self.counters.zero_variance_groups += zero_variance_groups
        self.counters.episodes_trained += len(taken.episodes)
        self.counters.groups_trained += len(taken.groups)

    def _mismatch(self, episodes: list[Episode]) -> dict[str, float]:
        """The int8 and staleness parts of the behaviour/trainer gap (``stoa.fleet.trainer.mismatch``):
        score the step's episodes with the float learner and with the int8 policy of this version."""
        from stoa.fleet.trainer.mismatch import decompose

        int8 = self.policies.score(self.version, episodes)
        if int8 is None:  # the current version is always held; a lost one leaves the split out
            return {}
        return decompose(episodes, self.learner.logprobs(episodes, temperature=None), int8)

    # -- checkpoints --------------------------------------------------------------------------
    def checkpoint(self) -> Path:
        """Learner checkpoint + the exact consumed-rollout bookkeeping (pending batches left unconsumed)."""
        ckdir = self.run_dir / "checkpoints"
        ckdir.mkdir(exist_ok=True)
        path = ckdir / f"v{self.version:012d}"
        if path.exists():
            return path
        intake = self.intake.state()
        extra = {"version": self.version, "rl_step": self.rl_step, "counters": asdict(self.counters), "intake": intake}
        self.learner.save_checkpoint(path, extra)
        self.ledger.write(checkpoint=path.name)
        for old in sorted(ckdir.glob("v*"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        self.intake.prune(intake)
        return path

    def _checkpoint_to_resume(self) -> Path | None:
        """The newest checkpoint when resuming; refuses (before anything is written) a start
        without ``--resume`` of a run that already has published weights."""
        ckdir = self.run_dir / "checkpoints"
        cks = sorted(p for p in ckdir.glob("v*") if p.is_dir()) if ckdir.exists() else []
        if self.resume and cks:
            if self.cfg.outer.active:
                raise StartRefused("--resume of a run with [outer] steps is not supported yet (the outer momentum "
                                   "and error feedback are not checkpointed); start a new run")
            return cks[-1]
        from stoa.transport.chain import ChainError

        try:
            head = self.publisher.head()
        except (ChainError, SignatureError) as e:
            raise StartRefused(f"run {self.run_name!r} in this store has weights this key did not sign ({e}); "
                               "use the run's own key, or choose another run name") from None
        if not self.resume and head is not None:
            raise StartRefused(f"run {self.run_name!r} already has published weights in this store; "
                               "pass --resume to continue it, or choose another run name")
        mine = self.published.read()
        if not self.resume and mine is not None:
            raise StartRefused(f"the run folder {self.run_dir} already published version {mine.version} of "
                               f"{self.run_name!r}; pass --resume to continue it, or use another run folder")
        return None

    def _resume(self, checkpoint: Path) -> dict[str, Any]:
        """Load ``checkpoint`` and publish its weights as a version never published before."""
        extra = self.learner.load_checkpoint(checkpoint)
        self.ledger.cut(checkpoint.name)
        self.rl_step = extra["rl_step"]
        self.counters = _Counters(**extra["counters"])
        # Versions published after the checkpoint came from steps now lost; never reuse their numbers.
        self.version, lost = next_version(self.published, extra["version"], self.publisher.head())
        self._store_lost(lost)
        self._publish(resumed_from=extra["version"])
        self._log("event", event="resumed", checkpoint=checkpoint.name, rl_step=self.rl_step)
        log.info("resumed from %s at RL step %d; publishing as version %d", checkpoint.name, self.rl_step, self.version)
        return extra
