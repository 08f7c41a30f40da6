"""The families people fine-tune, on every stack: start-up parity at (near) real shape, then the fleet.

    python benchmarks/families.py [--families gemma-3-1b,mistral-7b-v0.1] [--parts parity,fleet]
                                  [--json PATH] [--workdir DIR] [--quick]

For each preset of :data:`FAMILIES` (random weights, exact tensor names and shapes, see
``stoa init-tiny --preset``), each part in its own process:

1. ``parity``: the preset at its real shape, except where :data:`PARITY_LAYERS` cuts layers to
   fit this machine (width, heads, ``head_dim``, vocabulary, windows, RoPE, soft-caps kept), in
   bfloat16 on disk as checkpoints ship. What the trainer's start-up check measures
   (:func:`stoa.fleet.parity.check`: the engine's built fields against the config, then probe
   episodes on the float torch learner, the int8 MLX engine and the torch int8 scorer), one stack
   in memory at a time; then, for sliding-window families, the same weights with the window cut to
   16 (a config edit) on the probes and on 200-token episodes, so the window is crossed at the
   real width. The engine runs its int8 kernels (``quantized``) to hold no float copy.
2. ``fleet``: ``stoa train`` (one trainer, one worker, local store) for 2 RL steps on
   ``examples/custom_env.py``'s arithmetic, on the preset's structure at the width of
   :func:`fleet_shape` (real vocabulary, layer pattern, ``head_dim``, soft-caps and RoPE; window 16 so
   episodes cross it), with the run's trust checks at their defaults. Reports the parity event, the
   audit floor and accepted / rejected batches, and what ``stoa train --check`` says with the torch
   and with the Megatron learner (a family Megatron cannot build is refused in one line; Megatron
   itself is not run: its model code needs CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["smollm2-135m", "qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b", "mistral-7b-v0.1", "gemma-2-2b",
            "gemma-3-1b"]
PARITY_LAYERS = {"llama-3.2-1b": 8, "mistral-7b-v0.1": 2, "gemma-2-2b": 2, "gemma-3-1b": 14}
"""Layers kept where the real depth does not fit this shared machine's memory (about 0.75B
parameters at most: a float32 learner plus the int8 state)."""
WINDOW = 16

_FLEET = """
name = "{name}"
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


def texts() -> list[str]:
    sys.path.insert(0, str(ROOT / "examples"))
    import custom_env  # noqa: F401 - registers example/Arithmetic-v0

    import stoa.envs

    return list(stoa.envs.make("example/Arithmetic-v0").unwrapped.tokenizer_texts())


