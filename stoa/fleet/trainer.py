"""The trainer process: validated episodes in, optimizer steps, PULSE versions out.

Loop (``stoa trainer CONFIG --store URL``)::

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

Versions are publication counters: version v is the policy after v weight updates *as
published*. After a crash the trainer resumes from its newest checkpoint and publishes the next
version after the store's head (so versions never repeat), and re-delivers exactly the batches
its checkpoint had not trained on (``RolloutReader.state(pending=...)``): no episode is lost or
counted twice. ``<run_dir>/ledger.jsonl`` records the fate of every group (trained at which step,
or dropped and why) and a marker per checkpoint; on resume it is cut back to the checkpoint's
marker, so it always describes exactly the training the current weights contain.

Under ``torchrun`` (several ranks, Megatron learner) this loop runs on rank 0 alone and its
learner calls are mirrored to the other ranks (:mod:`stoa.fleet.distributed`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from stoa.fleet.admission import batch_problem, episode_metric_means
from stoa.fleet.config import RunConfig, import_env_module
from stoa.fleet.metrics import MetricsSink
from stoa.fleet.run import publish_run, read_heartbeats
from stoa.fleet.trust import TrustGate, scoped
from stoa.transport.chain import WeightPublisher
from stoa.transport.exchange import Batch, RolloutReader, mark_finished, write_progress
from stoa.transport.signing import SignatureError, read_signed, sign_document
from stoa.transport.store import ObjectStore
from stoa.types import Episode

__all__ = ["Trainer", "prepare_model", "eval_metrics"]

log = logging.getLogger("stoa.trainer")


def prepare_model(cfg: RunConfig, run_dir: Path) -> Path:
    """The run's starting HF folder: ``model.path``, or a tiny model built (deterministically) for
    the task, its tokenizer trained on the environment's ``tokenizer_texts()``."""
    if cfg.model.path:
        path = Path(cfg.model.path).expanduser()
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.path {path} is not a Hugging Face folder (no config.json)")
        return path
    out = run_dir / "model"
    if (out / "model.safetensors").exists():
        return out
    import stoa.envs
    from stoa.models.tiny import build_tiny

    import_env_module(cfg.env)
    env = stoa.envs.make(cfg.env.id, split=cfg.env.train_split, **cfg.env.kwargs).unwrapped
    texts = env.tokenizer_texts()
    if texts is None:
        raise ValueError(f"{cfg.env.id} supplies no tokenizer_texts(), so no tiny model can be built for it; "
                         "set model.path to a Hugging Face folder")
    tmp = run_dir / ".model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny(tmp, texts, dataclasses.replace(cfg.model.tiny, seed=cfg.seed + cfg.model.tiny.seed))
    tmp.replace(out)
    return out


def successes(episodes: list[Episode], success_metric: str | None) -> np.ndarray:
    """1.0 for each episode that solved its item (the env's ``success_metric``, else reward > 0)."""
    return np.array([bool(e.metrics.get(success_metric)) if success_metric else e.reward > 0 for e in episodes], float)


def eval_metrics(episodes: list[Episode], samples: int, success_metric: str | None,
                 metric_types: dict[str, Any]) -> dict[str, float]:
    """pass@1 (mean success over every sample), pass@k (any of the k samples of an item), mean
    reward, and the mean of every declared numeric or bool metric of the evaluation episodes."""
    ok = successes(episodes, success_metric)
    by_q: dict[str, list[float]] = {}
    for e, v in zip(episodes, ok):
        by_q.setdefault(e.group_id, []).append(v)
    return {
        "eval/pass@1": float(ok.mean()),
        f"eval/pass@{samples}": float(np.mean([max(v) for v in by_q.values()])),
        "eval/mean_reward": float(np.mean([e.reward for e in episodes])),
        "eval/questions": float(len(by_q)),
        **episode_metric_means(episodes, metric_types, "eval"),
    }


