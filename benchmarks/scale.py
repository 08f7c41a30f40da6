"""Real-size models through the fleet: what each component costs at the Qwen2.5-0.5B shape.

    python benchmarks/scale.py [--preset qwen2.5-0.5b] [--quick] [--json PATH] [--workdir DIR]

Builds a random-weight model of the preset's exact shape (``stoa init-tiny --preset``), then:

1. **components**, each in its own process so its peak RSS is its own:
   - ``mlx``: int8 worker engine load + quantize, generation tokens/s on the search task, MLX
     scoring, a spot-check as the trainer does it (load another version's state + score);
   - ``torch``: :class:`stoa.backends.torch.int8.TorchInt8Scorer` on the same state and episodes:
     agreement with MLX (max and p99 per-token |log-prob difference|, and the sampling
     margins of the generated tokens) and speed;
   - ``held``: trainer RAM for the int8 states a spot-check may claim at ``max_lag`` 8: a dict of
     states in RAM (the baseline) vs :class:`stoa.fleet.trainer.heldstates.HeldStates` on disk;
   - ``pulse``: quantize, PULSE delta at a 0.5% code change rate vs the full state, apply, hash;
   - ``publish`` (only when named in ``--parts``): one publish's export + quantize on the torch
     learner, the whole float copy first (the baseline) vs one tensor at a time, peak RSS above
     the learner's and whether both give the same state;
2. **fleet** (not with ``--quick``): ``stoa trainer`` + 2 ``stoa worker`` + 1 ``stoa worker
   --follow-only`` subprocesses on a local store for ``benchmarks/scale.toml``'s RL steps, with
   each process's peak RSS (``VmHWM``), cold join, sync per version, learner seconds per 1k
   tokens, publish seconds and the trust layer's spot-check seconds from the trainer's metrics.

``--quick`` (about a minute) keeps the real vocabulary and width but 2 layers, and skips the fleet.
llama.cpp (``llama-cpp-python``) as a generation peer is measured only if already installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV_ID, ENV_KW = "bench/ScaleSearch-v0", {"num_entities": 30, "facts_per_entity": 3, "num_test_facts": 10, "seed": 5}
GB = 1e9


def rss() -> dict[str, float]:
    """This process's current and peak resident set (GB), anonymous and file-backed parts."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[k] = int(v.split()[0]) * 1024 / GB
    return out


