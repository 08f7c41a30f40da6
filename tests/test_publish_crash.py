"""The trainer's publish and resume against crashes and a store that loses versions.

An honest worker samples with the weights the store serves under a label; the trainer checks its
batches (sampling checks, spot-checks) with the int8 state it holds under that label, and refuses
a batch claiming a label it has not reached. So after any crash or store rollback, for every
(version, state) a worker could have synced: the trainer's held state of that version must be
that very state, and the version must not be above the trainer's. These tests drive the real
``Trainer._publish`` / ``Trainer._resume`` / ``Trainer._start`` over a real store, weight chain and
held states; the learner is a small set of numpy arrays (its optimizer is not under test).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

import stoa.fleet.trainer.heldstates as heldstates
from stoa.fleet.config import load_config
from stoa.fleet.trainer.heldstates import HeldStates
from stoa.fleet.trainer.policies import HeldPolicies
from stoa.fleet.trainer import Trainer
from stoa.transport.chain import SYNC_ERRORS, WeightPublisher, WeightSubscriber
from stoa.transport.pulse import state_hash
from stoa.transport.signing import generate_private_key
from stoa.transport.store import LocalStore

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "arithmetic_tiny.toml"
NAMES = ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight", "model.norm.weight")


class ArrayLearner:
    """The learner surface ``_publish`` and ``_resume`` use, over three numpy arrays."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.w = {NAMES[0]: rng.normal(size=(16, 64)), NAMES[1]: rng.normal(size=(64, 16)), NAMES[2]: np.ones(64)}
        self.w = {k: v.astype(np.float32) for k, v in self.w.items()}
        self.updates = 0

    def update(self) -> None:  # one optimizer step: every weight moves
        self.updates += 1
        rng = np.random.default_rng(1000 + self.updates)
        self.w = {k: (v + 0.05 * rng.normal(size=v.shape)).astype(np.float32) for k, v in self.w.items()}

    def iter_weights(self, dtype: str = "float32"):
        for k, v in self.w.items():
            yield k, v.copy()

    def reset_optimizer(self, config=None) -> None:
        pass

    def save_checkpoint(self, path: Path, extra: dict) -> None:
        path.mkdir(parents=True)
        for i, k in enumerate(NAMES):
            np.save(path / f"{i}.npy", self.w[k])
        (path / "meta.json").write_text(json.dumps({"updates": self.updates, "extra": extra}))

    def load_checkpoint(self, path: Path) -> dict:
        self.w = {k: np.load(path / f"{i}.npy", allow_pickle=False) for i, k in enumerate(NAMES)}
        meta = json.loads((path / "meta.json").read_text())
        self.updates = meta["updates"]
        return meta["extra"]


def trainer(store, run_dir: Path, key, resume: bool = False) -> Trainer:
    """A trainer with what ``Trainer.run`` builds before its first publish."""
    cfg = load_config(CONFIG, {"warmstart.steps": 0, "warmstart.practice_steps": 0, "pulse.anchor_every": 3})
    t = Trainer(cfg, store, run_dir, key, resume=resume)
    t.publisher = WeightPublisher(store, cfg.name, key, anchor_every=cfg.pulse.anchor_every)
    t.policies = HeldPolicies(run_dir / "model", cfg.rollout, cfg.trainer.max_lag, run_dir / "held",
                              chain=t.publisher.subscriber)
    t.learner = ArrayLearner()
    return t


def steps(t: Trainer, n: int) -> None:
    """What ``Trainer.step`` does around a publish, ``n`` times."""
    for _ in range(n):
        t.learner.update()
        t.rl_step += 1
        t.version += 1
        t._publish()


def checkpoint(t: Trainer) -> None:
    path = t.run_dir / "checkpoints" / f"v{t.version:012d}"
    t.learner.save_checkpoint(path, {"version": t.version, "rl_step": t.rl_step, "counters": asdict(t.counters),
                                     "intake": {}})
    t.ledger.write(checkpoint=path.name)


def resume(store, run_dir: Path, key) -> Trainer:
    """``stoa trainer --resume``: from the newest checkpoint, or a fresh start without one."""
    t = trainer(store, run_dir, key, resume=True)
    ck = t._checkpoint_to_resume()
    t._resume(ck) if ck is not None else t._start()
    return t


