"""The fleet runtime with real processes meeting in a real store: end to end, kills, resume, bad input.

Every test here starts real `stoa trainer` / `stoa worker` processes on a tiny model and a tiny
synthetic task. Process start-up (torch, MLX, transformers imports) dominates their time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from stoa.fleet.config import load_config
from stoa.fleet.metrics import read_metrics
from stoa.fleet.operator.status import fleet_status
from stoa.transport.chain import WeightSubscriber
from stoa.transport.exchange import rollout_key
from stoa.transport.pulse import state_hash
from stoa.transport.signing import generate_private_key, save_keypair
from stoa.transport.store import LocalStore
from stoa.types import Episode, Segment, encode_episodes

from helpers import arithmetic_config, tiny_fleet_config

pytestmark = pytest.mark.slow

def write_config(tmp: Path, name: str = "fleet-test", steps: int = 6, max_lag: int = 3) -> Path:
    p = tmp / f"{name}.toml"
    p.write_text(tiny_fleet_config(name, trainer={"steps": steps, "max_lag": max_lag}))
    return p


def env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


class Fleet:
    """Spawns trainer and worker processes of one run; kills whatever is left at the end."""

    def __init__(self, tmp: Path, config: Path):
        self.tmp, self.config = tmp, config
        self.cfg = load_config(config)
        self.store_dir, self.run_dir = tmp / "store", tmp / "run"
        self.key, self.pub = save_keypair(generate_private_key(), tmp / "keys", "run")
        self.procs: list[subprocess.Popen] = []

    @property
    def store(self) -> LocalStore:
        return LocalStore(self.store_dir)

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", "stoa", *args], env=env(), stdout=open(self.tmp / log, "ab"),
                             stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def trainer(self, *extra: str) -> subprocess.Popen:
        return self._spawn(["trainer", str(self.config), "--store", str(self.store_dir), "--key", str(self.key),
                            "--run-dir", str(self.run_dir), *extra], "trainer.log")

    def worker(self, wid: str, *extra: str) -> subprocess.Popen:
        return self._spawn(["worker", "--store", str(self.store_dir), "--run", self.cfg.name, "--public-key",
                            str(self.pub), "--id", wid, "--cache", str(self.tmp / "cache" / wid), *extra],
                           f"{wid}.log")

    def log(self, name: str) -> str:
        p = self.tmp / name
        return p.read_text(errors="replace") if p.exists() else ""

    def rows(self, kind: str | None = None) -> list[dict]:
        rows = read_metrics(self.run_dir / "metrics.jsonl")
        return [r for r in rows if kind is None or r["kind"] == kind]

    def ledger(self) -> list[dict]:
        p = self.run_dir / "ledger.jsonl"
        return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []

    def wait(self, proc: subprocess.Popen, timeout: float = 240) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process did not finish in {timeout}s; trainer log:\n{self.log('trainer.log')[-3000:]}")

    def wait_for(self, cond, timeout: float = 240, what: str = "condition") -> None:
        deadline = time.time() + timeout
        while not cond():
            if time.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}; trainer log:\n{self.log('trainer.log')[-3000:]}")
            for p in self.procs:
                if p.poll() not in (None, 0, -9, -15):
                    raise AssertionError(f"a process failed ({p.args[3]}):\n{self.log('trainer.log')[-3000:]}")
            time.sleep(0.2)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path, write_config(tmp_path))
    yield f
    f.close()


def trained_groups(ledger: list[dict]) -> list[str]:
    return [g.rsplit("/", 1)[-1] for e in ledger for g in e.get("trained", [])]  # ledger ids are <key id>/<group>


MALLORY = generate_private_key()


def put_sealed(st: LocalStore, run: str, seq: int, version: int, blob: bytes) -> None:
    """Plant a batch as a worker would upload it: sealed with its (unenrolled, open-run) key."""
    from stoa.transport.identity import seal_batch

    st.put(rollout_key(run, "mallory", seq, version),
           seal_batch(blob, run=run, worker_id="mallory", seq=seq, version=version, private_key=MALLORY))


def waiting_groups(fleet: Fleet) -> list[str]:
    """The group ids of the batches the trainer's newest checkpoint left unconsumed (pending
    ones included) and of those uploaded since: what a resumed trainer would read next."""
    from stoa.transport.exchange import RolloutReader

    ck = sorted((fleet.run_dir / "checkpoints").glob("v*"))[-1]
    reader = RolloutReader(fleet.store, fleet.cfg.name)
    reader.restore(json.loads((ck / "meta.json").read_text())["extra"]["intake"]["reader"])
    return [e.group_id for b in reader.poll() for e in b.episodes if e.sample_index == 0]


def check_accounting(fleet: Fleet, workers: tuple[str, ...]) -> None:
    """Every group the ``workers`` uploaded (their own count, in their heartbeats) was trained,
    dropped with a reason in the ledger, checked as probation work (never trained), or is still
    waiting for the trainer: none vanished, none counted twice. The store's rollouts cannot say:
    the trainer deletes the batches it consumed at each checkpoint, so a batch it took and lost
    would leave no trace there. For runs with no refused batch (a refused one is in none of these)."""
    st, run, ledger = fleet.store, fleet.cfg.name, fleet.ledger()
    gpc = fleet.cfg.rollout.groups_per_cohort
    uploaded = sum(json.loads(st.get(f"{run}/workers/{w}.json"))["batches"] for w in workers) * gpc
    trained = trained_groups(ledger)
    dropped = [g.rsplit("/", 1)[-1] for e in ledger for gs in e.get("dropped", {}).values() for g in gs]
    probation = [e["probation"] for e in ledger if "probation" in e]
    waiting = waiting_groups(fleet)
    accounted = len(trained) + len(dropped) + gpc * len(probation) + len(waiting)
    assert uploaded == accounted and len(set(trained) | set(dropped) | set(waiting)) == accounted - gpc * len(probation), (
        f"{'+'.join(workers)} uploaded {uploaded} groups: {len(trained)} trained, {len(dropped)} dropped, "
        f"{len(probation)} probation batches of {gpc}, {len(waiting)} waiting", fleet.log("trainer.log")[-3000:])


def uploaded_groups(store: LocalStore, run: str, skip: set[str] = frozenset()) -> set[str]:
    """The group ids of every batch in the run's rollouts folder, less the batches at keys ``skip``."""
    from stoa.transport.identity import open_sealed
    from stoa.types import decode_episodes

    out = set()
    for key in store.list(f"{run}/rollouts/"):
        if key not in skip:
            out |= {e.group_id for e in decode_episodes(open_sealed(store.get(key))[1])}
    return out


