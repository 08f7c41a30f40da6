"""`benchmarks/checks.py --quick`: the trainer's model checks next to its learner step, on the
demo's model and CPU, for each int8 scorer; the JSON it writes holds a ratio per scorer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_checks_benchmark_runs_and_reports_a_ratio_per_scorer(tmp_path):
    out = tmp_path / "checks.json"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "checks.py"), "--quick", "--episodes", "16",
                        "--batch", "8", "--repeats", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "learner step" in r.stdout and "every episode (torch)" in r.stdout, r.stdout
    assert "audit + sampling (torch)" in r.stdout
    got = json.loads(out.read_text())
    assert got["episodes"] == 16 and set(got["ratio"]) >= {"torch"}
    assert all(v > 1.0 for v in got["ratio"].values()) and set(got["ratio_sampled"]) == set(got["ratio"])
    every = got["rows"]["every (torch)"]
    assert every["episodes"] == 16 and every["rows"] < every["episodes"]  # all, repeats sharing a pass
    assert got["rows"]["audit"]["rows"] <= got["rows"]["audit"]["episodes"] == 4  # 2 (25%) of each batch of 8
    sampled = got["rows"]["sampling (torch)"]
    assert sampled["rows"] < sampled["episodes"]  # repeated samples share a forward pass