class Worker:
    """An honest worker: follows the pointer and remembers every (version, state hash) it sampled with."""

    def __init__(self, store, t: Trainer):
        self.sub = WeightSubscriber(store, t.run_name, t.key.public_key())
        self.seen: set[tuple[int, str]] = set()
        self.held = None

    def sync(self) -> None:
        try:
            r = self.sub.sync(self.held)
        except SYNC_ERRORS:  # nothing committed, or nothing it can follow: it waits
            return
        self.held = (r.version, r.state)
        self.seen.add((r.version, state_hash(r.state)))


def refused(t: Trainer, worker: Worker) -> list[str]:
    """Why the trainer would refuse honest batches sampled with what ``worker`` saw (empty: none)."""
    held = HeldStates(t.run_dir / "held", keep=1000)  # what the trainer holds, as a restart finds it
    out = []
    for v, h in sorted(worker.seen):
        if v > t.version:
            out.append(f"v{v}: above the trainer's version {t.version} (refused as from the future)")
        elif t.version - v <= t.cfg.trainer.max_lag and not t.policies.held(v):
            out.append(f"v{v}: not held, not rebuildable (unverifiable)")
        elif (got := held.get(v)) is not None and state_hash(got) != h:
            out.append(f"v{v}: held state differs from the published one (honest tokens fail the sampling check)")
    labels = {}
    for v, h in worker.seen:
        if labels.setdefault(v, h) != h:
            out.append(f"v{v}: one label named two states")
    return out


def events(run_dir: Path, name: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "event" and r.get("event") == name]


class Crash(Exception):
    pass


