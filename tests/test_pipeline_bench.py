"""`benchmarks/pipeline.py --quick` over TCP: stages in their own processes generate the whole
model's tokens, every frame's bytes are accounted for, and each stage reports its busy seconds
(the idle share per stage). `benchmarks/pipeline_fleet.py --quick`: a pipeline in the real fleet
against a whole-model worker, with nothing rejected. Bounds here are structural, not timings."""

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


@pytest.mark.slow
def test_the_fleet_pipeline_benchmark_reports_a_worker_and_a_pipeline_with_nothing_rejected(tmp_path):
    """`benchmarks/pipeline_fleet.py --quick`: real trainer, worker, driver and stage processes; the
    pipeline's episodes pass every trust check as the whole-model worker's do."""
    out = tmp_path / "pipeline_fleet.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pipeline_fleet.py"), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=540, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "| vs worker |" in r.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [(x["rollout"], x["stages"], x["one_way_ms"]) for x in runs] == [("worker", 1, None), ("pipeline", 2, 0.0)]
    assert runs[0]["ratio"] == 1.0 and runs[1]["ratio"] == runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"]
    for x in runs:
        assert x["finished"] and x["steps"] == 2 and x["generated_tokens"] > 0 and x["tokens_per_s"] > 0
        assert x["accepted_batches"] > 0 and x["rejected_batches"] == 0 and x["quarantined_batches"] == 0
        assert x["groups_trained"] > 0 and x["groups_lost"] == 0 and x["trained_twice"] == 0
        assert x["episodes_checked"] > 0  # every episode's draws and log mu were re-derived by the trainer
        assert 0 <= x["claim_gap_max"] < x["spot_check_tolerance"]
        want = {"trainer", "worker"} | {f"stage{i}" for i in range(1, x["stages"])}
        assert set(x["peak_rss_mib"]) == want and all(v > 0 for v in x["peak_rss_mib"].values())
