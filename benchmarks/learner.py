"""Torch learner training throughput: sequence packing vs padding, on CPU by default.

Episodes look like Search-R1 rollouts: a chat prompt, 0-3 rounds of (think + search call by the
model, retrieved documents from the environment), then an answer; lengths vary ~10x. Both
variants take DPPO steps over the same batch with the same token budget per micro-batch;
"padded" puts one episode per row and pads each micro-batch to its longest episode (the usual
baseline), "packed" fills rows with whole episodes. Each variant runs in its own process so its
peak memory is its own. Prints a table; ``--json PATH`` writes ``packing_speedup`` (packed over
padded training tokens/s) and the per-variant figures.

    python benchmarks/learner.py [--quick] [--json out.json] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def make_episodes(n: int, vocab: int, seed: int):
    from stoa.types import Episode, Segment

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        segs = []
        for _ in range(int(rng.choice([0, 1, 1, 2, 3]))):
            k = int(rng.integers(8, 40))  # <think> ... </think><search> query </search>
            segs.append(Segment("model", rng.integers(0, vocab, k), -rng.uniform(0.05, 4, k).astype(np.float32)))
            segs.append(Segment("env", rng.integers(0, vocab, int(rng.integers(60, 180)))))  # 3 documents
        k = int(rng.integers(4, 24))  # <answer> ... </answer><|im_end|>
        segs.append(Segment("model", rng.integers(0, vocab, k), -rng.uniform(0.05, 4, k).astype(np.float32)))
        prompt = rng.integers(0, vocab, int(rng.integers(25, 70)))
        out.append(Episode(prompt, segs, reward=float(rng.random()), group_id=str(i // 8), sample_index=i % 8))
    return out


def run_variant(args: argparse.Namespace) -> dict:
    import torch

    from stoa.backends.learner import LearnerConfig, make_learner

    torch.set_num_threads(args.threads)
    ln = make_learner("torch", args.model, LearnerConfig(
        lr=1e-4, micro_batch_tokens=args.micro_batch_tokens, packing=args.variant == "packed"))
    eps = make_episodes(args.episodes, ln.vocab_size, seed=0)
    adv = np.random.default_rng(1).standard_normal(len(eps))
    rss_loaded = _rss_mib()
    ln.train_step(eps, adv)  # warm-up
    times, metrics = [], None
    for _ in range(args.steps):
        t0 = time.perf_counter()
        metrics = ln.train_step(eps, adv)
        times.append(time.perf_counter() - t0)
    sec = float(np.median(times))
    return {
        "variant": args.variant,
        "tokens_per_step": metrics["tokens"],
        "step_seconds": sec,
        "tokens_per_s": metrics["tokens"] / sec,
        "micro_batches": metrics["micro_batches"],
        "pad_fraction": metrics["pad_fraction"],
        "peak_rss_mib": _peak_rss_mib(),
        "step_peak_mib": _peak_rss_mib() - rss_loaded,
    }


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small batch, few steps (< 1 min)")
    p.add_argument("--json", type=Path, help="write results here")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--episodes", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--variant", choices=["packed", "padded"], help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.episodes = args.episodes or (32 if args.quick else 128)
    args.steps = args.steps or (2 if args.quick else 4)
    if args.variant:  # child process: one variant
        print(json.dumps(run_variant(args)))
        return

    from stoa.models.tiny import TinyConfig, build_tiny

    texts = [f"protein P{i} binds receptor R{i % 13} in tissue T{i % 7} <search> P{i} </search>" for i in range(3000)]
    tiny = TinyConfig()  # the demo's size: width 128, 4 layers, ~2k vocab
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny(tmp, texts, tiny)
        for variant in ("padded", "packed"):
            cmd = [sys.executable, __file__, "--variant", variant, "--model", str(model),
                   "--threads", str(args.threads), "--episodes", str(args.episodes), "--steps", str(args.steps),
                   "--micro-batch-tokens", str(args.micro_batch_tokens)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results[variant] = json.loads(out.strip().splitlines()[-1])
    speedup = results["packed"]["tokens_per_s"] / results["padded"]["tokens_per_s"]
    print(f"torch learner, tiny Qwen2 (width {tiny.hidden_size}, {tiny.num_layers} layers), {args.episodes} episodes "
          f"({results['packed']['tokens_per_step']:.0f} tokens)/step, {args.micro_batch_tokens}-token micro-batches, "
          f"{args.threads} threads, CPU float32")
    print(f"{'variant':<8} {'tokens/s':>9} {'s/step':>7} {'micro-batches':>13} {'pad frac':>8} "
          f"{'peak RSS MiB':>12} {'step peak MiB':>13}")
    for v in ("padded", "packed"):
        r = results[v]
        print(f"{v:<8} {r['tokens_per_s']:>9.0f} {r['step_seconds']:>7.2f} {r['micro_batches']:>13.0f} "
              f"{r['pad_fraction']:>8.2f} {r['peak_rss_mib']:>12.0f} {r['step_peak_mib']:>13.0f}")
    print(f"packing_speedup (packed / padded tokens/s): {speedup:.2f}x")
    if args.json:
        payload = {"packing_speedup": speedup, "packed": results["packed"], "padded": results["padded"],
                   "episodes": args.episodes, "steps": args.steps, "threads": args.threads,
                   "micro_batch_tokens": args.micro_batch_tokens, "quick": args.quick}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
