"""The off-policy study: when does the DPPO gate matter? Objectives x forced lag x seeds, run by `stoa sweep`.

Every cell is a real fleet run on this machine (``stoa train``: the trainer and two int8 MLX
workers meeting in a LocalStore through PULSE) on the harder synthetic task
``stoa/SyntheticSearchHard-v0`` (paraphrases, similarly named distractors, two-hop questions), with
the policy lag forced by the run-config key ``--lag-key`` (``rollout.lag``: workers generate with
the version ``lag`` behind the trainer's head). The staleness gate is widened with the lag
(``trainer.max_lag = lag + 3``) so forced-stale groups are trained on, not dropped. Each seed's
warm start runs once and is shared by that seed's cells (paired comparisons, see
``stoa/fleet/operator/sweep.py``).

The grid (objective names as the sweep knows them):

* ``dppo`` (binary-TV gate, the default), ``dppo_kl`` (binary-KL gate), ``tis`` (capped ratio, no
  gate: DPPO without its gate), ``icepop`` (two-sided ratio band), ``ppo`` (clip against mu),
  ``gepo`` (group-expectation weight, arXiv 2508.17850), and ``none``;
* ``none`` (no correction) is ``reinforce``: ``-A log pi``, no importance weight, gate or clip.
  It is the objective that ignores mu entirely, so any gap to it is what a correction buys.
* lags 0, 2, 4, 8; seeds 0, 1, 2 (``--quick``: ``dppo`` and ``none`` x lags 0 and 8, seed 0,
  a smaller task, a warm start of 320 steps (not 840) and 16 RL steps per cell: a
  check of the harness that fits in 15 minutes here, not a result; its tiny model barely reads).

``--task arithmetic``: the same grid on the researcher's own task (``examples/custom_env.py``, the
calculator arithmetic of ``examples/arithmetic_tiny.toml``: same model, env, warm start and learner,
which learns there, held-out pass@1 about 5% -> 80% in 40 RL steps), plus the study's needs:
``trainer.max_lag`` widened per lag, ``trainer.mismatch_every = 4``, evaluation every 10 versions.
Grid ``offpolicy-arith`` (``--quick``: ``offpolicy-arith-quick``, ``dppo`` and ``none`` x lags 0
and 8, seed 0, 16 RL steps, 50 questions x 1 sample). ``env.module`` is written as this checkout's
absolute path to ``examples/custom_env.py`` (a relative one would be read beside the written
run config). ``--objectives``, ``--lags`` and ``--seeds`` cut a grid
down; the cells of a cut grid are the same runs as the full grid's, so a larger cut reuses them.
Check each seed's warm start in ``results.md``: seed 2's fails on this task (p(final turn) 0.001,
the model never learns to copy the calculator's result), so its cells carry no signal.

``--model PATH`` (a Hugging Face folder, e.g. SmolLM2-135M-Instruct) measures instead, on that
model, what the gate sees in ``examples/smollm2_addition.toml``'s fleet, without a sweep: the int8
MLX engine (the workers' policy mu) samples episodes of the example's task at temperature 1; the
float torch learner scores them at the same version (lag 0) and after one AdamW step at the
example's learning rate on its demonstrations (lag 1, the lag its single worker runs at). Per lag:
tokens, the share with ``|pi - mu| > 0.2`` (what DPPO's binary-TV gate masks when the advantage
pushes that token further away: an upper bound of its share), the share it masks under the
episodes' own group advantages, KL(mu||pi) (k1, k3) and percentiles of ``|log pi - log mu|``.
``--quick``: 4 prompts x 4 samples (about a minute); default 16 x 8. ``--json PATH`` writes the rows.

Resumable: run it again and finished cells are kept. ``--json PATH`` writes
``{"quick": ..., "seconds": ..., "cells": [...]}``; each cell has ``objective``, ``lag``, ``seed``,
``final_pass_at_1``, ``best_pass_at_1``, ``gate_fraction``, ``kl_mu_pi`` and the rest of
:func:`stoa.fleet.operator.sweep.cell_result`. The table and plots are in ``<runs>/<name>/results.md``.

    python benchmarks/offpolicy.py --quick --json quick.json          # < 15 min on 2 cores
    python benchmarks/offpolicy.py --json study.json                  # the study: many CPU-hours
    python benchmarks/offpolicy.py --quick --lag-key trainer.max_lag  # before rollout.lag exists
    python benchmarks/offpolicy.py --task arithmetic --quick          # 226 s on an idle 2-core machine (measured)
    python benchmarks/offpolicy.py --task arithmetic --lags 0 2 4 8 --seeds 0 1   # docs/offpolicy.md's grid
    python benchmarks/offpolicy.py --model ~/.cache/stoa/models/SmolLM2-135M-Instruct --quick --json real.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RUN = """\