def rss_of(pid: int) -> dict[str, float]:
    """Another process's current resident set (GB): total, anonymous and file-backed (mapped files,
    e.g. held states: reclaimable) parts."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) * 1024 / GB for k, _, v in (x.partition(":") for x in lines)
            if k in ("VmRSS", "RssAnon", "RssFile")}


def peak_of(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GB
    except OSError:
        return None
    return None


# ---------------------------------------------------------------------------------------------
# Component parts (each runs in a subprocess: python scale.py --part NAME --model DIR --work DIR)
# ---------------------------------------------------------------------------------------------


def _env():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scale_env  # noqa: F401  (registers the task)
    import stoa.envs

    return lambda: stoa.envs.make(ENV_ID, split="train", **ENV_KW)


def part_mlx(model: Path, work: Path, groups: int) -> dict:
    import numpy as np

    from stoa.backends.engine import RolloutRequest, SamplingConfig
    from stoa.backends.mlx import MLXEngine
    from stoa.fleet.trainer.heldstates import HeldStates
    from stoa.types import encode_episodes

    make_env = _env()
    t = time.perf_counter()
    eng = MLXEngine.from_pretrained(model)
    load_s = time.perf_counter() - t
    after_load = rss()
    reqs = [RolloutRequest(i, f"g{i}", 2) for i in range(groups)]
    sampling = SamplingConfig(temperature=1.0, max_turn_tokens=12, max_episode_tokens=192, seed=0)
    eng.rollout(make_env, reqs[:1], SamplingConfig(temperature=1.0, max_turn_tokens=2, max_episode_tokens=64, seed=1))
    t = time.perf_counter()
    eps = eng.rollout(make_env, reqs, sampling)
    gen_s = time.perf_counter() - t
    gen_tokens = sum(e.num_model_tokens for e in eps)
    (work / "episodes.bin").write_bytes(encode_episodes(eps, compress=False))
    t = time.perf_counter()
    ref = eng.score(eps)
    score_s = time.perf_counter() - t
    np.savez(work / "mlx_scores.npz", *ref)
    t = time.perf_counter()
    margins = eng.sampling_margins(eps, [sampling.seed] * len(eps))
    margins_s = time.perf_counter() - t
    np.savez(work / "mlx_margins.npz", *margins)
    shutil.rmtree(work / "held", ignore_errors=True)  # a rerun in the same folder writes v0 afresh
    held = HeldStates(work / "held", keep=2)
    t = time.perf_counter()
    held.put(0, eng.state)
    put_s = time.perf_counter() - t
    t = time.perf_counter()
    h = eng.state_hash()
    hash_s = time.perf_counter() - t
    other = {k: v.copy() for k, v in eng.state.items()}
    t = time.perf_counter()
    eng.load_state(1, other)  # a spot-check of another version: the whole state is loaded first
    load_state_s = time.perf_counter() - t
    t = time.perf_counter()
    eng.score(eps[:2])
    spot_score_s = time.perf_counter() - t
    return {"load_quantize_s": load_s, "rss_after_load_gb": after_load["VmRSS"], "gen_s": gen_s,
            "gen_tokens": gen_tokens, "gen_tokens_per_s": gen_tokens / gen_s, "episodes": len(eps),
            "score_tokens": int(sum(len(e) for e in eps)), "score_s": score_s, "margins_s": margins_s,
            "held_put_s": put_s,
            "state_hash_s": hash_s, "state_hash": h, "spot_load_state_s": load_state_s,
            "spot_score_s": spot_score_s, "spot_check_s": load_state_s + spot_score_s,
            "state_bytes": int(sum(a.nbytes for a in eng.state.values())), "peak_rss_gb": rss()["VmHWM"],
            "mode": eng.mode}


def part_torch(model: Path, work: Path, threads: int) -> dict:
    import numpy as np
    import torch

    from stoa.backends.torch.int8 import TorchInt8Scorer
    from stoa.fleet.trainer.heldstates import HeldStates
    from stoa.types import decode_episodes

    torch.set_num_threads(threads)
    eps = decode_episodes((work / "episodes.bin").read_bytes())
    ref = np.load(work / "mlx_scores.npz")
    ref = [ref[f"arr_{i}"] for i in range(len(eps))]
    t = time.perf_counter()
    scorer = TorchInt8Scorer(model)
    init_s = time.perf_counter() - t
    state = HeldStates(work / "held", keep=2).get(0)
    t = time.perf_counter()
    scorer.load_state(0, state)
    first_load_s = time.perf_counter() - t
    t = time.perf_counter()
    scorer.load_state(1, state)  # steady state: the model's memory is already faulted in
    load_state_s = time.perf_counter() - t
    scorer.score(eps[:1])
    t = time.perf_counter()
    got = scorer.score(eps)
    score_s = time.perf_counter() - t
    t = time.perf_counter()
    scorer.score(eps[:2])
    spot_score_s = time.perf_counter() - t
    mref = np.load(work / "mlx_margins.npz")
    mref = np.concatenate([mref[f"arr_{i}"] for i in range(len(eps))])
    t = time.perf_counter()
    margins = np.concatenate(scorer.sampling_margins(eps, [0] * len(eps)))  # part_mlx samples with seed 0
    margins_s = time.perf_counter() - t
    d_all = np.concatenate([np.abs(a[1:] - b[1:]) for a, b in zip(got, ref)])
    d_model = np.concatenate([np.abs(a - b)[e.loss_mask()] for a, b, e in zip(got, ref, eps)])
    return {"init_s": init_s, "first_load_state_s": first_load_s, "load_state_s": load_state_s, "score_s": score_s, "spot_score_s": spot_score_s,
            "spot_check_s": load_state_s + spot_score_s, "diff_max": float(d_all.max()),
            "diff_p99": float(np.percentile(d_all, 99)), "diff_model_max": float(d_model.max()) if d_model.size else 0.0,
            "diff_model_p99": float(np.percentile(d_model, 99)) if d_model.size else 0.0,
            "logprob_mean": float(np.mean(np.concatenate([r[1:] for r in ref]))), "margins_s": margins_s,
            "margin_tokens": int(margins.size), "margin_diff_max": float(np.abs(margins - mref).max(initial=0.0)),
            "margin_min": float(margins.min(initial=1.0)), "margin_mlx_min": float(mref.min(initial=1.0)),
            "margin_within_band": int((np.abs(margins) < 1e-4).sum()), "peak_rss_gb": rss()["VmHWM"]}


def _states(work: Path, n: int):
    """``n`` successive int8 states: the MLX part's state, then 0.5% of codes moved per version."""
    import numpy as np

    from stoa.fleet.trainer.heldstates import HeldStates

    base = HeldStates(work / "held", keep=2).get(0)
    rng = np.random.default_rng(0)
    cur = {k: np.array(v) for k, v in base.items()}
    for v in range(n):
        if v:
            cur = {k: a.copy() for k, a in cur.items()}
            for k, a in cur.items():
                if a.dtype == np.uint8:
                    flat = a.reshape(-1)
                    idx = rng.choice(flat.size, max(1, flat.size // 200), replace=False)
                    flat[idx] = np.clip(flat[idx].astype(np.int16) + rng.choice([-1, 1], idx.size), 0, 255)
        yield v, cur


def _trim() -> None:
    """Return freed heap to the OS, so RSS counts what is held, not what glibc keeps cached."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def part_held(model: Path, work: Path, kind: str, max_lag: int) -> dict:
    """Trainer-side RAM for the states of versions v-max_lag..v, held as ``kind`` (dict|disk)."""

    import numpy as np

    from stoa.fleet.trainer.heldstates import HeldStates

    base_rss = rss()["VmRSS"]
    n = max_lag + 1
    t0 = time.perf_counter()
    if kind == "dict":
        held: dict = {}
        for v, s in _states(work, n + 2):
            held[v] = s
            for old in [o for o in held if o < v - max_lag]:
                del held[old]
        _trim()
        r = rss()
        touched = sum(int(a.reshape(-1)[::4096].sum()) for a in held[min(held)].values())
        out = {"versions": len(held)}
    else:
        d = work / "held-bench"
        shutil.rmtree(d, ignore_errors=True)
        disk = HeldStates(d, keep=n)
        for v, s in _states(work, n + 2):
            disk.put(v, s)
            del s
        _trim()
        got = disk.get(disk.versions()[0])  # a spot-check reads the oldest claimable version
        touched = sum(int(np.asarray(a).sum(dtype=np.int64)) for a in got.values())
        r = rss()
        out = {"versions": len(disk.versions()), "disk_bytes": disk.nbytes()}
        del got
        shutil.rmtree(d, ignore_errors=True)
    state_bytes = sum(a.nbytes for a in HeldStates(work / "held", keep=2).get(0).values())
    return {**out, "kind": kind, "max_lag": max_lag, "rss_gb": r["VmRSS"] - base_rss, "rss_anon_gb": r["RssAnon"],
            "rss_file_gb": r["RssFile"], "state_gb": state_bytes / GB, "seconds": time.perf_counter() - t0,
            "checksum": touched, "peak_rss_gb": rss()["VmHWM"]}


def part_publish(model: Path, work: Path, how: str) -> dict:
    """One publish's export + quantize on the torch learner (CPU, float32): the whole float copy
    then quantize (``whole``, the trainer's way before) or one tensor at a time (``streamed``)."""
    from stoa.backends.learner import LearnerConfig, make_learner
    from stoa.transport.pulse import state_hash
    from stoa.transport.quant import quantize_state

    ln = make_learner("torch", model, LearnerConfig(device="cpu", threads=1))
    previous = quantize_state(ln.iter_weights("float32"))  # the last published state, as the trainer holds it
    before = rss()["VmRSS"]
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    t = time.perf_counter()
    weights = ln.export_weights("float32") if how == "whole" else ln.iter_weights("float32")
    state = quantize_state(weights, previous=previous)
    seconds = time.perf_counter() - t
    peak = rss()["VmHWM"]
    del weights
    return {"rss_before_gb": before, "peak_gb": peak, "extra_gb": peak - before, "export_quantize_s": seconds,
            "state_gb": sum(a.nbytes for a in state.values()) / GB, "state_hash": state_hash(state)}


def part_pulse(model: Path, work: Path) -> dict:
    import numpy as np
    from safetensors.numpy import load_file

    from stoa.transport import pulse
    from stoa.transport.quant import quantize_state

    w = load_file(str(model / "model.safetensors"))
    t = time.perf_counter()
    s0 = quantize_state(w)
    quant_s = time.perf_counter() - t
    rng = np.random.default_rng(1)
    for k in list(w):
        if w[k].ndim == 2:  # movement for the requantize timing: 1% of weights nudged
            flat = w[k].reshape(-1)
            idx = rng.choice(flat.size, max(1, flat.size // 100), replace=False)
            flat[idx] += rng.standard_normal(idx.size).astype(np.float32) * np.abs(flat[idx]).mean() * 0.5
    t = time.perf_counter()
    s1 = quantize_state(w, previous=s0)
    requant_s = time.perf_counter() - t
    del w
    codes = [k for k in s0 if s0[k].dtype == np.uint8]
    requant_changed = sum(int((s0[k] != s1[k]).sum()) for k in codes) / sum(s0[k].size for k in codes)
    # Bytes per sync at exactly the reference rate: 0.5% of codes moved by one step.
    s1 = {k: a.copy() for k, a in s0.items()}
    for k in codes:
        flat = s1[k].reshape(-1)
        idx = rng.choice(flat.size, max(1, flat.size // 200), replace=False)
        flat[idx] = np.where(flat[idx] == 255, 254, np.where(flat[idx] == 0, 1, flat[idx] + rng.choice(
            np.array([-1, 1], np.int16), idx.size))).astype(np.uint8)
    changed = sum(int((s0[k] != s1[k]).sum()) for k in codes) / sum(s0[k].size for k in codes)
    t = time.perf_counter()
    delta = pulse.encode_delta(s0, s1)
    encode_s = time.perf_counter() - t
    t = time.perf_counter()
    full = pulse.encode_state(s1)
    anchor_s = time.perf_counter() - t
    full_bytes = len(full)
    del full
    t = time.perf_counter()
    pulse.apply_delta_inplace(s0, delta)
    apply_s = time.perf_counter() - t
    t = time.perf_counter()
    ok = pulse.state_hash(s0) == pulse.state_hash(s1)
    hash_s = (time.perf_counter() - t) / 2
    return {"quantize_s": quant_s, "requant_keep_s": requant_s, "requant_changed_frac": requant_changed,
            "changed_code_frac": changed,
            "delta_bytes": len(delta), "anchor_bytes": full_bytes, "encode_s": encode_s, "anchor_encode_s": anchor_s,
            "apply_s": apply_s, "state_hash_s": hash_s, "apply_matches": ok, "peak_rss_gb": rss()["VmHWM"]}


# ---------------------------------------------------------------------------------------------
# The fleet, through the public CLI
# ---------------------------------------------------------------------------------------------


def run_fleet(model: Path, work: Path, steps: int, timeout_s: float, overrides: list[str] = ()) -> dict:
    import numpy as np

    from stoa.transport.signing import generate_private_key, load_private_key, save_keypair

    run_dir, store = work / "run", work / "store"
    for p in (run_dir, store):
        shutil.rmtree(p, ignore_errors=True)
    (run_dir / "keys").mkdir(parents=True)
    save_keypair(generate_private_key(), run_dir / "keys", "run")
    key = run_dir / "keys" / "run.key"
    public_hex = load_private_key(key).public_key().public_bytes_raw().hex()
    from stoa.backends import openmp

    env = openmp.shared_env(dict(os.environ, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1"))  # one machine's cores
    stoa = [sys.executable, "-m", "stoa"]

    def spawn(name: str, args: list[str]) -> tuple[subprocess.Popen, float]:
        log = open(run_dir / f"{name}.log", "ab")
        return subprocess.Popen(stoa + args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True), time.time()

    procs = {"trainer": spawn("trainer", ["trainer", str(ROOT / "benchmarks" / "scale.toml"), "--store", str(store),
                                           "--run-dir", str(run_dir), "--key", str(key),
                                           "--set", f"model.path={json.dumps(str(model))}",
                                           "--set", f"trainer.steps={steps}",
                                           *(x for o in overrides for x in ("--set", o))])}
    for wid in ("worker-0", "worker-1"):
        procs[wid] = spawn(wid, ["worker", "--store", str(store), "--run", "scale", "--public-key", public_hex,
                                 "--id", wid, "--cache", str(run_dir / "cache" / wid)])
    procs["follower"] = spawn("follower", ["worker", "--follow-only", "--store", str(store), "--run", "scale",
                                           "--public-key", public_hex, "--id", "follower"])
    peaks: dict[str, float] = {}
    anon: dict[str, float] = {}
    series: list[tuple[float, float, float, float]] = []  # the trainer's (s, RSS, anon, file) every 0.5 s
    t0, failed = time.time(), None
    try:
        while procs["trainer"][0].poll() is None:
            for name, (p, _) in procs.items():
                v = peak_of(p.pid)
                if v is not None:
                    peaks[name] = max(peaks.get(name, 0.0), v)
                now = rss_of(p.pid)
                if "RssAnon" in now:
                    anon[name] = max(anon.get(name, 0.0), now["RssAnon"])
                    if name == "trainer":
                        series.append((round(time.time() - t0, 1), round(now["VmRSS"], 3), round(now["RssAnon"], 3),
                                       round(now["RssFile"], 3)))
            if time.time() - t0 > timeout_s:
                failed = f"timed out after {timeout_s:.0f} s"
                break
            time.sleep(0.5)
    finally:
        for name, (p, _) in procs.items():
            if p.poll() is None:
                p.terminate()
        for name, (p, _) in procs.items():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    wall = time.time() - t0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()] \
        if (run_dir / "metrics.jsonl").exists() else []
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    if procs["trainer"][0].returncode not in (0, None) and failed is None:
        failed = f"trainer exited {procs['trainer'][0].returncode}"
    out: dict = {"fleet_wall_s": wall, "steps_done": len(train), "failed": failed,
                 "peak_rss_gb": {k: round(v, 3) for k, v in peaks.items()},
                 "peak_anon_gb": {k: round(v, 3) for k, v in anon.items()}, "trainer_rss_series": series}
    # Cold join: from when version 0 was committed (or the worker started, if later) to the
    # worker's "joined run" line: download, verify, engine build. Log times have 1 s resolution.
    try:
        man = json.loads((store / "scale" / "weights" / f"{0:012d}" / "manifest.json").read_text())
        v0_at = float(json.loads(man["body"])["created"])
    except (OSError, ValueError, KeyError):
        v0_at = 0.0
    joins = []
    for wid in ("worker-0", "worker-1"):
        text = (run_dir / f"{wid}.log").read_text(errors="replace")
        m = re.search(r"^(\d\d:\d\d:\d\d) \S+ INFO worker \S+ (?:\(key \S+\) )?joined run", text, re.M)
        if m:
            since = max(procs[wid][1], v0_at)
            hh, mm, ss = (int(x) for x in m.group(1).split(":"))
            lt = time.localtime(since)
            joined = time.mktime((lt.tm_year, lt.tm_mon, lt.tm_mday, hh, mm, ss, 0, 0, lt.tm_isdst))
            joins.append(joined + 0.5 - since)
    out["join_s"] = joins
    syncs = []
    for line in (run_dir / "follower.log").read_text(errors="replace").splitlines():
        m = re.search(r"(delta|anchor|\w+) to version (\d+) in ([\d.]+) s \((\d+) bytes", line)
        if m:
            syncs.append({"kind": m.group(1), "version": int(m.group(2)), "s": float(m.group(3)), "bytes": int(m.group(4))})
    out["syncs"] = syncs
    deltas = [s for s in syncs if s["version"] > 0]
    out["sync_p50_s"] = float(np.median([s["s"] for s in deltas])) if deltas else None
    if train:
        toks = sum(r.get("learner/tokens", r.get("tokens", 0)) for r in train)
        secs = sum(r.get("learner/seconds", r.get("seconds", 0)) for r in train)
        out.update({
            "learner_tokens": toks, "learner_s": secs,
            "learner_s_per_1k_tokens": 1000 * secs / toks if toks else None,
            "step_s": [round(r["time/step_s"], 2) for r in train],
            "publish_s": float(np.median([r["pulse/seconds"] for r in train])),
            "quantize_s": float(np.median([r.get("pulse/quantize_s", np.nan) for r in train])),
            "delta_bytes": [r["pulse/bytes"] for r in train], "full_bytes": train[-1]["pulse/full_bytes"],
            "spot_check_s_total": train[-1].get("trust/spot_check_s"), "audit_s_total": train[-1].get("trust/audit_s"),
            "replay_s_total": train[-1].get("trust/replay_s"),
            "trust_counts": {k: v for k, v in train[-1].items() if k.startswith("trust/") and not k.endswith("_s")},
        })
    out["eval_s"] = [r.get("eval/seconds") for r in evals]
    beats = []
    for p in sorted((store / "scale" / "workers").glob("*.json")) if (store / "scale" / "workers").exists() else []:
        try:
            beats.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            pass
    out["worker_tokens_per_s"] = [b.get("tokens_per_s") for b in beats if isinstance(b, dict) and "tokens_per_s" in b]
    tail = (run_dir / "trainer.log").read_text(errors="replace").splitlines()[-8:]
    out["trainer_log_tail"] = tail
    return out


# ---------------------------------------------------------------------------------------------
# The cost model: per-parameter coefficients measured above, extrapolated to larger shapes
# ---------------------------------------------------------------------------------------------

LINKS = {"fiber300": 300, "cable100": 100, "dsl50": 50, "dsl25": 25, "overseas50": 50, "flaky10": 10}
"""Download Mbit/s of docs/wan.md's link classes."""


def _codes(cfg: dict) -> int:
    from stoa.models.presets import tensor_specs

    return sum(int(s[0]) * int(s[1]) for _, s, _ in tensor_specs(cfg) if len(s) == 2)


def cost_model(res: dict, targets=("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen3-8b"),
               change_rate: float = 0.005, max_lag: int = 8) -> dict:
    """Extrapolate the measured per-parameter costs of ``res`` to the ``targets`` presets.

    Linear in the parameter (or int8 code) count: state bytes, delta bytes per changed code,
    hash/apply/quantize seconds, worker memory; generation tokens/s inversely (decode is bound
    by reading the weights). Mac figures assume MLX's int8 kernels (no float copy) and are not
    measured here."""
    from stoa.models.presets import hf_config_for, num_params

    m, t, p, f = res["mlx"], res["torch"], res["pulse"], res.get("fleet", {})
    base = hf_config_for(res["preset"])
    if res.get("quick"):
        base = dict(base, num_hidden_layers=2)
    P0, C0 = num_params(base), _codes(base)
    state_per_code = m["state_bytes"] / C0
    bytes_per_change = p["delta_bytes"] / (p["changed_code_frac"] * C0)
    worker_peak = max((v for k, v in f.get("peak_rss_gb", {}).items() if k.startswith("worker")), default=m["peak_rss_gb"])
    # A worker on a CPU holds the int8 state and its float32 copy (4 bytes a parameter); on a Mac
    # MLX runs the int8 kernels on the state alone. The rest (runtime, tokenizer, KV cache) is
    # the measured peak minus those two, taken as fixed.
    overhead = max(0.0, worker_peak - (m["state_bytes"] + 4 * P0) / GB)
    out = {"basis": {"params": P0, "worker_overhead_gb": overhead, "codes": C0, "state_bytes_per_code": state_per_code,
                     "delta_bytes_per_changed_code": bytes_per_change, "worker_peak_gb_per_bparam": worker_peak / (P0 / 1e9),
                     "change_rate": change_rate, "max_lag": max_lag}}
    for name in targets:
        cfg = hf_config_for(name)
        P, C = num_params(cfg), _codes(cfg)
        k = C / C0
        state = state_per_code * C
        delta = bytes_per_change * change_rate * C
        row = {
            "params": P, "state_gb": state / GB, "delta_mb": delta / 1e6, "full_vs_delta": state / delta,
            "state_hash_s": p["state_hash_s"] * k, "apply_s": p["apply_s"] * k * change_rate / p["changed_code_frac"],
            "quantize_s": p["quantize_s"] * k, "encode_s": p["encode_s"] * k,
            "sync_s": {c: delta * 8 / (mb * 1e6) + p["apply_s"] * k + p["state_hash_s"] * k for c, mb in LINKS.items()},
            "full_sync_s": {c: state * 8 / (mb * 1e6) for c, mb in LINKS.items()},
            "worker_x86_gb": overhead + (state + 4 * P) / GB,
            "worker_mac_gb": overhead + state / GB,
            "trainer_held_dict_gb": (max_lag + 1) * state / GB,
            "trainer_held_disk_gb": state / GB,
            "trainer_mlx_eval_gb": (state + 4 * P) / GB,
            "gpu_learner_gb": 16 * P / GB, "gpu_scorer_bf16_gb": 2 * P / GB,
            "x86_gen_tok_s": m["gen_tokens_per_s"] * P0 / P,
            "mlx_cpu_score_s_per_1k_tok": 1000 * m["score_s"] / m["score_tokens"] * P / P0,
            "torch_cpu_score_s_per_1k_tok": 1000 * t["score_s"] / m["score_tokens"] * P / P0,
            "mlx_spot_check_s": m["spot_check_s"] * P / P0,
        }
        if f.get("learner_s_per_1k_tokens"):
            row["cpu_learner_s_per_1k_tok"] = f["learner_s_per_1k_tokens"] * P / P0
        out[name] = row
    return out


# ---------------------------------------------------------------------------------------------


def sub(part: str, model: Path, work: Path, *extra: str) -> dict:
    out = work / f"{part}{'-'.join(('',) + extra)}.json"
    cmd = [sys.executable, __file__, "--part", part, "--model", str(model), "--work", str(work), "--out", str(out), *extra]
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stdout[-2000:], r.stderr[-4000:], file=sys.stderr)
        return {"failed": f"exit {r.returncode}", "stderr": r.stderr[-1500:]}
    res = json.loads(out.read_text())
    res["wall_s"] = time.perf_counter() - t
    return res


def build(preset: str, quick: bool, work: Path) -> tuple[Path, int, float]:
    from stoa.models.presets import build_preset, hf_config_for, num_params

    cfg = hf_config_for(preset)
    if quick:
        cfg = dict(cfg, num_hidden_layers=2, max_window_layers=2)
    name = f"{preset}{'-2layer' if quick else ''}".replace("/", "_")
    path = work / "models" / name
    t = time.perf_counter()
    if not (path / "model.safetensors").exists():
        from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts

        build_preset(path, cfg, list(tokenizer_texts(generate(SyntheticConfig(seed=0)))))
    return path, num_params(cfg), time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--quick", action="store_true", help="2 layers of the real shape, components only (~1 min)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--workdir", type=Path, default=Path("runs/scale-bench"))
    ap.add_argument("--steps", type=int, default=3, help="RL steps of the fleet run")
    ap.add_argument("--groups", type=int, default=4, help="groups of 2 generated by the MLX part")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the scorer part")
    ap.add_argument("--no-fleet", action="store_true")
    ap.add_argument("--fleet-timeout", type=float, default=3600)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a run-config override for the fleet's trainer (repeatable), e.g. trainer.int8_scorer=\"torch\"")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--parts", default="mlx,torch,held,pulse,fleet", help="what to measure (comma-separated)")
    ap.add_argument("--from-json", type=Path, help="start from a saved run's results (re-measure only --parts)")
    ap.add_argument("extra", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.part:
        fn = {"mlx": lambda: part_mlx(a.model, a.work, int(a.extra[0])),
              "torch": lambda: part_torch(a.model, a.work, int(a.extra[0])),
              "held": lambda: part_held(a.model, a.work, a.extra[0], int(a.extra[1])),
              "pulse": lambda: part_pulse(a.model, a.work),
              "publish": lambda: part_publish(a.model, a.work, a.extra[0])}[a.part]
        a.out.write_text(json.dumps(fn(), indent=1))
        return

    work = a.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    parts = set(a.parts.split(",")) - {""}
    if a.quick or a.no_fleet:
        parts.discard("fleet")
    res: dict = json.loads(a.from_json.read_text()) if a.from_json else {}
    if parts:
        model, params, build_s = build(res.get("preset", a.preset), res.get("quick", a.quick), work)
        print(f"model {model.name}: {params / 1e9:.3f}B params (built in {build_s:.0f} s)", flush=True)
        res.update({"preset": res.get("preset", a.preset), "quick": res.get("quick", a.quick), "params": params})
    params = res["params"]
    if "mlx" in parts:
        res["mlx"] = sub("mlx", model, work, str(2 if a.quick else a.groups))
        print(f"mlx: {json.dumps(res['mlx'])[:400]}", flush=True)
    if "torch" in parts:
        res["torch"] = sub("torch", model, work, str(a.threads))
        print(f"torch: {json.dumps(res['torch'])[:400]}", flush=True)
    if "held" in parts:
        res["held_dict"] = sub("held", model, work, "dict", "8")
        res["held_disk"] = sub("held", model, work, "disk", "8")
        print(f"held: dict {res['held_dict'].get('rss_gb')} GB, disk {res['held_disk'].get('rss_gb')} GB", flush=True)
    if "pulse" in parts:
        res["pulse"] = sub("pulse", model, work)
        print(f"pulse: {json.dumps(res['pulse'])[:400]}", flush=True)
    if "publish" in parts:
        res["publish_whole"] = sub("publish", model, work, "whole")
        res["publish_streamed"] = sub("publish", model, work, "streamed")
        print(f"publish: whole {json.dumps(res['publish_whole'])[:300]}; streamed "
              f"{json.dumps(res['publish_streamed'])[:300]}", flush=True)
    if parts:
        try:
            import llama_cpp  # noqa: F401
            res["llama_cpp"] = "installed, but this benchmark has no GGUF conversion step; not measured"
        except ImportError:
            res["llama_cpp"] = "skipped: llama-cpp-python is not installed"
        print(f"llama.cpp peer: {res['llama_cpp']}", flush=True)
    if "fleet" in parts:
        res["fleet"] = run_fleet(model, work, a.steps, a.fleet_timeout, a.overrides)
        res["fleet"]["overrides"] = a.overrides
        print(f"fleet: {json.dumps(res['fleet'])[:600]}", flush=True)
    m, t, hd, hk, p = (res.get(k, {}) for k in ("mlx", "torch", "held_dict", "held_disk", "pulse"))
    pw, ps = res.get("publish_whole", {}), res.get("publish_streamed", {})
    f = res.get("fleet", {})
    peaks = f.get("peak_rss_gb", {})
    res["summary"] = summary = {
        "params": params,
        "peak_rss_trainer_gb": peaks.get("trainer"),
        "peak_rss_worker_gb": max([v for k, v in peaks.items() if k.startswith("worker")], default=m.get("peak_rss_gb")),
        "peak_rss_follower_gb": peaks.get("follower"),
        "cold_join_s": max(f["join_s"]) if f.get("join_s") else None,
        "sync_p50_s": f.get("sync_p50_s"),
        "delta_bytes_per_version": (float(sorted(f["delta_bytes"])[len(f["delta_bytes"]) // 2]) if f.get("delta_bytes")
                                    else p.get("delta_bytes")),
        "full_state_bytes": f.get("full_bytes") or p.get("anchor_bytes"),
        "gen_tokens_per_s": m.get("gen_tokens_per_s"),
        "learner_s_per_1k_tokens": f.get("learner_s_per_1k_tokens"),
        "publish_s": f.get("publish_s"),
        "publish_quantize_s": f.get("quantize_s"),
        "spot_check_s": m.get("spot_check_s"),
        "spot_check_torch_s": t.get("spot_check_s"),
        "worker_load_quantize_s": m.get("load_quantize_s"),
        "torch_vs_mlx_score_speedup": (m["score_s"] / t["score_s"]) if t.get("score_s") and m.get("score_s") else None,
        "torch_vs_mlx_logprob_max": t.get("diff_max"), "torch_vs_mlx_logprob_p99": t.get("diff_p99"),
        "torch_vs_mlx_margin_max": t.get("margin_diff_max"),
        "held_dict_gb": hd.get("rss_gb"), "held_disk_gb": hk.get("rss_gb"),
        "held_ratio": (hd["rss_gb"] / max(hk["rss_gb"], 1e-3)) if hd.get("rss_gb") and hk.get("rss_gb") else None,
        "pulse_delta_bytes_0p5pct": p.get("delta_bytes"), "pulse_delta_vs_full": (
            p["delta_bytes"] / p["anchor_bytes"]) if p.get("delta_bytes") else None,
        "fleet_steps": f.get("steps_done"),
        "publish_extra_rss_whole_gb": pw.get("extra_gb"), "publish_extra_rss_streamed_gb": ps.get("extra_gb"),
        "publish_same_state": (pw["state_hash"] == ps["state_hash"]) if pw.get("state_hash") and ps.get("state_hash")
        else None,
    }
    complete = all(res.get(k) and "failed" not in res[k] for k in ("mlx", "torch", "pulse"))
    res["cost_model"] = cm = cost_model(res) if complete else {}
    rows = [
        ("params", f"{params / 1e9:.3f} B", ""),
        ("worker: load + quantize", f"{m.get('load_quantize_s', 0):.1f} s", f"RSS {m.get('rss_after_load_gb', 0):.2f} GB"),
        ("worker: generation", f"{m.get('gen_tokens_per_s', 0):.1f} tok/s", f"{m.get('episodes')} episodes, MLX {m.get('mode')}"),
        ("MLX score", f"{m.get('score_s', 0):.2f} s", f"{m.get('score_tokens')} tokens"),
        ("torch int8 score", f"{t.get('score_s', 0):.2f} s",
         f"x{summary['torch_vs_mlx_score_speedup'] or 0:.2f} vs MLX; |dlogp| max {t.get('diff_max', 0):.2e} p99 {t.get('diff_p99', 0):.2e}"),
        ("sampling margins", f"MLX {m.get('margins_s', 0):.2f} s", f"torch {t.get('margins_s', 0):.2f} s; "
         f"|dmargin| max {t.get('margin_diff_max', 0):.2e} over {t.get('margin_tokens')} tokens, "
         f"min {t.get('margin_min', 0):.2e}, {t.get('margin_within_band')} within 1e-4 of an edge"),
        ("spot-check (load state + 2 eps)", f"MLX {m.get('spot_check_s', 0):.2f} s", f"torch {t.get('spot_check_s', 0):.2f} s"),
        ("held states, max_lag 8", f"dict {hd.get('rss_gb', 0):.2f} GB", f"disk {hk.get('rss_gb', 0):.2f} GB (one state {hd.get('state_gb', 0):.2f} GB)"),
        ("PULSE delta (0.5% of codes)", f"{p.get('delta_bytes', 0) / 1e6:.1f} MB", f"full {p.get('anchor_bytes', 0) / 1e6:.0f} MB; "
         f"changed {100 * p.get('changed_code_frac', 0):.2f}%; encode {p.get('encode_s', 0):.2f} s apply {p.get('apply_s', 0):.2f} s"),
        ("state hash (full)", f"{p.get('state_hash_s', 0):.2f} s", ""),
    ]
    if pw and ps:
        rows.append(("publish: export + quantize, RSS over", f"whole {pw.get('extra_gb', 0):.2f} GB, "
                     f"{pw.get('export_quantize_s', 0):.1f} s", f"streamed {ps.get('extra_gb', 0):.2f} GB, "
                     f"{ps.get('export_quantize_s', 0):.1f} s (x{pw.get('extra_gb', 0) / max(ps.get('extra_gb', 0), 1e-3):.1f} "
                     f"less); same state: {summary['publish_same_state']}"))
    if f:
        rows += [
            ("fleet", f"{f.get('steps_done')} RL steps in {f.get('fleet_wall_s', 0):.0f} s", f.get("failed") or "ok"),
            ("peak RSS", f"trainer {summary['peak_rss_trainer_gb'] or 0:.2f} GB",
             f"workers {[peaks.get(w) for w in ('worker-0', 'worker-1')]} GB, follower {peaks.get('follower')}"),
            ("cold join", f"{summary['cold_join_s'] or 0:.0f} s", ""),
            ("sync per version (p50)", f"{summary['sync_p50_s'] or 0:.2f} s", f"{summary['delta_bytes_per_version'] or 0:,.0f} bytes"),
            ("learner", f"{summary['learner_s_per_1k_tokens'] or 0:.1f} s / 1k tokens", ""),
            ("publish (export+quantize excluded)", f"{summary['publish_s'] or 0:.2f} s",
             f"export + quantize before it {summary['publish_quantize_s'] or 0:.2f} s"),
        ]
    print()
    print(f"{'component':38s} {'measured':28s} detail")
    for name, v, d in rows:
        print(f"{name:38s} {v:28s} {d}")
    print()
    print("extrapolated (per-parameter coefficients measured above; 0.5% of codes change per version):")
    print(f"{'model':14s} {'params':>7s} {'int8 state':>10s} {'delta':>8s} {'sync dsl50':>10s} {'full dsl50':>10s} "
          f"{'held x9':>8s} {'MLX eval':>8s} {'worker x86':>10s} {'worker Mac':>10s}")
    for name, r in cm.items():
        if name != "basis":
            print(f"{name:14s} {r['params'] / 1e9:6.2f}B {r['state_gb']:8.2f}GB {r['delta_mb']:6.1f}MB "
                  f"{r['sync_s']['dsl50']:9.1f}s {r['full_sync_s']['dsl50']:9.0f}s {r['trainer_held_dict_gb']:6.1f}GB "
                  f"{r['trainer_mlx_eval_gb']:6.1f}GB {r['worker_x86_gb']:8.1f}GB {r['worker_mac_gb']:8.1f}GB")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
