"""Several trainers with outer steps against one trainer, at the same steps and episodes (docs/outer.md).

What it measures, in one process: the outer loop's arithmetic exactly as the fleet runs it (each
trainer a torch learner with its own AdamW, ``stoa.fleet.trainer.learning.learn_step`` for every
inner step, ``stoa.fleet.outer.codec`` for every update and merged step, the Nesterov outer
optimizer, the int8 policy the workers would run). It leaves out the processes and the store
(``tests/test_outer_fleet.py`` runs those): rollouts are sampled by one int8 engine at the last
merged version, as workers following the chain would, and the trainers' inner steps run one after
another.

The task learns within the budget, so the comparison means something: *largest digit* (the prompt
``max 3 7 2 9``, the answer one token, ``9``; 400 training items, 200 held out). A random-init tiny
Qwen2 (1 layer, width 64, ~55k parameters) is warm-started on demonstrations that answer with a
random digit of the prompt 3 times in 4 and the largest once (held-out pass@1 0.2-0.3), so RL has
signal and something to learn: one trainer raises it to 0.8-0.85 in 64 steps.

Per configuration (trainers N, inner steps H, codec, outer step: DiLoCo's Nesterov or plain
averaging), with S total steps of G groups (x 8 samples) for one trainer: N trainers take S/H outer steps, each trainer H inner steps of G/N
groups, so every configuration trains on S x G groups. Columns: held-out pass@1 of the final int8
policy (200 items x 2 samples at temperature 1), at the start and half way; its change against one
trainer of the same seed; bytes exchanged between trainers per outer step (N-1 updates up, one
merged step down to each of the N-1) and in total, and how many times less that is than sending
full float32 updates both ways after every step; trainer wall time on the critical path (the
slowest trainer's inner steps of each outer step, plus the merge) against one trainer in the same
run.

    python benchmarks/outer.py --quick --json outer.json     # 1 seed, 3 rows, S = 16
    python benchmarks/outer.py --jobs 2 --json outer.json    # 2 seeds (one process each), 11 rows, S = 64
    python benchmarks/outer.py --rows 1:1:none,2:4:int8:avg  # only these rows (trainers:H:codec[:avg])
    python benchmarks/outer.py --merge a.json b.seed1.json   # the tables of rows saved by earlier runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stoa.envs import TextEnv  # noqa: E402

SAMPLES = 8
GRID = [(1, 1, "none"), (2, 1, "int8"), (2, 4, "int8"), (2, 16, "int8"), (4, 1, "int8"), (4, 4, "int8"),
        (4, 16, "int8"), (2, 4, "top2"), (4, 4, "top2"), (2, 16, "top2"), (4, 16, "top16")]
"""(trainers, inner steps, codec): ``topK`` keeps K values of each block of 64 (the ``topk`` code)."""
QUICK = [(1, 1, "none"), (2, 4, "int8"), (2, 4, "top2")]


class LargestDigit(TextEnv):
    """``max a b c d`` (distinct digits) -> the largest, as one token; reward 1 when it is right."""

    metric_types = {"correct": bool}
    success_metric = "correct"
    demo_styles = ("oracle", "guess")

    def __init__(self, split: str = "train", size: int = 400, digits: int = 4, seed: int = 0) -> None:
        rng = np.random.default_rng([seed, {"train": 0, "test": 1}[split]])
        self.items = [tuple(int(d) for d in rng.choice(10, size=digits, replace=False)) for _ in range(size)]
        self.split, self._done, self._gold = split, True, ""

    def __len__(self) -> int:
        return len(self.items)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        i = self._select_index(options)
        self._gold, self._done = str(max(self.items[i])), False
        return "max " + " ".join(map(str, self.items[i])), {"question_id": f"{self.split}-{i}",
                                                             "gold_answers": [self._gold], "index": i}

    def step(self, action):
        if self._done:
            raise RuntimeError("the episode has ended; call reset()")
        self._done = True
        ok = action.replace("<|im_end|>", "").strip() == self._gold
        return "", float(ok), True, False, {"metrics": {"correct": ok}}

    def oracle_turns(self, index: int) -> list[str]:
        return [str(max(self.items[index]))]

    def demonstration_turns(self, index, style, rng):
        if style == "guess":  # a digit of the prompt, at random: the habit RL improves on
            return [str(self.items[index][int(rng.integers(len(self.items[index])))])]
        return super().demonstration_turns(index, style, rng)

    def tokenizer_texts(self):
        for i in range(len(self)):
            yield self.reset(options={"index": i})[0]
            yield self.oracle_turns(i)[0]


def setup(seed: int, warm_steps: int, workdir: Path):
    """A tiny model for the task, warm-started (lr 3e-3, batch 32, 1 oracle in 4); its weights."""
    from stoa.backends.learner import make_learner
    from stoa.fleet.config import RunConfig
    from stoa.fleet.trainer.warmstart import Demonstrations
    from stoa.models.tiny import TinyConfig, build_tiny
    from transformers import AutoTokenizer

    model_dir = build_tiny(workdir / f"model{seed}", list(LargestDigit().tokenizer_texts()),
                           TinyConfig(vocab_size=300, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                                      intermediate_size=128, seed=seed))
    warm = make_learner("torch", model_dir, RunConfig.from_dict({"seed": seed, "learner": {"lr": 3e-3, "threads": 2}})
                        .learner.config)
    demos = Demonstrations(LargestDigit, AutoTokenizer.from_pretrained(str(model_dir)))
    rng = np.random.default_rng(seed)
    for _ in range(warm_steps):
        warm.sft_step([demos.episode(int(i), "oracle" if rng.random() < 0.25 else "guess", rng)
                       for i in rng.integers(len(demos), size=32)])
    cfg = RunConfig.from_dict({"seed": seed, "learner": {"lr": 1e-3, "threads": 2}})
    return cfg, model_dir, warm.export_weights()


def run_config(n: int, h: int, code: str, steps: int, groups: int, cfg, model_dir, start, seed: int,
               start_pass: float | None = None, outer: str = "nesterov") -> dict:
    """One configuration; ``outer``: DiLoCo's Nesterov (lr 0.7, momentum 0.9) or ``avg`` (lr 1, no
    momentum: the mean of the trainers' weights)."""
    from stoa.backends.engine import RolloutRequest, SamplingConfig, make_engine
    from stoa.backends.learner import make_learner
    from stoa.fleet.outer.codec import encode_update, fp32_bytes
    from stoa.fleet.outer.nesterov import OuterOptimizer
    from stoa.fleet.trainer.learning import learn_step
    from stoa.transport.quant import quantize_state

    learners = []
    for _ in range(n):
        lr = make_learner("torch", model_dir, cfg.learner.config)
        lr.load_weights(start)
        learners.append(lr)
    theta = {k: np.array(v, np.float32) for k, v in start.items()}
    shapes = {k: v.shape for k, v in theta.items()}
    engine = make_engine(model_dir, "auto", state=quantize_state(theta), version=0)
    train = lambda: LargestDigit("train")  # noqa: E731  (one factory: the engine keeps its envs)
    test = lambda: LargestDigit("test", size=200)  # noqa: E731
    rng = np.random.default_rng(seed + 17)
    sampling = SamplingConfig(temperature=1.0, max_turn_tokens=1, max_episode_tokens=32, seed=seed)

    def evaluate(v: int) -> float:
        eps = engine.rollout(test, [RolloutRequest(i, f"eval-{v}-{i}", 2) for i in range(200)],
                             SamplingConfig(temperature=1.0, max_turn_tokens=1, max_episode_tokens=32, seed=seed + 7919))
        return float(np.mean([e.reward > 0 for e in eps]))

    compress, topk = ("topk", int(code[3:])) if code.startswith("top") else (code, 2)
    opt, resid = OuterOptimizer(*((0.7, 0.9) if outer == "nesterov" else (1.0, 0.0))), [None] * n
    bresid, per_step, total, crit = None, [], 0, 0.0
    outer_steps, per = steps // h, max(1, groups // n)
    curve = {0: evaluate(0) if start_pass is None else start_pass}
    for v in range(outer_steps):
        seconds = [0.0] * n
        for j in range(h):
            for i in range(n):
                reqs = [RolloutRequest(int(x), f"v{v}-{j}-{i}-{g}", SAMPLES) for g, x in enumerate(rng.integers(400, size=per))]
                eps = engine.rollout(train, reqs, sampling)
                t0 = time.perf_counter()
                learn_step(cfg, learners[i], eps, v, "correct", {"correct": bool})
                seconds[i] += time.perf_counter() - t0
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
                enc = encode_update(delta, resid[i], compress=compress, topk=topk)
                resid[i] = enc.residual
                grads.append(enc.decoded)
                sent += enc.bytes
            enc = encode_update(opt.step(grads), bresid, compress=compress, topk=topk)
            bresid = enc.residual
            sent += enc.bytes * (n - 1)
            theta = {k: theta[k] + enc.decoded[k] for k in theta}
            for lr in learners:
                lr.load_weights(theta)
        crit += max(seconds) + time.perf_counter() - t0
        per_step.append(sent)
        total += sent
        engine.load_state(v + 1, quantize_state(theta))
        done = (v + 1) * h
        if done % max(1, steps // 2) == 0 or done == steps:
            curve[done] = evaluate(done)
    full = fp32_bytes(shapes)
    return {"trainers": n, "inner_steps": h, "compress": code if n > 1 or h > 1 else "-",
            "outer": outer if n > 1 or h > 1 else "-",
            "outer_steps": outer_steps, "groups_per_inner_step": per, "pass_at_1": curve[max(curve)],
            "curve": curve, "bytes_per_outer_step": float(np.mean(per_step)), "bytes_total": int(total),
            "fp32_every_step_total": int(2 * (n - 1) * full * steps), "params": sum(int(np.prod(s)) for s in shapes.values()),
            "trainer_wall_s": crit}


def table(rows: list[dict], steps: int) -> list[str]:
    """One line a row; ``vs 1`` against one trainer of the same seed."""
    qs = sorted({q for r in rows for q in r["curve"]})
    out = [f"{'seed':>4} {'N':>2} {'H':>3} {'code':>5} {'merge':>8} {'outer':>5} " + " ".join(f"{'@' + str(q):>5}" for q in qs)
           + f" {'vs 1':>6} {'B/outer step':>12} {'B total':>10} {'less':>7} {'wall s':>6} {'vs 1':>5}"]
    for r in rows:
        less = f"{r['less_than_fp32_every_step']:.0f}x" if r["bytes_total"] else "-"
        out.append(f"{r['seed']:>4} {r['trainers']:>2} {r['inner_steps']:>3} {r['compress']:>5} {r['outer']:>8} {r['outer_steps']:>5} "
                   + " ".join(f"{r['curve'][q]:>5.2f}" if q in r["curve"] else f"{'':>5}" for q in qs)
                   + f" {r['pass_at_1_vs_one']:>+6.3f} {r['bytes_per_outer_step']:>12,.0f} {r['bytes_total']:>10,}"
                   f" {less:>7} {r['trainer_wall_s']:>6.1f} {r['wall_vs_one']:>5.2f}")
    return out


def summary(rows: list[dict], seeds: list[int]) -> list[str]:
    """Per configuration: pass@1 per seed, their mean and spread, the change against one trainer."""
    out = [f"{'N':>2} {'H':>3} {'code':>5} {'merge':>8} " + " ".join(f"{'s' + str(s):>6}" for s in seeds)
           + f" {'mean':>6} {'spread':>6} {'vs 1':>6} {'less':>6}"]
    keys = list(dict.fromkeys((r["trainers"], r["inner_steps"], r["compress"], r["outer"]) for r in rows))
    for k in keys:
        rs = [r for r in rows if (r["trainers"], r["inner_steps"], r["compress"], r["outer"]) == k]
        p = [r["pass_at_1"] for r in rs]
        less = f"{rs[0]['less_than_fp32_every_step']:.0f}x" if rs[0]["bytes_total"] else "-"
        out.append(f"{k[0]:>2} {k[1]:>3} {k[2]:>5} {k[3]:>8} " + " ".join(f"{x:>6.3f}" for x in p)
                   + f" {np.mean(p):>6.3f} {max(p) - min(p):>6.3f} {np.mean([r['pass_at_1_vs_one'] for r in rs]):>+6.3f}"
                   f" {less:>6}")
    return out


def one_seed(seed: int, quick: bool, threads: int, partial: Path | None = None, grid: list | None = None) -> list[dict]:
    """Every configuration of the grid for one seed (its own warm start), in this process."""
    import torch

    torch.set_num_threads(threads)
    t0 = time.time()
    steps, groups, warm = (16, 8, 40) if quick else (64, 8, 60)
    rows, start_pass = [], None
    with tempfile.TemporaryDirectory() as tmp:
        cfg, model_dir, start = setup(seed, warm, Path(tmp))
        print(f"seed {seed}: warm start done ({time.time() - t0:.0f} s)", file=sys.stderr)
        for n, h, code, *outer in grid or (QUICK if quick else GRID):
            r = run_config(n, h, code, steps, groups, cfg, model_dir, start, seed, start_pass, *outer)
            start_pass = r["curve"][0]  # the same warm start for every row of the seed
            rows.append({"seed": seed, **r})
            if partial is not None:  # what a seed has measured survives a later failure
                partial.write_text(json.dumps(rows, indent=1))
            print(f"seed {seed} N={n} H={h} {code} {r['outer']}: pass@1 {r['pass_at_1']:.3f} ({time.time() - t0:.0f} s)",
                  file=sys.stderr)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 seed, 3 rows, S = 16, 40 warm-start steps")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1; --quick: 0)")
    p.add_argument("--jobs", type=int, default=1, help="seeds run in this many processes at once (1 thread each)")
    p.add_argument("--rows", help="only these configurations, e.g. 1:1:none,4:16:top16,2:4:int8:avg "
                   "(trainers:H:codec[:avg for plain averaging instead of DiLoCo's Nesterov outer step])")
    p.add_argument("--merge", type=Path, nargs="+", help="print the tables of rows saved by earlier runs (--json "
                   "files or their .seedN.json partials); the first of each configuration counts")
    a = p.parse_args()
    t0 = time.time()
    seeds = [int(s) for s in (a.seeds or ("0" if a.quick else "0,1")).split(",")]
    steps, groups = (16, 8) if a.quick else (64, 8)
    grid = [(int(n), int(h), *rest) for n, h, *rest in (x.split(":") for x in a.rows.split(","))] if a.rows else None
    cpu = float("nan")
    if a.merge:
        rows, seen = [], set()
        for path in a.merge:
            doc = json.loads(path.read_text())
            for r in doc["rows"] if isinstance(doc, dict) else doc:
                key = (r["seed"], r["trainers"], r["inner_steps"], r["compress"], r.get("outer", "nesterov"))
                if key not in seen:
                    seen.add(key)
                    rows.append({"outer": "-" if r["compress"] == "-" else "nesterov", **r,
                                 "curve": {int(q): x for q, x in r["curve"].items()}})
        seeds = sorted({r["seed"] for r in rows})
        steps = max(max(r["curve"]) for r in rows)
    elif a.jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(a.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows = [r for rs in pool.map(one_seed, seeds, [a.quick] * len(seeds), [1] * len(seeds),
                                         [a.json and a.json.with_suffix(f".seed{s}.json") for s in seeds],
                                         [grid] * len(seeds)) for r in rs]
    else:
        c0 = time.process_time()
        rows = [r for s in seeds for r in one_seed(s, a.quick, 2, a.json and a.json.with_suffix(f".seed{s}.json"), grid)]
        cpu = time.process_time() - c0
    rows.sort(key=lambda r: (r["seed"], r["trainers"] > 1 or r["inner_steps"] > 1, r["outer"] == "avg",
                             r["compress"] != "int8", r["trainers"], r["inner_steps"]))
    for r in rows:
        base = next((b for b in rows if b["seed"] == r["seed"] and b["trainers"] == 1 and b["inner_steps"] == 1), None)
        r["less_than_fp32_every_step"] = r["fp32_every_step_total"] / r["bytes_total"] if r["bytes_total"] else None
        r["pass_at_1_vs_one"] = r["pass_at_1"] - base["pass_at_1"] if base else float("nan")
        r["wall_vs_one"] = r["trainer_wall_s"] / base["trainer_wall_s"] if base else float("nan")
    wall, load = time.time() - t0, os.getloadavg()[0]
    print(f"largest digit, {rows[0]['params']:,}-parameter Qwen2, S = {steps} steps of G = {groups} groups x {SAMPLES} "
          f"per configuration, seeds {seeds}; " + (f"rows of {len(a.merge)} files" if a.merge else
                                                   f"{wall:.0f} s wall, {cpu:.0f} s CPU, load average {load:.1f}"))
    print("\n".join(table(rows, steps)))
    if len(seeds) > 1:
        print("\n".join(summary(rows, seeds)))
    se = float(np.sqrt(0.25 / 400))
    print(f"held-out pass@1: 200 items x 2 samples; its sampling error is at most {se:.3f} (1 sd) per number")
    if a.json:
        a.json.write_text(json.dumps({"quick": a.quick, "seeds": seeds, "steps": steps, "groups": groups,
                                      "samples": SAMPLES, "seconds": wall, "cpu_seconds": cpu, "load_average": load,
                                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