# Written by benchmarks/offpolicy.py: the off-policy study's run config (every cell starts here).
name = "offpolicy"
seed = 0

[model]
path = ""

[model.tiny]
vocab_size = 2048
hidden_size = 128
num_layers = 2
num_heads = 4
num_kv_heads = 2
intermediate_size = 384

[env]
id = "stoa/SyntheticSearchHard-v0"
kwargs = {{ num_families = {families}, num_test = {num_test}, seed = 0 }}

[warmstart]
# Reading practice (oracle demonstrations, both hops) in sibling worlds, then this world's habit:
# few searches with the document's words, more lazy one-search readers, most guesses.
practice_steps = {practice}
practice_worlds = 16
steps = {habit}
batch_size = {batch}
mix = {{ oracle = 0.2, naive = 0.3, guess = 0.5 }}
practice_answer_only = {batch}
lr = 3e-3
check_every = 200
threads = 2

[rollout]
group_size = 8
groups_per_cohort = 4
max_outstanding = 1
temperature = 1.0
max_turn_tokens = 16
max_episode_tokens = 256
max_batch = 64

[trainer]
steps = {steps}
groups_per_step = 8
max_lag = 3
advantage = "drgrpo"
threads = 1
checkpoint_every = 25
mismatch_every = 4

[learner]
kind = "torch"
lr = 5e-4
grad_clip = 1.0
micro_batch_tokens = 8192

[objective]
kind = "dppo"

[pulse]
anchor_every = 50
dtype = "float32"

[eval]
every = {eval_every}
num_questions = {eval_questions}
samples = {eval_samples}

[trust]
reward_range = [0.0, 1.0]

