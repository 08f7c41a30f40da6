"""A run with no learning signal says so: the share of a step's groups whose rewards differ is
logged every step, and when it stays at 0 the trainer warns, `stoa status` shows it from the
head's signed metadata and `stoa report` puts it at the top of the summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from stoa.fleet.config import RunConfig
from stoa.fleet.metrics import MetricsSink, read_metrics
from stoa.fleet.operator.report import write_report
from stoa.fleet.operator.status import fleet_status, render
from stoa.transport.store import LocalStore

from helpers import arithmetic_config

# examples/custom_env.py's task with every reward 0: nothing any policy samples can be reinforced.
UNSOLVABLE = """
import importlib.util, sys
import stoa.envs
spec = importlib.util.spec_from_file_location("custom_env_base", {path!r})
base = importlib.util.module_from_spec(spec)
sys.modules["custom_env_base"] = base
spec.loader.exec_module(base)


class UnsolvableEnv(base.ArithmeticEnv):
    def step(self, action):
        obs, _, terminated, truncated, info = super().step(action)
        if "metrics" in info:
            info["metrics"] = dict(info["metrics"], correct=False)
        return obs, 0.0, terminated, truncated, info


stoa.envs.register("test/Unsolvable-v0", entry_point=UnsolvableEnv)
"""


def test_a_run_without_signal_warns_in_the_log_status_and_report(tmp_path):
    examples = Path(__file__).resolve().parents[1] / "examples"
    module = tmp_path / "unsolvable.py"
    module.write_text(UNSOLVABLE.format(path=str(examples / "custom_env.py")))
    config = arithmetic_config("flat").replace(str(examples / "custom_env.py"), str(module))
    config = config.replace('id = "example/Arithmetic-v0"', 'id = "test/Unsolvable-v0"')
    config = config.replace("steps = 3\ngroups_per_step", "steps = 4\nwarn_flat_steps = 2\ngroups_per_step")
    assert "warn_flat_steps = 2" in config and "test/Unsolvable-v0" in config
    (tmp_path / "flat.toml").write_text(config)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, "-m", "stoa", "train", str(tmp_path / "flat.toml"), "--runs",
                        str(tmp_path / "runs")], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "runs" / "flat"
    rows = read_metrics(run / "metrics.jsonl")
    train = [x for x in rows if x["kind"] == "train"]
    assert len(train) == 4 and all(x["groups/signal_frac"] == 0 for x in train)
    assert [x["groups/flat_steps"] for x in train] == [1, 2, 3, 4]
    warned = [x for x in rows if x.get("event") == "no_learning_signal"]
    assert [x["steps"] for x in warned] == [2, 4]  # at warn_flat_steps and at its doubling
    assert "event no_learning_signal" in r.stdout
    assert "no learning signal for 2 steps in a row" in (run / "trainer.log").read_text()
    md = (run / "summary.md").read_text()
    assert "**No learning signal**" in md and "4 steps had none" in md
    status = fleet_status(LocalStore(run / "store"), "flat", public_key=run / "keys" / "run.pub")
    assert status["learning"] == {"signal_frac": 0.0, "flat_steps": 4, "reward": 0.0}
    assert any("no learning signal for 4 steps in a row" in str(t) for t in render(status))
    assert fleet_status(LocalStore(run / "store"), "flat")["learning"] is None  # unverified: not shown


def test_the_report_warns_of_a_flat_stretch_and_not_of_a_run_that_learns(tmp_path):
    def run(name: str, signal: list[float]) -> str:
        run_dir = tmp_path / name
        sink = MetricsSink(run_dir, tensorboard=False, wandb=False)
        (run_dir / "config.json").write_text(RunConfig(name=name).to_json())
        sink.log("eval", 0, **{"eval/pass@1": 0.1, "eval/questions": 50})
        for v, s in enumerate(signal, 1):
            sink.log("train", v, **{"reward/mean": 0.1, "groups/signal_frac": s, "staleness/lag0": 8,
                                    "pulse/bytes": 10, "pulse/full_bytes": 100})
        sink.close()
        write_report(run_dir)
        assert json.loads((run_dir / "summary.json").read_text())["no_signal_steps"] == signal.count(0.0)
        return (run_dir / "summary.md").read_text()

    learns = run("learns", [0.5, 0.0, 0.25, 0.0, 0.75])
    assert "Warning" not in learns and "No learning signal" not in learns and "30.0% of a step's groups" in learns
    stretch = run("stretch", [0.5, 0.0, 0.0, 0.0, 0.25])
    assert "**Warning**: 3 steps in a row had no group whose rewards differ" in stretch
    assert "No learning signal" not in stretch
    assert "**No learning signal**" in run("flat", [0.0] * 4)
