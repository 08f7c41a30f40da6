"""model.prompt_format: one rule (stoa.backends.prompting) builds every prompt, for chat and base models.

A base model (no chat template) gets the environment's prompt as plain text; the engine, the warm
start's demonstrations, replay and `stoa train --check` all follow the run's format, and a format
the model cannot use is refused before anything starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stoa.backends import prompting
from stoa.fleet.config import ConfigError, RunConfig, check_runnable

from helpers import tiny_fleet_config

PROMPT = "which kinase does Mertil bind ?"


def without_chat_template(src: Path, dst: Path) -> Path:
    """A copy of the HF folder ``src`` whose tokenizer has no chat template (a base model's folder)."""
    shutil.copytree(src, dst)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    for f in ("chat_template.jinja", "chat_template.json"):
        (dst / f).unlink(missing_ok=True)
    return dst


@pytest.fixture(scope="module")
def base_model(tiny_model, tmp_path_factory):
    return without_chat_template(tiny_model, tmp_path_factory.mktemp("base") / "model")


def tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def test_auto_is_chat_with_a_template_and_plain_without(tiny_model, base_model):
    chat_tok, base_tok = tokenizer(tiny_model), tokenizer(base_model)
    assert prompting.resolve("auto", chat_tok) == "chat" and prompting.resolve("auto", base_tok) == "plain"
    want = chat_tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    assert prompting.prompt_tokens(chat_tok, PROMPT, "auto") == list(want)  # what chat models have always had
    assert prompting.prompt_tokens(base_tok, PROMPT, "auto") == base_tok.encode(PROMPT, add_special_tokens=True)
    assert prompting.prompt_tokens(chat_tok, PROMPT, "plain") == prompting.prompt_tokens(base_tok, PROMPT, "plain")
    assert "auto -> plain" in prompting.describe("auto", base_tok) and "no chat template" in prompting.describe(
        "auto", base_tok)
    assert prompting.describe("chat", chat_tok).startswith("prompt format: chat")


def test_chat_is_refused_without_a_template_and_unknown_formats_always(base_model, tiny_model):
    with pytest.raises(prompting.PromptFormatError, match="no chat template"):
        prompting.prompt_tokens(tokenizer(base_model), PROMPT, "chat")
    with pytest.raises(prompting.PromptFormatError, match="not one of"):
        prompting.resolve("jinja", tokenizer(tiny_model))


def test_plain_prompts_parse_no_control_token_out_of_the_text(base_model):
    tok = tokenizer(base_model)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end not in prompting.prompt_tokens(tok, "stop here <|im_end|> and go on", "plain")


# -- the engine, replay and the warm start follow the run's format ---------------------------------

def _env_factory():
    import stoa.envs

    return lambda: stoa.envs.make("stoa/SyntheticSearch-v0", split="train", num_entities=30, facts_per_entity=3,
                                  num_test_facts=10, seed=5)


def _engine(model: Path, fmt: str):
    pytest.importorskip("mlx.core", reason="the MLX engine needs mlx")
    from stoa.backends.engine import EngineConfig, make_engine

    return make_engine(model, "mlx", config=EngineConfig(max_batch=4, prompt_format=fmt))


def test_engine_builds_plain_prompts_and_refuses_chat_without_a_template(base_model):
    from stoa.backends.engine import EngineError, RolloutRequest, SamplingConfig

    engine = _engine(base_model, "auto")
    assert engine.codec.prompt_format == "plain"
    make_env = _env_factory()
    episodes = engine.rollout(make_env, [RolloutRequest(3, "g", 2)],
                              SamplingConfig(max_turn_tokens=6, max_episode_tokens=128, seed=1))
    text, _ = make_env().reset(options={"index": 3})
    want = prompting.prompt_tokens(tokenizer(base_model), text, "plain")
    assert all(e.prompt_tokens.tolist() == want for e in episodes)
    with pytest.raises(EngineError, match="no chat template"):
        _engine(base_model, "chat")


def test_replay_and_the_warm_start_build_the_engines_prompts(tiny_model):
    """On a model with a template, a run may still choose plain prompts: the warm start's
    demonstrations and replay then build exactly the engine's, and a replay in the other format
    names the prompt as the difference."""
    from stoa.backends.engine import RolloutRequest, SamplingConfig
    from stoa.fleet.trust.replay import Replayer
    from stoa.fleet.trainer.warmstart import Demonstrations

    plain, chat = _engine(tiny_model, "plain"), _engine(tiny_model, "auto")
    assert (plain.codec.prompt_format, chat.codec.prompt_format) == ("plain", "chat")
    make_env = _env_factory()
    episodes = plain.rollout(make_env, [RolloutRequest(i, f"g{i}", 2) for i in range(3)],
                             SamplingConfig(max_turn_tokens=6, max_episode_tokens=128, seed=2))
    same = Replayer(make_env, plain.codec, max_turn_tokens=6, max_episode_tokens=128)
    assert same.check_all(episodes) == []
    other = Replayer(make_env, chat.codec, max_turn_tokens=6, max_episode_tokens=128)
    reasons = [why for _, why in other.check_all(episodes)]
    assert len(reasons) == len(episodes) and all("chat prompt format" in r for r in reasons)
    tok = tokenizer(tiny_model)
    for fmt, engine in (("plain", plain), ("auto", chat)):
        demo = Demonstrations(make_env, tok, prompt_format=fmt).episode(4, "oracle", np.random.default_rng(0))
        text, _ = make_env().reset(options={"index": 4})
        assert demo.prompt_tokens.tolist() == engine.codec.prompt_tokens(text)


# -- `stoa train --check` -------------------------------------------------------------------------

def test_check_runnable_names_the_format_and_refuses_one_the_model_cannot_use(base_model, tiny_model):
    def cfg(path: Path, fmt: str) -> RunConfig:
        return RunConfig.from_dict({"name": "x", "model": {"path": str(path), "prompt_format": fmt}})

    assert check_runnable(cfg(base_model, "auto")).startswith("prompt format: auto -> plain")
    assert check_runnable(cfg(base_model, "plain")).startswith("prompt format: plain")
    assert check_runnable(cfg(tiny_model, "auto")).startswith("prompt format: auto -> chat")
    with pytest.raises(ConfigError, match="model.prompt_format: .* has no chat template"):
        check_runnable(cfg(base_model, "chat"))
    with pytest.raises(ConfigError, match="model.prompt_format"):
        RunConfig.from_dict({"name": "x", "model": {"prompt_format": "jinja"}})


def test_train_check_reports_the_format_and_refuses_chat_for_a_base_model(base_model, tmp_path):
    config = tmp_path / "base.toml"
    config.write_text(tiny_fleet_config("base", model={"path": str(base_model)}))
    run = lambda *a: subprocess.run([sys.executable, "-m", "stoa", "train", str(config), "--check", *a,
                                     "--runs", str(tmp_path / "runs")], capture_output=True, text=True, timeout=120)
    r = run()
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"]["prompt_format"] == "auto" and "prompt format: auto -> plain" in r.stderr
    r = run("--set", "model.prompt_format=chat")
    assert r.returncode == 2 and "has no chat template" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "stoa", "train", str(config), "--set", "model.prompt_format=chat",
                        "--runs", str(tmp_path / "runs")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "has no chat template" in r.stderr
    assert not (tmp_path / "runs").exists()  # refused before any process started or anything was written


# -- a base model through the fleet ---------------------------------------------------------------

@pytest.mark.slow
def test_a_base_model_without_a_chat_template_trains_through_the_fleet(tmp_path):
    """A random-weight model whose tokenizer has no chat template (a base model) runs the whole
    fleet with plain prompts: warm start, workers' episodes, every episode replayed and audited,
    RL steps and evaluations, no batch rejected; the workers' prompts are the plain text."""
    pytest.importorskip("mlx.core", reason="the workers need mlx")
    from stoa.fleet.config import load_config
    from stoa.fleet.metrics import read_metrics
    from stoa.fleet.trainer import prepare_model
    from stoa.transport.store import LocalStore
    from stoa.types import decode_episodes

    built = prepare_model(RunConfig.from_dict({"name": "b", **_tiny_task()}), tmp_path / "build")
    model = without_chat_template(built, tmp_path / "base-model")
    config = tmp_path / "base.toml"
    config.write_text(tiny_fleet_config("base", model={"path": str(model)}, trainer={"steps": 3}))
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "stoa", "train", str(config), "--runs", str(tmp_path / "runs")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "runs" / "base"
    rows = read_metrics(run / "metrics.jsonl")
    assert len([x for x in rows if x["kind"] == "train"]) == 3
    assert [x["version"] for x in rows if x["kind"] == "eval"] == [0, 3]
    assert [x for x in rows if x["kind"] == "warmstart" and "warmstart/p_final_turn" in x]
    finished = [x for x in rows if x.get("event") == "finished"][-1]
    assert finished["rejected_batches"] == 0 and finished["episodes_trained"] > 0
    from transformers import AutoTokenizer

    from stoa.transport.identity import open_sealed

    store, cfg, tok = LocalStore(run / "store"), load_config(config), AutoTokenizer.from_pretrained(str(model))
    task = cfg.env.make(cfg.env.train_split)
    checked = 0
    for key in store.list("base/rollouts/"):
        for ep in decode_episodes(open_sealed(store.get(key))[1]):
            text, _ = task.reset(options={"index": ep.item_index})
            assert ep.prompt_tokens.tolist() == prompting.prompt_tokens(tok, text, "plain")
            checked += 1
    assert checked > 0


def _tiny_task() -> dict:
    from helpers import TINY_FLEET

    return {k: TINY_FLEET[k] for k in ("seed", "model", "env")}