def test_local_train_end_to_end(tmp_path):
    """`stoa train` runs the trainer + 2 workers to the end and writes metrics, plots and a summary."""
    config = write_config(tmp_path, "e2e", steps=4)
    r = subprocess.run([sys.executable, "-m", "stoa", "train", str(config), "--runs", str(tmp_path / "runs")],
                       env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "runs" / "e2e"
    rows = read_metrics(run / "metrics.jsonl")
    evals = [x for x in rows if x["kind"] == "eval"]
    train = [x for x in rows if x["kind"] == "train"]
    assert [x["version"] for x in evals] == [0, 4] and len(train) == 4
    for x in evals:
        assert 0.0 <= x["eval/pass@1"] <= 1.0 and 0.0 <= x["eval/searched"] <= 1.0
    for x in train:  # a step whose groups all had equal rewards trains nothing, and says so
        assert x["learner/skipped_no_signal"] or 0.0 <= x["gate/masked_frac"] <= 1.0
        assert x["pulse/bytes"] > 0
    checks = [x["phase"] for x in rows if x["kind"] == "warmstart" and "warmstart/p_final_turn" in x]
    assert checks == ["practice", "habit"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["versions"] == 4 and summary["workers"] == 2
    assert all(Path(p).stat().st_size > 1000 for p in summary["plots"])
    assert "pass@1" in r.stdout and (run / "summary.md").exists()
    assert list((run / "tensorboard").iterdir())
    # The workers saw the finish marker and left cleanly.
    status = fleet_status(LocalStore(run / "store"), "e2e", public_key=run / "keys" / "run.pub")
    assert status["finished"] and status["head"] == 4
    assert {w["status"] for w in status["workers"]} == {"stopped"} and len(status["workers"]) == 2
    r = subprocess.run([sys.executable, "-m", "stoa", "status", "--store", str(run / "store"), "--run", "e2e",
                        "--public-key", str(run / "keys" / "run.pub")], env={**env(), "COLUMNS": "200"}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "finished, head version 4" in r.stdout and "worker-1" in r.stdout, r.stdout + r.stderr


def test_kill_worker_mid_run_trainer_carries_on(tmp_path):
    """kill -9 a worker while it generates and uploads: the trainer never sees a partial batch."""
    # 30 steps: one worker finishes a 6-step run of this model in about a second, before any kill.
    fleet = Fleet(tmp_path, write_config(tmp_path, steps=30))
    try:
        _kill_victim_mid_run(fleet)
    finally:
        fleet.close()


def _kill_victim_mid_run(fleet: Fleet) -> None:
    trainer = fleet.trainer()
    victim = fleet.worker("victim")
    hb = f"{fleet.cfg.name}/workers/victim.json"
    # The victim first: a steady worker that joins a second earlier can finish this tiny run alone.
    fleet.wait_for(lambda: fleet.store.exists(hb) and b"generating" in fleet.store.get(hb), what="the victim to generate")
    steady = fleet.worker("steady")
    rng = np.random.default_rng(0)
    for _ in range(3):  # kill it at random moments of its loop, restart it, and kill it again
        time.sleep(float(rng.uniform(0.0, 0.6)))
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        victim = fleet.worker("victim")
    assert fleet.wait(trainer) == 0, fleet.log("trainer.log")[-3000:]
    assert fleet.wait(steady, 60) == 0
    assert fleet.wait(victim, 120) == 0
    st = fleet.store
    assert st.list(f"{fleet.cfg.name}/quarantine/") == []  # nothing torn was ever visible
    assert not [k for k in st.list("") if ".stoa-tmp" in k]
    trained = trained_groups(fleet.ledger())
    assert len(trained) == len(set(trained)) == 30 * 2


def test_kill_trainer_mid_step_and_resume(fleet):
    """kill -9 the trainer mid-run; --resume loses no episode, counts none twice, keeps the chain intact."""
    trainer = fleet.trainer()
    workers = [fleet.worker("w0"), fleet.worker("w1")]
    fleet.wait_for(lambda: len(fleet.rows("train")) >= 3, what="three RL steps")
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    killed_at = max(r["version"] for r in fleet.rows("train"))
    resumed = fleet.trainer("--resume")
    assert fleet.wait(resumed) == 0, fleet.log("trainer.log")[-3000:]
    for w in workers:
        assert fleet.wait(w, 60) == 0

    ledger = fleet.ledger()
    trained = trained_groups(ledger)
    assert len(trained) == len(set(trained)), "a group was trained on twice"
    assert max(e["rl_step"] for e in ledger) == 6 and len([e for e in ledger if "trained" in e]) == 6
    dropped = {g.rsplit("/", 1)[-1] for e in ledger for gs in e.get("dropped", {}).values() for g in gs}
    # Every uploaded group was trained, dropped with a reason, or is still waiting; none vanished.
    waiting = set(waiting_groups(fleet))
    # A key's probation batches (made before the run published its salt, which a slow or restarted
    # trainer can delay) are checked and credited, never trained: the ledger names each one.
    probation = {e["probation"] for e in ledger if "probation" in e}
    vanished = uploaded_groups(fleet.store, fleet.cfg.name, skip=probation) - set(trained) - dropped - waiting
    assert not vanished, (sorted(vanished)[:8], [e for e in ledger if not e.get("trained")][-20:],
                          fleet.log("trainer.log")[-3000:])
    check_accounting(fleet, ("w0", "w1"))  # and what the store no longer holds
    # Versions never repeat: the resumed trainer published past what the killed one had.
    events = [r for r in fleet.rows("event") if r.get("event") == "resumed"]
    assert len(events) == 1 and events[0]["version"] > killed_at
    # The chain is intact: a fresh worker joins at the head and the state verifies.
    sub = WeightSubscriber(fleet.store, fleet.cfg.name, fleet.pub)
    res = sub.sync(None)
    assert res.version == sub.head() and state_hash(res.state) == sub.manifest(res.version).state_hash


def test_sigterm_stops_the_trainer_after_a_step_and_resume_finishes_the_run(tmp_path):
    """SIGTERM: the current step completes, a checkpoint at the stopped version, exit 0, no finished
    marker (the worker keeps waiting); --resume then trains exactly the remaining steps. 30 steps:
    with the C decode step a 6-step run could end before the signal landed."""
    fleet = Fleet(tmp_path, write_config(tmp_path, steps=STEPS_SIGTERM))
    try:
        _sigterm_then_resume(fleet)
    finally:
        fleet.close()


STEPS_SIGTERM = 30


def _sigterm_then_resume(fleet) -> None:
    from stoa.transport.exchange import is_finished
    from stoa.transport.signing import load_public_key

    trainer = fleet.trainer()
    worker = fleet.worker("w0")
    fleet.wait_for(lambda: len(fleet.rows("train")) >= 2, what="two RL steps")
    trainer.send_signal(signal.SIGTERM)
    assert fleet.wait(trainer, 120) == 0, fleet.log("trainer.log")[-3000:]
    stopped = [r for r in fleet.rows("event") if r.get("event") == "stopped"]
    assert len(stopped) == 1 and 2 <= stopped[0]["rl_step"] < STEPS_SIGTERM, stopped
    assert (fleet.run_dir / "checkpoints" / f"v{stopped[0]['version']:012d}").is_dir()
    assert not is_finished(fleet.store, fleet.cfg.name, load_public_key(fleet.pub))
    assert worker.poll() is None  # a stopped run is not over
    resumed = fleet.trainer("--resume")
    assert fleet.wait(resumed) == 0, fleet.log("trainer.log")[-3000:]
    assert fleet.wait(worker, 60) == 0
    ledger = fleet.ledger()
    trained = trained_groups(ledger)
    assert len([e for e in ledger if "trained" in e]) == STEPS_SIGTERM and len(trained) == len(set(trained))
    assert is_finished(fleet.store, fleet.cfg.name, load_public_key(fleet.pub))


def test_offline_worker_catches_up(tmp_path):
    """A worker stopped (SIGSTOP) for many versions catches up through deltas or a newer anchor."""
    fleet = Fleet(tmp_path, write_config(tmp_path, steps=30))
    try:
        _offline_worker_catches_up(fleet)
    finally:
        fleet.close()


def _offline_worker_catches_up(fleet: Fleet) -> None:
    trainer = fleet.trainer()
    sleeper = fleet.worker("sleeper")
    hb = f"{fleet.cfg.name}/workers/sleeper.json"
    fleet.wait_for(lambda: fleet.store.exists(hb), what="the sleeper's first heartbeat")
    sleeper.send_signal(signal.SIGSTOP)
    stopped_at = json.loads(fleet.store.get(hb))["version"]
    w0 = fleet.worker("w0")  # the run goes on without the sleeper
    fleet.wait_for(lambda: len(fleet.rows("train")) >= stopped_at + 4, what="four RL steps while the sleeper is offline")
    sleeper.send_signal(signal.SIGCONT)
    fleet.wait_for(lambda: (b := json.loads(fleet.store.get(hb)))["version"] >= stopped_at + 4
                   and b["batches"] >= 2, what="the sleeper to catch up and upload again")
    assert fleet.wait(trainer) == 0
    assert fleet.wait(w0, 60) == 0 and fleet.wait(sleeper, 60) == 0
    assert json.loads(fleet.store.get(hb))["status"] == "stopped"
    assert "joined run" in fleet.log("sleeper.log") and "Traceback" not in fleet.log("sleeper.log")


def _raw_batch(episodes: list[Episode], mutate) -> bytes:
    body = msgpack.unpackb(encode_episodes(episodes, compress=False)[6:], raw=False)
    mutate(body["episodes"][0])
    return b"STEP\x01\x00" + msgpack.packb(body, use_bin_type=True)


def test_bad_episodes_are_quarantined_with_a_reason(fleet):
    """Wrong version, out-of-vocabulary tokens, non-finite log-probs, oversize: quarantined, counted, no crash."""
    fleet.config.write_text(fleet.config.read_text().replace("[trust]\n", "[trust]\nban_after = 0\n", 1))  # every reason, not a ban
    trainer = fleet.trainer()
    fleet.wait_for(lambda: fleet.store.exists(f"{fleet.cfg.name}/current.json"), what="version 0")
    run = fleet.cfg.name
    st = fleet.store

    def ep(**kw):
        base = dict(prompt_tokens=np.array([1, 2, 3]), segments=[Segment("model", np.array([4, 5]), np.array([-0.5, -1.0]))],
                    reward=1.0, policy_version=0, worker_id="mallory", group_id="g", sample_index=0)
        base.update(kw)
        return Episode(**base)

    good = [ep(sample_index=i) for i in range(2)]
    put_sealed(st, run, 0, 0, encode_episodes([ep(worker_id="mallory", policy_version=0, segments=[
        Segment("model", np.array([4, 10**6]), np.array([-0.5, -1.0]))])]))  # token id far outside the vocabulary
    put_sealed(st, run, 1, 0, _raw_batch(good, lambda d: d.update(
        segments=[{"kind": "model", "tokens": np.array([4], "<i4").tobytes(),
                   "logprobs": np.array([np.nan], "<f4").tobytes()}])))
    put_sealed(st, run, 2, 999, encode_episodes([ep(policy_version=999, group_id="future")]))
    put_sealed(st, run, 3, 0, _raw_batch(good, lambda d: d.update(  # over the token limit
        prompt=(np.arange(400_000) % 50).astype("<i4").tobytes())))
    put_sealed(st, run, 4, 0, b"\x00garbage, not an episode batch")
    workers = [fleet.worker("w0"), fleet.worker("w1")]
    assert fleet.wait(trainer) == 0, fleet.log("trainer.log")[-3000:]
    for w in workers:
        fleet.wait(w, 60)
    reasons = {k.rsplit("/", 1)[1]: json.loads(st.get(k))["reason"]
               for k in st.list(f"{run}/quarantine/mallory/") if k.endswith(".reason.json")}
    assert len(reasons) == 5, reasons
    text = " | ".join(sorted(reasons.values()))
    for needle in ("outside the vocabulary", "non-finite", "newer than the trainer", "over the limit", "magic"):
        assert needle in text, text
    assert fleet.rows("train")[-1]["dropped/quarantined_batches"] == 5


def test_resume_before_any_checkpoint_starts_over_without_reusing_versions(fleet):
    trainer = fleet.trainer()
    sub = WeightSubscriber(fleet.store, fleet.cfg.name, fleet.pub)
    fleet.wait_for(lambda: sub.head() is not None, what="version 0")
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    assert not (fleet.run_dir / "checkpoints").exists() or not list((fleet.run_dir / "checkpoints").iterdir())
    first_head = sub.head()
    resumed = fleet.trainer("--resume")
    workers = [fleet.worker("w0"), fleet.worker("w1")]
    assert fleet.wait(resumed) == 0, fleet.log("trainer.log")[-3000:]
    for w in workers:
        fleet.wait(w, 60)
    evals = [r["version"] for r in fleet.rows("eval")]
    assert first_head + 1 in evals  # started over after the old head: version numbers never repeat
    assert sub.head() == first_head + 1 + 6
    trained = trained_groups(fleet.ledger())
    assert len(trained) == len(set(trained)) == 6 * 2


def test_poisoned_batches_are_quarantined_and_a_killed_trainer_trains_on(fleet):
    """Batches that pass the codec but not the run's bounds (a reward that overflows float32, a
    temperature the run never asked for, metrics of the wrong type, another task's episodes) are
    quarantined with reasons instead of crashing the step; a planted unsigned finish marker stops
    no worker; the trainer killed after seeing them resumes and finishes (no crash loop)."""
    fleet.config.write_text(fleet.config.read_text().replace("[trust]\n", "[trust]\nban_after = 0\n", 1))  # every reason, not a ban
    trainer = fleet.trainer()
    fleet.wait_for(lambda: fleet.store.exists(f"{fleet.cfg.name}/current.json"), what="version 0")
    run, st = fleet.cfg.name, fleet.store

    def group(gid: str, **kw) -> list[Episode]:
        eps = []
        for i in range(2):
            base = dict(prompt_tokens=np.array([1, 2, 3]), reward=float(i),
                        segments=[Segment("model", np.array([4, 5]), np.array([-0.5, -1.0]))],
                        policy_version=0, worker_id="mallory", group_id=gid, sample_index=i,
                        env_id="stoa/SyntheticSearch-v0", metrics={"em": bool(i), "searched": True, "turns": 1})
            base.update(kw)
            eps.append(Episode(**base))
        return eps

    poisons = {
        "reward": group("p-reward", reward=1e300),
        "temperature": group("p-temp", temperature=1e-30),
        "metric-none": group("p-none", metrics={"em": None, "turns": 1}),
        "metric-str": group("p-str", metrics={"searched": "yes", "turns": 1}),
        "task": group("p-task", env_id="someone/Else-v0"),
    }
    for seq, eps in enumerate(poisons.values()):
        put_sealed(st, run, seq, 0, encode_episodes(eps))
    st.put(f"{run}/finished.json", b'{"body": "{}", "sig": "00"}')  # unsigned: must stop nobody
    fleet.wait_for(lambda: sum(k.endswith(".reason.json") for k in st.list(f"{run}/quarantine/")) >= 5,
                   what="the poisoned batches to be quarantined")
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    resumed = fleet.trainer("--resume")
    workers = [fleet.worker("w0"), fleet.worker("w1")]
    assert fleet.wait(resumed) == 0, fleet.log("trainer.log")[-3000:]
    for w in workers:
        assert fleet.wait(w, 60) == 0
    reasons = " | ".join(json.loads(st.get(k))["reason"] for k in st.list(f"{run}/quarantine/mallory/")
                         if k.endswith(".reason.json"))
    for needle in ("not finite in float32", "temperature 1e-30", "metric 'em' is NoneType", "metric 'searched' is str",
                   "not the run's task"):
        assert needle in reasons, reasons
    assert "Traceback" not in fleet.log("trainer.log")
    assert "ignoring" in fleet.log("w0.log") + fleet.log("w1.log")  # the planted marker was seen and refused
    trained = trained_groups(fleet.ledger())
    assert len(trained) == len(set(trained)) and not any(g.startswith("p-") for g in trained)


def test_a_researchers_own_env_trains_end_to_end(tmp_path):
    """`stoa train` on examples/custom_env.py's task: the runtime builds a tiny model from the env's
    tokenizer texts, warm-starts it from its demonstrations and logs its own metrics."""
    config = tmp_path / "arith.toml"
    config.write_text(arithmetic_config("arith"))
    r = subprocess.run([sys.executable, "-m", "stoa", "train", str(config), "--runs", str(tmp_path / "runs")],
                       env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = read_metrics(tmp_path / "runs" / "arith" / "metrics.jsonl")
    train = [x for x in rows if x["kind"] == "train"]
    evals = [x for x in rows if x["kind"] == "eval"]
    assert len(train) == 3 and [x["version"] for x in evals] == [0, 3]
    for x in train:
        assert {"rollout/correct", "rollout/used_calc", "rollout/num_calls"} <= set(x)
    assert {"eval/pass@1", "eval/used_calc"} <= set(evals[-1])
    assert "used_calc" in r.stdout


def test_forced_lag_trains_on_stale_rollouts_and_splits_the_mismatch(tmp_path):
    """rollout.lag = 2: workers generate with the version two behind the head (once there is one),
    every trained episode is that stale, and the mismatch is split into int8 and staleness parts."""
    f = Fleet(tmp_path, write_config(tmp_path, "lagged", steps=5, max_lag=3))
    try:
        trainer = f.trainer("--set", "rollout.lag=2", "--set", "trainer.mismatch_every=1")
        workers = [f.worker("w0"), f.worker("w1")]
        assert f.wait(trainer) == 0, f.log("trainer.log")[-3000:]
        for w in workers:
            f.wait(w, 60)
        train = f.rows("train")
        assert len(train) == 5
        for r in train:
            lags = {int(k[len("staleness/lag"):]) for k in r if k.startswith("staleness/lag")}
            # version v is trained on rollouts of version max(0, v - 1 - 2) or older (gate: <= 3 behind)
            assert min(lags) >= min(2, r["version"] - 1), (r["version"], lags)
            assert {"mismatch/kl_total", "mismatch/kl_stale", "mismatch/kl_int8"} <= set(r)
        late = [r for r in train if r["version"] >= 4]
        assert any(r["mismatch/abs_stale"] > 0 for r in late)
    finally:
        f.close()
