"""A run's store and run folder written as the real components write them, for the dashboard's
tests and benchmark: versions published by :class:`~stoa.transport.chain.WeightPublisher` (their
learning figures in the signed metadata), heartbeats by :func:`~stoa.fleet.run.write_heartbeat`,
a signed trust report and evaluations, rollouts waiting, quarantined objects, and a
``metrics.jsonl`` by :class:`~stoa.fleet.metrics.MetricsSink`.

:class:`CountingStore` wraps a store and counts its reads (the dashboard's cost on the store).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stoa.fleet.metrics import MetricsSink
from stoa.fleet.run import Heartbeat, write_heartbeat
from stoa.transport import layout
from stoa.transport.chain import WeightPublisher
from stoa.transport.signing import generate_private_key, sign_document
from stoa.transport.store import LocalStore

__all__ = ["CountingStore", "ShowRun", "show_run"]

READS = ("get", "get_range", "list", "exists", "size")


class CountingStore:
    """``store`` with every read (:data:`READS`) counted in :attr:`reads` by method."""

    def __init__(self, store: Any):
        self.inner, self.reads = store, Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in READS:
            return attr

        def counted(*a: Any, **kw: Any) -> Any:
            self.reads[name] += 1
            return attr(*a, **kw)
        return counted

    def __repr__(self) -> str:
        return f"CountingStore({self.inner!r})"


@dataclass
class ShowRun:
    store: LocalStore
    run: str
    run_dir: Path
    public_key: Any
    head: int
    evals: list[int]
    train_steps: int


def _state(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"model.layers.0.mlp.up_proj.weight": rng.integers(0, 256, (64, 128), dtype=np.uint8),
            "model.layers.0.mlp.up_proj.scales": rng.standard_normal((64, 2)).astype(np.float16),
            "model.layers.0.mlp.up_proj.biases": rng.standard_normal((64, 2)).astype(np.float16),
            "model.norm.weight": rng.standard_normal(128).astype(np.float32)}


def show_run(root: str | Path, workers: int = 3, versions: int = 4, *, extra_workers: list[Heartbeat] | None = None,
             trust_extra: dict[str, dict[str, Any]] | None = None, run: str = "demo", seed: int = 0) -> ShowRun:
    """Write a run of ``versions`` published versions (0 .. versions-1) and ``workers`` honest workers
    ``worker-<i>`` under ``root``/store and ``root``/run (its ``metrics.jsonl``); plus
    ``extra_workers``' heartbeats (stored under a key of their own, whatever id they carry) and
    ``trust_extra`` (key id -> trust record) in the signed trust report."""
    root = Path(root)
    store, key, rng = LocalStore(root / "store"), generate_private_key(), np.random.default_rng(seed)
    store.put(layout.config(run), sign_document("run-config", {"config": {"name": run}}, key))
    pub = WeightPublisher(store, run, key, anchor_every=50)
    state = _state(rng)
    for v in range(versions):
        codes = state["model.layers.0.mlp.up_proj.weight"].reshape(-1)
        idx = rng.choice(codes.size, 40, replace=False)
        codes[idx] = np.clip(codes[idx].astype(int) + 1, 0, 255).astype(np.uint8)
        frac = 0.0 if v == 0 else min(1.0, 0.2 * v)
        pub.publish(v, state, metadata={"learning": {"signal_frac": frac, "flat_steps": 0 if frac else 1,
                                                     "reward": 0.1 * v}})
    head, now = versions - 1, time.time()
    trust: dict[str, dict[str, Any]] = {}
    for i in range(workers):
        wid = f"worker-{i}"
        write_heartbeat(store, run, Heartbeat(wid, head - i % 2, "generating", 32 * (i + 1), 2 * (i + 1), 3.0,
                                              400.0 + i, "int8", f"host-{i}", now - i))
        trust[f"{i:016x}"] = {"worker_id": wid, "accepted_batches": 2 * (i + 1), "trained_episodes": 32 * (i + 1),
                              "rejected": {}, "banned": "", "last_seen": now}
        store.put(f"{layout.rollouts(run, wid)}{i:012d}.bin", b"x")
    for j, hb in enumerate(extra_workers or []):
        store.put(f"{layout.heartbeats(run)}extra-{j}.json", hb.to_json())
    trust.update(trust_extra or {})
    store.put(layout.trust_report(run), sign_document("trust-report", {
        "run": run, "version": head, "time": now, "mode": "enrolled", "workers": trust, "keys": len(trust),
        "banned_keys": sum(bool(t.get("banned")) for t in trust.values()),
        "anonymous": {"stranger": {"unsigned": 2}}}, key))
    evals = list(range(0, versions, 2))
    for v in evals:
        store.put(layout.evaluation(run, v), sign_document("eval", {"run": run, "version": v, "metrics": {
            "eval/pass@1": 0.1 + 0.1 * v, "eval/searched": 0.3 + 0.05 * v, "eval/questions": 50}}, key))
    store.put(f"{layout.quarantine(run, 'worker-0')}000000000009.reason.json", b'{"reason": "replay"}')
    sink = MetricsSink(root / "run", tensorboard=False, wandb=False)
    sink.log("event", 0, event="started", headline=["searched"])
    for v in range(versions):
        if v in evals:
            sink.log("eval", v, **{"eval/pass@1": 0.1 + 0.1 * v, "eval/searched": 0.3 + 0.05 * v})
        if v:
            sink.log("train", v, **{"reward/mean": 0.1 * v, "groups/signal_frac": min(1.0, 0.2 * v),
                                    "gate/masked_frac": 0.001 * v, "staleness/mean": 0.5, "staleness/max": 1,
                                    "pulse/bytes": 1000 + 10 * v, "pulse/full_bytes": 9000,
                                    "pulse/anchor": False})
    sink.close()
    return ShowRun(store, run, root / "run", key.public_key(), head, evals, versions - 1)
