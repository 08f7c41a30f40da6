"""Run configs: every section typed and checked at load, naming the key; one resolved objective."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stoa.fleet.config import ConfigError, RunConfig, UnresolvedObjective, load_config

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "papersearch_tiny.toml"


@pytest.mark.parametrize("override, needle", [
    ({"objective.dleta": 0.1}, "objective.dleta"),
    ({"objective.delta_high": -1.0}, "delta_high"),
    ({"objective.kind": "nope"}, "objective.kind"),
    ({"objective.gate": 3}, "gate"),
    ({"learner.lrr": 1e-3}, "learner.lrr"),
    ({"learner.lr": -1.0}, "lr"),
    ({"learner.lr": "fast"}, "learner.lr"),
    ({"learner.kind": "jax"}, "learner.kind"),
    ({"model.tiny.hidden": 128}, "model.tiny.hidden"),
    ({"model.tiny.hidden_size": 100}, "hidden_size"),
    ({"trainer.stepz": 1}, "trainer.stepz"),
    ({"trainer.steps": "5"}, "trainer.steps"),
    ({"trust.reward_range": [1.0]}, "trust.reward_range"),
    ({"rollout.temprature": 1.0}, "rollout.temprature"),
    ({"rollout.engine": "vllm"}, "rollout.engine"),
    ({"warmstart.reading_steps": 10}, "warmstart.reading_steps"),
    ({"warmstart.mix": {"oracle": -1.0}}, "warmstart.mix"),
    ({"env.kwargz": {}}, "env.kwargz"),
    ({"eval.every": 0}, "eval.every"),
    ({"pulse.dtype": "int4"}, "pulse.dtype"),
    ({"fleet.workers": -1}, "fleet.workers"),
    ({"trust.mode": "closed"}, "trust.mode"),
    ({"trust.max_worker_shar": 0.5}, "trust.max_worker_shar"),
    ({"trust.max_worker_share": 0.0}, "max_worker_share"),
    ({"trust.replay": "yes"}, "trust.replay"),
    ({"trust.audit_fraction": 2.0}, "trust.audit_fraction"),
    ({"trust.audit.fraction": 2.0}, "trust.audit.fraction"),
    ({"trust.audit.spot_check_tolerance": 0.0}, "spot_check_tolerance"),
    ({"bogus": 1}, "bogus"),
])
def test_a_bad_key_or_value_fails_at_load_naming_it(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, override)
    assert needle in str(e.value)


def test_a_key_that_moved_names_its_new_place():
    with pytest.raises(ConfigError, match=r"trainer\.reward_range is now trust\.reward_range"):
        load_config(DEMO, {"trainer.reward_range": [0.0, 1.0]})
    assert load_config(DEMO, {"trust.reward_range": [0.0, 1.0]}).trust.reward_range == (0.0, 1.0)


def test_each_section_lives_in_the_room_that_uses_it():
    from stoa.fleet import config, task
    from stoa.fleet.operator import section as operator
    from stoa.fleet.trainer import section as trainer
    from stoa.fleet.trust import section as trust
    from stoa.fleet.worker import section as worker

    homes = {"rollout": worker, "trainer": trainer, "eval": trainer, "model": trainer, "env": task,
             "warmstart": trainer, "pulse": trainer, "fleet": operator, "trust": trust}
    for section, home in homes.items():
        cls = type(getattr(RunConfig(), section))
        assert cls.__module__ == home.__name__ and getattr(config, cls.__name__) is cls, section
    assert type(RunConfig().trust.audit).__module__ == trust.__name__


def test_the_objective_is_resolved_once_with_its_own_config(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[objective]\nkind = "ppo"\nclip_low = 0.1\n')
    cfg = load_config(path)
    from stoa.algos import ppo

    assert cfg.objective.name == "ppo" and isinstance(cfg.objective.config, ppo.Config)
    assert cfg.objective.config.clip_low == 0.1
    with pytest.raises(ConfigError) as e:  # DPPO's gate settings are no PPO options: refused, not ignored
        load_config(DEMO, {"objective.kind": "ppo"})
    assert "objective.gate" in str(e.value)
    assert load_config(tmp_path / "run.toml", {"objective": {}}).objective.name == "dppo"  # the default


def test_round_trip_through_json_and_the_workers_view():
    cfg = load_config(DEMO)
    data = json.loads(cfg.to_json())
    assert data["objective"]["kind"] == "dppo" and data["learner"]["kind"] == "torch"
    assert RunConfig.from_dict(data) == cfg
    worker_view = RunConfig.from_dict({**data, "objective": {"kind": "mylab.losses:not_installed_here"}},
                                      resolve_objective=False)
    assert isinstance(worker_view.objective, UnresolvedObjective) and worker_view.rollout == cfg.rollout


def test_config_load_imports_no_framework():
    code = ("import sys; from stoa.fleet.config import load_config; load_config(sys.argv[1]); "
            "bad = [m for m in ('torch', 'mlx', 'transformers', 'megatron') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code, str(DEMO)], check=True)


def test_train_check_prints_the_resolved_config_and_exits():
    r = subprocess.run([sys.executable, "-m", "stoa", "train", str(DEMO), "--check", "--set", "trainer.steps=7"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    resolved = json.loads(r.stdout)
    assert resolved["trainer"]["steps"] == 7 and resolved["objective"]["delta_high"] == 0.2
    r = subprocess.run([sys.executable, "-m", "stoa", "train", str(DEMO), "--check", "--set", "learner.lrr=1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "learner.lrr" in r.stderr


def test_every_example_config_loads():
    for path in sorted((ROOT / "examples").glob("*.toml")):
        load_config(path)
