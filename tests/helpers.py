"""Helpers shared by test modules (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import numpy as np

from stoa.types import Episode, Segment


def random_episodes(n: int, vocab: int, seed: int = 0, temperature: float | None = None) -> list[Episode]:
    """Multi-turn episodes: prompt, then model turns with env (tool) output between them.

    Groups of 4 share a group id; each episode's temperature is drawn from {0.7, 1.0, 1.3}
    unless ``temperature`` is given.
    """
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        segs = []
        for turn in range(int(rng.integers(1, 4))):
            k = int(rng.integers(1, 12))
            segs.append(Segment("model", rng.integers(0, vocab, k), -rng.uniform(0.1, 6, k).astype(np.float32)))
            if turn < 2 and rng.random() < 0.7:
                segs.append(Segment("env", rng.integers(0, vocab, int(rng.integers(1, 20)))))
        t = float(rng.choice([0.7, 1.0, 1.3])) if temperature is None else temperature
        out.append(Episode(rng.integers(0, vocab, int(rng.integers(2, 16))), segs, reward=float(rng.random()),
                           group_id=str(i // 4), sample_index=i % 4, temperature=t))
    return out


TINY_FLEET: dict = {
    "seed": 3,
    "model": {"tiny": {"vocab_size": 700, "hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                       "intermediate_size": 128}},
    "env": {"id": "stoa/SyntheticSearch-v0",
            "kwargs": {"num_entities": 30, "facts_per_entity": 3, "num_test_facts": 10, "seed": 5}},
    "warmstart": {"practice_steps": 2, "practice_worlds": 2, "steps": 2, "mix": {"oracle": 0.25, "guess": 0.75},
                  "batch_size": 8, "practice_answer_only": 4},
    "rollout": {"group_size": 2, "groups_per_cohort": 2, "max_turn_tokens": 8, "max_episode_tokens": 160,
                "max_batch": 8, "poll_seconds": 0.1},
    "trainer": {"steps": 6, "groups_per_step": 2, "max_lag": 3, "checkpoint_every": 2, "threads": 1,
                "poll_seconds": 0.05},
    "trust": {"reward_range": [0.0, 1.0]},
    "learner": {"lr": 1e-3},
    "pulse": {"anchor_every": 4},
    "eval": {"every": 100, "num_questions": 4, "samples": 1},
    "fleet": {"workers": 2},
}
"""The fleet tests' run: a 1-layer tiny model on a 30-entity synthetic task, groups of 2, a few steps."""


def tiny_fleet_config(name: str, **sections: dict) -> str:
    """:data:`TINY_FLEET` as TOML, named ``name``, with each section updated by ``sections``
    (``trainer={"steps": 2}``; a nested table such as ``learner={"megatron": {...}}`` is merged too)."""
    def merge(base: dict, over: dict) -> dict:
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "mix" else v
        return out

    return _toml({"name": name, **merge(TINY_FLEET, sections)})


def _toml(table: dict, prefix: str = "") -> str:
    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        return repr(v)

    inline = {k: v for k, v in table.items() if not (isinstance(v, dict) and k not in ("kwargs", "mix"))}
    lines = [f"{k} = {value(v)}" for k, v in inline.items()]
    for k, v in table.items():
        if k not in inline:
            lines += ["", f"[{prefix}{k}]", _toml(v, f"{prefix}{k}.")]
    return "\n".join(lines).strip("\n") + "\n"


_ARITHMETIC = """
name = "{name}"
seed = 1

[model.tiny]
vocab_size = 400
hidden_size = 64
num_layers = 1
num_heads = 2
num_kv_heads = 1
intermediate_size = 128

[env]
module = "{module}"
id = "example/Arithmetic-v0"
kwargs = {{ size = 40 }}

[warmstart]
practice_steps = 2
practice_worlds = 2
steps = 2
mix = {{ oracle = 0.5, guess = 0.5 }}
batch_size = 8

[rollout]
group_size = 4
groups_per_cohort = 2
max_turn_tokens = 16
max_episode_tokens = 128
max_batch = 8

[trainer]
steps = 3
groups_per_step = 2
threads = 1
skip_zero_variance_groups = false

[eval]
every = 100
num_questions = 4
samples = 1

[trust]
reward_range = [0.0, 1.0]

[fleet]
workers = 1
"""


def arithmetic_config(name: str) -> str:
    """A few-step `stoa train` run of examples/custom_env.py's task (the fleet's smallest real run)."""
    from pathlib import Path

    module = Path(__file__).resolve().parents[1] / "examples" / "custom_env.py"
    return _ARITHMETIC.format(name=name, module=module)


# Small random models of each family's real structure (tests/test_model_families.py, the torch engine's tests).
FAMILY_WINDOW = 16
FAMILY_TEXTS = ["the river runs to the sea and the town lies on its bank, where the kinase Mertil binds Kavorin"] * 40


def family_structure(name: str) -> dict:
    """The preset's config with its structure kept (layer pattern, GQA, head_dim beside the
    width, q/k norms, soft-caps, RoPE bases) at a few hundred kB, and a 16-token window."""
    from stoa.models.presets import PRESETS

    c = dict(PRESETS[name], vocab_size=1024, intermediate_size=256, hidden_size=128)
    kv = 2
    heads = kv * min(4, c["num_attention_heads"] // c["num_key_value_heads"])
    c.update(num_attention_heads=heads, num_key_value_heads=kv, head_dim=64 if "head_dim" in c else 128 // heads,
             num_hidden_layers={"gemma3_text": 7, "gemma2": 4}.get(c["model_type"], 3))
    if c["model_type"] == "qwen2":
        c["hidden_size"] = c["head_dim"] * heads
    if "query_pre_attn_scalar" in c:
        c["query_pre_attn_scalar"] = 64
    if c["model_type"] in ("qwen2", "qwen3"):
        c.update(use_sliding_window=True, max_window_layers=1)
    c["sliding_window"] = FAMILY_WINDOW
    return c


def train_with_package(tmp_path, name: str, config: str, package_dir) -> list[dict]:
    """``stoa train`` on ``config`` (run ``name``) in a subprocess with ``package_dir`` (an example
    package's folder) first on ``PYTHONPATH``, as a user who installed it would; asserts it exits 0
    and returns the run's ``train`` metric rows."""
    import os
    import subprocess
    import sys

    from stoa.fleet.metrics import read_metrics

    path = tmp_path / f"{name}.toml"
    path.write_text(config)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(package_dir), os.environ.get("PYTHONPATH", "")]),
               OPENBLAS_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "stoa", "train", str(path), "--runs", str(tmp_path / "runs")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [x for x in read_metrics(tmp_path / "runs" / name / "metrics.jsonl") if x["kind"] == "train"]