[fleet]
workers = 2
worker_threads = 1
"""

FULL = {"objectives": ["dppo", "dppo_kl", "tis", "icepop", "ppo", "none", "gepo"], "lags": [0, 2, 4, 8],
        "seeds": [0, 1, 2], "families": 150, "num_test": 200, "practice": 800, "habit": 40, "batch": 64, "steps": 100,
        "eval_every": 10, "eval_questions": 200, "eval_samples": 2}
QUICK = {"objectives": ["dppo", "none"], "lags": [0, 8], "seeds": [0], "families": 60, "num_test": 64,
         "practice": 300, "habit": 20, "batch": 64, "steps": 16, "eval_every": 8, "eval_questions": 64,
         "eval_samples": 1}

ARITH_FULL = {"objectives": ["dppo", "dppo_kl", "tis", "icepop", "ppo", "none", "gepo"], "lags": [0, 2, 4, 8],
              "seeds": [0, 1, 2], "steps": 40, "eval_every": 10, "eval_questions": 100, "eval_samples": 2}
ARITH_QUICK = {"objectives": ["dppo", "none"], "lags": [0, 8], "seeds": [0], "steps": 16, "eval_every": 8,
               "eval_questions": 50, "eval_samples": 1}
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_config(task: str, grid: dict) -> str:
    """The run config every cell starts from (``task``: ``hard`` or ``arithmetic``; the arithmetic
    grid's own settings are the sweep's ``[set]``, see :func:`study_settings`)."""
    if task != "arithmetic":
        return RUN.format(**grid)
    # examples/arithmetic_tiny.toml itself, with its env module as an absolute path: the run config
    # is written elsewhere, and a relative module is read beside the config file.
    text = (EXAMPLES / "arithmetic_tiny.toml").read_text()
    module = 'module = "custom_env.py"'
    if module not in text:
        raise SystemExit(f"examples/arithmetic_tiny.toml no longer says {module!r}; update benchmarks/offpolicy.py")
    return text.replace(module, f"module = {json.dumps(str(EXAMPLES / 'custom_env.py'))}")


def study_settings(task: str, grid: dict) -> dict:
    """Overrides of every cell (the sweep's ``[set]``): the hard task's are in its run config."""
    if task != "arithmetic":
        return {}
    return {"trainer.steps": grid["steps"], "trainer.mismatch_every": 4, "eval.every": grid["eval_every"],
            "eval.num_questions": grid["eval_questions"], "eval.samples": grid["eval_samples"]}


def sweep_file(name: str, grid: dict, lag_key: str, parallel: int, settings: dict | None = None) -> str:
    lines = [f'name = "{name}"', 'config = "run.toml"', f"objectives = {json.dumps(grid['objectives'])}",
             f"lags = {json.dumps(grid['lags'])}", f"seeds = {json.dumps(grid['seeds'])}", f"parallel = {parallel}",
             f'lag_key = "{lag_key}"', "shared_warmstart = true", ""]
    if settings:
        lines += ["[set]", *(f'"{k}" = {json.dumps(v)}' for k, v in settings.items()), ""]
    lines += ["[objective.dppo_kl]", 'kind = "dppo"', 'gate = "kl"', ""]
    for lag in grid["lags"]:  # the staleness gate must let the forced lag through
        lines += [f"[lag_set.{lag}]", f'"trainer.max_lag" = {lag + 3}', ""]
    return "\n".join(lines)


def _example():
    """The real-model example's run config and its task's module."""
    import importlib.util
    import tomllib

    cfg = tomllib.loads((EXAMPLES / "smollm2_addition.toml").read_text())
    spec = importlib.util.spec_from_file_location("addition_env", EXAMPLES / cfg["env"]["module"])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return cfg, mod


def lag_row(lag: int, episodes, pi: list, delta: float = 0.2) -> dict:
    """What the TV gate and the mismatch look like for ``episodes`` scored ``pi`` at ``lag``."""
    import numpy as np

    groups: dict[str, list[float]] = {}
    for e in episodes:
        groups.setdefault(e.group_id, []).append(e.reward)
    d, gated = [], 0
    for e, lp in zip(episodes, pi):
        m = e.loss_mask()[1:]
        diff = (np.asarray(lp)[1:] - e.behavior_logprobs()[1:])[m]  # log pi - log mu
        d.append(diff)
        adv = e.reward - float(np.mean(groups[e.group_id]))
        tv = np.exp(e.behavior_logprobs()[1:][m] + diff) - np.exp(e.behavior_logprobs()[1:][m])
        gated += int(((adv > 0) & (tv > delta)).sum() + ((adv < 0) & (tv < -delta)).sum())
    d = np.concatenate(d).astype(np.float64)
    mu = np.concatenate([e.behavior_logprobs()[1:][e.loss_mask()[1:]] for e in episodes]).astype(np.float64)
    tv = np.abs(np.exp(mu + d) - np.exp(mu))
    r = np.exp(d)  # pi / mu; k1 and k3 estimate KL(mu || pi) over tokens drawn from mu
    a = np.abs(d)
    return {"lag": lag, "tokens": int(d.size), "tv_gate_either_sign": float((tv > delta).mean()),
            "tv_gate_with_advantages": gated / d.size, "kl_k1": float(-d.mean()),
            "kl_k3": float((r - 1 - np.log(r)).mean()), "abs_dlogp_p50": float(np.percentile(a, 50)),
            "abs_dlogp_p90": float(np.percentile(a, 90)), "abs_dlogp_p99": float(np.percentile(a, 99)),
            "abs_dlogp_max": float(a.max()), "max_tv": float(tv.max())}


def real_model(args: argparse.Namespace) -> None:
    """``--model``: the gate's share and the int8-vs-float mismatch on a pretrained model at lags 0 and 1."""
    import numpy as np
    from transformers import AutoTokenizer

    from stoa.backends.engine import RolloutRequest, SamplingConfig
    from stoa.backends.learner import LearnerConfig, make_learner
    from stoa.backends.mlx import MLXEngine
    from stoa.fleet.trainer.warmstart import Demonstrations
    from stoa.transport.quant import quantize_state

    t0 = time.time()
    cfg, mod = _example()
    kwargs, ro, lr = cfg["env"].get("kwargs", {}), cfg["rollout"], float(cfg["learner"]["lr"])
    make = lambda: mod.AdditionEnv(split="train", **kwargs)  # noqa: E731
    prompts, g = (4, 4) if args.quick else (16, 8)
    learner = make_learner("torch", args.model, LearnerConfig(lr=lr, threads=args.threads))
    engine = MLXEngine.from_state(args.model, dict(quantize_state(learner.iter_weights("float32"))), 0)
    sampling = SamplingConfig(temperature=1.0, max_turn_tokens=ro["max_turn_tokens"],
                              max_episode_tokens=ro["max_episode_tokens"], seed=11)
    eps = engine.rollout(make, [RolloutRequest(i, f"g{i}", g) for i in range(prompts)], sampling)
    rows = [lag_row(0, eps, learner.logprobs(eps))]
    demos = Demonstrations(make, AutoTokenizer.from_pretrained(str(args.model)), "real")
    learner.sft_step(demos.batch(16, {"oracle": 1.0}, np.random.default_rng(0)))  # one AdamW step at lr
    rows.append(lag_row(1, eps, learner.logprobs(eps)))
    print(f"{args.model.name}, int8 MLX engine ({engine.mode}) vs float32 torch, {len(eps)} episodes of "
          f"{cfg['env']['id']} at T=1; lag 1 = one AdamW step at lr {lr:g}")
    print(f"{'lag':>3} {'tokens':>7} {'TV gate (either sign)':>22} {'TV gate (advantages)':>21} {'KL k1':>9} "
          f"{'KL k3':>9} {'|dlogp| p50':>11} {'p90':>9} {'p99':>9} {'max':>9}")
    for r in rows:
        print(f"{r['lag']:>3} {r['tokens']:>7} {100 * r['tv_gate_either_sign']:>21.3f}% "
              f"{100 * r['tv_gate_with_advantages']:>20.3f}% {r['kl_k1']:>9.2e} {r['kl_k3']:>9.2e} "
              f"{r['abs_dlogp_p50']:>11.2e} {r['abs_dlogp_p90']:>9.2e} {r['abs_dlogp_p99']:>9.2e} "
              f"{r['abs_dlogp_max']:>9.2e}")
    seconds = time.time() - t0
    print(f"{seconds:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model.name, "quick": args.quick, "lr": lr,
                                         "engine_mode": engine.mode, "episodes": len(eps), "rows": rows,
                                         "seconds": round(seconds, 1)}, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="dppo and none x lags 0, 8 x seed 0, small (< 15 min)")
    p.add_argument("--json", type=Path, help="write the cells here")
    p.add_argument("--runs", type=Path, default=Path("runs"), help="folder of runs/<name>/")
    p.add_argument("--lag-key", default="rollout.lag", help="run-config key of the forced lag")
    p.add_argument("--parallel", type=int, default=1, help="cells at a time (each is 3 processes)")
    p.add_argument("--steps", type=int, help="RL steps per cell (default: the grid's)")
    p.add_argument("--seeds", type=int, nargs="+", help="seeds (default: the grid's)")
    p.add_argument("--task", choices=["hard", "arithmetic"], default="hard",
                   help="hard: stoa/SyntheticSearchHard-v0; arithmetic: examples/custom_env.py (it learns)")
    p.add_argument("--objectives", nargs="+", help="objectives (default: the grid's)")
    p.add_argument("--lags", type=int, nargs="+", help="lags (default: the grid's)")
    p.add_argument("--model", type=Path, help="a Hugging Face folder: measure the gate and mismatch on it (no sweep)")
    p.add_argument("--threads", type=int, default=2, help="--model: torch threads")
    args = p.parse_args()
    if args.model:
        return real_model(args)

    if args.task == "arithmetic":
        grid = dict(ARITH_QUICK if args.quick else ARITH_FULL)
        name = "offpolicy-arith-quick" if args.quick else "offpolicy-arith"
    else:
        grid = dict(QUICK if args.quick else FULL)
        name = "offpolicy-quick" if args.quick else "offpolicy"
    grid.update({k: v for k, v in (("steps", args.steps), ("seeds", args.seeds), ("objectives", args.objectives),
                                   ("lags", args.lags)) if v is not None})
    spec_dir = args.runs / f"{name}.spec"
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "run.toml").write_text(run_config(args.task, grid))
    (spec_dir / "sweep.toml").write_text(sweep_file(name, grid, args.lag_key, args.parallel,
                                                    study_settings(args.task, grid)))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "stoa", "sweep", str(spec_dir / "sweep.toml"), "--runs", str(args.runs)],
                       env=env, check=False)
    seconds = time.time() - t0
    results = args.runs / name / "results.json"
    if not results.exists():
        sys.exit(r.returncode or 1)
    cells = json.loads(results.read_text())["cells"]
    print(f"{sum(c['status'] == 'done' for c in cells)}/{len(cells)} cells in {seconds:.0f} s; "
          f"table and plots: {args.runs / name / 'results.md'}")
    for c in cells:
        if c["status"] == "done":
            print(f"  {c['id']:<22} pass@1 {c['start_pass_at_1']:.3f} -> {c['final_pass_at_1']:.3f} "
                  f"(best {c['best_pass_at_1']:.3f})  gate {c['gate_fraction'] or 0:.4f}  "
                  f"KL(mu||pi) {c['kl_mu_pi'] or 0:.4f}  {c['wall_seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"task": args.task, "quick": args.quick, "lag_key": args.lag_key,
                                         "seconds": round(seconds, 1), "cells": cells}, indent=2) + "\n")
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