@dataclass
class _Counters:
    episodes_trained: int = 0
    groups_trained: int = 0
    dropped_stale_groups: int = 0
    dropped_reused_groups: int = 0
    dropped_malformed_groups: int = 0
    zero_variance_groups: int = 0
    future_version_batches: int = 0
    rejected_batches: int = 0
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
        ranks: under torchrun, rank 0's :class:`stoa.fleet.distributed.Ranks` (the learner's
            calls are mirrored to the other ranks); None in a single process.
    """

    def __init__(self, cfg: RunConfig, store: ObjectStore, run_dir: Path, private_key: Any, resume: bool = False,
                 on_row: Callable[[dict], None] | None = None, ranks: Any = None):
        self.cfg, self.store, self.run_dir = cfg, store, Path(run_dir)
        self.ranks = ranks
        self.run_name = cfg.name
        self.key = private_key
        self.resume = resume
        self.on_row = on_row
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(cfg.to_json() + "\n")
        self.sink = MetricsSink(self.run_dir)
        self.ledger_path = self.run_dir / "ledger.jsonl"
        self.counters = _Counters()
        self.pool: list[tuple[Batch, dict[str, list[Episode]]]] = []
        self.held: list[Batch] = []  # batches the trust gate will review again (contested groups)
        self.used_groups: set[str] = set()
        self.version = 0
        self.rl_step = 0
        self.state: dict[str, np.ndarray] | None = None
        self._recent: dict[int, dict[str, np.ndarray]] = {}  # int8 states a spot-check may need
        self._eval_engine = None
        self.trust: TrustGate | None = None
        self._t0 = time.time()

    # -- helpers ------------------------------------------------------------------------------
    def _log(self, kind: str, **metrics: Any) -> dict:
        row = self.sink.log(kind, self.version, **metrics)
        if self.on_row:
            self.on_row(row)
        return row

    def _ledger(self, **entry: Any) -> None:
        with open(self.ledger_path, "a") as f:
            f.write(json.dumps({"rl_step": self.rl_step, "version": self.version, **entry}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _make_env(self, split: str, **over: Any):
        import stoa.envs

        return stoa.envs.make(self.cfg.env.id, split=split, **{**self.cfg.env.kwargs, **over})

    def _learner_config(self, **over: Any):
        lc = self.cfg.learner.config
        threads = self.cfg.trainer.threads or lc.threads
        return dataclasses.replace(lc, **{"seed": self.cfg.seed, "threads": threads, **over})

    # -- phases -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from stoa.backends.learner import make_learner

        cfg = self.cfg
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and self.ranks is None:
            raise RuntimeError("under torchrun the trainer runs through stoa.fleet.distributed.run_ranks "
                               "(as `stoa trainer` does), which makes every rank follow rank 0")
        import_env_module(cfg.env)
        task = self._make_env(cfg.env.train_split).unwrapped
        self.metric_types = dict(task.metric_types)
        self.success_metric = task.success_metric
        self._log("event", event="started", headline=list(task.headline_metrics), success_metric=self.success_metric)
        self.model_dir = prepare_model(cfg, self.run_dir)
        publish_run(self.store, self.run_name, cfg, self.model_dir, self.key)
        options = dataclasses.asdict(cfg.learner.megatron) if cfg.learner.kind == "megatron" else {}
        build = self.ranks.make_learner if self.ranks else make_learner  # all ranks build theirs with rank 0
        self.learner = build(cfg.learner.kind, self.model_dir, self._learner_config(), **options)
        self.trust = TrustGate(cfg.trust, self.store, self.run_name, self.key, ledger=self._ledger, seed=cfg.seed)
        self.trust.refresh(force=True)
        self.reader = RolloutReader(self.store, self.run_name, vocab_size=self.learner.vocab_size,
                                    admit=self.trust.admit, require_seal=True, max_hashes=cfg.trust.max_hashes)
        self.publisher = WeightPublisher(self.store, self.run_name, self.key, anchor_every=cfg.pulse.anchor_every)
        resumed = self._maybe_resume()
        if not resumed:
            if cfg.warmstart.steps or cfg.warmstart.practice_steps:
                self.warm_start()
            self.learner.reset_optimizer(self._learner_config())
            head = self.publisher.head()  # --resume without a checkpoint: start over, but never reuse a version
            self.version = 0 if head is None else head + 1
            self._publish()
            self.evaluate()
        self._attach_trust()
        while self.rl_step < cfg.trainer.steps:
            if not self.step():
                if self.ranks:
                    self.ranks.idle()  # a heartbeat keeps the other ranks' wait under the collective timeout
                time.sleep(cfg.trainer.poll_seconds)
        if not self._evaluated(self.version):
            self.evaluate()
        self.checkpoint()
        mark_finished(self.store, self.run_name, self.key, self.version)
        summary = self._log("event", event="finished", seconds=time.time() - self._t0, **asdict(self.counters))
        self.sink.close()
        return summary

    def warm_start(self) -> None:
        """Practice in sibling tasks, then this task's habit (see ``WarmstartConfig``)."""
        from transformers import AutoTokenizer

        from stoa.fleet.warmstart import Demonstrations, answer_only, final_turn_probability

        ws, env_cfg = self.cfg.warmstart, self.cfg.env
        tok = AutoTokenizer.from_pretrained(str(self.model_dir))
        demos = Demonstrations(lambda: self._make_env(env_cfg.train_split), tok, env_cfg.id)
        for style in [ws.practice_style, *ws.mix]:
            if style not in demos.styles:
                raise ValueError(f"warmstart: {env_cfg.id} has no demonstration style {style!r}; it has {demos.styles}")
        held = Demonstrations(lambda: self._make_env(env_cfg.eval_split), tok, env_cfg.id)
        rng = np.random.default_rng([self.cfg.seed, 17])
        check = [e for e in (held.episode(int(i), ws.practice_style, rng) for i in rng.permutation(len(held))[:64]) if e]
        self.learner.reset_optimizer(self._learner_config(lr=ws.lr, schedule="constant", warmup_steps=20,
                                                          threads=ws.threads or self.cfg.trainer.threads))
        worlds: list[Demonstrations] = []
        if ws.practice_steps or ws.practice_answer_only:
            for k in range(1, ws.practice_worlds + 1):
                over = demos.env.unwrapped.practice_kwargs(k)
                if over is None:
                    raise ValueError(f"warmstart: {env_cfg.id} has no sibling tasks (practice_kwargs); "
                                     "set warmstart.practice_steps = 0 and practice_answer_only = 0")
                worlds.append(Demonstrations(lambda over=over: self._make_env(env_cfg.train_split, **over), tok,
                                             env_cfg.id))
        t0 = last_report = time.time()
        losses: list[float] = []
        total = ws.practice_steps + ws.steps
        for s in range(1, total + 1):
            if s <= ws.practice_steps:
                phase = "practice"
                batch = [worlds[w].sample(ws.practice_style, rng) for w in rng.integers(len(worlds), size=ws.batch_size)]
            else:
                phase = "habit"
                batch = demos.batch(ws.batch_size, ws.mix, rng)
                batch += [answer_only(worlds[w].sample(ws.practice_style, rng))
                          for w in rng.integers(len(worlds), size=ws.practice_answer_only)] if worlds else []
            losses.append(self.learner.sft_step(batch)["loss"])
            row = {"step": s, "of": total, "phase": phase, "loss": float(np.mean(losses)), "seconds": time.time() - t0}
            if (ws.check_every and s % ws.check_every == 0) or s in (ws.practice_steps, total):
                p = final_turn_probability(self.learner.logprobs(check), check)
                self._log("warmstart", **row, **{"warmstart/p_final_turn": p})
                log.info("warm start %d/%d (%s): loss %.3f, p(final turn) of held-out %s demonstrations %.2f",
                         s, total, phase, row["loss"], ws.practice_style, p)
                losses, last_report = [], time.time()
            elif time.time() - last_report >= 10:  # a heartbeat for non-TTY watchers; no held-out check
                self._log("warmstart", **row)
                last_report = time.time()

    def _publish(self) -> Any:
        from stoa.transport.quant import quantize_state

        weights = self.learner.export_weights(self.cfg.pulse.dtype)
        self.state = quantize_state(weights, previous=self.state)
        self._keep_state()
        return self.publisher.publish(self.version, self.state, {"rl_step": self.rl_step})

    def _keep_state(self) -> None:
        """Keep the int8 states a worker may still claim (staleness gate), for spot-checks."""
        self._recent[self.version] = self.state
        for v in [v for v in self._recent if v < self.version - self.cfg.trainer.max_lag]:
            del self._recent[v]

    def _engine(self):
        """The trainer's int8 engine (evaluation, replay's tokenizer, spot-checks), built once."""
        from stoa.backends.engine import EngineConfig, make_engine

        if self._eval_engine is None:
            rc = self.cfg.rollout
            self._eval_engine = make_engine(self.model_dir, rc.engine, state=self.state, version=self.version,
                                            mode=rc.engine_mode, config=EngineConfig(max_batch=rc.max_batch),
                                            worker_id="eval")
        return self._eval_engine

    def _int8_at(self, version: int, state: dict[str, np.ndarray]):
        """The trainer's int8 engine holding ``version`` (loaded only when it holds another one;
        versions never repeat within a run, so a version names one state)."""
        engine = self._engine()
        if engine.version != version:
            engine.load_state(version, state)
        return engine

    def _score_int8(self, version: int, episodes: list[Episode]) -> list[np.ndarray] | None:
        state = self._recent.get(version)
        return None if state is None else self._int8_at(version, state).score(episodes)

    def _attach_trust(self) -> None:
        from stoa.fleet.verify import ReplayCodec, Replayer

        rc = self.cfg.rollout
        replayer = Replayer(lambda: self._make_env(self.cfg.env.train_split), ReplayCodec.from_engine(self._engine()),
                            max_turn_tokens=rc.max_turn_tokens, max_episode_tokens=rc.max_episode_tokens)
        assert self.trust is not None
        self.trust.attach(replayer=replayer, score_float=lambda eps: self.learner.logprobs(eps, temperature=None),
                          score_int8=self._score_int8)

    def _evaluated(self, version: int) -> bool:
        """Whether ``version``'s evaluation is in the store *and* verifies under the run's key."""
        key = f"{self.run_name}/eval/v{version:012d}.json"
        try:
            body = read_signed(self.store, key, "eval", self.key.public_key(),
                               expect={"run": self.run_name, "version": version})
        except SignatureError as e:  # a planted or corrupted marker: evaluate again (and overwrite it)
            log.warning("ignoring %s: %s", key, e)
            return False
        return body is not None

    def evaluate(self) -> dict[str, float]:
        """Held-out pass@1 / pass@k / task metrics of the current int8 state (what workers run)."""
        from stoa.backends.engine import RolloutRequest, SamplingConfig

        cfg, ev = self.cfg, self.cfg.eval
        assert self.state is not None
        t0 = time.time()
        engine = self._int8_at(self.version, self.state)
        make_env = lambda: self._make_env(cfg.env.eval_split)
        n = min(ev.num_questions, len(make_env().unwrapped))
        requests = [RolloutRequest(i, f"eval-{i}", ev.samples) for i in range(n)]
        sampling = SamplingConfig(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                  max_turn_tokens=cfg.rollout.max_turn_tokens,
                                  max_episode_tokens=cfg.rollout.max_episode_tokens, seed=cfg.seed + 7919)
        episodes = engine.rollout(make_env, requests, sampling)
        m = eval_metrics(episodes, ev.samples, self.success_metric, self.metric_types)
        m["eval/seconds"] = time.time() - t0
        if self.trust is not None and cfg.trust.audit and self.trust.audit.floor is None:
            # The audit's floor: these int8 episodes scored by the float weights they were quantized from.
            m["trust/audit_floor"] = self.trust.calibrate(episodes, self.learner.logprobs(episodes, temperature=None))
        self.store.put(f"{self.run_name}/eval/v{self.version:012d}.json", sign_document("eval", {
            "run": self.run_name, "version": self.version, "metrics": m}, self.key))
        self._log("eval", **m)
        log.info("eval v%d: pass@1 %.3f (%d items x %d, %.1fs)", self.version, m["eval/pass@1"], n, ev.samples,
                 m["eval/seconds"])
        return m

    # -- RL -----------------------------------------------------------------------------------
    def _reject(self, batch: Batch, reason: str, category: str = "invalid") -> None:
        """Quarantine a batch (recorded in the reader's state, so a restart never retries it)."""
        self.reader.quarantine(batch, reason)
        self.counters.rejected_batches += 1
        if self.trust is not None:
            self.trust.reject(batch.key_id, batch.worker_id, category, reason, len(batch.episodes))
        self._ledger(rejected=batch.key, reason=reason[:500])
        log.warning("quarantined %s: %s", batch.key, reason)

    def _poll(self) -> None:
        cfg = self.cfg
        assert self.trust is not None
        self.trust.refresh()
        batches = self.reader.poll()
        self.trust.record_rejections(self.reader.last_report.rejected)
        if batches:  # what was taken, per worker (signed): workers throttle on it (rollout.max_outstanding)
            write_progress(self.store, self.run_name, self.reader.progress(), self.key)
        admitted: list[Batch] = []
        for batch in batches:
            if batch.version > self.version:
                self._reject(batch, f"policy version {batch.version} is newer than the trainer's "
                                    f"{self.version}: not produced by this run's weights")
                self.counters.future_version_batches += 1
                continue
            try:
                why = batch_problem(batch.episodes, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                    group_size=cfg.rollout.group_size, reward_range=cfg.trainer.reward_range,
                                    env_id=cfg.env.id, metric_types=self.metric_types)
            except Exception as e:  # whatever a stranger's batch breaks, it is the batch's fault
                why = f"checking the batch failed: {type(e).__name__}: {e}"
            if why:
                self._reject(batch, why)
                continue
            admitted.append(batch)
        # Identity, replay, copies and the log-prob audit (stoa.fleet.trust), then the pool.
        admitted, self.held = self.held + admitted, []
        for batch, verdict in zip(admitted, self.trust.review(admitted, self.version)):
            if verdict is not None and verdict[0] == "hold":  # a contested group: judged again next poll
                self.held.append(batch)
                continue
            if verdict is not None:
                self._reject(batch, verdict[1], verdict[0])
                continue
            groups: dict[str, list[Episode]] = {}
            for ep in batch.episodes:
                groups.setdefault(ep.group_id, []).append(ep)
            self.pool.append((batch, groups))
        for kid in self.trust.take_new_bans():  # a banned key's queued batches are never trained on
            for batch, _ in [(b, g) for b, g in self.pool if b.key_id == kid]:
                self.pool = [(b, g) for b, g in self.pool if b.key != batch.key]
                self._reject(batch, f"worker key {kid} was banned: {self.trust.records[kid].banned[:300]}", "banned")

    def _take_groups(self) -> list[tuple[Batch, list[Episode]]] | None:
        """``groups_per_step`` eligible groups (with their batch), oldest first, or None if not enough yet."""
        tc, G = self.cfg.trainer, self.cfg.rollout.group_size
        chosen: list[tuple[int, str]] = []
        dropped: dict[str, list[str]] = {"reused": [], "stale": [], "malformed": []}
        cap, per_key = self.trust.max_groups(tc.groups_per_step) if self.trust else tc.groups_per_step, Counter()
        for b_i, (batch, groups) in enumerate(self.pool):
            for gid, eps in list(groups.items()):
                sgid = scoped(batch.key_id, gid)  # group ids live in their sender's namespace
                why = ("reused" if sgid in self.used_groups else "stale" if self.version - batch.version > tc.max_lag
                       else "malformed" if len(eps) != G or len({e.sample_index for e in eps}) != G else None)
                if why:
                    dropped[why].append(sgid)
                    del groups[gid]
                elif len(chosen) < tc.groups_per_step and per_key[batch.key_id] < cap:
                    chosen.append((b_i, gid))
                    per_key[batch.key_id] += 1
        self.counters.dropped_reused_groups += len(dropped["reused"])
        self.counters.dropped_stale_groups += len(dropped["stale"])
        self.counters.dropped_malformed_groups += len(dropped["malformed"])
        if any(dropped.values()):
            self._ledger(dropped={k: v for k, v in dropped.items() if v})
        if len(chosen) < tc.groups_per_step:
            self.pool = [(b, g) for b, g in self.pool if g]
            return None
        out = [(self.pool[b_i][0], self.pool[b_i][1].pop(gid)) for b_i, gid in chosen]
        self.pool = [(b, g) for b, g in self.pool if g]
        return out

    def _learn(self, taken: list[tuple[Batch, list[Episode]]]) -> tuple[list[list[Episode]], dict[str, Any], dict]:
        """Advantages and one learner step over ``taken``; returns (groups, rollout metrics, learner metrics).

        Raises whatever the learner raises (the caller finds the batch to blame)."""
        from stoa.algos.advantages import group_advantages

        tc = self.cfg.trainer
        groups = [[dataclasses.replace(e, group_id=scoped(b.key_id, e.group_id)) for e in g] for b, g in taken]
        episodes = [e for g in groups for e in g]
        rewards = np.array([e.reward for e in episodes], np.float32)
        adv, stats = group_advantages(rewards, [e.group_id for e in episodes], kind=tc.advantage)
        adv = np.asarray(adv, np.float32)
        keep = ~np.asarray(stats["zero_variance_mask"], bool) if tc.skip_zero_variance_groups else np.ones(len(adv), bool)
        lags = [self.version - e.policy_version for e in episodes]
        ok = successes(episodes, self.success_metric)
        rollout = {
            "reward/mean": float(rewards.mean()),
            "rollout/pass@1": float(np.mean(ok)),
            **episode_metric_means(episodes, self.metric_types, "rollout"),
            "rollout/model_tokens": float(np.mean([e.num_model_tokens for e in episodes])),
            "staleness/mean": float(np.mean(lags)), "staleness/max": float(max(lags)),
            "groups/zero_variance_frac": float(stats["frac_zero_variance_groups"]),
            "groups/zero_variance": int(stats["num_zero_variance_groups"]),
        }
        for lag, n in Counter(lags).items():
            rollout[f"staleness/lag{lag}"] = n
        if tc.mismatch_every and (self.rl_step + 1) % tc.mismatch_every == 0:
            rollout.update(self._mismatch(episodes))
        learn: dict[str, Any] = {"learner/skipped_no_signal": not keep.any()}
        if keep.any():
            sel = [e for e, k in zip(episodes, keep) if k]
            learn = self.learner.train_step(sel, adv[keep], objective=self.cfg.objective)
        return groups, rollout, learn

    def _mismatch(self, episodes: list[Episode]) -> dict[str, float]:
        """The int8 and staleness parts of the behaviour/trainer gap (``stoa.fleet.mismatch``):
        score the step's episodes with the float learner and with the int8 policy of this version."""
        from stoa.fleet.mismatch import decompose

        assert self.state is not None
        int8 = self._int8_at(self.version, self.state).score(episodes)
        return decompose(episodes, self.learner.logprobs(episodes, temperature=None), int8)

    def _blame(self, taken: list[tuple[Batch, list[Episode]]], error: Exception) -> None:
        """A learner step failed: quarantine the batches whose episodes the learner cannot take, put
        the other groups back, or (if no batch alone fails) quarantine every batch of the step."""
        by_batch: dict[str, tuple[Batch, list[list[Episode]]]] = {}
        for batch, g in taken:
            by_batch.setdefault(batch.key, (batch, []))[1].append(g)
        guilty = []
        for key, (batch, groups) in by_batch.items():
            try:
                lps = self.learner.logprobs([e for g in groups for e in g])
                if not all(np.isfinite(lp).all() for lp in lps):
                    raise ValueError("non-finite trainer log-probs")
            except Exception as e:
                guilty.append((batch, f"the learner cannot take it: {type(e).__name__}: {e}"))
        if not guilty:
            guilty = [(b, f"a learner step over this and {len(by_batch) - 1} other batch(es) failed: "
                          f"{type(error).__name__}: {error}") for b, _ in by_batch.values()]
        bad = {b.key for b, _ in guilty}
        for batch, reason in guilty:
            self.pool = [(b, g) for b, g in self.pool if b.key != batch.key]
            self._reject(batch, reason[:2000])
        # The innocent groups go back to the front of the pool, as they were.
        back: dict[str, tuple[Batch, dict[str, list[Episode]]]] = {}
        for batch, g in taken:
            if batch.key not in bad:
                back.setdefault(batch.key, (batch, {}))[1][g[0].group_id] = g
        self.pool = list(back.values()) + self.pool
        self.counters.failed_steps += 1

    def step(self) -> bool:
        """One RL step if enough groups are ready; returns whether a step was taken.

        Nothing a worker uploaded can make this raise: a batch that fails a check, or on which
        the learner fails, is quarantined with the reason and training goes on."""
        tc = self.cfg.trainer
        self._poll()
        taken = self._take_groups()
        if taken is None:
            return False
        t0 = time.time()
        try:
            groups, rollout, learn = self._learn(taken)
        except Exception as e:
            log.warning("learner step failed (%s: %s); finding the batch to blame", type(e).__name__, e)
            self._blame(taken, e)
            return False
        episodes = [e for g in groups for e in g]
        for g in groups:
            self.used_groups.add(g[0].group_id)
        for batch, g in taken:
            self.trust.trained(batch, len(g))
        for k, n in rollout.items():
            if k.startswith("staleness/lag"):
                lag = k[len("staleness/lag"):]
                self.counters.staleness[lag] = self.counters.staleness.get(lag, 0) + n
        self.counters.zero_variance_groups += rollout.pop("groups/zero_variance")
        self.counters.episodes_trained += len(episodes)
        self.counters.groups_trained += len(groups)
        self.rl_step += 1
        self.version += 1
        pub = self._publish()
        self._ledger(trained=[g[0].group_id for g in groups],
                     policy_versions=sorted({e.policy_version for e in episodes}))
        beats, _ = read_heartbeats(self.store, self.run_name)
        now = time.time()
        self._log("train", rl_step=self.rl_step, **rollout, **learn,
                  **{"pulse/bytes": pub.bytes_written, "pulse/full_bytes": pub.full_state_bytes,
                     "pulse/anchor": pub.kind == "anchor", "pulse/seconds": pub.seconds,
                     "time/step_s": now - t0, "time/elapsed_s": now - self._t0,
                     "throughput/episodes_per_s": self.counters.episodes_trained / (now - self._t0),
                     "fleet/workers_alive": sum(now - b.time < 30 and b.status != "stopped" for b in beats),
                     "dropped/stale_groups": self.counters.dropped_stale_groups,
                     "dropped/reused_groups": self.counters.dropped_reused_groups,
                     "dropped/quarantined_batches": self.reader.quarantined,
                     "dropped/rejected_batches": self.counters.rejected_batches}, **self.trust.metrics())
        self.trust.write_report(self.version)
        if self.version % self.cfg.eval.every == 0 and self.rl_step < tc.steps:
            self.evaluate()
        if self.rl_step % tc.checkpoint_every == 0 and self.rl_step < tc.steps:
            self.checkpoint()
        return True

    # -- checkpoints --------------------------------------------------------------------------
    def checkpoint(self) -> Path:
        """Learner checkpoint + the exact consumed-rollout bookkeeping (pending batches left unconsumed)."""
        ckdir = self.run_dir / "checkpoints"
        ckdir.mkdir(exist_ok=True)
        path = ckdir / f"v{self.version:012d}"
        if path.exists():
            return path
        pending = [b for b, g in self.pool if g] + self.held
        pending_groups = {scoped(b.key_id, gid) for b, g in self.pool for gid in g}
        pending_used = sorted(gid for b, _ in self.pool for gid in {scoped(b.key_id, e.group_id) for e in b.episodes}
                              if gid in self.used_groups and gid not in pending_groups)
        reader_state = self.reader.state(pending=pending)
        extra = {"version": self.version, "rl_step": self.rl_step, "reader": reader_state,
                 "used_groups": pending_used, "counters": asdict(self.counters),
                 "trust": self.trust.state() if self.trust else {}}
        self.learner.save_checkpoint(path, extra)
        self._ledger(checkpoint=path.name)
        for old in sorted(ckdir.glob("v*"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        self.reader.prune(reader_state)
        return path

    def _cut_ledger(self, checkpoint: str | None) -> None:
        """Forget ledger lines written after ``checkpoint``'s marker (all of them for None): that training was lost."""
        if not self.ledger_path.exists():
            return
        lines = self.ledger_path.read_text().splitlines(keepends=True)
        keep = len(lines) if checkpoint is not None else 0
        for i, line in enumerate(lines):
            try:
                if json.loads(line).get("checkpoint") == checkpoint:
                    keep = i + 1
            except json.JSONDecodeError:
                break
        tmp = self.ledger_path.with_suffix(".tmp")
        tmp.write_text("".join(lines[:keep]))
        tmp.replace(self.ledger_path)

    def _maybe_resume(self) -> bool:
        ckdir = self.run_dir / "checkpoints"
        cks = sorted(p for p in ckdir.glob("v*") if p.is_dir()) if ckdir.exists() else []
        if not (self.resume and cks):
            if self.publisher.head() is not None and not self.resume:
                raise RuntimeError(f"run {self.run_name!r} already has published weights in this store; "
                                   "pass --resume to continue it, or choose another run name")
            self._cut_ledger(None)  # nothing of an earlier attempt survives without a checkpoint
            return False
        extra = self.learner.load_checkpoint(cks[-1])
        self._cut_ledger(cks[-1].name)
        self.reader.restore(extra["reader"])
        self.used_groups = set(extra["used_groups"])
        if self.trust is not None and extra.get("trust"):
            self.trust.restore(extra["trust"])
        self.rl_step = extra["rl_step"]
        self.counters = _Counters(**extra["counters"])
        head = self.publisher.head()
        # Versions published after the checkpoint came from steps now lost; never reuse their numbers.
        self.version = max(extra["version"], head if head is not None else 0) + 1
        from stoa.transport.quant import quantize_state

        self.state = quantize_state(self.learner.export_weights(self.cfg.pulse.dtype))
        self._keep_state()
        self.publisher.publish(self.version, self.state, {"rl_step": self.rl_step, "resumed_from": extra["version"]})
        self._log("event", event="resumed", checkpoint=cks[-1].name, rl_step=self.rl_step)
        log.info("resumed from %s at RL step %d; publishing as version %d", cks[-1].name, self.rl_step, self.version)
        return True
