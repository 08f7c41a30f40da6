"""Fleet runs under seeded faults against a fault-free run of the same seed: what held, what each kind cost.

Every run is real ``stoa trainer`` / ``stoa worker`` processes on a tiny model and the synthetic
search task (``stoa.testing.chaos``), meeting in a real S3 server (SeaweedFS) through the fault
proxy (``stoa.testing.storefaults``; no faults in the fault-free run). One run per fault kind, each
with that kind alone on a schedule drawn from ``--seed``, then (without ``--quick``) one run with
all of them: workers SIGKILLed and restarted under the same identity, workers asleep (SIGSTOP /
SIGCONT) for seconds mid-cohort or for longer than the heartbeat window, the trainer SIGKILLed
and resumed, a worker's cache disk full (a filled tmpfs; root only), and store faults at stated
rates in windows of seconds (5xx, timeouts past the clients' read timeout, resets mid-body, slow
answers, stalled multipart parts). Each row's cost is its wall time over the fault-free run's,
and the same for the RL phase alone (first RL step to the end: process start-up left out).
Memory, open files and store objects under long churn: ``benchmarks/soak.py``.

With ``--learn`` the fleet is the demo's (``examples/papersearch_tiny.toml``: its model, warm
start, 100 RL steps, 2 workers), fault-free and then under every kind at once, and the table adds
held-out pass@1 and search rate at the first and last eval against the demo's bar.

    python benchmarks/chaos.py [--quick | --learn] [--json out.json] [--seed 0] [--steps 30] [--workers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIG = """name = "chaos-bench"
seed = {seed}

[model.tiny]
vocab_size = 700
hidden_size = 64
num_layers = 1
num_heads = 2
num_kv_heads = 1
intermediate_size = 128

[env]
id = "stoa/SyntheticSearch-v0"
kwargs = {{ num_entities = 30, facts_per_entity = 3, num_test_facts = 10, seed = 5 }}

[warmstart]
practice_steps = 2
practice_worlds = 2
steps = 2
mix = {{ oracle = 0.25, guess = 0.75 }}
batch_size = 8
practice_answer_only = 4

[rollout]
group_size = 2
groups_per_cohort = 2
max_turn_tokens = 8
max_episode_tokens = 160
max_batch = 8
poll_seconds = 0.1

[trainer]
steps = {steps}
groups_per_step = 2
max_lag = 3
checkpoint_every = 2
threads = 1
poll_seconds = 0.05

[trust]
reward_range = [0.0, 1.0]

[learner]
lr = 1e-3

[pulse]
anchor_every = 4

