"""A fleet run under faults injected on a seeded schedule, and what must hold afterwards.

:func:`plan` draws the faults from a seed; :class:`ChaosRun` starts a trainer and workers (real
``stoa trainer`` / ``stoa worker`` processes meeting in one store), fires each fault once the
trainer has logged its ``after_step``-th RL step, and runs the fleet to the end; :func:`verify`
reads back what must hold: the run finished, no group was trained twice, no honest worker was
struck or banned. Faults:

* ``kill-worker``: SIGKILL a worker, restart it ``seconds`` later with the same id and cache;
* ``pause-worker``: SIGSTOP a worker for ``seconds`` (mid-cohort), then SIGCONT: it wakes stale;
* ``kill-trainer``: SIGKILL the trainer, restart it at once with ``--resume``.

Every fault fired is a line of ``<root>/chaos.jsonl`` (time, kind, target, the trainer's step).
The processes are bound to the harness (:mod:`stoa.fleet.lifetime`): they exit if it dies.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ChaosRun", "Fault", "plan", "verify"]

KINDS = ("kill-worker", "pause-worker", "kill-trainer")


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` (one of :data:`KINDS`) on ``target`` once the trainer has logged
    ``after_step`` RL steps; ``seconds`` is a worker's time down (killed) or asleep (paused)."""

    after_step: int
    kind: str
    target: str
    seconds: float = 0.0


def plan(seed: int, steps: int, workers: int, worker_kills: int = 2, pauses: int = 1,
         trainer_kills: int = 1) -> list[Fault]:
    """A seeded schedule over a run of ``steps`` RL steps and workers ``worker-0..workers-1``."""
    rng = random.Random(seed)
    when = lambda: rng.randint(1, max(1, steps - 2))  # noqa: E731 - never after the last step
    faults = [Fault(when(), "kill-worker", f"worker-{rng.randrange(workers)}", round(rng.uniform(0.5, 3.0), 2))
              for _ in range(worker_kills)]
    faults += [Fault(when(), "pause-worker", f"worker-{rng.randrange(workers)}", round(rng.uniform(5.0, 15.0), 2))
               for _ in range(pauses)]
    faults += [Fault(when(), "kill-trainer", "trainer") for _ in range(trainer_kills)]
    return sorted(faults, key=lambda f: (f.after_step, f.kind, f.target))


