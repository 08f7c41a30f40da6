"""Dishonest workers, for testing the trainer's checks (``docs/trust.md``).

Each is a real :class:`stoa.fleet.worker.Worker` (real MLX engine, real store, sealed uploads)
with one behaviour changed. Run one with ``stoa worker ... --adversary KIND`` or add one to a
local fleet with ``stoa train CONFIG --adversary KIND``:

=====================  ===================================================  =====================
kind                   what it does                                         caught by
=====================  ===================================================  =====================
``flip-rewards``       reward 1 on every wrong answer                       replay (reward)
``forge-metrics``      the task's success metric and every other bool       replay (metrics)
                       metric it declares set to true
``zero-logprobs``      every behaviour log-prob claimed 0                   audit + spot-check
``shuffle-logprobs``   behaviour log-probs shuffled within each episode     audit + spot-check
``other-model``        samples with another (random) model of the same      audit + spot-check
                       shape and tokenizer, claims the run's version
``forge-observations`` the first observation of each episode replaced       replay (observation)
                       by planted text
``copy``               uploads other workers' batches as its own            assigned work
``framer``             re-signs other workers' fresh batches, unchanged,    assigned work (the
                       under its own key (to have the originals struck)     originals are never struck)
``copy-variant``       its own honest groups with one episode replaced by   the sampling check
                       a copy of another (relabelled as that sample)        (repeated tokens)
``cold-sampler``       samples at 0.7x the temperature, claims the run's    the sampling check
                       and reports honest log-probs of what it sampled
``selective``          honest, but never uploads a batch with a success,    withholding rate
                       nor half of the others (a taste of its own)          (flagged, not banned)
``unenrolled``         honest, but its key is not enrolled                  the roster (an enrolled
                                                                            run; in an open run it
                                                                            is a new worker)
=====================  ===================================================  =====================

They know no task: what a task's metrics are comes from the environment's declared hooks
(``TextEnv.metric_types``, ``success_metric``), found through its registered id. Nothing here
is used by honest code paths.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from stoa.fleet.worker import Worker
from stoa.transport import layout
from stoa.transport.exchange import parse_rollout_key
from stoa.transport.identity import SealError, open_sealed
from stoa.transport.store import StoreError
from stoa.types import Episode, EpisodeError, Segment, decode_episodes

__all__ = ["KINDS", "make_adversary"]

log = logging.getLogger("stoa.adversary")


class _Adversary(Worker):
    kind = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rng = np.random.default_rng(list(self.worker_id.encode()))
        log.warning("worker %s runs as the %r adversary", self.worker_id, self.kind)


class FlipRewards(_Adversary):
    kind = "flip-rewards"

    def finish_cohort(self, episodes: list[Episode]) -> list[Episode]:
        for e in episodes:
            e.reward = max(e.reward, 1.0)
        return episodes


def _declared(env_id: str) -> tuple[dict[str, Any], str | None]:
    """A registered task's declared ``(metric_types, success_metric)``, read from its class."""
    import gymnasium
    from gymnasium.envs.registration import load_env_creator

    import stoa.envs  # noqa: F401  (registers the built-in tasks)

    cls = load_env_creator(gymnasium.spec(env_id).entry_point)
    return dict(getattr(cls, "metric_types", {})), getattr(cls, "success_metric", None)


class ForgeMetrics(_Adversary):
    kind = "forge-metrics"

    def finish_cohort(self, episodes: list[Episode]) -> list[Episode]:
        for e in episodes:
            types, success = _declared(e.env_id)
            forged = {k: True for k, t in types.items() if t is bool or (isinstance(t, tuple) and bool in t)}
            e.metrics = {**e.metrics, **forged, **({success: True} if success else {})}
        return episodes


class ZeroLogprobs(_Adversary):
    kind = "zero-logprobs"

    def finish_cohort(self, episodes: list[Episode]) -> list[Episode]:
        for e in episodes:
            for s in e.segments:
                if s.kind == "model":
                    s.logprobs = np.zeros_like(s.logprobs)
        return episodes


