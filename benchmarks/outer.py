"""Several trainers with outer steps against one trainer, at the same steps and episodes (docs/outer.md).

What it measures, in one process: the outer loop's arithmetic exactly as the fleet runs it (each
trainer a torch learner with its own AdamW, ``stoa.fleet.trainer.learning.learn_step`` for every
inner step, ``stoa.fleet.outer.codec`` for every update and merged step, the Nesterov outer
optimizer, the int8 policy the workers would run), on the synthetic search task with a tiny model
warm-started on other worlds. It leaves out the processes and the store (``tests/test_outer_fleet.py``
runs those): rollouts are sampled by one int8 engine at the current version (lag 0), and the
trainers' inner steps run one after another.

Per configuration (trainers N, inner steps H), with S total steps of G groups for one trainer:
N trainers take S/H outer steps, each trainer H inner steps of G/N groups, so every configuration
trains on S x G groups. Columns: held-out pass@1 of the final int8 policy (and its change against
one trainer in the same run); bytes exchanged between trainers per outer step (N-1 updates up,
one merged step down to each of the N-1) and in total, and the ratio of the total to sending full
float32 updates both ways after every inner step; trainer wall time on the critical path (the
slowest trainer's inner steps of each outer step, plus the merge), and its ratio to one trainer.

    python benchmarks/outer.py --quick --json outer.json     # < 1 min on 2 cores
    python benchmarks/outer.py --json outer.json             # longer: warm start 400 steps, S = 64
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def setup(quick: bool, seed: int, workdir: Path):
    import stoa.envs
    from stoa.backends.learner import make_learner
    from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts
    from stoa.fleet.config import RunConfig
    from stoa.fleet.trainer.warmstart import Demonstrations
    from stoa.models.tiny import TinyConfig, build_tiny

    corpus = dict(num_entities=30 if quick else 100, facts_per_entity=3, num_test_facts=10 if quick else 40)
    make = lambda split, s=0: stoa.envs.make("stoa/SyntheticSearch-v0", split=split, seed=s, **corpus)  # noqa: E731
    model_dir = build_tiny(workdir / "model", tokenizer_texts(generate(SyntheticConfig(seed=0, **corpus))),
                           TinyConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                                      intermediate_size=128, seed=seed))
    cfg = RunConfig.from_dict({"seed": seed, "learner": {"lr": 1e-3, "threads": 2},
                               "trainer": {"groups_per_step": 8}})
    learner = make_learner("torch", model_dir, cfg.learner.config)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    worlds = [Demonstrations(lambda s=s: make("train", s), tok) for s in range(1, 5)]
    rng = np.random.default_rng(seed)
    for _ in range(20 if quick else 400):
        learner.sft_step([worlds[w].sample("oracle", rng) for w in rng.integers(4, size=16)])
    return cfg, model_dir, learner.export_weights(), make


def run_config(n: int, h: int, steps: int, groups: int, cfg, model_dir, start, make, seed: int, evalq: int,
               quick: bool = False):
    from stoa.backends.engine import RolloutRequest, SamplingConfig, make_engine
    from stoa.backends.learner import make_learner
    from stoa.fleet.outer.codec import encode_update, fp32_bytes
    from stoa.fleet.outer.nesterov import OuterOptimizer
    from stoa.fleet.trainer.learning import learn_step
    from stoa.transport.quant import quantize_state

    learners = []
    for i in range(n):
        lr = make_learner("torch", model_dir, cfg.learner.config)
        lr.load_weights(start)
        learners.append(lr)
    theta = {k: np.array(v, np.float32) for k, v in start.items()}
    shapes = {k: v.shape for k, v in theta.items()}
    engine = make_engine(model_dir, "auto", state=quantize_state(theta), version=0)
    task = make("train").unwrapped
    n_items, rng = len(task), np.random.default_rng(seed + 17)
    sampling = SamplingConfig(temperature=1.0, max_turn_tokens=8, max_episode_tokens=160, seed=seed)
    opt, resid = OuterOptimizer(0.7, 0.9, True), [None] * n
    bresid, per_step, total, crit, roll_s = None, [], 0, 0.0, 0.0
    outer_steps = steps // h
    per = max(1, groups // n)
    for v in range(outer_steps):
        seconds = [0.0] * n
        for _ in range(h):
            for i in range(n):
                t0 = time.perf_counter()
                reqs = [RolloutRequest(int(x), f"v{v}-{i}-{t0}-{j}", 2 if quick else 4) for j, x in enumerate(rng.integers(n_items, size=per))]
                eps = engine.rollout(lambda: make("train"), reqs, sampling)
                t1 = time.perf_counter()
                roll_s += t1 - t0
                learn_step(cfg, learners[i], eps, v, task.success_metric, dict(task.metric_types))
                seconds[i] += time.perf_counter() - t1
        t0 = time.perf_counter()
        if n == 1 and h == 1:  # one trainer as today: its weights are the published ones
            theta = {k: np.array(a, np.float32) for k, a in learners[0].iter_weights("float32")}
            sent = 0
        else:
            grads, sent = [], 0
            for i, lr in enumerate(learners):
                now = {k: np.array(a, np.float32) for k, a in lr.iter_weights("float32")}
                delta = {k: theta[k] - now[k] for k in theta}
                if i == 0:
                    grads.append(delta)  # the coordinator's own, exact
                    continue
                enc = encode_update(delta, resid[i])
                resid[i] = enc.residual
                grads.append(enc.decoded)
                sent += enc.bytes
            enc = encode_update(opt.step(grads), bresid)
            bresid = enc.residual
            sent += enc.bytes * (n - 1)
            theta = {k: theta[k] + enc.decoded[k] for k in theta}
            for lr in learners:
                lr.load_weights(theta)
        crit += max(seconds) + time.perf_counter() - t0
        per_step.append(sent)
        total += sent
        engine.load_state(v + 1, quantize_state(theta))
    evq = min(evalq, len(make("test").unwrapped))
    eps = engine.rollout(lambda: make("test"), [RolloutRequest(i, f"eval-{i}", 1 if quick else 2) for i in range(evq)],
                         SamplingConfig(temperature=1.0, max_turn_tokens=8, max_episode_tokens=160, seed=seed + 7919))
    full = fp32_bytes(shapes)
    return {"trainers": n, "inner_steps": h, "outer_steps": outer_steps, "groups_per_inner_step": per,
            "pass_at_1": float(np.mean([e.reward > 0 for e in eps])),
            "bytes_per_outer_step": float(np.mean(per_step)), "bytes_total": int(total),
            "fp32_every_step_total": int(2 * (n - 1) * full * steps),
            "trainer_wall_s": crit, "rollout_s": roll_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny task, 20 warm-start steps, S = 16 of 2 groups x 2 samples")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--four", action="store_true", help="add 4 trainers at H = 4")
    a = p.parse_args()
    import torch

    torch.set_num_threads(2)
    t0 = time.time()
    steps, groups, evalq = (16, 2, 10) if a.quick else (64, 8, 40)
    grid = [(1, 1), (2, 1), (2, 4), (2, 16)] + ([(4, 4)] if a.four or not a.quick else [])
    with tempfile.TemporaryDirectory() as tmp:
        cfg, model_dir, start, make = setup(a.quick, a.seed, Path(tmp))
        print(f"warm start done ({time.time() - t0:.0f} s)", file=sys.stderr)
        rows = []
        for n, h in grid:
            rows.append(run_config(n, h, steps, groups, cfg, model_dir, start, make, a.seed, evalq, a.quick))
            print(f"N={n} H={h} done ({time.time() - t0:.0f} s)", file=sys.stderr)
    base = rows[0]
    print(f"S = {steps} steps of G = {groups} groups (x{2 if a.quick else 4} samples) per configuration, seed {a.seed}, "
          f"{time.time() - t0:.0f} s in all")
    print(f"{'N':>2} {'H':>3} {'outer':>5} {'pass@1':>7} {'vs 1':>6} {'B/outer step':>13} {'B total':>11} "
          f"{'fp32 every step':>16} {'less':>7} {'wall s':>7} {'vs 1':>5}")
    for r in rows:
        less = r["fp32_every_step_total"] / r["bytes_total"] if r["bytes_total"] else float("nan")
        r["less_than_fp32_every_step"] = less
        r["pass_at_1_vs_one"] = r["pass_at_1"] - base["pass_at_1"]
        r["wall_vs_one"] = r["trainer_wall_s"] / base["trainer_wall_s"]
        print(f"{r['trainers']:>2} {r['inner_steps']:>3} {r['outer_steps']:>5} {r['pass_at_1']:>7.3f} "
              f"{r['pass_at_1_vs_one']:>+6.3f} {r['bytes_per_outer_step']:>13,.0f} {r['bytes_total']:>11,} "
              f"{r['fp32_every_step_total']:>16,} {less:>6.1f}x {r['trainer_wall_s']:>7.2f} {r['wall_vs_one']:>5.2f}")
    if a.json:
        a.json.write_text(json.dumps({"quick": a.quick, "seed": a.seed, "steps": steps, "groups": groups,
                                      "seconds": time.time() - t0, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