@dataclass
class ChaosRun:
    """A trainer and ``workers`` workers of ``config`` meeting in ``<root>/store``; see the module."""

    config: Path
    root: Path
    run_name: str
    key: Path
    public_key: str
    workers: int
    faults: list[Fault] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    fired: list[dict[str, Any]] = field(default_factory=list)

    @property
    def store_dir(self) -> Path:
        return self.root / "store"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    def _spawn(self, name: str, args: list[str]) -> None:
        from stoa.fleet import lifetime

        env = dict(os.environ, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1", **self.env,
                   **lifetime.child_env(self._bind[0]))
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "stoa", *args], env=env,
                                            stdout=open(self.root / f"{name}.log", "ab"),
                                            stderr=subprocess.STDOUT, pass_fds=(self._bind[0],))

    def _trainer(self, resume: bool = False) -> None:
        self._spawn("trainer", ["trainer", str(self.config), "--store", str(self.store_dir), "--key", str(self.key),
                                "--run-dir", str(self.run_dir)] + (["--resume"] if resume else []))

    def _worker(self, wid: str) -> None:
        self._spawn(wid, ["worker", "--store", str(self.store_dir), "--run", self.run_name, "--public-key",
                          self.public_key, "--id", wid, "--cache", str(self.root / "cache" / wid)])

    def steps(self) -> int:
        """RL steps the trainer has logged (all sessions together)."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return 0
        from stoa.fleet.metrics import read_metrics

        return sum(r.get("kind") == "train" for r in read_metrics(path))

    def _fire(self, f: Fault, later: list[tuple[float, str, str]]) -> None:
        p = self.procs[f.target]
        if f.kind == "pause-worker":
            p.send_signal(signal.SIGSTOP)
            later.append((time.time() + f.seconds, "cont", f.target))
        else:
            p.send_signal(signal.SIGKILL)
            p.wait()
            if f.kind == "kill-trainer":
                self._trainer(resume=True)
            else:
                later.append((time.time() + f.seconds, "start", f.target))
        row = {"time": time.time(), "step": self.steps(), **asdict(f)}
        self.fired.append(row)
        with open(self.root / "chaos.jsonl", "a") as out:
            out.write(json.dumps(row) + "\n")

    def run(self, timeout: float = 600.0) -> float:
        """Run the fleet to the end with the faults; returns the wall seconds. Raises
        ``AssertionError`` (with the trainer's log tail) when a process fails or time runs out."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._bind = os.pipe()
        t0 = time.time()
        pending, later = sorted(self.faults, key=lambda f: f.after_step), []
        try:
            self._trainer()
            for i in range(self.workers):
                self._worker(f"worker-{i}")
            while True:
                now = time.time()
                for item in [x for x in later if x[0] <= now]:
                    later.remove(item)
                    if item[1] == "cont":
                        self.procs[item[2]].send_signal(signal.SIGCONT)
                    else:
                        self._worker(item[2])
                while pending and self.steps() >= pending[0].after_step:
                    self._fire(pending.pop(0), later)
                if self.procs["trainer"].poll() is not None:  # a killed one was replaced in _fire
                    break
                if now - t0 > timeout:
                    raise AssertionError(f"the run did not finish in {timeout:.0f} s:\n{self.log('trainer')[-3000:]}")
                time.sleep(0.2)
            for _, what, wid in later:
                if what == "cont":
                    self.procs[wid].send_signal(signal.SIGCONT)
            if self.procs["trainer"].returncode != 0:
                raise AssertionError(f"the trainer exited {self.procs['trainer'].returncode}:\n"
                                     f"{self.log('trainer')[-3000:]}")
            for name, p in self.procs.items():
                if name != "trainer":
                    try:
                        p.wait(timeout=max(30.0, timeout - (time.time() - t0)))
                    except subprocess.TimeoutExpired:
                        raise AssertionError(f"{name} did not leave the finished run:\n{self.log(name)[-2000:]}")
            return time.time() - t0
        finally:
            for p in self.procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                    p.wait()
            for fd in self._bind:
                os.close(fd)

    def log(self, name: str) -> str:
        p = self.root / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""


def verify(run: ChaosRun, public_key: Any) -> dict[str, Any]:
    """What held: ``finished``, ``groups_trained``, ``trained_twice``, ``groups_uploaded``,
    ``groups_lost`` (uploaded and still in the store, yet neither trained, dropped with a reason, nor still waiting in the
    newest checkpoint's reader), ``resumed`` (trainer restarts
    seen in its events), and per honest worker its ``strikes`` and ``banned`` (from the trust report)."""
    from stoa.fleet.metrics import read_metrics
    from stoa.fleet.trust.records import read_trust_report
    from stoa.transport.exchange import is_finished
    from stoa.transport.store import LocalStore

    store = LocalStore(run.store_dir)
    ledger_path = run.run_dir / "ledger.jsonl"
    ledger = [json.loads(line) for line in ledger_path.read_text().splitlines()] if ledger_path.exists() else []
    trained = [g for e in ledger for g in e.get("trained", [])]
    report = read_trust_report(store, run.run_name, public_key)
    workers = {w.worker_id: {"strikes": w.strikes, "banned": w.banned, "accepted_batches": w.accepted_batches}
               for w in (report.workers.values() if report else [])}
    events = [r for r in read_metrics(run.run_dir / "metrics.jsonl") if r.get("kind") == "event"]
    settled = set(trained) | {g for e in ledger for gs in e.get("dropped", {}).values() for g in gs}
    checkpoints = sorted((run.run_dir / "checkpoints").glob("v*"))
    if checkpoints:  # what the newest checkpoint's reader had taken but not trained on
        from stoa.transport.exchange import RolloutReader

        reader = RolloutReader(store, run.run_name)
        reader.restore(json.loads((checkpoints[-1] / "meta.json").read_text())["extra"]["intake"]["reader"])
        settled |= {f"{b.key_id}/{e.group_id}" for b in reader.poll() for e in b.episodes}
    from stoa.transport.identity import open_sealed
    from stoa.types import decode_episodes

    uploaded = set()  # the batches still in the store (the trainer prunes those its checkpoints settled)
    for key in store.list(f"{run.run_name}/rollouts/"):
        seal, payload = open_sealed(store.get(key))
        uploaded |= {f"{seal.key_id}/{e.group_id}" for e in decode_episodes(payload)}
    return {"finished": is_finished(store, run.run_name, public_key), "groups_trained": len(trained),
            "trained_twice": len(trained) - len(set(trained)), "groups_uploaded": len(uploaded),
            "groups_lost": len(uploaded - settled),
            "resumed": sum(r.get("event") == "resumed" for r in events), "workers": workers}
