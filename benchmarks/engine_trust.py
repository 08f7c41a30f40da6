"""Honest and cheating workers on the torch rollout engine, judged by the trainer's scorers.

Workers sample with the torch engine (its CPU default, or ``--mode``) on the arithmetic example
(``examples/custom_env.py``) at T = 1, batches of one group of 4 episodes, each batch its own
group ids; every token of every episode is re-derived by the trainer's check (``check_draws``,
drift allowance half the audit's sampling band): by the torch int8 scorer (transformers' modules,
float32), by torch engines in the int8 kernel's modes (``--judge-modes``: what a CPU trainer's
``auto`` check runs on) and, where MLX is installed, by the MLX engine (float32). Cheaters claim T = 1 and honest log-probs of what
they drew (re-scored at T = 1) after sampling at 0.8 T, 0.6 T, or with top-p 0.9. Per row: tokens,
worst margin, the share within the band (ambiguous, never punished), tokens below ``-band``
(caught), episodes and batches holding a caught token.

    python benchmarks/engine_trust.py [--model PATH] [--mode auto] [--honest-batches 16] [--cheat-batches 8]
                                      [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def batches(eng, n: int, sampling, seed0: int) -> list[list]:
    from stoa.backends.engine import RolloutRequest

    from custom_env import ArithmeticEnv

    return [eng.rollout(lambda: ArithmeticEnv(size=40), [RolloutRequest(b % 40, f"b{seed0}-{b}", 4)],
                        dataclasses.replace(sampling, seed=seed0 + b)) for b in range(n)]


def claim_honest(eng, eps: list, temperature: float) -> list:
    """Episodes claiming ``temperature`` and top-p 1 with log-probs re-scored so (what a careful cheater sends)."""
    from stoa.testing.adversaries import claim_logprobs

    eps = [dataclasses.replace(e, temperature=temperature, top_p=1.0) for e in eps]
    claim_logprobs(eps, eng.score(eps))
    return eps


def judge(scorer, groups: list[list], seed0: int, band: float) -> dict:
    margins, eps_caught, batches_caught, lp_gap = [], 0, 0, 0.0
    for b, eps in enumerate(groups):
        draws = scorer.check_draws(eps, [seed0 + b] * len(eps), drift=band / 2)
        caught = [bool((d.margins < -band).any()) for d in draws]
        eps_caught += sum(caught)
        batches_caught += any(caught)
        margins += [d.margins for d in draws]
        lp_gap = max([lp_gap] + [float(np.abs(d.logprobs - e.behavior_logprobs()[d.at]).max()) for d, e in
                                 zip(draws, eps) if d.at.size])
    m = np.concatenate(margins)
    return {"tokens": int(m.size), "worst_margin": float(m.min()), "ambiguous": float((np.abs(m) <= band).mean()),
            "caught": float((m < -band).mean()), "episodes_caught": eps_caught,
            "episodes": sum(len(g) for g in groups), "batches_caught": batches_caught, "batches": len(groups),
            "max_abs_dlogprob": lp_gap}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path.home() / ".cache/stoa/models/SmolLM2-135M-Instruct")
    ap.add_argument("--honest-batches", type=int, default=16)
    ap.add_argument("--cheat-batches", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", default="auto", help="the workers' torch engine mode")
    ap.add_argument("--judge-modes", default="int24,quantized",
                    help="torch engine modes that judge too (the int8 kernel's: int24, int16, quantized; '' for none)")
    ap.add_argument("--bf16-batches", type=int, default=4, help="honest batches of a bfloat16-compute engine (its drift)")
    ap.add_argument("--only-bf16", action="store_true", help="only the bfloat16 rows")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    try:
        import stoa.backends.mlx  # noqa: F401  (OpenBLAS for MLX before torch loads)
        have_mlx = True
    except ImportError:
        have_mlx = False
    import torch

    from stoa.backends.engine import EngineConfig, SamplingConfig, make_engine
    from stoa.backends.torch.int8 import TorchInt8Scorer
    from stoa.fleet.trust.audit import AuditConfig

    torch.set_num_threads(args.threads)
    band = AuditConfig().sampling_band
    from stoa.backends.engine import EngineError

    eng = make_engine(args.model, "torch", config=EngineConfig(max_batch=8), device="cpu", mode=args.mode)
    judges = {"torch scorer": TorchInt8Scorer(args.model, "cpu")}
    judges["torch scorer"].load_state(0, eng.state)
    for mode in filter(None, args.judge_modes.split(",")):
        try:
            judges[f"torch engine, {mode}"] = make_engine(args.model, "torch", state=eng.state, mode=mode,
                                                          config=EngineConfig(max_batch=8), device="cpu")
        except EngineError as e:
            print(f"no {mode} judge: {e}")
    if have_mlx:
        judges["MLX engine"] = make_engine(args.model, "mlx", state=eng.state, mode="dequantized")
    base = SamplingConfig(max_turn_tokens=16, max_episode_tokens=120)
    rows: dict = {}
    if args.bf16_batches:  # an engine computing in bfloat16 (what a GPU worker may run), judged in float32
        bf16 = make_engine(args.model, "torch", state=eng.state, mode="bfloat16", config=EngineConfig(max_batch=8),
                           device="cpu")
        groups = batches(bf16, args.bf16_batches, base, 3000)
        rows["honest bfloat16 engine, torch scorer"] = judge(judges["torch scorer"], groups, 3000, band)
        del bf16
    if args.only_bf16:
        judges, args.honest_batches, args.cheat_batches = {}, 0, 0
    honest = batches(eng, args.honest_batches, base, 1000)
    for name, sc in judges.items():
        rows[f"honest, {name}"] = judge(sc, honest, 1000, band)
    cheats = {"0.8 T": dataclasses.replace(base, temperature=0.8), "0.6 T": dataclasses.replace(base, temperature=0.6),
              "top-p 0.9, claims 1.0": dataclasses.replace(base, top_p=0.9)}
    for name, s in (cheats.items() if args.cheat_batches else ()):
        groups = [claim_honest(eng, g, 1.0) for g in batches(eng, args.cheat_batches, s, 5000)]
        rows[f"samples at {name}" if "T" in name and "top" not in name else f"samples with {name}"] = judge(
            judges["torch scorer"], groups, 5000, band)
    print(f"\nTorch-engine workers ({eng.mode} mode) on {args.model.name}, band {band}; cheaters judged by the torch scorer")
    print(f"{'worker, judge':<34} {'tokens':>7} {'worst margin':>13} {'ambiguous':>9} {'caught':>7} "
          f"{'episodes':>9} {'batches':>8} {'max |dlogp|':>11}")
    for k, r in rows.items():
        print(f"{k:<34} {r['tokens']:>7} {r['worst_margin']:>+13.2e} {r['ambiguous']:>9.1%} {r['caught']:>7.1%} "
              f"{r['episodes_caught']:>4}/{r['episodes']:<4} {r['batches_caught']:>3}/{r['batches']:<4} "
              f"{r['max_abs_dlogprob']:>11.1e}")
    if args.json:
        args.json.write_text(json.dumps({"band": band, "mode": eng.mode, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
