"""A fleet run under seeded faults against a fault-free run of the same seed: what held, what it cost.

Both runs are real ``stoa trainer`` / ``stoa worker`` processes meeting in a local store, on a tiny
model and the synthetic search task (``stoa.testing.chaos``). The chaos run injects, on a schedule
drawn from ``--seed``: workers SIGKILLed and restarted under the same identity, a worker asleep
(SIGSTOP / SIGCONT) mid-cohort that wakes stale, and one SIGKILL of the trainer followed by
``--resume``. Store faults (5xx, timeouts, resets, slow responses through a proxy), a full cache
disk, and memory / open files under churn are not injected by this version.

    python benchmarks/chaos.py [--quick] [--json out.json] [--seed 0] [--steps 30] [--workers 4]
"""

from __future__ import annotations

import argparse
import json
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


def one_run(root: Path, seed: int, steps: int, workers: int, faults: list) -> dict:
    from stoa.fleet.metrics import read_metrics
    from stoa.testing.chaos import ChaosRun, verify
    from stoa.transport.signing import generate_private_key, load_public_key, save_keypair

    root.mkdir(parents=True)
    config = root / "run.toml"
    config.write_text(CONFIG.format(seed=seed, steps=steps))
    key, pub = save_keypair(generate_private_key(), root / "keys", "run")
    run = ChaosRun(config, root / "fleet", "chaos-bench", key, str(pub), workers, faults,
                   env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    wall = run.run(timeout=1800)
    got = verify(run, load_public_key(pub))
    train = [r for r in read_metrics(run.run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    half = max(1, len(train) // 2)
    reward = lambda rows: sum(r["reward/mean"] for r in rows) / max(1, len(rows))  # noqa: E731
    honest = got.pop("workers")
    return {"wall_s": round(wall, 1), "faults": [f["kind"] for f in run.fired], **got,
            "reward_first_half": round(reward(train[:half]), 4), "reward_second_half": round(reward(train[half:]), 4),
            "honest_strikes": sum(w["strikes"] for w in honest.values()),
            "honest_banned": sum(bool(w["banned"]) for w in honest.values()),
            "accepted_batches": sum(w["accepted_batches"] for w in honest.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 steps, 3 workers, 4 faults (about a minute)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()
    from stoa.testing.chaos import plan

    steps, workers = (10, 3) if args.quick else (args.steps, args.workers)
    kills, pauses = (2, 1) if args.quick else (max(2, steps // 6), max(1, steps // 15))
    faults = plan(args.seed, steps, workers, worker_kills=kills, pauses=pauses, trainer_kills=1)
    with tempfile.TemporaryDirectory() as tmp:
        clean = one_run(Path(tmp) / "clean", args.seed, steps, workers, [])
        chaos = one_run(Path(tmp) / "chaos", args.seed, steps, workers, faults)
    out = {"seed": args.seed, "steps": steps, "workers": workers,
           "schedule": [f.__dict__ for f in faults], "fault_free": clean, "chaos": chaos,
           "overhead": round(chaos["wall_s"] / clean["wall_s"] - 1, 3)}
    rows = [("wall s", "wall_s"), ("finished", "finished"), ("groups trained", "groups_trained"),
            ("trained twice", "trained_twice"), ("groups still in the store", "groups_uploaded"),
            ("of them lost", "groups_lost"), ("accepted batches", "accepted_batches"),
            ("trainer resumes", "resumed"), ("honest workers struck", "honest_strikes"),
            ("honest workers banned", "honest_banned"), ("reward, first half of steps", "reward_first_half"),
            ("reward, second half", "reward_second_half")]
    print(f"chaos benchmark: seed {args.seed}, {steps} steps, {workers} workers; faults: "
          + ", ".join(f"{f.kind} {f.target} after step {f.after_step}" for f in faults))
    print(f"| {'':28} | fault-free | chaos |\n|{'-' * 30}|-----------:|------:|")
    for label, k in rows:
        print(f"| {label:28} | {clean[k]!s:>10} | {chaos[k]!s:>5} |")
    print(f"wall-time overhead of the faults: {out['overhead'] * 100:+.0f}%")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