def with_window(src: Path, dst: Path, window: int) -> Path:
    """``src`` with every sliding window cut to ``window`` (the same weight files, linked)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    cfg["sliding_window"] = window
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def long_episodes(vocab: int, n: int = 3, length: int = 200) -> list:
    import numpy as np

    from stoa.types import Episode, Segment

    rng = np.random.default_rng(0)
    return [Episode(prompt_tokens=rng.integers(0, vocab, 8).astype(np.int32),
                    segments=[Segment("model", rng.integers(0, vocab, length).astype(np.int32),
                                      np.zeros(length, np.float32))], reward=0.0, group_id=f"long-{i}")
            for i in range(n)]


def parity_part(name: str, work: Path) -> dict:
    """The start-up check's measurements (:func:`stoa.fleet.parity.check`), one stack in memory at a
    time: the float learner's scores and int8 state, then the engine's, then the torch scorer's."""
    import gc

    import stoa.backends.mlx  # noqa: F401 - OpenBLAS before mlx
    from stoa.backends.learner import LearnerConfig, make_learner
    from stoa.backends.mlx import MLXEngine
    from stoa.backends.torch.int8 import make_scorer
    from stoa.fleet import parity
    from stoa.models import hfconfig
    from stoa.models.presets import PRESETS, build_preset, num_params
    from stoa.transport.quant import quantize_state

    cfg = dict(PRESETS[name])
    cfg["num_hidden_layers"] = PARITY_LAYERS.get(name, cfg["num_hidden_layers"])
    t0 = time.perf_counter()
    path = build_preset(work / name, cfg, texts(), tokenizer_vocab=2048, dtype="bfloat16")
    out = {"family": name, "layers": cfg["num_hidden_layers"], "params": num_params(cfg),
           "build_s": time.perf_counter() - t0}
    spec = hfconfig.read(cfg)
    folders = [("real", path)] + ([("window16", with_window(path, work / f"{name}-w16", WINDOW))]
                                  if spec.sliding_window else [])
    for label, folder in folders:
        state = quantize_state(make_learner("torch", folder, LearnerConfig(threads=2)).iter_weights("float32"))
        gc.collect()
        engine = MLXEngine.from_state(folder, dict(state), 0, mode="quantized")
        why = parity.join_check(engine, folder)
        eps = parity.probe_episodes(engine.codec, engine.vocab_size)
        eps += long_episodes(2048) if label == "window16" else []
        en = engine.score(eps)
        del engine
        gc.collect()
        learner = make_learner("torch", folder, LearnerConfig(threads=2))  # built again: one stack at a time
        fl = learner.logprobs(eps, temperature=None)
        del learner
        gc.collect()
        scorer = make_scorer(folder, "cpu", "float32")
        scorer.load_state(0, state)
        sc = scorer.score(eps)
        del scorer, state
        gc.collect()
        row: dict = {"join_check": why or "ok", "tokens_max": max(len(e) for e in eps)}
        for part, sel in (("probe", [i for i, e in enumerate(eps) if e.group_id.startswith("parity")]),
                          ("long", [i for i, e in enumerate(eps) if e.group_id.startswith("long")])):
            if sel:
                pick = lambda xs: [xs[i] for i in sel]  # noqa: E731
                e_f, w1 = parity.gap(pick(en), pick(fl), pick(eps))
                s_f, w2 = parity.gap(pick(sc), pick(fl), pick(eps))
                e_s, w3 = parity.gap(pick(en), pick(sc), pick(eps))
                row.update({f"{part}/int8_vs_float": e_f, f"{part}/scorer_vs_float": s_f,
                            f"{part}/engine_vs_scorer": e_s, f"{part}/max_token": max(w1, w2, w3),
                            f"{part}/within_bounds": e_f < parity.INT8_BOUND and s_f < parity.INT8_BOUND
                            and e_s < parity.SAME_WEIGHTS_BOUND})
        out[label] = row
    return out


