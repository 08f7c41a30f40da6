"""One Gumbel-max draw at batch 64 over 49,152 and 151,936 tokens: the numpy host sampler (noise
only where it can decide the draw) against the full rule (every entry noised, the previous host
sampler) in the same run, the C sampler the torch engine uses on CPUs (``stoa.backends.torch.csample``;
its ratio is to the numpy host sampler), and the torch sampler on the same logits (CPU, and CUDA
when there is one). Logits: flat (N(0, 0.5), a random model's) and LM-like (N(0, 2.5) with a spiked token per
row and 200 tokens at 0.6 of the spike). Each figure is the best of ``--repeats`` calls; every
sampler's tokens are checked equal.

    python benchmarks/sampler.py [--quick] [--json out.json] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np


class FullRule:
    """The previous host sampler: noise for every vocabulary entry (reused buffers, row chunks)."""

    def __init__(self) -> None:
        self.z = self.e = np.empty((0, 0), np.float32)

    def __call__(self, logits: np.ndarray, seeds: np.ndarray, t: float) -> np.ndarray:
        from stoa.backends.sampling import gumbel

        b, v = logits.shape
        if self.z.shape != logits.shape:
            self.z, self.e = np.empty_like(logits), np.empty_like(logits)
        z, e = self.z, self.e
        np.multiply(logits, np.float32(1 / t), out=z)
        z -= z.max(axis=1, keepdims=True)
        np.exp(z, out=e)
        e.sum(axis=1)
        step = max(1, (1 << 18) // v)
        for a in range(0, b, step):
            gumbel(seeds[a:a + step], v, np.float32, out=e[a:a + step])
        e += z
        return e.argmax(axis=1)


def best_ms(fn, repeats: int) -> float:
    fn()
    out = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return 1e3 * out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    from stoa.backends.sampling import HostSampler
    from stoa.backends.torch import csample
    from stoa.backends.torch.sample import sample

    torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else 7
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rng = np.random.default_rng(0)
    host, full_rule = HostSampler(threads=args.threads), FullRule()
    c_ok = csample.available()[0]
    if not c_ok:
        print(f"C sampler column skipped: {csample.available()[1]}")
    rows = []
    load = os.getloadavg()
    for v in (49152, 151936):
        for kind in ("flat", "LM-like"):
            lg = (rng.standard_normal((64, v)) * (0.5 if kind == "flat" else 2.5)).astype(np.float32)
            if kind == "LM-like":
                lg[np.arange(64), rng.integers(0, v, 64)] += 25
                lg[:, rng.integers(0, v, 200)] += 15
            seeds = rng.integers(0, 2**63, 64, dtype=np.uint64)
            want = full_rule(lg, seeds, 1.0)
            row = {"vocab": v, "logits": kind, "full_ms": best_ms(lambda: full_rule(lg, seeds, 1.0), repeats),
                   "host_ms": best_ms(lambda: host(lg, seeds, 1.0), repeats)}
            assert np.array_equal(host(lg, seeds, 1.0)[0], want)
            if c_ok:
                assert np.array_equal(csample.sample(lg, seeds, 1.0, threads=args.threads)[0], want)
                row["c_ms"] = best_ms(lambda: csample.sample(lg, seeds, 1.0, threads=args.threads), repeats)
            for dev in devices:
                t = torch.from_numpy(lg).to(dev)
                assert np.array_equal(sample(t, seeds, 1.0)[0], want)
                row[f"torch_{dev}_ms"] = best_ms(lambda: sample(t, seeds, 1.0), repeats)
            rows.append(row)
    print(f"\nOne draw at batch 64 ({args.threads} threads, load {load[0]:.2f} -> {os.getloadavg()[0]:.2f}), "
          f"best of {repeats}")
    print(f"{'vocab':>7} {'logits':<8} {'full rule ms':>13} {'host ms':>8} {'ratio':>6}"
          + (f" {'C ms':>7} {'C ratio':>8}" if c_ok else "") + "".join(f" {'torch ' + d + ' ms':>13}" for d in devices))
    for r in rows:
        print(f"{r['vocab']:>7} {r['logits']:<8} {r['full_ms']:>13.1f} {r['host_ms']:>8.1f} "
              f"{r['full_ms'] / r['host_ms']:>6.2f}"
              + (f" {r['c_ms']:>7.2f} {r['host_ms'] / r['c_ms']:>8.1f}" if c_ok else "")
              + "".join(f" {r[f'torch_{d}_ms']:>13.1f}" for d in devices))
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "load": load, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
