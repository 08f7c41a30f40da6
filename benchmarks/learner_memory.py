"""Torch learner memory per training step: what ``learner.micro_batch_tokens`` and
``learner.gradient_checkpointing`` cost on a real model, on CPU.

Activation memory of one micro-batch grows with its tokens, and a trainer whose episodes grow
longer as the policy learns (a model that starts searching) meets its peak late in a run. Each
setting runs in its own process: the model is loaded, one warm-up step allocates the optimizer
state, the peak-RSS counter is reset (``/proc/self/clear_refs``), and one DPPO step over the same
Search-R1-shaped batch is measured: its peak above the resident memory before it, and tokens/s.
The baseline row is the default (8192-token micro-batches, no checkpointing).

    python benchmarks/learner_memory.py [--model PATH] [--quick] [--json out.json] [--threads 2]

Without ``--model`` it uses the real model ``make setup`` builds (SmolLM2-135M-Instruct), else
(and always with ``--quick``) a tiny random model. Linux only (reads ``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learner import make_episodes  # noqa: E402  (the same Search-R1-shaped episodes)

BASELINE = (8192, False)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def run_setting(args: argparse.Namespace) -> dict:
    import torch

    from stoa.backends.learner import LearnerConfig, make_learner

    torch.set_num_threads(args.threads)
    ln = make_learner("torch", args.model, LearnerConfig(lr=1e-5, micro_batch_tokens=args.micro_batch_tokens,
                                                         gradient_checkpointing=args.checkpointing))
    eps = make_episodes(args.episodes, ln.vocab_size, seed=0)
    adv = np.random.default_rng(1).standard_normal(len(eps))
    ln.train_step(eps[:8], adv[:8])  # warm-up: the optimizer state exists from here on
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (peak RSS) to the current RSS
    t0 = time.perf_counter()
    m = ln.train_step(eps, adv)
    sec = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    return {"micro_batch_tokens": args.micro_batch_tokens, "checkpointing": args.checkpointing,
            "tokens": m["tokens"], "micro_batches": m["micro_batches"], "step_seconds": sec,
            "tokens_per_s": m["tokens"] / sec, "rss_before_gib": before / 2**20,
            "step_peak_gib": (peak - before) / 2**20, "peak_rss_gib": peak / 2**20,
            "params": sum(p.numel() for p in ln.model.parameters())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="a Hugging Face model folder (default: the real model, if built)")
    p.add_argument("--quick", action="store_true", help="two settings on the tiny model (< 1 min)")
    p.add_argument("--json", type=Path, help="write results here")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--episodes", type=int, default=None)
    p.add_argument("--micro-batch-tokens", type=int, help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(run_setting(args)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from stoa.testing.realmodel import cached

            model = None if args.quick else cached()  # --quick: the tiny model, to stay under a minute
            if model is None:
                from stoa.models.tiny import TinyConfig, build_tiny

                texts = [f"protein P{i} binds receptor R{i % 13} <search> P{i} </search>" for i in range(3000)]
                model = build_tiny(tmp, texts, TinyConfig())
        settings = [(2048, False), BASELINE] if args.quick else \
            [(1024, False), (2048, False), (4096, False), BASELINE, (8192, True)]
        episodes = args.episodes or (48 if args.quick else 96)
        rows = []
        for mbt, ckpt in settings:
            cmd = [sys.executable, __file__, "--child", "--model", str(model), "--threads", str(args.threads),
                   "--episodes", str(episodes), "--micro-batch-tokens", str(mbt)] + (["--checkpointing"] if ckpt else [])
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    base = next(r for r in rows if (r["micro_batch_tokens"], r["checkpointing"]) == BASELINE)
    for r in rows:
        r["peak_vs_baseline"] = r["step_peak_gib"] / base["step_peak_gib"]
        r["speed_vs_baseline"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["activation_mib_per_1k_tokens"] = r["step_peak_gib"] * 1024 / (min(r["micro_batch_tokens"], r["tokens"]) / 1000)
    print(f"torch learner memory, {Path(model).name} ({rows[0]['params'] / 1e6:.0f}M parameters), {episodes} episodes "
          f"({base['tokens']:.0f} tokens) a step, {args.threads} threads, CPU float32")
    print("| micro_batch_tokens | checkpointing | micro-batches | step peak GiB | vs baseline | MiB per 1k tokens "
          "| tokens/s | speed vs baseline | peak RSS GiB |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['micro_batch_tokens']} | {'on' if r['checkpointing'] else 'off'} | {r['micro_batches']:.0f} "
              f"| {r['step_peak_gib']:.2f} | {r['peak_vs_baseline']:.2f}x | {r['activation_mib_per_1k_tokens']:.0f} "
              f"| {r['tokens_per_s']:.0f} | {r['speed_vs_baseline']:.2f}x | {r['peak_rss_gib']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"model": Path(model).name, "episodes": episodes, "threads": args.threads,
                                         "quick": args.quick, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
