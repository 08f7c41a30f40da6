"""What the trainer's model checks cost per step, against its learner step, on the learner's device.

Per optimizer step the trainer takes ``--episodes`` episodes (batches of ``--batch``) and, before
training on them, checks every batch. By default (``audit.every_episode``) the int8 scorer
checks **every episode** (``check_draws``: one forward pass per distinct row gives every sampled
token's draw margin and log-prob). The cheaper, weaker configuration (``every_episode = false``)
is measured too: the **audit** (the learner's forward pass at model tokens over
``audit.fraction`` of its episodes, one row per distinct episode) and the **sampling check**
(one random episode and every episode that repeats another's tokens). This runs exactly those
calls next to the learner's DPPO step (the baseline) on the same episodes, for each int8 scorer
available: torch on the learner's device (``torch``: transformers' modules; ``torch engine``: the
torch rollout engine's own decoder, on a CPU with its int8 kernel and with float32 weights), and the MLX engine (``engine``) where MLX is installed. Replay (CPU
work of the task, not of the model) and the rare spot-checks are not included; the demo's
metrics give them (docs/trust.md).

Episodes look like converged Search-R1 rollouts (``benchmarks/learner.py``'s shapes: a prompt,
0-3 rounds of think + search and retrieved documents, an answer); in each group of 8 only
``--distinct`` of the samples differ (the rest repeat one of them), as a converged policy plays
(the demo: ~30% distinct).

    python benchmarks/checks.py [--quick] [--json out.json] [--preset tiny|qwen2.5-0.5b|...]
                                [--device auto|cpu|cuda] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_episodes(n: int, vocab: int, distinct: float, seed: int, group: int = 8):
    """Converged groups of ``group`` samples: ``ceil(distinct * group)`` of them differ, the rest
    repeat one of those. Each sample is shaped as ``benchmarks/learner.py``'s Search-R1 rollouts."""
    from dataclasses import replace

    from learner import make_episodes as search_r1_episodes

    k, n_groups = max(1, math.ceil(distinct * group)), math.ceil(n / group)
    unique = search_r1_episodes(n_groups * k, vocab, seed)
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        mine = unique[g * k:(g + 1) * k]
        for i in range(group):
            sample = mine[i] if i < k else mine[int(rng.integers(k))]
            out.append(replace(sample, group_id=f"g{g}", sample_index=i, item_index=g))
    return out[:n]


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, after one warm-up call."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one small step's worth, few repeats (< 1 min on CPU)")
    p.add_argument("--json", type=Path, help="write results here")
    p.add_argument("--preset", default="tiny", help="'tiny' (the demo's model) or a stoa.models.presets name")
    p.add_argument("--model", type=Path, help="a Hugging Face model folder instead of a preset (e.g. the real model)")
    p.add_argument("--device", default="auto", help="the learner's and the torch scorer's device")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the demo's trainer uses 1)")
    p.add_argument("--episodes", type=int, default=None, help="episodes per optimizer step (default 64)")
    p.add_argument("--batch", type=int, default=32, help="episodes per worker batch (the demo's 4 groups of 8)")
    p.add_argument("--distinct", type=float, default=0.3, help="share of distinct samples in a group")
    p.add_argument("--fraction", type=float, default=0.25, help="trust.audit.fraction")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--micro-batch-tokens", type=int, default=8192,
                   help="the learner's micro-batch (smaller: less memory; the real model at 8192 needs ~15 GB)")
    args = p.parse_args()
    episodes = args.episodes or (32 if args.quick else 64)
    repeats = args.repeats or (2 if args.quick else 5)

    try:
        import stoa.backends.mlx as _mlx  # noqa: F401  (OpenBLAS for MLX before torch, where MLX is installed)
    except ImportError:
        pass
    import torch

    from stoa.backends.learner import LearnerConfig, make_learner
    from stoa.backends.torch.int8 import TorchInt8Scorer, resolve_device
    from stoa.fleet.trust.review import distinct_rows, sampling_pick
    from stoa.transport.quant import quantize_state

    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    texts = [f"protein P{i} binds receptor R{i % 13} in tissue T{i % 7} <search> P{i} </search>" for i in range(3000)]
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is not None:
            model = args.model
        elif args.preset == "tiny":
            from stoa.models.tiny import TinyConfig, build_tiny

            model = build_tiny(tmp, texts, TinyConfig(num_layers=2, intermediate_size=384))  # the demo's shape
        else:
            from stoa.models.presets import build_preset

            model = build_preset(tmp, args.preset, texts)
        learner = make_learner("torch", model, LearnerConfig(lr=1e-6, threads=args.threads, device=args.device,
                                                             micro_batch_tokens=args.micro_batch_tokens))
        vocab = min(learner.vocab_size, 2048)  # the tokenizer's ids (a preset's rows past them are padding)
        eps = make_episodes(episodes, vocab, args.distinct, seed=0)
        batches = [eps[i:i + args.batch] for i in range(0, len(eps), args.batch)]
        adv = np.random.default_rng(1).normal(size=len(eps)).astype(np.float32)
        rng = np.random.default_rng(2)
        audit_pick = [[b[i] for i in sorted(rng.choice(len(b), max(1, math.ceil(args.fraction * len(b))),
                                                       replace=False))] for b in batches]
        sample_pick = [[b[i] for i in sampling_pick(b, rng, 1)] for b in batches]
        state = quantize_state(learner.iter_weights())
        from stoa.backends.engine import EngineConfig, make_engine

        scorers = {"torch": TorchInt8Scorer(model, device)}
        scorers["torch"].load_state(0, state)
        eng = make_engine(model, "torch", state=state, version=0, device=device)
        scorers[f"torch engine ({eng.mode})"] = eng
        for other in ("quantized", "dequantized"):  # the kernel's float32 path and float32 weights, to compare with
            if eng.mode in ("int24", "quantized") and other != eng.mode:
                scorers[f"torch engine ({other})"] = make_engine(model, "torch", state=state, version=0,
                                                                 device=device, mode=other)
        try:
            scorers["engine"] = make_engine(model, "mlx", state=state, version=0, config=EngineConfig(max_batch=64))
        except ImportError:
            pass

        def sync() -> None:
            if device.startswith("cuda"):
                torch.cuda.synchronize()

        step_s = timed(lambda: (learner.train_step(eps, adv), sync()), repeats)
        audit_s = timed(lambda: [(learner.logprobs(distinct_rows(a)[0], None, model_only=True), sync())
                                 for a in audit_pick], repeats)
        rows = {"step": {"seconds": step_s}, "audit": {"seconds": audit_s,
                                                        "episodes": sum(len(a) for a in audit_pick),
                                                        "rows": sum(len(distinct_rows(a)[0]) for a in audit_pick)}}
        for name, sc in scorers.items():
            s = timed(lambda: [(sc.sampling_margins(x, [7] * len(x)), sync()) for x in sample_pick], repeats)
            rows[f"sampling ({name})"] = {"seconds": s, "episodes": sum(len(x) for x in sample_pick),
                                          "rows": sum(len(distinct_rows(x)[0]) for x in sample_pick)}
            s = timed(lambda: [(sc.check_draws(x, [7] * len(x), drift=0.01), sync()) for x in batches], repeats)
            rows[f"every ({name})"] = {"seconds": s, "episodes": len(eps),
                                       "rows": sum(len(distinct_rows(x)[0]) for x in batches)}
    tokens = sum(len(e) for e in eps)
    print(f"model checks per optimizer step: {args.model or args.preset} on {device} ({args.threads} CPU threads), {len(eps)} "
          f"episodes ({tokens} tokens, {args.distinct:.0%} distinct per group) in batches of {args.batch}; "
          f"median of {repeats}")
    print(f"{'':<20} {'s/step':>8} {'episodes':>8} {'rows':>5} {'ratio (step + checks) / step':>30}")
    print(f"{'learner step':<20} {step_s:>8.3f}")
    results, sampled = {}, {}
    for name in [k for k in rows if k.startswith("sampling")]:
        scorer = name[len("sampling ("):-1]
        sampled[scorer] = (step_s + audit_s + rows[name]["seconds"]) / step_s
        results[scorer] = (step_s + rows[f"every ({scorer})"]["seconds"]) / step_s
    for k, r in rows.items():
        if k == "step":
            continue
        print(f"{k:<20} {r['seconds']:>8.3f} {r['episodes']:>8} {r['rows']:>5}")
    for scorer, ratio in results.items():
        print(f"{'every episode (' + scorer + ')':<38} {'':>5} {ratio:>30.3f}")
        print(f"{'audit + sampling (' + scorer + ')':<38} {'':>5} {sampled[scorer]:>30.3f}")
    if args.json:
        payload = {"preset": str(args.model or args.preset), "device": device, "threads": args.threads, "episodes": len(eps),
                   "tokens": tokens, "batch": args.batch, "distinct": args.distinct, "fraction": args.fraction,
                   "repeats": repeats, "quick": args.quick, "rows": rows,
                   "ratio": results, "ratio_sampled": sampled}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
