"""A long fleet run with worker churn, and what it costs in memory, open files and store objects.

:class:`SoakRun` starts a trainer and ``workers`` workers (real ``stoa trainer`` / ``stoa worker``
processes meeting in one store, as :class:`~stoa.testing.chaos.ChaosRun`), lets them run
``calm_s`` seconds undisturbed (the baseline), then every ``churn_s`` seconds makes one worker
leave (SIGTERM: it finishes its upload; or SIGKILL) and a worker join in its place: the same
identity again (same id, key and cache) or a new one (a new id, key and cache). ``worker-0``
never leaves: it is the long-lived worker whose levels are compared with the churned ones'.
After ``seconds`` the churn stops, the trainer is stopped (SIGTERM: a checkpoint) and resumed
with ``trainer.steps`` two steps further, so the run ends with a finished marker and
:func:`~stoa.testing.chaos.verify` can count what was lost.

Every ``sample_s`` seconds it samples, from ``/proc``, each live process's resident memory,
open file descriptors and threads, and lists the store, counting objects by kind
(:func:`store_kind`). :func:`summary` reduces the samples to per-process levels and fitted
slopes and per-kind counts; :data:`RETENTION` says what bounds each kind.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stoa.testing.chaos import ChaosRun

__all__ = ["RETENTION", "SoakRun", "fit_slope", "proc_sample", "store_kind", "summary"]

RETENTION: dict[str, str] = {
    "weights/anchor": "the 2 newest anchors and every version down to them, plus versions of the last 600 s",
    "weights/delta": "as weights/anchor",
    "weights/manifest": "as weights/anchor",
    "rollouts": "batches not yet settled by a durable checkpoint, plus each worker id's newest batch (ever)",
    "quarantine": "every refused batch and ticket, kept for the operator (none in an honest run)",
    "tickets": "a key's tickets until the trainer binds or refuses them (at most 2 per live key)",
    "heartbeats": "one per worker id heard from in the last 10 minutes (the trainer deletes older ones)",
    "salts": "one per key with standing (enrolled, or with accepted work), ever",
    "bans": "one per banned key",
    "eval": "one per evaluated version (every eval.every versions and the last)",
    "control": "8 documents (config, pointer, roster, bindings, progress, sequence floors, trust report, "
               "finished), each replaced in place",
    "model": "the model folder's files, fixed",
}
"""What bounds each kind of store object (:func:`store_kind`), as the code retains it."""

_CONTROL = {"config.json", "current.json", "workers.json", "bindings.json", "progress.json", "sequence.json",
            "finished.json", "trust.json"}


def store_kind(run: str, key: str) -> str:
    """The kind of a store key of run ``run``: a key of :data:`RETENTION`, or ``other``."""
    rest = key[len(run) + 1:] if key.startswith(run + "/") else key
    head, _, tail = rest.partition("/")
    if not tail:
        return "control" if head in _CONTROL else "other"
    if head == "weights":
        name = tail.rpartition("/")[2]
        return {"anchor.safetensors": "weights/anchor", "delta.pulse": "weights/delta",
                "manifest.json": "weights/manifest"}.get(name, "weights/other")
    if head == "workers":
        return "heartbeats"
    if head in ("rollouts", "quarantine", "tickets", "salts", "bans", "eval", "model"):
        return head
    return "other"


def proc_sample(pid: int) -> dict[str, float] | None:
    """Resident memory (MB), open file descriptors and threads of a live process, or None."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields:  # a zombie
        return None
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "fds": fds, "threads": int(fields["Threads"])}


def fit_slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``(t seconds, y)`` points, per hour; None with fewer than 3 points."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return sum((t - mt) * (y - my) for t, y in points) / var * 3600.0


