"""Install by role: the package metadata's extras, and a worker that runs with only what
`stoa[worker]` installs (no torch, megatron-core, tensorboard, matplotlib or datasets).

The worker check builds a site-packages of links to this environment's packages minus the
trainer's, and runs a real int8 MLX rollout there with `python -S` (so nothing else is on the
path): what a volunteer's fresh `pip install ".[worker]"` holds, without a download.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINER_ONLY = ("torch", "torchgen", "functorch", "triton", "nvidia", "megatron", "megatron_core", "tensorboard",
                "tensorboard_data_server", "matplotlib", "mpl_toolkits", "datasets", "einops")


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _names(reqs: list[str]) -> set[str]:
    import re

    return {re.split(r"[\[<>=;! ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def test_extras_by_role():
    extras = _extras()
    base = _names(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    heavy = {"torch", "megatron-core", "tensorboard", "matplotlib", "datasets", "transformers", "mlx", "mlx-lm"}
    assert not base & heavy
    assert _names(extras["worker"]) == {"mlx", "mlx-lm"}
    assert {"stoa", "torch", "transformers", "tensorboard", "matplotlib", "datasets"} <= _names(extras["trainer"])
    assert "megatron-core" in _names(extras["megatron"]) and "stoa[trainer]" in extras["megatron"]
    assert "torch" not in _names(extras["gpu"]) and "megatron-core" in _names(extras["gpu"])
    assert extras["all"] == ["stoa[megatron]", "stoa[reasoning-gym]", "stoa[dashboard]"]
    assert _names(extras["dashboard"]) == {"starlette", "uvicorn"}
    assert _names(extras["reasoning-gym"]) == {"reasoning-gym"}
    assert 'torch==2.13.0; sys_platform == \'linux\'' in extras["trainer"]  # the CPU wheel, never a CUDA pull
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert '"torch==2.13.0"' in setup and '-e ".[all,dev]"' in setup
    assert setup.index('"torch==2.13.0"') < setup.index('-e ".[all,dev]"')  # torch first


WORKER_RUN = """
import sys
import numpy as np
import stoa, stoa.cli, stoa.fleet.worker.worker, stoa.fleet.operator.status, stoa.transport.s3
import stoa.envs
from stoa.backends.engine import EngineConfig, RolloutRequest, SamplingConfig, make_engine
from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts
from stoa.models.tiny import TinyConfig, build_tiny
corpus = generate(SyntheticConfig(seed=0, num_entities=30, num_test_facts=20))
model = build_tiny(sys.argv[1], list(tokenizer_texts(corpus)), TinyConfig(vocab_size=300, hidden_size=64,
                   num_layers=1, intermediate_size=128))
engine = make_engine(model, config=EngineConfig(max_batch=4), mode="quantized")
env = lambda: stoa.envs.make("stoa/SyntheticSearch-v0", config=SyntheticConfig(seed=0, num_entities=30, num_test_facts=20))
eps = engine.rollout(env, [RolloutRequest(0, "g0", 2)], SamplingConfig(max_turn_tokens=8, seed=0))
assert len(eps) == 2 and all(len(e) > 0 for e in eps)
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "megatron", "tensorboard", "matplotlib", "datasets"})
print("heavy:", heavy)
"""


def test_a_worker_runs_with_only_the_worker_extra(tmp_path):
    pytest.importorskip("mlx.core", reason="the worker role needs mlx")
    site = Path(sysconfig.get_paths()["purelib"])
    farm = tmp_path / "site"
    farm.mkdir()
    for entry in site.iterdir():
        stem = entry.name.split("-")[0].split(".")[0].lower()
        if stem in TRAINER_ONLY or entry.name.endswith(".pth") or entry.name.startswith("__editable__"):
            continue
        (farm / entry.name).symlink_to(entry)
    env = {"PYTHONPATH": f"{ROOT}:{farm}", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin"}
    probe = subprocess.run([sys.executable, "-S", "-c", "import torch"], capture_output=True, text=True, env=env)
    assert probe.returncode != 0  # the farm really lacks the trainer's packages
    r = subprocess.run([sys.executable, "-S", "-c", WORKER_RUN, str(tmp_path / "m")], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "heavy: []" in r.stdout
    for args in (["--help"], ["worker", "--help"], ["status", "--help"]):
        h = subprocess.run([sys.executable, "-S", "-m", "stoa", *args], capture_output=True, text=True, env=env,
                           timeout=120)
        assert h.returncode == 0 and "Usage" in h.stdout, h.stderr[-2000:]
