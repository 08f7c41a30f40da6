"""Where a rollout's wall time goes (`stoa.backends.cohort.profiled`) on the torch engine (CPU):
the parts are non-negative, do not overlap and fit in the rollout's wall time; profiling changes
no episode; and `benchmarks/rollout.py --same-work`'s pieces (a cohort's row counts and breakdown,
llama.cpp's rows at the engine's mean lengths) without a real model or llama.cpp."""

from __future__ import annotations

import importlib.util
import sys
import time
import types
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="the torch engine needs torch")

import stoa.envs  # noqa: E402
from stoa.backends.cohort import RolloutProfile, profiled  # noqa: E402
from stoa.backends.engine import EngineConfig, RolloutRequest, SamplingConfig, make_engine  # noqa: E402
from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts  # noqa: E402
from stoa.models.tiny import TinyConfig, build_tiny  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CORPUS = SyntheticConfig(seed=0, num_entities=40, num_test_facts=10)
MODEL = TinyConfig(vocab_size=1024, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   intermediate_size=256, seed=0)
SAMPLING = SamplingConfig(max_turn_tokens=12, max_episode_tokens=400, seed=7)  # the task's stop strings
REQUESTS = [RolloutRequest(i, f"g{i}", 3) for i in range(4)]
SPLIT = ("prefill_s", "decode_s", "cache_s", "env_s", "tokenizer_s")  # the parts that do not overlap