[eval]
every = 100
num_questions = 4
samples = 1
"""


def one_run(root: Path, config_text: str, run_name: str, seed: int, workers: int, faults: list, s3,
            timeout: float = 1800) -> dict:
    from stoa.fleet.metrics import read_metrics
    from stoa.testing.chaos import ChaosRun, verify
    from stoa.transport.signing import generate_private_key, load_public_key, save_keypair

    root.mkdir(parents=True)
    config = root / "run.toml"
    config.write_text(config_text)
    key, pub = save_keypair(generate_private_key(), root / "keys", "run")
    run = ChaosRun(config, root / "fleet", run_name, key, str(pub), workers, faults,
                   env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}, s3=s3, seed=seed)
    wall = run.run(timeout=timeout)
    got = verify(run, load_public_key(pub))
    rows = read_metrics(run.run_dir / "metrics.jsonl")
    train = [r for r in rows if r.get("kind") == "train"]
    end = max(r["time"] for r in rows)
    events = [r["event"] for r in rows if r.get("kind") == "event" and r.get("worker")]
    half = max(1, len(train) // 2)
    reward = lambda rows: sum(r["reward/mean"] for r in rows) / max(1, len(rows))  # noqa: E731
    honest = got.pop("workers")
    evals = [r for r in rows if r.get("kind") == "eval"]
    learned = {f"{k}_{at}": round(e.get(f"eval/{k}", float("nan")), 4)
               for at, e in (("start", evals[0]), ("end", evals[-1])) if evals for k in ("pass@1", "searched")}
    return {**learned, "eval_versions": [e["version"] for e in evals],"wall_s": round(wall, 1), "rl_s": round(end - train[0]["time"], 1) if train else None,
            "faults": [f["kind"] for f in run.fired], "store_faults": run.store_faults, **got,
            "trainer_store_retries": train[-1].get("store/retries", 0) if train else 0,
            "worker_store_retries": max((r.get("fleet/store_retries", 0) for r in train), default=0),
            "fleet_events": {e: events.count(e) for e in sorted(set(events))},
            "stale_groups": train[-1].get("dropped/stale_groups", 0) if train else 0,
            "reward_first_half": round(reward(train[:half]), 4), "reward_second_half": round(reward(train[half:]), 4),
            "honest_strikes": sum(w["strikes"] for w in honest.values()),
            "honest_banned": sum(bool(w["banned"]) for w in honest.values()),
            "accepted_batches": sum(w["accepted_batches"] for w in honest.values())}


DEMO = Path(__file__).resolve().parents[1] / "examples" / "papersearch_tiny.toml"


def learn_schedule(seed: int, steps: int, workers: int) -> list:
    """Every fault kind at once over the demo's RL steps: workers killed and restarted, one paused,
    one asleep past the heartbeat window, the trainer killed and resumed, a full cache disk (root
    only) and one window of each store fault."""
    from stoa.testing.chaos import STORE_KINDS, plan

    return plan(seed, steps, workers, worker_kills=6, pauses=2, trainer_kills=1, sleeps=1, sleep_s=(60.0, 120.0),
                disk_fulls=int(os.geteuid() == 0), store={k: 1 for k in STORE_KINDS})


def schedules(seed: int, steps: int, workers: int, quick: bool) -> dict[str, list]:
    """One schedule per fault kind (that kind alone), and without ``quick`` all of them together."""
    from stoa.testing.chaos import STORE_KINDS, plan

    none = dict(worker_kills=0, pauses=0, trainer_kills=0)
    sleep_s = (40.0, 50.0) if quick else (60.0, 120.0)
    out = {"kill-worker": plan(seed, steps, workers, **{**none, "worker_kills": 2}),
           "pause-worker": plan(seed, steps, workers, **{**none, "pauses": 1}),
           "sleep-worker": plan(seed, steps, workers, **none, sleeps=1, sleep_s=sleep_s),
           "kill-trainer": plan(seed, steps, workers, **{**none, "trainer_kills": 1})}
    if os.geteuid() == 0:  # the full disk is a tmpfs the harness mounts
        out["disk-full"] = plan(seed, steps, workers, **none, disk_fulls=1)
    for kind in STORE_KINDS:
        out[kind] = plan(seed, steps, workers, **none, store={kind: 2})
    if not quick:
        kills, pauses = max(2, steps // 6), max(1, steps // 15)
        out["all"] = plan(seed, steps, workers, worker_kills=kills, pauses=pauses, trainer_kills=1, sleeps=1,
                          sleep_s=sleep_s, disk_fulls=int(os.geteuid() == 0), store={k: 1 for k in STORE_KINDS})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 steps, 3 workers, one run per fault kind, no combined run")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--learn", action="store_true",
                    help="the demo (examples/papersearch_tiny.toml, 2 workers) fault-free and under every fault "
                         "kind at once: does it still learn? (~15-30 min on 2 cores)")
    args = ap.parse_args()
    from stoa.testing.seaweed import SeaweedFS

    if args.learn:
        text = DEMO.read_text().replace('name = "papersearch-tiny"', 'name = "chaos-learn"', 1)
        text = text.replace("seed = 0", f"seed = {args.seed}", 1)
        name, steps, workers, timeout = "chaos-learn", 100, 2, 5400
        plans = {"all": learn_schedule(args.seed, steps, workers)}
    else:
        steps, workers = (10, 3) if args.quick else (args.steps, args.workers)
        text, name, timeout = CONFIG.format(seed=args.seed, steps=steps), "chaos-bench", 1800
        plans = schedules(args.seed, steps, workers, args.quick)
    results = {}
    with tempfile.TemporaryDirectory() as tmp, SeaweedFS.start() as s3:
        results["fault-free"] = one_run(Path(tmp) / "clean", text, name, args.seed, workers, [], s3, timeout)
        for kind, faults in plans.items():
            print(f"[chaos] {kind}: " + ", ".join(f"{f.kind} {f.target} after step {f.after_step}"
                                                 + (f" for {f.seconds:g} s" if f.seconds else "")
                                                 + (f" at {f.rate:g}" if f.rate else "") for f in faults), flush=True)
            results[kind] = one_run(Path(tmp) / kind, text, name, args.seed, workers, faults, s3, timeout)
    clean = results["fault-free"]
    for r in results.values():
        r["overhead"] = round(r["wall_s"] / clean["wall_s"] - 1, 3)
        r["rl_overhead"] = round(r["rl_s"] / clean["rl_s"] - 1, 3) if r["rl_s"] and clean["rl_s"] else None
    out = {"seed": args.seed, "steps": steps, "workers": workers,
           "schedules": {k: [f.__dict__ for f in v] for k, v in plans.items()}, "runs": results}
    print(f"chaos benchmark: seed {args.seed}, {steps} steps, {workers} workers, store: SeaweedFS behind the fault proxy")
    print("| fault kind | fired | injected by the proxy | wall s | overhead | RL s | RL overhead | store retries "
          "(trainer / workers) | fleet events | stale groups dropped | groups trained | lost | trained twice "
          "| honest struck / banned |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        inj = ", ".join(f"{k} {v}" for k, v in r["store_faults"].items()) or "-"
        ev = ", ".join(f"{k} {v}" for k, v in r["fleet_events"].items()) or "-"
        pct = lambda x: "-" if x is None or name == "fault-free" else f"{x * 100:+.0f}%"  # noqa: E731
        print(f"| {name} | {len(r['faults'])} | {inj} | {r['wall_s']} | {pct(r['overhead'])} | {r['rl_s']} | "
              f"{pct(r['rl_overhead'])} | {r['trainer_store_retries']} / {r['worker_store_retries']} | {ev} | "
              f"{r['stale_groups']} | {r['groups_trained']} | {r['groups_lost']} | {r['trained_twice']} | "
              f"{r['honest_strikes']} / {r['honest_banned']} |")
    if any("pass@1_start" in r for r in results.values()):
        print("\n| run | eval versions | pass@1 start -> end | searched start -> end |\n|---|---|---|---|")
        for kind, r in results.items():
            print(f"| {kind} | {r['eval_versions'][0]}-{r['eval_versions'][-1]} | "
                  f"{r['pass@1_start']:.1%} -> {r['pass@1_end']:.1%} | {r['searched_start']:.1%} -> {r['searched_end']:.1%} |")
    if args.learn:
        bar = {k: r["pass@1_end"] - r["pass@1_start"] >= 0.40 and r["searched_end"] - r["searched_start"] >= 0.50
               for k, r in results.items()}
        print("the demo's bar (+40 points pass@1, +50 points search rate): "
              + ", ".join(f"{k} {'met' if ok else 'NOT met'}" for k, ok in bar.items()))
    held = all(r["finished"] and not r["groups_lost"] and not r["trained_twice"] and not r["honest_strikes"]
               and not r["honest_banned"] for r in results.values())
    print("held in every run: finished, 0 groups lost, 0 trained twice, 0 honest workers struck or banned"
          if held else "NOT HELD in some run: see the table")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
