"""`stoa sweep`: the sweep file's checks, the grid's overrides, and a tiny real sweep end to end
(shared warm start, two real fleet cells, resume without re-running, the report and its plots)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stoa.fleet.operator.sweep import SweepError, load_sweep, plan_cells, validate

from helpers import tiny_fleet_config

ROOT = Path(__file__).resolve().parents[1]

# The fleet tests' tiny run; zero-variance groups are trained so that every step logs the
# objective's metrics even before the tiny model earns any reward.
TINY = tiny_fleet_config("tiny", trainer={"steps": 2, "skip_zero_variance_groups": False}, fleet={"workers": 1})


def write(tmp: Path, sweep: str) -> Path:
    (tmp / "tiny.toml").write_text(TINY)
    p = tmp / "sweep.toml"
    p.write_text(sweep)
    return p


SMOKE = """
name = "smoke"
config = "tiny.toml"
objectives = ["dppo", "none"]
lags = [2]
seeds = [0]
lag_key = "trainer.max_lag"   # stands in for rollout.lag in this test
[set]
"trainer.steps" = 2
"""


def test_sweep_file_errors_name_the_problem(tmp_path):
    base = 'name = "s"\nconfig = "tiny.toml"\nlags = [0]\nseeds = [0]\n'
    cases = [
        (base + 'objectives = ["dppo"]\nparalel = 2\n', "unknown key"),
        (base + 'objectives = ["grpo"]\n', "'grpo' is not a built-in objective"),
        (base + 'objectives = ["dppo", "dppo"]\n', "without repeats"),
        ('name = "s"\nconfig = "tiny.toml"\nobjectives = ["dppo"]\nlags = [-1]\nseeds = [0]\n', "integers >= 0"),
        (base + 'objectives = ["v"]\n[objective.v]\ngate = "kl"\n', "with a kind"),
        (base + 'objectives = ["dppo"]\n[lag_set.x]\n"trainer.steps" = 1\n', "axis value"),
        (base + 'objectives = ["dppo"]\n[set]\n"objective.gate" = "kl"\n', r"\[objective\.<name>\] variant"),
    ]
    for text, match in cases:
        with pytest.raises(SweepError, match=match):
            load_sweep(write(tmp_path, text))


def test_every_cell_config_is_resolved_before_anything_runs(tmp_path):
    """A lag key this version's config lacks (or a bad variant option) fails naming cell and key."""
    path = write(tmp_path, SMOKE.replace('lag_key = "trainer.max_lag"', 'lag_key = "rollout.lagg"'))
    with pytest.raises(SweepError, match=r"cell dppo-lag2-seed0: .*rollout\.lagg"):
        validate(load_sweep(path))
    path = write(tmp_path, SMOKE.replace('["dppo", "none"]', '["dppo", "k"]') + '[objective.k]\nkind = "dppo"\ngate = "kll"\n')
    with pytest.raises(SweepError, match=r"cell k-lag2-seed0: objective\.gate"):
        validate(load_sweep(path))


def test_grid_and_override_precedence(tmp_path):
    path = write(tmp_path, """
name = "g"
config = "tiny.toml"
objectives = ["none", "kl"]
lags = [0, 8]
seeds = [0, 1]
lag_key = "trainer.max_lag"
shared_warmstart = false
[set]
"learner.lr" = 1e-3
"trainer.steps" = 5
[objective.kl]
kind = "dppo"
gate = "kl"
set = { "learner.lr" = 2e-4 }
[lag_set.8]
"trainer.steps" = 7
[seed_set.1]
"learner.lr" = 5e-4
""")
    sweep = load_sweep(path, parallel=3)
    assert sweep.parallel == 3 and sweep.config == (tmp_path / "tiny.toml").resolve()
    cells = {c.id: c.overrides for c in plan_cells(sweep)}
    assert list(cells) == ["none-lag0-seed0", "none-lag0-seed1", "none-lag8-seed0", "none-lag8-seed1",
                           "kl-lag0-seed0", "kl-lag0-seed1", "kl-lag8-seed0", "kl-lag8-seed1"]
    assert cells["none-lag0-seed0"]["objective"] == {"kind": "reinforce"}  # "none" = no correction
    assert cells["none-lag8-seed1"] == {"learner.lr": 5e-4, "trainer.steps": 7, "name": "none-lag8-seed1",
                                        "seed": 1, "trainer.max_lag": 8, "objective": {"kind": "reinforce"}}
    assert cells["kl-lag0-seed1"]["learner.lr"] == 2e-4 and cells["kl-lag0-seed1"]["objective"] == {"kind": "dppo",
                                                                                                       "gate": "kl"}
    assert len(validate(sweep)) == 8


