"""The torch rollout engine on a GPU: generated tokens/s against transformers' ``generate``, the
sampler's share of a decode step, and honest episodes through the trainer's checks.

On a random-weight model of a real shape built locally (``qwen2.5-0.5b`` by default; no
downloads), on one CUDA device, in one run:

* **throughput**: single-turn episodes of ``--new-tokens`` tokens (no stop strings; a random model
  almost never draws EOS, so every row generates the same length) from the same chat prompts,
  at batch 64, 128 and 256: the engine (``dequantized``: float32, TF32 off; ``bfloat16``) against
  ``transformers``' ``generate`` (sampling at temperature 1, same dtype, ``min_new_tokens`` =
  ``max_new_tokens``), generated tokens/s and achieved GFLOP/s (2 per weight of every matrix
  multiplied, plus attention);
* **sampler**: one Gumbel-max draw at the largest batch over the model's vocabulary, flat logits
  (a random model's: every token a candidate) and peaked ones (a trained model's spread), against
  the engine's decode step;
* **checks**: two-turn episodes (an observation prefilled onto kept caches) sampled by the
  float32 engine and by the bfloat16 one, re-derived by the trainer's float32 torch int8 scorer
  (``check_draws``, drift allowance half the audit's sampling band): each token's margin, the
  share below ``-band``, and the log-prob gap (the bfloat16 drift).

``--dry-run`` runs the same code on the CPU with a toy model and toy sizes (a check of the
script). Results: a table on stdout and ``--json PATH``.

    python benchmarks/gpu_engine.py [--dry-run] [--json out.json] [--preset qwen2.5-0.5b] [--budget-s 270]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = ("the river runs to the sea and the town lies on its bank where the kinase binds its partner in "
         "neurons which protein does it activate add seventeen and twenty five").split()
TOY = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 128,
       "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "vocab_size": 1024, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096,
       "tie_word_embeddings": True, "use_sliding_window": False}


class TextTask:
    """A text environment without gymnasium: a chat prompt per index, ``turns`` model turns (the
    first ones answered with a short observation), no reward."""

    stop_strings: tuple[str, ...] = ()
    replayable = True
    spec = None

    def __init__(self, prompts: list[str], turns: int = 1) -> None:
        self.prompts, self.turns, self.t = prompts, turns, 0

    @property
    def unwrapped(self) -> TextTask:
        return self

    def __len__(self) -> int:
        return len(self.prompts)

    def reset(self, seed=None, options=None):
        self.t = 0
        return self.prompts[int((options or {}).get("index", 0)) % len(self.prompts)], {}

    def step(self, text):
        self.t += 1
        done = self.t >= self.turns
        return ("" if done else " noted: the town lies on the bank."), 0.0, done, False, {"metrics": {}}


def prompts(n: int, words: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=words)) for _ in range(n)]


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_tokens_per_s(eng, task: list[str], batch: int, new: int) -> dict:
    from dataclasses import replace

    from stoa.backends.engine import RolloutRequest, SamplingConfig

    eng.config = replace(eng.config, max_batch=batch)
    s = SamplingConfig(max_turn_tokens=new, max_episode_tokens=4 * new + 256, stop_strings=(), seed=1)
    reqs = [RolloutRequest(i, f"p{i}", 1) for i in range(batch)]
    eng.rollout(lambda: TextTask(task), reqs[:max(1, batch // 8)], replace(s, max_turn_tokens=4))  # warm-up
    sync()
    t0 = time.perf_counter()
    eps = eng.rollout(lambda: TextTask(task), reqs, s)
    sync()
    wall = time.perf_counter() - t0
    st = eng.last_stats()
    return {"tokens": st.model_tokens, "wall_s": wall, "tokens_per_s": st.model_tokens / wall,
            "decode_steps": st.decode_steps, "step_ms": 1e3 * wall / max(1, st.decode_steps),
            "prompt_tokens": float(np.mean([len(e.prompt_tokens) for e in eps]))}


def hf_tokens_per_s(model, eng, task: list[str], batch: int, new: int) -> dict:
    import torch

    toks = [eng.codec.prompt_tokens(p) for p in task[:batch]]
    width = max(len(t) for t in toks)
    pad = int(eng.tokenizer.pad_token_id or 0)
    ids = torch.tensor([[pad] * (width - len(t)) + t for t in toks], device=model.device)
    mask = torch.tensor([[0] * (width - len(t)) + [1] * len(t) for t in toks], device=model.device)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad)
    with torch.no_grad():
        model.generate(input_ids=ids[:max(1, batch // 8)], attention_mask=mask[:max(1, batch // 8)],
                       max_new_tokens=4, min_new_tokens=4, **kw)
        sync()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **kw)
        sync()
    wall = time.perf_counter() - t0
    n = int(out.shape[0] * (out.shape[1] - width))
    return {"tokens": n, "wall_s": wall, "tokens_per_s": n / wall}


def sampler_ms(vocab: int, batch: int, device: str, spread: float, repeats: int = 5,
               dense: bool | None = None) -> float:
    import torch

    from stoa.backends.torch.sample import sample

    rng = np.random.default_rng(0)
    logits = torch.from_numpy((rng.standard_normal((batch, vocab)) * spread).astype(np.float32)).to(device)
    seeds = rng.integers(0, 2**63, batch, dtype=np.uint64)
    sample(logits, seeds, 1.0, dense=dense)
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        sample(logits, seeds, 1.0, dense=dense)
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def checks(path: Path, engines: dict, task: list[str], device: str, groups: int, samples: int, new: int) -> dict:
    """Honest two-turn episodes of each engine through the float32 torch int8 scorer's check."""
    from stoa.backends.engine import RolloutRequest, SamplingConfig
    from stoa.backends.torch.int8 import TorchInt8Scorer

    try:
        from stoa.fleet.trust.audit import AuditConfig

        band = AuditConfig().sampling_band
    except ImportError:  # a package the fleet imports is missing here: the audit's default
        band = 0.02
    scorer = TorchInt8Scorer(path, device, "float32")
    scorer.load_state(0, next(iter(engines.values())).state)
    s = SamplingConfig(max_turn_tokens=new, max_episode_tokens=4 * new + 256, stop_strings=(), seed=5)
    reqs = [RolloutRequest(i, f"g{i}", samples) for i in range(groups)]
    out: dict = {"band": band}
    for mode, eng in engines.items():
        eps = eng.rollout(lambda: TextTask(task, turns=2), reqs, s)
        draws = scorer.check_draws(eps, [5] * len(eps), drift=band / 2)
        m = np.concatenate([d.margins for d in draws])
        gap = np.concatenate([np.abs(d.logprobs - e.behavior_logprobs()[d.at]) for d, e in zip(draws, eps)])
        own = eng.score(eps)
        self_gap = max(float(np.abs(o[e.loss_mask()] - e.behavior_logprobs()[e.loss_mask()]).max()) for o, e in
                       zip(own, eps))
        out[mode] = {"episodes": len(eps), "tokens": int(m.size), "min_margin": float(m.min()),
                     "below_band": int((m < -band).sum()), "below_band_share": float((m < -band).mean()),
                     "mean_abs_dlogprob_vs_scorer": float(gap.mean()), "max_abs_dlogprob_vs_scorer": float(gap.max()),
                     "max_abs_dlogprob_vs_own_score": self_gap,
                     "turns": float(np.mean([e.metrics["turns"] for e in eps]))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, a toy model and toy sizes (checks the script)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--preset", default="qwen2.5-0.5b", help="model shape (stoa.models.presets)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=270, help="skip what is left past this many seconds")
    ap.add_argument("--quick", action="store_true", help="batch 64 and 256 only")
    args = ap.parse_args()
    t_start = time.perf_counter()
    import torch

    from stoa.backends.engine import make_engine
    from stoa.models.presets import build_preset, decode_flops, hf_config_for

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --dry-run to check the script on a CPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = TOY if args.dry_run else hf_config_for(args.preset)
    batches = (4, 8) if args.dry_run else ((64, 256) if args.quick else (64, 128, 256))
    new = 8 if args.dry_run else args.new_tokens
    res: dict = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
                 "model": "toy" if args.dry_run else args.preset, "new_tokens": new, "batches": list(batches),
                 "throughput": {}, "skipped": []}
    over = lambda: time.perf_counter() - t_start > args.budget_s  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        path = build_preset(Path(tmp) / "model", cfg, prompts(200, 12), tokenizer_vocab=300 if args.dry_run else 2048)
        task = prompts(max(batches), 24, seed=1)
        res["build_s"] = time.perf_counter() - t_start
        engines = {"dequantized": make_engine(path, "torch", device=device)}
        engines["bfloat16"] = make_engine(path, "torch", state=engines["dequantized"].state, mode="bfloat16",
                                          device=device)
        res["load_s"] = time.perf_counter() - t_start - res["build_s"]
        from transformers import AutoModelForCausalLM

        for dtype, mode in ((torch.float32, "dequantized"), (torch.bfloat16, "bfloat16")):
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
            for b in batches:
                if over():
                    res["skipped"].append(f"throughput {mode} batch {b}")
                    continue
                ours = engine_tokens_per_s(engines[mode], task, b, new)
                theirs = hf_tokens_per_s(hf, engines[mode], task, b, new)
                flops = decode_flops(cfg, ours["prompt_tokens"] + new / 2)
                res["throughput"][f"{mode}/{b}"] = {
                    "engine": ours, "transformers": theirs, "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
                    "engine_gflops": ours["tokens_per_s"] * flops / 1e9,
                    "transformers_gflops": theirs["tokens_per_s"] * flops / 1e9}
                print(f"[gpu_engine] {mode} batch {b}: {ours['tokens_per_s']:.0f} vs {theirs['tokens_per_s']:.0f} tok/s"
                      f" at {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
            del hf
        b = max(batches)
        step = res["throughput"].get(f"dequantized/{b}", {}).get("engine", {}).get("step_ms")
        res["sampler"] = {"batch": b, "vocab": int(cfg["vocab_size"]), "decode_step_ms": step,
                          "flat_ms": sampler_ms(int(cfg["vocab_size"]), b, device, 0.5),
                          "peaked_ms": sampler_ms(int(cfg["vocab_size"]), b, device, 4.0),
                          "flat_bounded_ms": sampler_ms(int(cfg["vocab_size"]), b, device, 0.5, dense=False),
                          "peaked_bounded_ms": sampler_ms(int(cfg["vocab_size"]), b, device, 4.0, dense=False)}
        if over():
            res["skipped"].append("checks")
        else:
            groups, samples = (2, 2) if args.dry_run else (16, 4)
            res["checks"] = checks(path, engines, task, device, groups, samples, min(new, 32))
    res["wall_s"] = time.perf_counter() - t_start
    table(res)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")


def table(r: dict) -> None:
    print(f"\nTorch rollout engine on {r['device']} (torch {r['torch']}), model {r['model']}, "
          f"{r['new_tokens']} tokens per row")
    print(f"{'mode':<12} {'batch':>5} {'engine tok/s':>13} {'generate tok/s':>15} {'ratio':>6} "
          f"{'engine GFLOP/s':>15} {'step ms':>8}")
    for key, t in r["throughput"].items():
        mode, b = key.split("/")
        print(f"{mode:<12} {b:>5} {t['engine']['tokens_per_s']:>13.0f} {t['transformers']['tokens_per_s']:>15.0f} "
              f"{t['ratio']:>6.2f} {t['engine_gflops']:>15.0f} {t['engine']['step_ms']:>8.1f}")
    s = r["sampler"]
    step = f"{s['decode_step_ms']:.1f} ms" if s["decode_step_ms"] else "n/a"
    print(f"sampler at batch {s['batch']}, vocab {s['vocab']}: flat {s['flat_ms']:.2f} ms, peaked "
          f"{s['peaked_ms']:.2f} ms (decode step {step}); bounded candidates: flat {s['flat_bounded_ms']:.2f} ms, "
          f"peaked {s['peaked_bounded_ms']:.2f} ms")
    c = r.get("checks")
    if c:
        print(f"checks (float32 torch int8 scorer, drift allowance {c['band'] / 2:g}, band {c['band']:g}):")
        for mode in ("dequantized", "bfloat16"):
            m = c[mode]
            print(f"  {mode:<12} {m['tokens']:>6} tokens: min margin {m['min_margin']:+.2e}, below band "
                  f"{m['below_band']} ({m['below_band_share']:.2%}), |dlogp| vs scorer mean "
                  f"{m['mean_abs_dlogprob_vs_scorer']:.1e} max {m['max_abs_dlogprob_vs_scorer']:.1e}")
    if r["skipped"]:
        print(f"skipped (budget): {', '.join(r['skipped'])}")
    print(f"wall {r['wall_s']:.0f} s (build {r['build_s']:.0f} s, load {r['load_s']:.0f} s)")


if __name__ == "__main__":
    main()