class CrashingStore:
    """Forwards to a store; the ``at``-th write through ``counter`` raises first (a kill -9 there)."""

    def __init__(self, inner, counter):
        self.inner, self.counter = inner, counter

    def put(self, key, data):
        self.counter.tick()
        self.inner.put(key, data)

    def delete(self, key):
        self.counter.tick()
        self.inner.delete(key)

    def put_if_absent(self, key, data):
        self.counter.tick()
        return self.inner.put_if_absent(key, data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Counter:
    def __init__(self, at: int | None = None):
        self.at, self.n, self.on = at, 0, False

    def tick(self) -> None:
        if self.on:
            self.n += 1
            if self.n == self.at:
                raise Crash(f"killed at write {self.n}")


class CrashingOs:
    """The ``os`` of a module whose renames (its durable writes) count as writes of ``counter``."""

    def __init__(self, counter):
        self.counter = counter

    def replace(self, *a, **kw):
        import os

        self.counter.tick()
        return os.replace(*a, **kw)

    def __getattr__(self, name):
        import os

        return getattr(os, name)


@pytest.fixture
def key():
    return generate_private_key()


def test_a_crash_mid_publish_then_resume_never_holds_the_dead_steps_weights_under_a_published_label(tmp_path, key):
    store = LocalStore(tmp_path / "store")
    counter = Counter(at=1)
    crashing = CrashingStore(store, counter)
    t = trainer(crashing, tmp_path / "run", key)
    worker = Worker(store, t)
    t._start()
    steps(t, 2)
    checkpoint(t)
    worker.sync()
    counter.on = True  # the next store write (the first of version 3's publish) is a kill -9
    with pytest.raises(Crash):
        steps(t, 1)
    t2 = resume(store, tmp_path / "run", key)
    worker.sync()
    steps(t2, 1)
    worker.sync()
    assert refused(t2, worker) == []


def test_a_deleted_pointer_while_the_trainer_is_down_never_reuses_a_label(tmp_path, key):
    store = LocalStore(tmp_path / "store")
    t = trainer(store, tmp_path / "run", key)
    worker = Worker(store, t)
    t._start()
    steps(t, 2)
    checkpoint(t)
    steps(t, 1)
    worker.sync()  # an honest worker samples with version 3
    store.delete(f"{t.run_name}/current.json")
    t2 = resume(store, tmp_path / "run", key)
    worker.sync()
    steps(t2, 1)
    worker.sync()
    assert refused(t2, worker) == []
    assert t2.version > 3
    lost = events(tmp_path / "run", "store_lost_versions")
    assert len(lost) == 1 and "pointer is gone" in lost[0]["detail"] and "up to version 3" in lost[0]["detail"]


def test_a_rolled_back_pointer_with_deleted_manifests_never_refuses_honest_batches(tmp_path, key):
    store = LocalStore(tmp_path / "store")
    t = trainer(store, tmp_path / "run", key)
    worker = Worker(store, t)
    t._start()
    steps(t, 1)
    old_pointer = store.get(f"{t.run_name}/current.json")  # version 1's signed pointer, kept by an attacker
    steps(t, 2)
    checkpoint(t)
    steps(t, 2)
    worker.sync()  # an honest worker samples with version 5
    for v in range(2, 6):  # while the trainer is down: manifests above version 1 deleted, its pointer put back
        store.delete(f"{t.run_name}/weights/{v:012d}/manifest.json")
    store.put(f"{t.run_name}/current.json", old_pointer)
    t2 = resume(store, tmp_path / "run", key)
    assert t2.version > 5
    worker.sync()
    steps(t2, 1)
    worker.sync()
    assert refused(t2, worker) == []
    lost = events(tmp_path / "run", "store_lost_versions")
    assert len(lost) == 1 and "head is version 1" in lost[0]["detail"]


def test_a_fresh_start_in_a_run_folder_that_published_is_refused(tmp_path, key):
    from stoa.fleet.trainer import StartRefused

    t = trainer(LocalStore(tmp_path / "store"), tmp_path / "run", key)
    t._start()
    other = trainer(LocalStore(tmp_path / "other-store"), tmp_path / "run", key)
    with pytest.raises(StartRefused, match="already published version 0"):
        other._checkpoint_to_resume()


def scenario(tmp_path: Path, key, monkeypatch, at: int | None) -> tuple[Trainer, Worker, int]:
    """Step 3's publish, then a resume from the checkpoint at version 2, with writes counted from
    step 3 on (store writes, the run folder's record and held states); ``at`` kills the trainer
    at that write. Then ``--resume`` again (no crash) and one more step. Returns the last trainer,
    the worker and how many writes were counted."""
    import stoa.fleet.trainer.publishing as publishing

    counter = Counter(at)
    for module in (publishing, heldstates):  # the run folder's durable writes
        monkeypatch.setattr(module, "os", CrashingOs(counter))
    store, run = LocalStore(tmp_path / "store"), tmp_path / "run"
    t = trainer(CrashingStore(store, counter), run, key)
    worker = Worker(store, t)
    t._start()
    steps(t, 2)
    checkpoint(t)
    worker.sync()
    counter.on = True
    try:
        steps(t, 1)
        worker.sync()
        t = resume(CrashingStore(store, counter), run, key)  # a kill -9 after step 3: resume from v2
        worker.sync()
    except Crash:
        worker.sync()
    counter.on = False
    t = resume(store, run, key)
    worker.sync()
    steps(t, 1)
    worker.sync()
    return t, worker, counter.n


def test_a_kill_at_every_write_of_publish_and_of_resume_refuses_and_loses_no_honest_batch(tmp_path, key, monkeypatch):
    _, _, total = scenario(tmp_path / "count", key, monkeypatch, None)
    assert total >= 10  # payloads, manifest and pointer, held data and marker, the record: twice
    for at in range(1, total + 1):
        t, worker, _ = scenario(tmp_path / f"k{at}", key, monkeypatch, at)
        assert refused(t, worker) == [], f"killed at write {at}"
        assert worker.seen and max(v for v, _ in worker.seen) == t.version, f"killed at write {at}"


def test_a_batch_from_a_version_the_trainer_has_not_reached_is_refused_without_a_strike(tmp_path, key):
    from helpers import tiny_fleet_config

    from stoa.fleet.intake import Intake
    from stoa.fleet.trust.ledger import Ledger
    from stoa.transport.exchange import RolloutWriter
    from stoa.types import Episode, Segment

    path = tmp_path / "run.toml"
    path.write_text(tiny_fleet_config("future", trust={"replay": False, "audit": {"enabled": False}}))
    cfg = load_config(path)
    store = LocalStore(tmp_path / "store")
    import stoa.envs

    make_env = lambda: stoa.envs.make(cfg.env.id, split=cfg.env.train_split, **cfg.env.kwargs)  # noqa: E731
    intake = Intake(cfg, store, key, vocab_size=700, metric_types={}, ledger=Ledger(tmp_path / "ledger.jsonl", dict),
                    float_scorer=None, int8=None, make_env=make_env)
    worker = RolloutWriter(store, cfg.name, "w", private_key=generate_private_key())
    for n in range(cfg.trust.ban_after + 1):  # more than enough to ban it, were they strikes
        eps = [Episode(np.array([1, 2, n]), [Segment("model", np.array([4, 5]), np.array([-0.5, -1.0]))], reward=0.0,
                       policy_version=9, worker_id="w", group_id="g", sample_index=i, temperature=1.0) for i in range(2)]
        worker.upload(eps, 9)
        assert intake.take(version=4) is None
    rec = intake.gate.records[worker.key_id]
    assert rec.rejected == {"future": cfg.trust.ban_after + 1} and rec.strikes == 0 and not rec.banned
