"""`benchmarks/pipeline.py --quick` over TCP: stages in their own processes generate the whole
model's tokens, every frame's bytes are accounted for, and each stage reports its busy seconds
(the idle share per stage). Bounds here are structural, not timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the pipeline's stages need torch")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_pipeline_benchmark_reports_an_idle_share_per_stage(tmp_path):
    out = tmp_path / "pipeline.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pipeline.py"), "--quick", "--channels", "tcp",
                        "--json", str(out)], capture_output=True, text=True, timeout=540, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "idle share per stage" in r.stdout
    got = json.loads(out.read_text())
    s, hidden = got["settings"], got["model"]["hidden"]
    assert {(row["micro"], row["one_way_ms"]) for row in got["runs"]} == {(1, 0), (1, 20), (4, 0), (4, 20)}
    assert 0 < got["baseline"]["busy_s"] <= got["baseline"]["seconds"]
    for row in got["runs"]:
        assert row["rows_same_as_baseline"] == row["rows"] == s["batch"]
        assert len(row["idle_share"]) == len(row["stage_busy_s"]) == len(row["stage_cpu_s"]) == row["stages"] == 2
        assert all(b > 0 for b in row["stage_busy_s"])  # every stage computed during the timed generation
        assert all(0 <= x < 1 for x in row["idle_share"])  # a stage computes only inside the timed window
        # boundary 0 carries the float32 residual stream of every prompt position and every drawn token
        # but the last, plus a header a frame: the timed generation's frames only, not the warm-up's
        floor = (s["prompt"] + s["tokens"] - 1) * 4 * hidden / s["tokens"]
        assert floor < row["bytes_per_token_boundary"] < floor + row["micro"] * 512 / s["batch"]
