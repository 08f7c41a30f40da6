"""``stoa sweep SWEEP.toml``: a grid of real fleet runs over objectives x lags x seeds, and its report.

A sweep file names a run config and the axes of the grid::

    name = "offpolicy"                    # everything goes under <runs>/<name>/
    config = "../examples/papersearch_tiny.toml"   # the run config (relative to this file)
    objectives = ["dppo", "none", "dppo_kl"]       # built-in names, "none", or variants below
    lags = [0, 2, 4, 8]
    seeds = [0, 1, 2]
    parallel = 1                          # cells run at a time (each is a trainer + its workers)
    lag_key = "rollout.lag"               # the run-config key the lag axis sets
    shared_warmstart = true               # one warm start per seed, shared by that seed's cells

    [set]                                 # overrides of every cell (dotted keys, as `--set`)
    "trainer.steps" = 100

    [objective.dppo_kl]                   # a variant: the [objective] table it stands for ...
    kind = "dppo"
    gate = "kl"
    set = { "learner.lr" = 3e-4 }         # ... and overrides of its cells only

    [lag_set.8]                           # overrides of the cells of one lag (or one seed: seed_set)
    "trainer.max_lag" = 9

Each cell is one ``stoa train`` (:func:`stoa.fleet.operator.launcher.train_local`, in its own process): the
trainer and the config's int8 MLX workers meeting in a LocalStore through PULSE, in
``<runs>/<name>/cells/<objective>-lag<L>-seed<S>/``. ``"none"`` (no correction) is ``reinforce``:
the plain policy gradient, with no importance weight, gate or clip. Every cell's config is
resolved before anything runs, so a typo (or a key this version lacks) fails at once, naming it.

**Shared warm start.** With ``shared_warmstart`` (and a config that has a warm start), each seed's
warm start runs once (``trainer.steps = 0``, no workers) and its checkpoint becomes a Hugging Face
folder that the seed's cells start from (``model.path``, warm start off): every objective and lag
of a seed starts from the same policy, so the cells of a seed are paired comparisons, and the grid
pays for one warm start per seed instead of one per cell.

**Resuming.** A cell is finished when its ``summary.json`` exists (``train_local`` writes it last);
running the sweep again skips finished cells and starts unfinished ones from scratch (their folder
is removed first). A failed cell is reported and the others go on.

**Report.** ``results.json`` (``{"sweep": ..., "warmstarts": [...], "cells": [...]}``, each cell
with the fields of :func:`cell_result`), ``results.md`` (one row per objective and lag, mean and
min..max over seeds) and ``plots/``: learning curves per objective, final pass@1 vs lag with the
seed spread, gate fraction vs lag, mismatch KL vs lag.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stoa.backends.export import ExportError, export_checkpoint
from stoa.errors import ExpectedFailure
from stoa.fleet.config import ConfigError, load_config
from stoa.fleet.metrics import read_metrics

__all__ = ["ALIASES", "Cell", "SweepConfig", "SweepError", "cell_result", "collect", "load_sweep", "plan_cells",
           "run_sweep", "summarize_cells", "validate", "write_report"]

ALIASES: dict[str, dict[str, Any]] = {"none": {"kind": "reinforce"}}
"""Objective names a sweep knows besides the built-ins: ``"none"`` is the no-correction baseline."""

_FINISHED = "summary.json"
_WARM_MARKER = "warmstart.json"


class SweepError(ExpectedFailure, ValueError):
    """The sweep file is invalid, or a shared warm start could not be turned into a model folder."""

    exit_code = 2


@dataclass(frozen=True)
class SweepConfig:
    """A sweep: the run config, the three axes and the overrides (see the module docstring)."""

    name: str
    """Sweep name: the folder ``<runs>/<name>/``."""
    config: Path
    """The run config every cell starts from."""
    objectives: tuple[str, ...]
    """Objective axis: built-in objective names, ``"none"``, or keys of :attr:`objective`."""
    lags: tuple[int, ...]
    """Lag axis: values of :attr:`lag_key` (versions behind the trainer's head)."""
    seeds: tuple[int, ...]
    """Seed axis: the run's ``seed`` (model init, data, sampling, warm start)."""
    parallel: int = 1
    """Cells (and warm starts) running at a time."""
    lag_key: str = "rollout.lag"
    """Dotted run-config key the lag axis sets."""
    shared_warmstart: bool = True
    """Warm start once per seed and start that seed's cells from it."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """``[set]``: dotted-key overrides of every cell."""
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``[objective.<name>]``: the ``[objective]`` table each variant stands for (``kind`` + options)."""
    variant_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``[objective.<name>].set``: overrides of that variant's cells."""
    lag_overrides: dict[int, dict[str, Any]] = field(default_factory=dict)
    """``[lag_set.<lag>]``: overrides of one lag's cells."""
    seed_overrides: dict[int, dict[str, Any]] = field(default_factory=dict)
    """``[seed_set.<seed>]``: overrides of one seed's cells (and its warm start)."""

    def __post_init__(self) -> None:
        ok = bool(self.name) and all(c.isalnum() or c in "-_." for c in self.name) and self.name[0] != "."
        _check(ok, f"name {self.name!r} must be non-empty and use only letters, digits, '-', '_', '.'")
        for axis in ("objectives", "lags", "seeds"):
            values = getattr(self, axis)
            _check(len(values) > 0 and len(set(values)) == len(values), f"{axis} must be a non-empty list without repeats")
        for o in self.objectives:
            _check(isinstance(o, str) and bool(o) and all(c.isalnum() or c in "-_." for c in o),
                   f"objectives: {o!r} must be a name of letters, digits, '-', '_', '.'")
        _check(all(type(v) is int and v >= 0 for v in self.lags + self.seeds), "lags and seeds must be integers >= 0")
        _check(type(self.parallel) is int and self.parallel >= 1, "parallel must be an integer >= 1")
        _check(isinstance(self.lag_key, str) and all(self.lag_key.split(".")), "lag_key must be a dotted key")

    def objective_table(self, label: str) -> dict[str, Any]:
        """The ``[objective]`` table of the cells labelled ``label``."""
        if label in self.variants:
            return dict(self.variants[label])
        return dict(ALIASES.get(label, {"kind": label}))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["config"] = str(self.config)
        d["lag_overrides"] = {str(k): v for k, v in self.lag_overrides.items()}
        d["seed_overrides"] = {str(k): v for k, v in self.seed_overrides.items()}
        return d


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise SweepError(msg)


_KEYS = {"name", "config", "objectives", "lags", "seeds", "parallel", "lag_key", "shared_warmstart", "set",
         "objective", "lag_set", "seed_set"}


def load_sweep(path: str | Path, **replace: Any) -> SweepConfig:
    """Read a sweep file; ``replace`` sets fields after reading (e.g. ``parallel=2``).

    Raises:
        SweepError: an unknown key, a value of the wrong type, an objective that is neither a
            built-in, ``"none"`` nor a variant defined in the file.
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SweepError(f"{path}: {e}") from None
    unknown = sorted(set(data) - _KEYS)
    _check(not unknown, f"{path}: unknown key(s) {unknown}; valid: {sorted(_KEYS)}")
    for key in ("name", "config", "objectives", "lags", "seeds"):
        _check(key in data, f"{path}: missing {key!r}")
    _check(isinstance(data["config"], str), "config must be a path (string)")
    for key in ("objectives", "lags", "seeds"):
        _check(isinstance(data[key], list), f"{key} must be a list")
    variants, variant_sets = {}, {}
    table = data.get("objective", {})
    _check(isinstance(table, dict), "[objective] must hold tables [objective.<name>]")
    for name, t in table.items():
        _check(isinstance(t, dict) and isinstance(t.get("kind"), str), f"objective.{name} must be a table with a kind")
        t = dict(t)
        variant_sets[name] = _overrides(t.pop("set", {}), f"objective.{name}.set")
        variants[name] = t
    fields_ = {
        "name": data["name"], "config": (path.parent / data["config"]).resolve(),
        "objectives": tuple(data["objectives"]), "lags": tuple(data["lags"]), "seeds": tuple(data["seeds"]),
        "overrides": _overrides(data.get("set", {}), "set"), "variants": variants, "variant_overrides": variant_sets,
        "lag_overrides": _axis_overrides(data.get("lag_set", {}), "lag_set"),
        "seed_overrides": _axis_overrides(data.get("seed_set", {}), "seed_set"),
    }
    for key in ("parallel", "lag_key", "shared_warmstart"):
        if key in data:
            fields_[key] = data[key]
    _check(isinstance(fields_.get("shared_warmstart", True), bool), "shared_warmstart must be true or false")
    fields_.update(replace)
    sweep = SweepConfig(**fields_)
    from stoa.algos import OBJECTIVES

    for o in sweep.objectives:
        _check(o in variants or o in ALIASES or o in OBJECTIVES,
               f"objectives: {o!r} is not a built-in objective {sorted(OBJECTIVES)}, 'none', or a variant "
               f"[objective.{o}] of this file")
    return sweep


def _overrides(table: Any, where: str) -> dict[str, Any]:
    _check(isinstance(table, dict), f"[{where}] must be a table of dotted keys")
    for k in table:
        # The sweep sets these per cell; an override would be silently replaced.
        _check(k not in ("name", "seed") and k.split(".")[0] != "objective",
               f"[{where}] {k!r}: the sweep sets name, seed and the objective itself "
               "(objective options go in an [objective.<name>] variant)")
    return dict(table)


def _axis_overrides(table: Any, where: str) -> dict[int, dict[str, Any]]:
    _check(isinstance(table, dict), f"[{where}] must hold tables [{where}.<value>]")
    out = {}
    for k, v in table.items():
        _check(str(k).isdigit(), f"[{where}.{k}]: the key must be an axis value (an integer)")
        out[int(k)] = _overrides(v, f"{where}.{k}")
    return out


@dataclass(frozen=True)
class Cell:
    """One point of the grid: a run name (``id``) and the overrides that make it."""

    objective: str
    lag: int
    seed: int
    overrides: dict[str, Any]

    @property
    def id(self) -> str:
        return f"{self.objective}-lag{self.lag}-seed{self.seed}"


def plan_cells(sweep: SweepConfig, warm_dirs: dict[int, Path] | None = None) -> list[Cell]:
    """Every cell of the grid, in objective-major order, with its overrides (later ones win:
    ``[set]``, seed, lag, objective variant, then the axis values themselves)."""
    cells = []
    for obj in sweep.objectives:
        for lag in sweep.lags:
            for seed in sweep.seeds:
                o = {**sweep.overrides, **sweep.seed_overrides.get(seed, {}), **sweep.lag_overrides.get(lag, {}),
                     **sweep.variant_overrides.get(obj, {})}
                o.update({"name": f"{obj}-lag{lag}-seed{seed}", "seed": seed, sweep.lag_key: lag,
                          "objective": sweep.objective_table(obj)})
                if warm_dirs and seed in warm_dirs:
                    o.update({"model.path": str(warm_dirs[seed]), "warmstart.steps": 0,
                              "warmstart.practice_steps": 0, "warmstart.practice_answer_only": 0})
                cells.append(Cell(obj, lag, seed, o))
    return cells


def _warm_overrides(sweep: SweepConfig, seed: int) -> dict[str, Any]:
    return {**sweep.overrides, **sweep.seed_overrides.get(seed, {}), "name": f"warmstart-seed{seed}", "seed": seed,
            "trainer.steps": 0, "fleet.workers": 0, "eval.num_questions": 1, "eval.samples": 1}


def _needs_warmstart(sweep: SweepConfig) -> bool:
    if not sweep.shared_warmstart:
        return False
    ws = load_config(sweep.config, _warm_overrides(sweep, sweep.seeds[0])).warmstart
    return bool(ws.steps or ws.practice_steps)


def validate(sweep: SweepConfig) -> list[Cell]:
    """Resolve every cell's run config (and each warm start's); returns the cells.

    Raises:
        SweepError: a cell's config is invalid (the message names the cell and the key).
    """
    warm = {s: Path(f"<shared warm start of seed {s}>") for s in sweep.seeds} if _safe_needs(sweep) else None
    cells = plan_cells(sweep, warm)
    for cell in cells:
        try:
            load_config(sweep.config, cell.overrides)
        except ConfigError as e:
            raise SweepError(f"cell {cell.id}: {e}") from None
    if warm:
        for seed in sweep.seeds:
            try:
                load_config(sweep.config, _warm_overrides(sweep, seed))
            except ConfigError as e:
                raise SweepError(f"warm start of seed {seed}: {e}") from None
    return cells


def _safe_needs(sweep: SweepConfig) -> bool:
    try:
        return _needs_warmstart(sweep)
    except ConfigError as e:
        raise SweepError(f"warm start: {e}") from None


# -- running ----------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def _train_args(config: Path, runs: Path, overrides: dict[str, Any]) -> list[str]:
    args = [sys.executable, "-m", "stoa", "train", str(config), "--runs", str(runs)]
    for k, v in overrides.items():
        args += ["--set", f"{k}={json.dumps(v)}"]
    return args


def _run_jobs(jobs: list[tuple[str, list[str], Path]], parallel: int, say: Callable[[str], None]) -> dict[str, int]:
    """Run ``(label, argv, log)`` jobs, ``parallel`` at a time; returns each label's exit code."""
    pending, running, codes = list(jobs), {}, {}
    try:
        while pending or running:
            while pending and len(running) < parallel:
                label, argv, log = pending.pop(0)
                log.parent.mkdir(parents=True, exist_ok=True)
                # Own session: an interrupt reaches each run once, from here (it then stops its fleet).
                with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
                    running[label] = (subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=_env(),
                                                       start_new_session=True), time.time())
                say(f"started {label} (log {log})")
            for label, (proc, t0) in list(running.items()):
                if proc.poll() is not None:
                    codes[label] = proc.returncode
                    del running[label]
                    say(f"{'finished' if proc.returncode == 0 else 'FAILED'} {label} "
                        f"in {time.time() - t0:.0f} s (exit {proc.returncode})")
            time.sleep(0.5)
    except KeyboardInterrupt:
        for proc, _ in running.values():
            proc.send_signal(signal.SIGINT)
        for proc, _ in running.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise
    return codes


