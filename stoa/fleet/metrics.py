"""Where a run's numbers go: ``metrics.jsonl``, TensorBoard scalars, and the end-of-run plots.

Every row of ``metrics.jsonl`` is one JSON object with a ``kind`` (``"train"``, ``"eval"``,
``"warmstart"``, ``"event"``), the policy ``version`` it refers to, the wall ``time`` and flat
scalar metrics named ``group/name`` (``docs/fleet.md``, "Metrics", says what each name means).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("stoa.metrics")

__all__ = ["MetricsSink", "peak_rss_mib", "read_metrics", "write_plots"]


class MetricsSink:
    """Appends rows to ``<dir>/metrics.jsonl`` and mirrors numeric values to TensorBoard (when the
    ``tensorboard`` package is installed) and to Weights & Biases (when ``wandb`` is installed and
    ``WANDB_PROJECT`` is set; ``WANDB_MODE=offline`` keeps it on disk). A row's ``version`` is
    logged as the metric ``version`` in W&B, whose own step counts rows."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, wandb: bool | None = None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._f = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard:
            try:
                from tensorboard.summary.writer.event_file_writer import EventFileWriter
            except ImportError:
                log.info("tensorboard is not installed: metrics go to metrics.jsonl only")
            else:
                self._tb = EventFileWriter(str(self.dir / "tensorboard"))
        self._wandb = _start_wandb(self.dir) if (wandb is None and os.environ.get("WANDB_PROJECT")) or wandb else None

    def log(self, kind: str, version: int, **metrics: Any) -> dict[str, Any]:
        row = {"kind": kind, "version": int(version), "time": round(time.time(), 3)}
        row.update({k: _clean(v) for k, v in metrics.items()})
        self._f.write(json.dumps(row, sort_keys=True) + "\n")
        scalars = {k if "/" in k else f"{kind}/{k}": float(v) for k, v in row.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("version", "time")}
        if self._tb is not None and scalars:
            from tensorboard.compat.proto import event_pb2, summary_pb2

            values = [summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
            self._tb.add_event(event_pb2.Event(wall_time=row["time"], step=row["version"],
                                               summary=summary_pb2.Summary(value=values)))
        if self._wandb is not None and scalars:
            self._wandb.log({**scalars, "version": row["version"]})
        return row

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def peak_rss_mib() -> float:
    """This process's own peak resident memory so far, in MiB: ``VmHWM`` on Linux, else
    ``ru_maxrss``. On Linux ``ru_maxrss`` keeps the parent's peak across fork and exec, so a
    process started by a big one (a benchmark, a test runner) would report its parent's."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 1024)  # bytes on macOS, KiB elsewhere


def _start_wandb(run_dir: Path) -> Any:
    """A W&B run named after the run folder, its config the resolved run config; None without wandb."""
    try:
        import wandb
    except ImportError:
        log.warning("WANDB_PROJECT is set but wandb is not installed (pip install wandb): not logging to W&B")
        return None
    config = None
    if (run_dir / "config.json").is_file():
        try:
            config = json.loads((run_dir / "config.json").read_text())
        except ValueError:
            config = None
    return wandb.init(project=os.environ.get("WANDB_PROJECT"), name=run_dir.name, dir=str(run_dir),
                      config=config, resume="allow", id=os.environ.get("WANDB_RUN_ID"))


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):  # numpy / torch scalars
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a ``metrics.jsonl`` (a torn last line from a crash is skipped)."""
    rows = []
    p = Path(path)
    if not p.exists():
        return rows
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def write_plots(rows: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """PNG plots of a finished run; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    evals = [r for r in rows if r.get("kind") == "eval"]
    train = [r for r in rows if r.get("kind") == "train"]
    paths = []

    headline = next((list(r.get("headline") or []) for r in rows
                     if r.get("kind") == "event" and r.get("event") == "started"), [])
    fig, ax = plt.subplots(figsize=(6, 4))
    if evals:
        v = [r["version"] for r in evals]
        ax.plot(v, [r.get("eval/pass@1") for r in evals], "o-", label="pass@1 (held out)")
        for m in headline:
            ax.plot(v, [r.get(f"eval/{m}") for r in evals], "s-", label=f"{m} (held out)")
    if train:
        for m in headline:
            ax.plot([r["version"] for r in train], [r.get(f"rollout/{m}") for r in train], alpha=0.35,
                    label=f"{m} (rollouts)")
    ax.set_ylim(-0.02, 1.02)
    paths.append(_finish(plt, fig, ax, "Learning curve", None, out / "pass_at_1.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    pub = [r for r in train if r.get("pulse/bytes")]
    if pub:
        ax.semilogy([r["version"] for r in pub], [r["pulse/bytes"] for r in pub], ".", label="published bytes")
        ax.semilogy([r["version"] for r in pub], [r["pulse/full_bytes"] for r in pub], "-", label="full int8 checkpoint")
    paths.append(_finish(plt, fig, ax, "PULSE: delta size vs full checkpoint", "bytes", out / "delta_bytes.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        v = [r["version"] for r in train]
        ax.plot(v, [r.get("gate/masked_frac") for r in train], label="masked (total)")
        ax.plot(v, [r.get("gate/masked_high_frac") for r in train], label="masked high (A>0, pi-mu>delta)")
        ax.plot(v, [r.get("gate/masked_low_frac") for r in train], label="masked low (A<0, pi-mu<-delta)")
    paths.append(_finish(plt, fig, ax, "DPPO gate", "fraction of model tokens", out / "gate_fraction.png"))
    return paths


def _finish(plt, fig, ax, title: str, ylabel: str | None, path: Path) -> Path:
    ax.set_xlabel("policy version")
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