def _sweep(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "stoa", "sweep", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900, check=False)


@pytest.mark.slow
def test_a_tiny_sweep_end_to_end_and_resumed(tmp_path):
    """Two real fleet cells (trainer + an int8 MLX worker each) from one shared warm start; the
    report holds every cell's numbers; a second run re-runs nothing."""
    path = write(tmp_path, SMOKE)
    r = _sweep(str(path), "--runs", str(tmp_path / "runs"), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    root = tmp_path / "runs" / "smoke"
    report = json.loads((root / "results.json").read_text())
    cells = {c["id"]: c for c in report["cells"]}
    assert set(cells) == {"dppo-lag2-seed0", "none-lag2-seed0"}
    for c in cells.values():
        assert c["status"] == "done" and c["steps"] == 2 and c["lag"] == 2 and c["seed"] == 0
        assert 0.0 <= c["final_pass_at_1"] <= c["best_pass_at_1"] <= 1.0
        assert [v for v, _ in c["curve"]] == [0, 2]
        for key in ("gate_fraction", "tv_gate_fraction", "kl_mu_pi", "abs_log_ratio", "ratio_gt2_frac",
                    "ratio_gt10_frac", "staleness_mean"):
            assert isinstance(c[key], float) and c[key] >= 0.0, (c["id"], key)
        assert "eval/searched" in c["final_eval"]
    assert cells["none-lag2-seed0"]["objective_table"] == {"kind": "reinforce"}
    assert cells["none-lag2-seed0"]["gate_fraction"] == 0.0  # no gate, no clip: nothing zeroed
    # Both cells started from the shared warm start: the same model folder, the same v0 policy.
    for cid in cells:
        cfg = json.loads((root / "cells" / cid / "config.json").read_text())
        assert cfg["model"]["path"] == str((root / "warmstart" / "seed0-model").resolve())
        assert cfg["warmstart"]["steps"] == 0 and cfg["trainer"]["max_lag"] == 2
        assert cfg["objective"]["kind"] == {"dppo-lag2-seed0": "dppo", "none-lag2-seed0": "reinforce"}[cid]
    assert cells["dppo-lag2-seed0"]["start_pass_at_1"] == cells["none-lag2-seed0"]["start_pass_at_1"]
    assert report["warmstarts"][0]["seed"] == 0
    md = (root / "results.md").read_text()
    assert "| dppo | 2 | 1 |" in md and "| none | 2 | 1 |" in md
    for name in ("learning_curves", "final_vs_lag", "gate_vs_lag", "kl_vs_lag"):
        assert (root / "plots" / f"{name}.png").stat().st_size > 5000

    # Resume: finished cells (summary.json) are not run again; a removed one is.
    stamp = (root / "cells" / "dppo-lag2-seed0" / "summary.json").stat().st_mtime_ns
    (root / "cells" / "none-lag2-seed0" / "summary.json").unlink()
    r = _sweep(str(path), "--runs", str(tmp_path / "runs"), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "2 cells, 1 already finished, 1 to run" in r.stdout and "warmstart-seed0" not in r.stdout
    assert (root / "cells" / "dppo-lag2-seed0" / "summary.json").stat().st_mtime_ns == stamp
    assert json.loads((root / "results.json").read_text())["cells"][1]["status"] == "done"
    # --report rebuilds the report from disk alone; --dry-run lists the cells.
    (root / "results.json").unlink()
    r = _sweep(str(path), "--runs", str(tmp_path / "runs"), "--report", cwd=tmp_path)
    again = json.loads((root / "results.json").read_text())
    assert r.returncode == 0 and [c["status"] for c in again["cells"]] == ["done", "done"]
    assert again["warmstarts"][0]["seed"] == 0
    r = _sweep(str(path), "--runs", str(tmp_path / "runs"), "--dry-run", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.count("-lag2-seed0: ") == 2 and "trainer.max_lag=2" in r.stdout