def fleet_shape(name: str) -> dict:
    """The preset's structure at a width the CPU trains in minutes: real vocabulary, ``head_dim``,
    layer pattern, soft-caps and RoPE, GQA ratio up to 4 over 2 key/value heads, 4 layers (7 for
    Gemma 3: five sliding, one full, one sliding), MLP 512, window 16; the width is the heads'
    (256 where ``head_dim`` is apart from it, as in Qwen3 and Gemma)."""
    from stoa.models.presets import PRESETS

    c = dict(PRESETS[name], intermediate_size=512)
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv = 2
    heads = kv * min(4, c["num_attention_heads"] // c["num_key_value_heads"])
    apart = c["model_type"] in ("qwen3", "gemma2", "gemma3_text")
    c.update(num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, hidden_size=256 if apart else heads * hd,
             num_hidden_layers={"gemma3_text": 7}.get(c["model_type"], 4))
    if c.get("sliding_window"):
        c["sliding_window"] = WINDOW
    return c


def fleet_part(name: str, work: Path) -> dict:
    from stoa.fleet.metrics import read_metrics
    from stoa.models.presets import build_preset, num_params

    cfg = fleet_shape(name)
    path = build_preset(work / f"{name}-fleet", cfg, texts(), tokenizer_vocab=512)
    config = work / f"{name}.toml"
    config.write_text(_FLEET.format(name=name, path=path, module=ROOT / "examples" / "custom_env.py"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    runs = work / "runs"
    out = {"family": name, "params": num_params(cfg), "layers": cfg["num_hidden_layers"],
           "hidden": cfg["hidden_size"], "window": cfg.get("sliding_window")}
    for learner in ("megatron", "torch"):  # --check only for Megatron: its model code needs CUDA
        check = subprocess.run([sys.executable, "-m", "stoa", "train", str(config), "--runs", str(runs), "--check",
                                "--set", f"learner.kind={learner}"], env=env, capture_output=True, text=True,
                               timeout=300)
        out[f"check/{learner}"] = "ok" if check.returncode == 0 else (check.stderr.strip().splitlines() or [""])[-1]
    if out["check/torch"] != "ok":
        return out
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "stoa", "train", str(config), "--runs", str(runs)],
                       env=env, capture_output=True, text=True, timeout=3000)
    out.update(returncode=r.returncode, seconds=time.perf_counter() - t0)
    if r.returncode != 0:
        out["tail"] = (r.stdout + r.stderr)[-2000:]
        return out
    rows = read_metrics(runs / name / "metrics.jsonl")
    par = next(x for x in rows if x.get("event") == "parity")
    train = [x for x in rows if x["kind"] == "train"]
    out.update({k: v for k, v in par.items() if k.startswith("parity/")},
               audit_floor=next((x["trust/audit_floor"] for x in rows if "trust/audit_floor" in x), None),
               steps=len(train), accepted=train[-1].get("trust/accepted_batches"),
               rejected=train[-1].get("trust/rejected_batches"),
               refusals=[x.get("event") for x in rows if x.get("event") in ("rejected", "banned")])
    return out


def available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def need_gb(name: str, part: str) -> float:
    """Memory a part holds at its peak: a float32 learner and the int8 state, or a small fleet."""
    from stoa.models.presets import PRESETS, num_params

    if part == "fleet":
        return 4.0
    return 5 * num_params({**PRESETS[name], "num_hidden_layers": PARITY_LAYERS.get(
        name, PRESETS[name]["num_hidden_layers"])}) / 2**30 + 1.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--parts", default="parity,fleet")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true",
                    help="A smoke run (under a few minutes): the fleet part of SmolLM2's and Gemma 3's shapes only.")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/stoa-families"))
    ap.add_argument("--wait", type=float, default=3600, help="Seconds to wait for the memory a part needs.")
    ap.add_argument("--one", nargs=2, metavar=("PART", "FAMILY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.families, args.parts = "smollm2-135m,gemma-3-1b", "fleet"
    if args.one:
        part, name = args.one
        work = args.workdir / name
        work.mkdir(parents=True, exist_ok=True)
        got = parity_part(name, work) if part == "parity" else fleet_part(name, work)
        print("RESULT " + json.dumps(got))
        return
    results = []
    for name in args.families.split(","):
        for part in args.parts.split(","):
            deadline = time.monotonic() + args.wait
            while available_gb() < need_gb(name, part) and time.monotonic() < deadline:
                time.sleep(30)  # a shared machine: start only when the part fits beside the others
            if available_gb() < need_gb(name, part):
                print(json.dumps({"family": name, "part": part, "skipped": f"needs {need_gb(name, part):.1f} GB, "
                                  f"{available_gb():.1f} GB available"}), flush=True)
                continue
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, __file__, "--workdir", str(args.workdir), "--one", part, name],
                               capture_output=True, text=True)
            line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
            got = json.loads(line[7:]) if line else {"family": name, "part": part, "error": r.stderr[-2000:]}
            got.update(part=part, wall_s=time.perf_counter() - t0)
            print(json.dumps(got), flush=True)
            results.append(got)
            shutil.rmtree(args.workdir / name, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