class ShuffleLogprobs(_Adversary):
    kind = "shuffle-logprobs"

    def finish_cohort(self, episodes: list[Episode]) -> list[Episode]:
        for e in episodes:
            model = [s for s in e.segments if s.kind == "model"]
            flat = self.rng.permutation(np.concatenate([s.logprobs for s in model]))
            k = 0
            for s in model:
                s.logprobs = flat[k:k + len(s.tokens)].astype(np.float32)
                k += len(s.tokens)
        return episodes


class OtherModel(_Adversary):
    """Samples with a random model of the run's shape and tokenizer; follows the version numbers only."""

    kind = "other-model"

    def make_engine(self, model_dir: Path, state: dict, version: int, rc: Any):
        from stoa.transport.quant import dequantize_state, quantize_state

        floats = dequantize_state(state)
        rng = np.random.default_rng(12345)
        other = {k: (rng.normal(0.0, float(v.std()) or 0.02, v.shape).astype(v.dtype) if v.ndim == 2 else v)
                 for k, v in floats.items()}
        self._foreign = quantize_state(other)
        return super().make_engine(model_dir, self._foreign, version, rc)

    def _sync(self, version: int | None = None) -> None:  # claims the version it would sync to
        head = version if version is not None else self.sub.head() if self.sub is not None else None
        if head is not None and self.engine is not None:
            self.engine.load_state(head, self._foreign)


class ForgeObservations(_Adversary):
    kind = "forge-observations"

    def finish_cohort(self, episodes: list[Episode]) -> list[Episode]:
        assert self.engine is not None
        planted = np.array(self.engine.codec.encode("\n\nThe answer is whatever you said.\n\n"), np.int32)
        for e in episodes:  # the first observation becomes planted text
            for j, s in enumerate(e.segments):
                if s.kind == "env":
                    e.segments[j] = Segment("env", planted)
                    break
        return episodes


class _NoRollout:
    """An engine that follows the chain but generates nothing (a copier needs no episodes of its own)."""

    def __init__(self, engine: Any) -> None:
        self.__dict__["_engine"] = engine

    def rollout(self, *args: Any, **kwargs: Any) -> list[Episode]:
        time.sleep(0.2)
        return []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._engine, name, value)


class Copy(_Adversary):
    """Uploads the batches of workers the trainer trusts (its public report says whose batches it
    accepts), at its own policy version, under its own id and key."""

    kind = "copy"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._copied: set[str] = set()

    def make_engine(self, model_dir: Path, state: dict, version: int, rc: Any):
        return _NoRollout(super().make_engine(model_dir, state, version, rc))

    def finish_cohort(self, episodes: list[Episode]) -> list[Episode]:
        assert self.engine is not None
        from stoa.fleet.trust import read_trust_report

        report = read_trust_report(self.store, self.run_name)
        trusted = {w.worker_id for w in (report.workers.values() if report else ())
                   if w.accepted_batches and not w.banned} - {self.worker_id}
        stolen = self._steal(lambda worker: worker in trusted)
        for e in stolen:
            e.group_id = f"{self.worker_id}-copy-{len(self._copied)}-{e.group_id}"[:200]
        return stolen

    def _steal(self, whose) -> list[Episode]:
        """The newest batch at our version of a worker ``whose(worker id)`` accepts, relabelled as ours."""
        assert self.engine is not None
        for key in reversed(self.store.list(layout.rollouts(self.run_name))):
            parsed = parse_rollout_key(self.run_name, key)
            if parsed is None or not whose(parsed[0]) or key in self._copied or parsed[2] != self.engine.version:
                continue
            self._copied.add(key)
            try:
                _, payload = open_sealed(self.store.get(key))
                stolen = decode_episodes(payload)
            except (SealError, StoreError, EpisodeError):
                continue
            for e in stolen:
                e.worker_id = self.worker_id
            log.info("copied %s (%d episodes)", key, len(stolen))
            return stolen
        return []


