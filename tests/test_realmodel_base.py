"""A real base model (gemma-3-270m, pretrained, no chat template) with plain prompts: `--check`
names the format and refuses chat, and `stoa train` runs it through the fleet with every episode
checked. Skips visibly when the model is not built (`python -m stoa.testing.realmodel --base`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the learner needs torch")

from stoa.fleet.config import ConfigError, RunConfig, check_runnable  # noqa: E402

_FLEET = """
name = "base"
seed = 1

[model]
path = "{path}"

[env]
module = "{module}"
id = "example/Arithmetic-v0"
kwargs = {{ size = 40 }}

[rollout]
group_size = 4
groups_per_cohort = 1
max_turn_tokens = 16
max_episode_tokens = 160
max_batch = 8

[trainer]
steps = 2
groups_per_step = 1
threads = 1
skip_zero_variance_groups = false

[eval]
every = 100
num_questions = 2
samples = 1

[fleet]
workers = 1

[trust]
reward_range = [0.0, 1.0]
"""


def test_check_names_plain_for_the_real_base_model_and_refuses_chat(real_base_model):
    cfg = lambda fmt: RunConfig.from_dict({"name": "x", "model": {"path": str(real_base_model), "prompt_format": fmt}})
    assert check_runnable(cfg("auto")) == "prompt format: auto -> plain (the tokenizer has no chat template)"
    with pytest.raises(ConfigError, match="no chat template"):
        check_runnable(cfg("chat"))


@pytest.mark.slow
def test_stoa_train_on_the_real_base_model_with_plain_prompts(real_base_model, tmp_path):
    """Parity passes, the workers' episodes start with the plain prompt (BOS + the text) and replay
    and the audit accept every honest batch."""
    from stoa.backends import prompting
    from stoa.backends.engine import resolve_backend
    from stoa.fleet.config import load_config
    from stoa.fleet.metrics import read_metrics
    from stoa.transport.identity import open_sealed
    from stoa.transport.store import LocalStore
    from stoa.types import decode_episodes
    from transformers import AutoTokenizer

    if resolve_backend("auto") == "mlx":  # the workers' engine here (Apple silicon, or no torch)
        pytest.importorskip("mlx.core", reason="the MLX engine needs mlx")
    module = Path(__file__).resolve().parents[1] / "examples" / "custom_env.py"
    config = tmp_path / "base.toml"
    config.write_text(_FLEET.format(path=real_base_model, module=module))
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, "-m", "stoa", "train", str(config), "--runs", str(tmp_path / "runs")],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = read_metrics(tmp_path / "runs" / "base" / "metrics.jsonl")
    train = [x for x in rows if x["kind"] == "train"]
    assert len(train) == 2 and train[-1]["trust/rejected_batches"] == 0
    assert train[-1]["trust/episodes_checked"] >= 8 and train[-1]["trust/sampling_violations"] == 0
    tok = AutoTokenizer.from_pretrained(str(real_base_model))
    cfg = load_config(config)
    task = cfg.env.make(cfg.env.train_split)
    store = LocalStore(tmp_path / "runs" / "base" / "store")
    episodes = [e for k in store.list("base/rollouts/") for e in decode_episodes(open_sealed(store.get(k))[1])]
    assert episodes
    for ep in episodes:
        text, _ = task.reset(options={"index": ep.item_index})
        assert ep.prompt_tokens.tolist() == prompting.prompt_tokens(tok, text, "plain")
        assert ep.prompt_tokens[0] == tok.bos_token_id