@dataclass
class SoakRun(ChaosRun):
    """A fleet under worker churn for ``seconds``; see the module."""

    seconds: float = 60.0
    """How long the churned run lasts (the final stop and resume come after)."""
    calm_s: float = 20.0
    """Seconds from the first RL step with no churn: the baseline."""
    churn_s: float = 10.0
    """Seconds between one worker leaving (and its replacement joining) and the next."""
    sample_s: float = 2.0
    """Seconds between samples of the processes and the store."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    """One row per sample: ``time``, ``phase`` (``start`` until the first RL step, ``calm``,
    ``churn``, ``end``), ``procs`` (name -> pid, rss_mb, fds, threads), ``store`` (kind -> objects),
    ``bytes`` (each control document's size) and ``disk`` (MB: the trainer's folder and its logs, the workers' caches)."""
    churns: list[dict[str, Any]] = field(default_factory=list)
    """One row per churn: time, who left, how (``SIGTERM`` / ``SIGKILL``), who joined."""
    identities: list[str] = field(default_factory=list)
    """Every worker id that ever ran."""

    def _sample(self, phase: str, t0: float) -> None:
        procs = {}
        for name, p in self.procs.items():
            if p.poll() is None:
                got = proc_sample(p.pid)
                if got is not None:
                    procs[name] = {"pid": p.pid, **got}
        counts: dict[str, int] = {}
        sizes: dict[str, int] = {}
        store = self.open_store()
        try:
            for key in store.list(f"{self.run_name}/"):
                kind = store_kind(self.run_name, key)
                counts[kind] = counts.get(kind, 0) + 1
                if kind == "control":
                    sizes[key.rpartition("/")[2]] = len(store.get(key))
        except Exception as e:  # a listing racing a delete: the next sample lists again
            counts = {"error": 1, "_what": str(e)[:200]}  # type: ignore[dict-item]
        self.samples.append({"time": round(time.time() - t0, 2), "phase": phase, "procs": procs, "store": counts,
                             "bytes": sizes, "disk": self._disk()})

    def _disk(self) -> dict[str, float]:
        """MB on local disk: the trainer's folder (its logs apart: metrics, ledger, TensorBoard) and the
        workers' caches (the largest)."""
        def walk(folder: Path) -> tuple[int, int]:
            data = logs = 0
            for dirpath, _, files in os.walk(folder):
                for f in files:
                    try:
                        n = os.stat(os.path.join(dirpath, f)).st_size
                    except FileNotFoundError:
                        continue
                    if f.endswith((".jsonl", ".log")) or f.startswith("events.out.tfevents"):
                        logs += n
                    else:
                        data += n
            return data, logs

        data, logs = walk(self.run_dir)
        caches = [walk(d)[0] for d in (self.root / "cache").glob("*")] if (self.root / "cache").exists() else []
        mb = lambda n: round(n / 2**20, 3)  # noqa: E731
        return {"trainer_mb": mb(data), "trainer_logs_mb": mb(logs), "caches_mb": mb(sum(caches)),
                "cache_max_mb": mb(max(caches, default=0))}

    def _rl_started(self) -> bool:
        return self.steps() > 0

    def _stopped_at(self) -> int:
        from stoa.fleet.metrics import read_metrics

        rows = read_metrics(self.run_dir / "metrics.jsonl")
        return max((r["rl_step"] for r in rows if r.get("kind") == "event" and r.get("event") == "stopped"), default=0)

    def run(self, timeout: float = 600.0) -> float:  # type: ignore[override]
        """Run the churned fleet, then stop and resume the trainer to finish; returns the wall seconds.
        Raises ``AssertionError`` (with a log tail) when a process fails or ``timeout`` passes."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._bind = os.pipe()
        self._store_on, self._mounts, self._proxy = {}, [], None
        rng = random.Random(self.seed)
        t0 = time.time()
        leaving: dict[str, subprocess.Popen] = {}  # who joins -> the process leaving its slot
        slots = [f"worker-{i}" for i in range(1, self.workers)]  # worker-0 stays
        born = self.workers
        try:
            self._setup()
            self._trainer()
            for i in range(self.workers):
                self._worker(f"worker-{i}")
                self.identities.append(f"worker-{i}")
            churn_from = next_churn = end = None
            last_sample = 0.0
            while True:
                now = time.time()
                if now - t0 > timeout:
                    raise AssertionError(f"the soak did not finish in {timeout:.0f} s:\n{self.log('trainer')[-3000:]}")
                if churn_from is None and self._rl_started():
                    churn_from = now + self.calm_s
                    next_churn, end = churn_from, churn_from + self.seconds
                phase = "start" if churn_from is None else "calm" if now < churn_from else "churn"
                if now - last_sample >= self.sample_s:
                    self._sample(phase, t0)
                    last_sample = now
                for new, old in list(leaving.items()):
                    if old.poll() is not None:
                        del leaving[new]
                        self._worker(new)
                        if new not in self.identities:
                            self.identities.append(new)
                if end is not None and now >= end and not leaving:
                    break
                ready = [s for s in slots if s not in leaving]  # one still leaving is not churned again
                if next_churn is not None and now >= next_churn and now < end and ready:
                    slot = ready[len(self.churns) % len(ready)]
                    how = rng.choice(["SIGTERM", "SIGKILL"])
                    same = rng.random() < 0.5
                    new = slot if same else f"worker-{born}"
                    born += not same
                    p = self.procs[slot]
                    p.send_signal(getattr(signal, how))
                    leaving[new] = p
                    slots[slots.index(slot)] = new
                    self.churns.append({"time": round(now - t0, 2), "left": slot, "how": how, "joined": new,
                                        "step": self.steps()})
                    next_churn += self.churn_s
                if self.procs["trainer"].poll() is not None:
                    raise AssertionError(f"the trainer exited {self.procs['trainer'].returncode}:\n"
                                         f"{self.log('trainer')[-3000:]}")
                time.sleep(0.2)
            self._finish(t0, timeout)
            return time.time() - t0
        finally:
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for fd in self._bind:
                os.close(fd)
            self._teardown()
            with open(self.root / "soak.jsonl", "w") as out:
                for row in self.samples:
                    out.write(json.dumps(row) + "\n")

    def _finish(self, t0: float, timeout: float) -> None:
        """SIGTERM the trainer (a checkpoint), resume it for two more steps, wait for the fleet to leave."""
        trainer = self.procs["trainer"]
        trainer.send_signal(signal.SIGTERM)
        while trainer.poll() is None:
            self._sample("end", t0)
            time.sleep(self.sample_s)
        if trainer.returncode != 0:
            raise AssertionError(f"the stopped trainer exited {trainer.returncode}:\n{self.log('trainer')[-3000:]}")
        steps = self._stopped_at() + 2
        self.procs["trainer (stopped)"] = self.procs.pop("trainer")
        self._spawn("trainer", ["trainer", str(self.config), "--store", self.store_url(), "--key", str(self.key),
                                "--run-dir", str(self.run_dir), "--resume", "--set", f"trainer.steps={steps}"])
        while any(p.poll() is None for p in self.procs.values()):
            if time.time() - t0 > timeout:
                raise AssertionError(f"the resumed run did not finish in {timeout:.0f} s:\n"
                                     f"{self.log('trainer')[-3000:]}")
            self._sample("end", t0)
            time.sleep(self.sample_s)
        bad = {n: p.returncode for n, p in self.procs.items() if n.startswith("trainer") and p.returncode != 0}
        if bad:
            raise AssertionError(f"trainer exit status {bad}:\n{self.log('trainer')[-3000:]}")


def summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Reduce the samples. Per process (by name and pid): its mean resident memory, descriptors and
    threads over the last fifth of the calm phase (``calm_*``: the baseline, for processes alive
    then) and over the last fifth of its life (``last_*``), its maxima, and the least-squares
    slopes (per hour) over the second half of the calm phase and over the churn phase. Per store kind
    (and per control document's size in bytes, and per local disk folder in MB): its count at the
    end of the calm phase, its maximum, at the end of the churn phase and after the finish."""
    lives: dict[tuple[str, int], list[tuple[float, str, dict]]] = {}
    for row in samples:
        for name, s in row["procs"].items():
            lives.setdefault((name, s["pid"]), []).append((row["time"], row["phase"], s))
    fields = ("rss_mb", "fds", "threads")
    procs = []
    for (name, pid), pts in lives.items():
        calm = [p for p in pts if p[1] == "calm"]
        churn = [p for p in pts if p[1] == "churn"]
        calm_tail = calm[-max(1, len(calm) // 5):]
        tail = pts[-max(1, len(pts) // 5):]
        mean = lambda part, f: round(sum(p[2][f] for p in part) / len(part), 2) if part else None  # noqa: E731
        slope = lambda part, f: fit_slope([(p[0], p[2][f]) for p in part])  # noqa: E731
        procs.append({"name": name, "pid": pid, "samples": len(pts), "born": pts[0][0],
                      "seconds": round(pts[-1][0] - pts[0][0], 1),
                      **{f"{f}_calm": mean(calm_tail, f) for f in fields},
                      **{f"{f}_last": mean(tail, f) for f in fields},
                      **{f"{f}_max": max(p[2][f] for p in pts) for f in fields},
                      **{f"{f}_calm_per_h": slope(calm[len(calm) // 2:], f) for f in ("rss_mb", "fds")},
                      **{f"{f}_churn_per_h": slope(churn, f) for f in ("rss_mb", "fds")}})
    kinds: dict[str, dict[str, int]] = {}
    calm_rows = [r for r in samples if r["phase"] == "calm"]
    churn_rows = [r for r in samples if r["phase"] == "churn"]
    for row in samples:
        for kind in row["store"]:
            if not kind.startswith("_"):
                kinds.setdefault(kind, {})
    for kind, d in kinds.items():
        d["calm_end"] = calm_rows[-1]["store"].get(kind, 0) if calm_rows else 0
        d["max"] = max(r["store"].get(kind, 0) for r in samples)
        d["churn_end"] = churn_rows[-1]["store"].get(kind, 0) if churn_rows else 0
        d["end"] = samples[-1]["store"].get(kind, 0)
    sizes: dict[str, dict[str, int]] = {}
    for name in sorted({n for r in samples for n in r.get("bytes", {})}):
        sizes[name] = {"calm_end": calm_rows[-1].get("bytes", {}).get(name, 0) if calm_rows else 0,
                       "max": max(r.get("bytes", {}).get(name, 0) for r in samples),
                       "churn_end": churn_rows[-1].get("bytes", {}).get(name, 0) if churn_rows else 0,
                       "end": samples[-1].get("bytes", {}).get(name, 0)}
    disk = {}
    for what in (samples[0].get("disk") or {}):
        disk[what] = {"calm_end": calm_rows[-1]["disk"][what] if calm_rows else 0,
                      "max": max(r["disk"][what] for r in samples),
                      "churn_end": churn_rows[-1]["disk"][what] if churn_rows else 0, "end": samples[-1]["disk"][what]}
    return {"procs": procs, "store": kinds, "bytes": sizes, "disk": disk}