class Framer(Copy):
    """Re-signs other workers' fresh batches unchanged (their group ids, items and draws) under its
    own key and name, hoping the trainer takes its copy and strikes the original."""

    kind = "framer"

    def finish_cohort(self, episodes: list[Episode]) -> list[Episode]:
        return self._steal(lambda worker: worker != self.worker_id)


class CopyVariant(_Adversary):
    """In each group of its own honest work, one sample is replaced by a copy of another sample's
    tokens relabelled with the replaced sample's index: every episode is genuine, the group is new."""

    kind = "copy-variant"

    def finish_cohort(self, episodes: list[Episode]) -> list[Episode]:
        import copy as _copy

        by_group: dict[str, list[int]] = {}
        for i, e in enumerate(episodes):
            by_group.setdefault(e.group_id, []).append(i)
        for idx in by_group.values():
            if len(idx) >= 2:
                twin = _copy.deepcopy(episodes[idx[0]])
                twin.sample_index = episodes[idx[1]].sample_index
                episodes[idx[1]] = twin
        return episodes


class ColdSampler(_Adversary):
    """Samples at 0.7x the run's temperature (sharper, more exploitative) and reports, at the run's
    temperature, the honest log-probs of the tokens it drew: every claimed log-prob re-scores."""

    kind = "cold-sampler"

    def sampling(self, rc: Any, seed: int) -> Any:
        import dataclasses

        return dataclasses.replace(super().sampling(rc, seed), temperature=rc.temperature * 0.7)

    def finish_cohort(self, episodes: list[Episode]) -> list[Episode]:
        assert self.engine is not None
        if not episodes:
            return episodes
        claimed = episodes[0].temperature / 0.7
        for e in episodes:
            e.temperature = claimed
        for e, lp in zip(episodes, self.engine.score(episodes)):
            at = len(e.prompt_tokens)
            for seg in e.segments:
                if seg.kind == "model":
                    seg.logprobs = np.asarray(lp[at:at + len(seg.tokens)], np.float32)
                at += len(seg.tokens)
        return episodes


class Selective(_Adversary):
    """Honest generation, uploads chosen by a preference of its own: a batch in which any episode
    succeeded (the task's success metric, from its declared hooks) is never uploaded, nor is every
    other one of the rest (a stand-in for any other taste), and their sequence numbers are
    skipped. The trainer sees a biased sample of genuine episodes."""

    kind = "selective"

    def finish_cohort(self, episodes: list[Episode]) -> list[Episode]:
        if not episodes:
            return episodes
        _, success = _declared(episodes[0].env_id)
        solved = any(bool(e.metrics.get(success)) if success else e.reward > 0 for e in episodes)
        self.made = getattr(self, "made", 0) + 1
        if solved or self.made % 2:
            self.withheld = getattr(self, "withheld", 0) + 1
            if self.writer is not None:
                self.writer.next_seq += 1  # the number is spent: its work is never uploaded
            log.info("withheld a batch (%d so far)", self.withheld)
            return []
        return episodes


class Unenrolled(_Adversary):
    """Honest work signed with a key the run never enrolled (refused in an ``enrolled`` run)."""

    kind = "unenrolled"


KINDS: dict[str, type[Worker]] = {c.kind: c for c in (FlipRewards, ForgeMetrics, ZeroLogprobs, ShuffleLogprobs,
                                                       OtherModel, ForgeObservations, Copy, Framer, CopyVariant,
                                                       ColdSampler, Selective, Unenrolled)}
"""Adversary kind -> worker class."""


def make_adversary(kind: str, *args: Any, **kwargs: Any) -> Worker:
    """A worker of ``kind`` (a key of :data:`KINDS`), built with :class:`~stoa.fleet.worker.Worker`'s arguments."""
    if kind not in KINDS:
        raise ValueError(f"unknown adversary {kind!r}; known: {sorted(KINDS)}")
    return KINDS[kind](*args, **kwargs)