def _warm_check(run_dir: Path) -> float | None:
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "warmstart/p_final_turn" in r]
    return rows[-1]["warmstart/p_final_turn"] if rows else None


def run_sweep(sweep: SweepConfig, runs_root: str | Path = "runs", say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every unfinished cell (and warm start), then write and return the report."""
    root = Path(runs_root) / sweep.name
    root.mkdir(parents=True, exist_ok=True)
    cells = validate(sweep)
    (root / "sweep.json").write_text(json.dumps(sweep.to_dict(), indent=2, default=str) + "\n")
    warm_dirs: dict[int, Path] = {}
    if _needs_warmstart(sweep):
        jobs = []
        for seed in sweep.seeds:
            hf = (root / "warmstart" / f"seed{seed}-model").resolve()
            warm_dirs[seed] = hf
            if not (hf / _WARM_MARKER).exists():
                shutil.rmtree(root / "warmstart" / f"warmstart-seed{seed}", ignore_errors=True)
                jobs.append((f"warmstart-seed{seed}", _train_args(sweep.config, root / "warmstart",
                                                                  _warm_overrides(sweep, seed)),
                             root / "logs" / f"warmstart-seed{seed}.log"))
        codes = _run_jobs(jobs, sweep.parallel, say)
        for seed in sweep.seeds:
            run_dir, hf = root / "warmstart" / f"warmstart-seed{seed}", warm_dirs[seed]
            if codes.get(f"warmstart-seed{seed}", 0) != 0:
                raise SweepError(f"the warm start of seed {seed} failed; see {root / 'logs'}")
            if not (hf / _WARM_MARKER).exists():
                model = load_config(sweep.config, _warm_overrides(sweep, seed)).model.path
                shutil.rmtree(hf, ignore_errors=True)  # a leftover of an interrupted export
                try:  # the warm start's newest checkpoint, as a Hugging Face folder (either learner's)
                    export_checkpoint(run_dir, hf, model_dir=Path(model).expanduser() if model else run_dir / "model")
                except ExportError as e:
                    raise SweepError(f"the warm start of seed {seed} left nothing to export: {e}") from None
                summary = json.loads((run_dir / _FINISHED).read_text())
                (hf / _WARM_MARKER).write_text(json.dumps({
                    "seed": seed, "p_final_turn": _warm_check(run_dir), "wall_seconds": summary.get("wall_seconds"),
                }) + "\n")
        cells = plan_cells(sweep, warm_dirs)
    cells_dir = root / "cells"
    todo = []
    for cell in cells:
        if (cells_dir / cell.id / _FINISHED).exists():
            continue
        shutil.rmtree(cells_dir / cell.id, ignore_errors=True)
        todo.append((cell.id, _train_args(sweep.config, cells_dir, cell.overrides), root / "logs" / f"{cell.id}.log"))
    say(f"sweep {sweep.name}: {len(cells)} cells, {len(cells) - len(todo)} already finished, "
        f"{len(todo)} to run, {sweep.parallel} at a time")
    codes = _run_jobs(todo, sweep.parallel, say)
    report = collect(sweep, runs_root, failed={k for k, v in codes.items() if v != 0})
    write_report(report, root)
    return report


def collect(sweep: SweepConfig, runs_root: str | Path = "runs", failed: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """The report of whatever has finished: ``{"sweep", "warmstarts", "cells"}`` (no run is started)."""
    root = Path(runs_root) / sweep.name
    markers = [root / "warmstart" / f"seed{s}-model" / _WARM_MARKER for s in sweep.seeds]
    warm = {s: m.parent.resolve() for s, m in zip(sweep.seeds, markers) if m.exists()}
    cells = plan_cells(sweep, warm or None)
    return {"sweep": sweep.to_dict(), "warmstarts": [json.loads(m.read_text()) for m in markers if m.exists()],
            "cells": [cell_result(c, root / "cells" / c.id, failed=c.id in failed) for c in cells]}


# -- results ------------------------------------------------------------------------------------


def _mean(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return float(sum(vals) / len(vals)) if vals else None


def cell_result(cell: Cell, run_dir: Path, failed: bool = False) -> dict[str, Any]:
    """One cell's numbers from its ``metrics.jsonl``.

    ``status`` (``"done"``, ``"failed"``, ``"missing"``); ``final_pass_at_1``, ``best_pass_at_1``,
    ``start_pass_at_1`` and ``best_to_last_gap`` from the held-out evaluations; ``curve``
    (``[[version, pass@1], ...]``); ``final_eval`` (every ``eval/*`` number of the last
    evaluation: the task's metrics, e.g. ``eval/searched``); means over the RL steps of
    ``gate_fraction`` (the fraction of tokens whose gradient the objective's own trust mechanism
    zeroed: ``gate/masked_frac`` for gates, ``clip/frac`` for clips, 0 for an objective with
    neither), ``tv_gate_fraction`` (what DPPO's default TV gate masks or would mask, the same for
    every objective), ``tv_gate_pos_fraction`` / ``tv_gate_neg_fraction`` (by advantage sign),
    ``kl_mu_pi`` (k3 KL(mu || pi)), ``kl_int8`` / ``kl_stale`` (its int8 and staleness parts, from
    ``trainer.mismatch_every`` steps; None when off), ``abs_log_ratio``, ``ratio_gt2_frac``, ``ratio_gt10_frac``,
    ``staleness_mean``; ``steps`` and ``wall_seconds``.
    """
    out: dict[str, Any] = {"id": cell.id, "objective": cell.objective, "lag": cell.lag, "seed": cell.seed,
                           "objective_table": cell.overrides.get("objective")}
    summary_path = run_dir / _FINISHED
    if not summary_path.exists():
        out["status"] = "failed" if failed else "missing"
        return out
    rows = read_metrics(run_dir / "metrics.jsonl")
    evals = [r for r in rows if r.get("kind") == "eval" and isinstance(r.get("eval/pass@1"), (int, float))]
    train = [r for r in rows if r.get("kind") == "train"]
    passes = [r["eval/pass@1"] for r in evals]
    if any("gate/masked_frac" in r for r in train):
        gate = _mean(train, "gate/masked_frac")
    elif any("clip/frac" in r for r in train):
        gate = _mean(train, "clip/frac")
    else:
        gate = 0.0 if any("mismatch/kl_all" in r for r in train) else None
    summary = json.loads(summary_path.read_text())
    out.update({
        "status": "done",
        "final_pass_at_1": passes[-1] if passes else None,
        "best_pass_at_1": max(passes) if passes else None,
        "start_pass_at_1": passes[0] if passes else None,
        "best_to_last_gap": (max(passes) - passes[-1]) if passes else None,
        "gate_fraction": gate,
        "tv_gate_fraction": _mean(train, "mismatch/tv_gate_frac"),
        "tv_gate_pos_fraction": _mean(train, "mismatch/tv_gate_pos_frac"),
        "tv_gate_neg_fraction": _mean(train, "mismatch/tv_gate_neg_frac"),
        "kl_mu_pi": _mean(train, "mismatch/kl_all"),
        "kl_int8": _mean(train, "mismatch/kl_int8"),
        "kl_stale": _mean(train, "mismatch/kl_stale"),
        "abs_log_ratio": _mean(train, "mismatch/abs_log_ratio"),
        "ratio_gt2_frac": _mean(train, "mismatch/ratio_gt2_frac"),
        "ratio_gt10_frac": _mean(train, "mismatch/ratio_gt10_frac"),
        "staleness_mean": _mean(train, "staleness/mean"),
        "steps": len(train),
        "wall_seconds": summary.get("wall_seconds"),
        "curve": [[r["version"], r["eval/pass@1"]] for r in evals],
        "final_eval": {k: v for k, v in (evals[-1] if evals else {}).items()
                       if k.startswith("eval/") and isinstance(v, (int, float)) and not isinstance(v, bool)},
    })
    return out


def summarize_cells(cells: Sequence[dict[str, Any]], key: str) -> dict[tuple[str, int], tuple[float, float, float, int]]:
    """``{(objective, lag): (mean, min, max, n)}`` of ``key`` over the finished seeds."""
    groups: dict[tuple[str, int], list[float]] = {}
    for c in cells:
        v = c.get(key)
        if c.get("status") == "done" and isinstance(v, (int, float)) and math.isfinite(v):
            groups.setdefault((c["objective"], c["lag"]), []).append(float(v))
    return {k: (sum(v) / len(v), min(v), max(v), len(v)) for k, v in groups.items()}


_TABLE = (("final_pass_at_1", "final pass@1", True), ("best_pass_at_1", "best pass@1", True),
          ("best_to_last_gap", "best-to-last", True), ("gate_fraction", "gate frac", True),
          ("tv_gate_fraction", "TV-gate frac", True), ("kl_mu_pi", "KL(mu||pi)", False),
          ("abs_log_ratio", "mean abs log r", False), ("ratio_gt2_frac", "r > 2", True),
          ("ratio_gt10_frac", "r > 10", True), ("staleness_mean", "staleness", False))


def _fmt(stat: tuple[float, float, float, int] | None, pct: bool) -> str:
    if stat is None:
        return "-"
    mean, lo, hi, n = stat
    f = (lambda x: f"{100 * x:.1f}%") if pct else (lambda x: f"{x:.3g}")
    return f(mean) if n == 1 or lo == hi else f"{f(mean)} ({f(lo)}..{f(hi)})"


def write_report(report: dict[str, Any], root: Path) -> list[Path]:
    """``results.json``, ``results.md`` and the plots of a sweep report; returns the written paths."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "results.json").write_text(json.dumps(report, indent=2, allow_nan=False, default=str) + "\n")
    cells = report["cells"]
    stats = {key: summarize_cells(cells, key) for key, _, _ in _TABLE}
    keys = sorted({(c["objective"], c["lag"]) for c in cells},
                  key=lambda k: (list(dict.fromkeys(c["objective"] for c in cells)).index(k[0]), k[1]))
    sweep = report.get("sweep", {})
    lines = [f"# Sweep {sweep.get('name', '')}", "",
             (f"Run config `{sweep.get('config', '')}`; lag key `{sweep.get('lag_key', '')}`; "
              f"{len(cells)} cells, {sum(c.get('status') == 'done' for c in cells)} finished. "
              "Each entry: mean over seeds (min..max). Fractions are of model tokens, means over RL steps."), "",
             "| objective | lag | seeds | " + " | ".join(t for _, t, _ in _TABLE) + " |",
             "|---|---|---|" + "---|" * len(_TABLE)]
    for k in keys:
        n = sum(c["objective"] == k[0] and c["lag"] == k[1] and c.get("status") == "done" for c in cells)
        lines.append(f"| {k[0]} | {k[1]} | {n} | " + " | ".join(_fmt(stats[key].get(k), pct)
                                                               for key, _, pct in _TABLE) + " |")
    for w in report.get("warmstarts", []):
        p = w.get("p_final_turn")
        lines.append(f"\nShared warm start of seed {w['seed']}: p(final turn | held-out practice) "
                     f"{'-' if p is None else f'{p:.2f}'}, {w.get('wall_seconds')} s.")
    failed = [c["id"] for c in cells if c.get("status") != "done"]
    if failed:
        lines.append(f"\nNot finished: {', '.join(failed)}.")
    paths = _plots(cells, keys, root / "plots")
    lines += ["", *(f"![{p.stem}](plots/{p.name})" for p in paths)]
    (root / "results.md").write_text("\n".join(lines) + "\n")
    return [root / "results.json", root / "results.md", *paths]


def _plots(cells: Sequence[dict[str, Any]], keys: list[tuple[str, int]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    done = [c for c in cells if c.get("status") == "done"]
    objectives = list(dict.fromkeys(k[0] for k in keys))
    lags = sorted({k[1] for k in keys})
    colors = {lag: plt.cm.viridis(i / max(1, len(lags) - 1)) for i, lag in enumerate(lags)}
    paths = []

    cols = min(4, len(objectives))
    rows = math.ceil(len(objectives) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False, sharey=True)
    for ax, obj in zip(axes.flat, objectives):
        for c in (c for c in done if c["objective"] == obj):
            v = [p[0] for p in c["curve"]]
            ax.plot(v, [p[1] for p in c["curve"]], "o-", ms=3, color=colors[c["lag"]], alpha=0.8,
                    label=f"lag {c['lag']}" if c["seed"] == min(x["seed"] for x in done) else None)
        ax.set_title(obj)
        ax.set_xlabel("policy version")
        ax.set_ylim(-0.02, 1.02)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in axes.flat[len(objectives):]:
        ax.axis("off")
    axes[0][0].set_ylabel("held-out pass@1")
    fig.suptitle("Learning curves per objective (one line per lag and seed)")
    fig.tight_layout()
    paths.append(_save(plt, fig, out / "learning_curves.png"))

    for key, title, ylabel, name in (
        ("final_pass_at_1", "Final pass@1 vs lag (mean, min..max over seeds)", "held-out pass@1", "final_vs_lag.png"),
        ("gate_fraction", "Gate fraction vs lag (the objective's own mask or clip)", "fraction of model tokens",
         "gate_vs_lag.png"),
        ("kl_mu_pi", "Mismatch KL(mu || pi) vs lag", "k3 estimate, mean over steps", "kl_vs_lag.png"),
    ):
        stats = summarize_cells(done, key)
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, obj in enumerate(objectives):
            pts = [(lag, stats[(obj, lag)]) for lag in lags if (obj, lag) in stats]
            if not pts:
                continue
            x = [p[0] + 0.08 * (i - len(objectives) / 2) for p in pts]  # small offsets keep bars apart
            mean = [p[1][0] for p in pts]
            ax.errorbar(x, mean, yerr=[[m - p[1][1] for m, p in zip(mean, pts)], [p[1][2] - m for m, p in zip(mean, pts)]],
                        marker="o", capsize=3, label=obj)
            for c in (c for c in done if c["objective"] == obj and isinstance(c.get(key), (int, float))):
                ax.plot(c["lag"] + 0.08 * (i - len(objectives) / 2), c[key], ".", color="gray", alpha=0.5)
        ax.set_xlabel("lag (versions behind the trainer)")
        ax.set_ylabel(ylabel)
        ax.set_xticks(lags)
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(_save(plt, fig, out / name))
    return paths


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
