"""`benchmarks/offpolicy.py`: the run configs and sweep files it writes resolve for every cell of
its grids, without running anything (the study itself is hours of fleet runs)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from stoa.fleet.config import import_env_module, load_config
from stoa.fleet.operator.sweep import load_sweep, validate

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("offpolicy_bench", ROOT / "benchmarks" / "offpolicy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("task, grid", [("hard", "FULL"), ("hard", "QUICK"), ("arithmetic", "ARITH_FULL"),
                                        ("arithmetic", "ARITH_QUICK")])
def test_every_cell_of_the_grids_resolves(tmp_path, task, grid):
    bench = _bench()
    g = getattr(bench, grid)
    (tmp_path / "run.toml").write_text(bench.run_config(task, g))
    (tmp_path / "sweep.toml").write_text(bench.sweep_file("offpolicy-test", g, "rollout.lag", 1,
                                                          bench.study_settings(task, g)))
    sweep = load_sweep(tmp_path / "sweep.toml")
    cells = validate(sweep)
    assert len(cells) == len(g["objectives"]) * len(g["lags"]) * len(g["seeds"])
    for cell in cells:  # the staleness gate lets each cell's forced lag through
        cfg = load_config(sweep.config, {**cell.overrides, "model.path": ""})
        assert cfg.rollout.lag == cell.lag and cfg.trainer.max_lag == cell.lag + 3
        assert cfg.trainer.mismatch_every == 4 and cfg.trainer.steps == g["steps"]


def test_the_arithmetic_config_finds_its_task_from_any_working_directory(tmp_path, monkeypatch):
    bench = _bench()
    (tmp_path / "run.toml").write_text(bench.run_config("arithmetic", bench.ARITH_QUICK))
    cfg = load_config(tmp_path / "run.toml")
    assert Path(cfg.env.module).is_absolute() and Path(cfg.env.module) == ROOT / "examples" / "custom_env.py"
    example = load_config(ROOT / "examples" / "arithmetic_tiny.toml")  # same model, task, warm start, learner
    for part in ("model", "warmstart", "learner"):
        assert getattr(cfg, part) == getattr(example, part)
    assert (cfg.env.id, cfg.env.kwargs) == (example.env.id, example.env.kwargs)
    monkeypatch.chdir(tmp_path)
    import_env_module(cfg.env)
    import stoa.envs

    stoa.envs.check_env(stoa.envs.make(cfg.env.id, split="test", **cfg.env.kwargs))
