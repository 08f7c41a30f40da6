"""A fleet run under faults injected on a seeded schedule, and what must hold afterwards.

:func:`plan` draws the faults from a seed; :class:`ChaosRun` starts a trainer and workers (real
``stoa trainer`` / ``stoa worker`` processes meeting in one store), fires each fault once the
trainer has logged its ``after_step``-th RL step, and runs the fleet to the end; :func:`verify`
reads back what must hold: the run finished, no group was trained twice, no honest worker was
struck or banned. Faults:

* ``kill-worker``: SIGKILL a worker, restart it ``seconds`` later with the same id and cache;
* ``pause-worker``: SIGSTOP a worker for ``seconds`` (mid-cohort), then SIGCONT: it wakes stale;
* ``sleep-worker``: as ``pause-worker``, but for longer than the trainer's 30 s heartbeat window
  (minutes in the benchmark), and in any case until the trainer has logged the worker
  ``worker_silent``; once awake it is logged ``worker_back``;
* ``kill-trainer``: SIGKILL the trainer, restart it at once with ``--resume``;
* ``disk-full``: fill the worker's cache file system (a size-capped tmpfs the harness mounted for
  it; root only) for ``seconds``, and in any case until the trainer has logged the worker's
  ``worker_trouble`` (at most a minute): its writes fail with ENOSPC, then the filler is removed;
* store faults (target ``store``, with :class:`ChaosRun` ``s3=`` only): for ``seconds`` every
  request of the trainer and the workers goes through :class:`~stoa.testing.storefaults.FaultProxy`
  at ``rate``: ``store-5xx`` (half ``500 InternalError``, half ``503 SlowDown``), ``store-timeout``
  (the answer held past the clients' read timeout), ``store-reset`` (connections reset mid-body),
  ``store-slow`` (answers delayed), ``store-multipart-stall`` (an ``UploadPart`` body stalls).

Every fault fired is a line of ``<root>/chaos.jsonl`` (time, kind, target, the trainer's step);
the proxy's own count of what it injected is :attr:`ChaosRun.store_faults`.
The processes are bound to the harness (:mod:`stoa.fleet.lifetime`): they exit if it dies.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ChaosRun", "Fault", "plan", "verify"]

STORE_KINDS = ("store-5xx", "store-timeout", "store-reset", "store-slow", "store-multipart-stall")
KINDS = ("kill-worker", "pause-worker", "sleep-worker", "kill-trainer", "disk-full", *STORE_KINDS)
STORE_READ_TIMEOUT_S = 2.0
"""The clients' S3 read timeout in a store-fault run (``store-timeout`` holds answers longer)."""


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` (one of :data:`KINDS`) on ``target`` once the trainer has logged
    ``after_step`` RL steps; ``seconds`` is a worker's time down (killed), asleep (paused), with a
    full disk, or a store fault's window; ``rate`` a store fault's share of requests hit."""

    after_step: int
    kind: str
    target: str
    seconds: float = 0.0
    rate: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault {self.kind!r} (known: {', '.join(KINDS)})")


def plan(seed: int, steps: int, workers: int, worker_kills: int = 2, pauses: int = 1,
         trainer_kills: int = 1, sleeps: int = 0, sleep_s: tuple[float, float] = (60.0, 120.0),
         disk_fulls: int = 0, store: dict[str, int] | None = None, store_rate: float = 0.2,
         store_window_s: tuple[float, float] = (5.0, 10.0)) -> list[Fault]:
    """A seeded schedule over a run of ``steps`` RL steps and workers ``worker-0..workers-1``;
    ``store`` maps store-fault kinds to how many windows of each."""
    rng = random.Random(seed)
    when = lambda: rng.randint(1, max(1, steps - 2))  # noqa: E731 - never after the last step
    faults = [Fault(when(), "kill-worker", f"worker-{rng.randrange(workers)}", round(rng.uniform(0.5, 3.0), 2))
              for _ in range(worker_kills)]
    faults += [Fault(when(), "pause-worker", f"worker-{rng.randrange(workers)}", round(rng.uniform(5.0, 15.0), 2))
               for _ in range(pauses)]
    faults += [Fault(when(), "kill-trainer", "trainer") for _ in range(trainer_kills)]
    faults += [Fault(when(), "sleep-worker", f"worker-{rng.randrange(workers)}", round(rng.uniform(*sleep_s), 2))
               for _ in range(sleeps)]
    faults += [Fault(when(), "disk-full", f"worker-{rng.randrange(workers)}", round(rng.uniform(5.0, 15.0), 2))
               for _ in range(disk_fulls)]
    for kind, n in (store or {}).items():
        faults += [Fault(when(), kind, "store", round(rng.uniform(*store_window_s), 2), store_rate) for _ in range(n)]
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
    s3: Any = None
    """A running :class:`~stoa.testing.seaweed.SeaweedFS`: the fleet meets in its bucket ``chaos``
    through a :class:`~stoa.testing.storefaults.FaultProxy` (needed by store faults); None: a local store."""
    seed: int = 0
    """Seed of the proxy's fault draws."""
    cache_mb: int = 64
    """Size of the tmpfs mounted as the cache of a worker that a ``disk-full`` fault targets."""
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    fired: list[dict[str, Any]] = field(default_factory=list)
    woke: list[dict[str, Any]] = field(default_factory=list)
    """Each paused or sleeping worker's wake-up: time, the trainer's step then, worker."""
    store_faults: dict[str, int] = field(default_factory=dict)
    """What the proxy injected, by its kind (``error-500``, ``timeout``, ...), once the run ended."""

    @property
    def store_dir(self) -> Path:
        return self.root / "store"

    def store_url(self, through_proxy: bool = True) -> str:
        """Where the fleet meets: the local folder, or the bucket through the proxy (or directly)."""
        if self.s3 is None:
            return str(self.store_dir)
        endpoint = self._proxy.endpoint if through_proxy else self.s3.endpoint
        return f"s3://chaos/{self._prefix}?endpoint={endpoint}&read_timeout={STORE_READ_TIMEOUT_S:g}"

    def open_store(self) -> Any:
        """The fleet's store, read directly (not through the proxy)."""
        from stoa.transport.store import LocalStore

        if self.s3 is None:
            return LocalStore(self.store_dir)
        from stoa.transport.s3 import S3Store

        return S3Store("chaos", self._prefix, endpoint_url=self.s3.endpoint, region="us-east-1",
                       credentials=self.s3.credentials)

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    def _spawn(self, name: str, args: list[str]) -> None:
        from stoa.backends import openmp
        from stoa.fleet import lifetime

        env = dict(os.environ, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1", **self.env,
                   **lifetime.child_env(self._bind[0]))
        openmp.shared_env(env)  # every process of the fleet shares this machine's cores
        if self.s3 is not None:
            env.update(AWS_ACCESS_KEY_ID=self.s3.credentials[0], AWS_SECRET_ACCESS_KEY=self.s3.credentials[1],
                       AWS_DEFAULT_REGION="us-east-1")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "stoa", *args], env=env,
                                            stdout=open(self.root / f"{name}.log", "ab"),
                                            stderr=subprocess.STDOUT, pass_fds=(self._bind[0],))

    def _trainer(self, resume: bool = False) -> None:
        self._spawn("trainer", ["trainer", str(self.config), "--store", self.store_url(), "--key", str(self.key),
                                "--run-dir", str(self.run_dir)] + (["--resume"] if resume else []))

    def _worker(self, wid: str) -> None:
        self._spawn(wid, ["worker", "--store", self.store_url(), "--run", self.run_name, "--public-key",
                          self.public_key, "--id", wid, "--cache", str(self.root / "cache" / wid)])

    def steps(self) -> int:
        """RL steps the trainer has logged (all sessions together)."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return 0
        from stoa.fleet.metrics import read_metrics

        return sum(r.get("kind") == "train" for r in read_metrics(path))

    def _fire(self, f: Fault, later: list[tuple[float, str, str]]) -> None:
        p = self.procs.get(f.target)
        if f.kind in STORE_KINDS:
            self._store_on[f.kind] = self._store_on.get(f.kind, 0.0) + f.rate
            self._apply_store_rates()
            later.append((time.time() + f.seconds, "store-off", f"{f.kind}:{f.rate}"))
        elif f.kind == "disk-full":
            _fill(self._cache(f.target))
            self._filled_since[f.target] = time.time()
            later.append((time.time() + f.seconds, "disk-free", f.target))
        elif f.kind in ("pause-worker", "sleep-worker"):
            p.send_signal(signal.SIGSTOP)
            self._asleep_since[f.target] = time.time()
            later.append((time.time() + f.seconds, "cont" if f.kind == "pause-worker" else "wake", f.target))
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

    def _cache(self, wid: str) -> Path:
        return self.root / "cache" / wid

    def _apply_store_rates(self) -> None:
        from stoa.testing.storefaults import FaultRates

        on = self._store_on
        half = on.get("store-5xx", 0.0) / 2
        self._proxy.set_rates(FaultRates(
            error_500=half, slowdown_503=half, timeout=on.get("store-timeout", 0.0), reset=on.get("store-reset", 0.0),
            slow=on.get("store-slow", 0.0), multipart_stall=min(1.0, on.get("store-multipart-stall", 0.0)),
            hold_s=STORE_READ_TIMEOUT_S + 1.0, slow_s=1.0))

    def _seen(self, event: str, wid: str, since: float) -> bool:
        """Whether the trainer has logged ``event`` for ``wid`` since ``since``."""
        from stoa.fleet.metrics import read_metrics

        path = self.run_dir / "metrics.jsonl"
        return path.exists() and any(r.get("event") == event and r.get("worker") == wid
                                     and r.get("time", 0.0) >= since for r in read_metrics(path))

    def _ready(self, f: Fault) -> bool:
        """A worker is put to sleep only once its heartbeat is in the store: one asleep before it ever
        beat is unknown to the trainer, which then never calls it silent (a loaded machine's worker
        can still be loading its model when the trainer's fast first steps come)."""
        if f.kind != "sleep-worker":
            return True
        from stoa.transport import layout

        if getattr(self, "_direct", None) is None:
            self._direct = self.open_store()
        return self._direct.exists(layout.heartbeat(self.run_name, f.target))

    def _silent_seen(self, wid: str) -> bool:
        """Whether the trainer has logged ``wid`` silent since it was put to sleep."""
        return self._seen("worker_silent", wid, self._asleep_since.get(wid, 0.0))

    def _trouble_seen(self, wid: str) -> bool:
        """Whether the trainer has logged ``wid``'s trouble since its disk was filled, or a minute
        has passed (a worker that wrote nothing meanwhile has nothing to report)."""
        since = self._filled_since.get(wid, 0.0)
        return time.time() - since > 60.0 or self._seen("worker_trouble", wid, since)

    def _later(self, what: str, arg: str) -> None:
        if what in ("cont", "wake"):
            self.procs[arg].send_signal(signal.SIGCONT)
            self.woke.append({"time": time.time(), "step": self.steps(), "worker": arg})
        elif what == "start":
            self._worker(arg)
        elif what == "disk-free":
            (self._cache(arg) / _FILLER).unlink(missing_ok=True)
        elif what == "store-off":
            kind, rate = arg.split(":")
            self._store_on[kind] = max(0.0, self._store_on.get(kind, 0.0) - float(rate))
            self._apply_store_rates()

    def _setup(self) -> None:
        """The proxy in front of the S3 server, and a size-capped tmpfs per worker a disk-full fault targets."""
        if self.s3 is not None:
            from stoa.testing.storefaults import FaultProxy

            self.s3.make_bucket("chaos")
            self._prefix = f"{self.run_name}-{uuid.uuid4().hex[:8]}"  # runs sharing a server never meet
            self._proxy = FaultProxy(("127.0.0.1", self.s3.port), seed=self.seed)
        elif any(f.kind in STORE_KINDS for f in self.faults):
            raise ValueError("store faults need ChaosRun(s3=...): a real S3 server behind the proxy")
        for wid in sorted({f.target for f in self.faults if f.kind == "disk-full"}):
            d = self._cache(wid)
            d.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.cache_mb}m", "tmpfs", str(d)], check=True,
                           capture_output=True)
            self._mounts.append(d)

    def _teardown(self) -> None:
        for d in self._mounts:
            subprocess.run(["umount", "-l", str(d)], capture_output=True)
        if self._proxy is not None:
            self.store_faults = {k: v for k, v in self._proxy.injected.items() if v}
            self._proxy.close()

    def run(self, timeout: float = 600.0) -> float:
        """Run the fleet to the end with the faults; returns the wall seconds. Raises
        ``AssertionError`` (with the trainer's log tail) when a process fails or time runs out."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._bind = os.pipe()
        t0 = time.time()
        pending, later = sorted(self.faults, key=lambda f: f.after_step), []
        self._asleep_since: dict[str, float] = {}
        self._filled_since: dict[str, float] = {}
        self._store_on, self._mounts, self._proxy = {}, [], None
        try:
            self._setup()
            self._trainer()
            for i in range(self.workers):
                self._worker(f"worker-{i}")
            while True:
                now = time.time()
                for item in sorted(x for x in later if x[0] <= now):
                    later.remove(item)
                    if item[1] == "wake" and not self._silent_seen(item[2]):
                        later.append((now + 0.5, *item[1:]))  # asleep until the trainer has said so
                        continue
                    if item[1] == "disk-free" and not self._trouble_seen(item[2]):
                        later.append((now + 0.5, *item[1:]))  # full until the trainer has said so
                        continue
                    self._later(item[1], item[2])
                while pending and self.steps() >= pending[0].after_step and self._ready(pending[0]):
                    self._fire(pending.pop(0), later)
                if self.procs["trainer"].poll() is not None:  # a killed one was replaced in _fire
                    break
                if now - t0 > timeout:
                    raise AssertionError(f"the run did not finish in {timeout:.0f} s:\n{self.log('trainer')[-3000:]}")
                time.sleep(0.2)
            for _, what, arg in sorted(later):
                if what != "start":
                    self._later(what, arg)
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
            self._teardown()

    def log(self, name: str) -> str:
        p = self.root / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""


_FILLER = ".chaos-filler"


def _fill(folder: Path) -> int:
    """Fill the file system under ``folder`` with one file until the kernel says ENOSPC; returns its bytes."""
    n, block = 0, b"\0" * (1 << 20)
    with open(folder / _FILLER, "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    n += f.write(block[:size])
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
    return n


def verify(run: ChaosRun, public_key: Any) -> dict[str, Any]:
    """What held: ``finished``, ``groups_trained``, ``trained_twice``, ``groups_uploaded``,
    ``groups_lost`` (uploaded and still in the store, yet neither trained, dropped with a reason, played on
    probation (a new key's first work, checked and never trained on), nor still waiting in the newest
    checkpoint's reader) and the first 20 of them (``lost``), ``resumed`` (trainer restarts seen in its events), and per honest worker its ``strikes`` and ``banned`` (from the trust report)."""
    from stoa.fleet.metrics import read_metrics
    from stoa.fleet.trust.records import read_trust_report
    from stoa.transport.exchange import is_finished

    store = run.open_store()
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

    probation = {e["probation"] for e in ledger if "probation" in e}  # checked, credited, never trained on
    uploaded = set()  # the batches still in the store (the trainer prunes those its checkpoints settled)
    for key in store.list(f"{run.run_name}/rollouts/"):
        seal, payload = open_sealed(store.get(key))
        groups = {f"{seal.key_id}/{e.group_id}" for e in decode_episodes(payload)}
        uploaded |= groups
        if key in probation:  # a new key's first work, kept as its newest batch when the key left at once
            settled |= groups
    return {"finished": is_finished(store, run.run_name, public_key), "groups_trained": len(trained),
            "trained_twice": len(trained) - len(set(trained)), "groups_uploaded": len(uploaded),
            "groups_lost": len(uploaded - settled), "lost": sorted(uploaded - settled)[:20],
            "resumed": sum(r.get("event") == "resumed" for r in events), "workers": workers}
