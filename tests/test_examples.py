"""Smoke tests: every example script runs with tiny sizes (the demo config itself: tests/test_fleet.py)."""

import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_dppo_loop_example_runs(tmp_path, capsys):
    mod = runpy.run_path(str(ROOT / "examples" / "dppo_loop.py"))
    args = mod["Args"](out=str(tmp_path), num_entities=30, warmstart_steps=2, warmstart_batch=4, iterations=2, prompts=2,
                       group_size=2, eval_questions=4)
    result = mod["main"](args)
    assert set(result) == {"pass@1_start", "pass@1_end", "search_rate_start", "search_rate_end"}
    assert all(0.0 <= v <= 1.0 for v in result.values())
    out = capsys.readouterr().out
    assert "before RL" in out and "iter   2" in out and "after RL" in out


def test_example_configs_load():
    from stoa.fleet.config import load_config

    for path in sorted((ROOT / "examples").glob("*.toml")):
        cfg = load_config(path)
        assert cfg.name and cfg.seed is not None, path


@pytest.mark.parametrize("name", ["smollm2_search.toml", "smollm2_addition.toml"])
def test_the_real_model_examples_find_their_model_under_home(real_model, tmp_path, name):
    """`model.path = "~/..."` is expanded wherever it is read, so the examples run for any user
    after `make setup` (which builds the model into ~/.cache/stoa/models); the chat model gets chat prompts."""
    from stoa.fleet.config import check_runnable, load_config
    from stoa.fleet.trainer import prepare_model

    cfg = load_config(ROOT / "examples" / name)
    assert cfg.model.path.startswith("~/")
    if Path(cfg.model.path).expanduser() != real_model:
        pytest.skip(f"the real model is built in {real_model}, not where the example looks ({cfg.model.path})")
    # imports the env (examples/addition_env.py for one), reads the model's config and tokenizer
    assert check_runnable(cfg) == "prompt format: auto -> chat (the tokenizer has a chat template)"
    assert prepare_model(cfg, tmp_path) == real_model