def _bench():
    spec = importlib.util.spec_from_file_location("rollout_bench", ROOT / "benchmarks" / "rollout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_env():
    return stoa.envs.make("stoa/SyntheticSearch-v0", config=CORPUS)


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    tiny = build_tiny(tmp_path_factory.mktemp("tiny"), list(tokenizer_texts(generate(CORPUS))), MODEL)
    e = make_engine(tiny, "torch", config=EngineConfig(max_batch=8), device="cpu")
    e.rollout(make_env, REQUESTS[:1], SAMPLING)  # environments built outside the timed calls
    return e


def test_parts_are_non_negative_and_fit_in_the_rollout_wall_time(eng):
    bench = _bench()
    with profiled() as prof, bench._timing_sampler(eng, prof):
        t0 = time.perf_counter()
        eps = eng.rollout(make_env, REQUESTS, SAMPLING)
        wall = time.perf_counter() - t0
    st = eng.last_stats()
    assert all(getattr(prof, f.name) >= 0 for f in fields(RolloutProfile))
    assert st.turns > len(eps)  # multi-turn: observations were prefilled between decode steps
    assert min(prof.prefill_s, prof.decode_s, prof.sample_s, prof.env_s, prof.tokenizer_s) > 0
    assert prof.sample_s <= prof.decode_s  # the sampler is timed inside the decode steps
    assert sum(getattr(prof, k) for k in SPLIT) <= prof.wall_s <= wall
    assert prof.other_s >= 0 and prof.wall_s == pytest.approx(st.wall_s)
    assert (prof.cohorts, prof.decode_steps) == (1, st.decode_steps)
    assert prof.decode_rows / prof.decode_steps <= EngineConfig(max_batch=8).max_batch
    d = bench.breakdown(prof, wall)
    assert all(d[k] >= 0 for k in bench.BREAKDOWN)
    assert sum(d[k] for k in bench.BREAKDOWN) == pytest.approx(wall)
    assert "sample" not in vars(eng)  # the sampler's timer is gone with its block


def test_profiling_leaves_the_episodes_identical(eng):
    plain = eng.rollout(make_env, REQUESTS, SAMPLING)
    with profiled() as prof, _bench()._timing_sampler(eng, prof):
        timed = eng.rollout(make_env, REQUESTS, SAMPLING)
    assert prof.sample_s > 0
    assert len(plain) == len(timed)
    for a, b in zip(plain, timed):
        assert np.array_equal(a.tokens(), b.tokens())
        assert np.array_equal(a.behavior_logprobs(), b.behavior_logprobs())
        assert (a.reward, a.metrics) == (b.reward, b.metrics)


def test_a_block_sums_its_cohorts_and_only_its_own(eng):
    with profiled() as prof:
        eng.rollout(make_env, REQUESTS[:2], SAMPLING)
        first = prof.wall_s
        eng.rollout(make_env, REQUESTS[2:], SAMPLING)
    assert prof.cohorts == 2 and prof.wall_s > first
    assert prof.sample_s == 0  # nobody timed the sampler
    eng.rollout(make_env, REQUESTS[:1], SAMPLING)
    assert prof.cohorts == 2


def test_a_same_work_cohort_counts_each_row_and_splits_its_wall_time(eng):
    c = _bench()._same_work_cohort(eng, make_env, SAMPLING, rows=6, group_size=3, tries=1)
    assert (c["rows"], c["group_size"]) == (6, 3)
    assert len(c["prompt_tokens"]) == len(c["gen_tokens"]) == len(c["env_tokens"]) == 6
    assert c["mean_env"] > 0 and c["mean_turns"] > 1  # the search task answers between turns
    assert c["tokens_per_s"] == pytest.approx(sum(c["gen_tokens"]) / c["wall_s"])
    d = c["breakdown"]
    assert d["sampler_timed"] and d["wall_s"] == c["wall_s"]
    assert all(d[k] >= 0 for k in _bench().BREAKDOWN)
    odd = _bench()._same_work_cohort(eng, make_env, SAMPLING, rows=1, group_size=3, tries=1)
    assert (odd["rows"], odd["group_size"], len(odd["gen_tokens"])) == (1, 1, 1)


def test_llama_cpp_runs_rows_of_the_engine_mean_lengths(monkeypatch, tmp_path):
    calls = []

    def batched_bench(gguf, threads, prompt, gen, batches):
        calls.append((gguf.name, threads, prompt, gen, tuple(batches)))
        return {b: {"tokens_per_s": 100.0 * b} for b in batches}

    fake = types.SimpleNamespace(status=lambda: None, gguf=lambda model, kind: tmp_path / f"m-{kind}.gguf",
                                 batched_bench=batched_bench)
    monkeypatch.setitem(sys.modules, "llamacpp", fake)
    bench = _bench()
    tasks = {"search": {"rows": {16: {"mean_prompt": 60.4, "mean_env": 30.2, "mean_gen": 41.6}}}}
    assert bench._same_work_llama(tmp_path, tasks, 2) == "built"
    assert sorted(calls) == [("m-f32.gguf", 2, 91, 42, (16,)), ("m-q8_0.gguf", 2, 91, 42, (16,))]
    assert tasks["search"]["rows"][16]["llama_cpp"] == {"prompt": 91, "gen": 42, "F32": 1600.0, "Q8_0": 1600.0}
    fake.status = lambda: "skipped: llama.cpp is not built in X"
    tasks = {"search": {"rows": {16: {"mean_prompt": 60.4, "mean_env": 30.2, "mean_gen": 41.6}}}}
    assert bench._same_work_llama(tmp_path, tasks, 2).startswith("skipped: llama.cpp is not built")
    assert "llama_cpp" not in tasks["search"]["rows"][16]


def test_a_failed_llama_cpp_run_says_why(monkeypatch, tmp_path):
    import subprocess

    def fails(*args):
        raise subprocess.CalledProcessError(1, ["/x/bin/llama-batched-bench", "-m"], stderr="error: no such model\n")

    fake = types.SimpleNamespace(status=lambda: None, gguf=lambda model, kind: tmp_path / "m.gguf", batched_bench=fails)
    monkeypatch.setitem(sys.modules, "llamacpp", fake)
    tasks = {"t": {"rows": {1: {"mean_prompt": 10.0, "mean_env": 0.0, "mean_gen": 5.0}}}}
    assert _bench()._same_work_llama(tmp_path, tasks, 2) == "failed: llama-batched-bench -m: error: no such model"
