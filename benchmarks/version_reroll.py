"""Version rerolls: among how many weight versions could an attacker choose each trainable batch?

A worker that keeps the last ``trainer.max_lag + 1`` published versions can make its assigned
batch under each of them and upload the one it likes best. This drives a real
:class:`~stoa.fleet.intake.Intake` on a local store (enrolled keys, real sealed batches, a trainer
version that moves one step per poll) and, before each of the attacker's uploads, forks the
trainer (a copy of the store and of the intake) once per version the attacker holds to ask
whether that batch, claiming that version, would be taken into the pool. The attacker then uploads
one of the accepted ones (drawn at random) and the run goes on. An honest worker (newest version
only) runs beside it as the baseline: it holds one version, so it has one choice, and every one
of its batches must be taken.

It measures whatever ``stoa`` is on ``PYTHONPATH``: run it on a checkout without batch bindings
(no ``stoa.fleet.trust.binding``) for the numbers before, with them for after; the attacker then
tickets its numbers and makes each one with the items its binding names.

    python benchmarks/version_reroll.py [--quick] [--json PATH] [--batches 24]

Pure CPU, a few seconds; no model.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import logging
import shutil
import tempfile
from pathlib import Path

import numpy as np

from stoa.fleet.config import RunConfig
from stoa.fleet.intake import Intake
from stoa.fleet.trust.assign import assignment
from stoa.fleet.trust.ledger import Ledger
from stoa.transport.exchange import RolloutWriter
from stoa.transport.identity import enroll_worker, read_salt
from stoa.transport.signing import generate_private_key
from stoa.transport.store import LocalStore
from stoa.types import Episode, Segment

RUN = "reroll"
ENV = {"id": "stoa/SyntheticSearch-v0",
       "kwargs": {"num_entities": 30, "facts_per_entity": 3, "num_test_facts": 10, "seed": 5}}
BOUND = importlib.util.find_spec("stoa.fleet.trust.binding") is not None


class _Scorer:
    def logprobs(self, episodes, temperature=1.0, *, model_only=False):
        return [np.zeros(len(e.tokens()), np.float32) for e in episodes]


def _make_env():
    import stoa.envs

    return stoa.envs.make(ENV["id"], **ENV["kwargs"])


class Key:
    """One worker key: its writer, and how it learns its work (salt; binding when the run binds)."""

    def __init__(self, store, run_key, name: str):
        self.private = generate_private_key()
        self.writer = RolloutWriter(store, RUN, name, private_key=self.private)
        enroll_worker(store, RUN, run_key, self.private.public_key(), name)
        self.salt = read_salt(store, RUN, self.writer.key_id, run_key.public_key())
        self.seq = 0

    def ticket(self, store) -> None:
        if BOUND:
            from stoa.fleet.trust.binding import write_ticket

            write_ticket(store, RUN, self.seq, self.private)

    def work(self, store, run_key, cfg: RunConfig, n_items: int):
        """``(items, group ids, seed, bound version or None)`` of this key's next number."""
        beacon = version = None
        if BOUND:
            from stoa.fleet.trust.binding import read_bindings

            bound, _ = read_bindings(store, RUN, run_key.public_key())
            b = bound.get(self.writer.key_id, {}).get(self.seq)
            if b is None:
                return None
            beacon, version = b.beacon, b.version
        extra = (beacon,) if BOUND else ()
        a = assignment(cfg.seed, self.writer.key_id, self.seq, n_items, cfg.rollout.groups_per_cohort, self.salt, *extra)
        return a, version


def _episodes(cfg: RunConfig, key: Key, a, version: int, rng) -> list[Episode]:
    out = []
    for gid, item in zip(a.group_ids, a.items):
        for s in range(cfg.rollout.group_size):
            out.append(Episode(rng.integers(0, 700, 5), [Segment("model", rng.integers(0, 700, 4), -rng.random(4))],
                               reward=float(s % 2), policy_version=version, worker_id=key.writer.worker_id,
                               env_id=ENV["id"], group_id=gid, sample_index=s, item_index=item))
    return out


def _accepted_in_fork(intake: Intake, store: LocalStore, key: Key, episodes: list[Episode], version: int,
                      trainer_version: int, seq: int) -> bool:
    """Whether the intake, forked with a copy of the store, would pool this batch at this version."""
    with tempfile.TemporaryDirectory() as d:
        shutil.copytree(store.root, Path(d) / "store")
        fork_store = LocalStore(Path(d) / "store")
        fork = copy.deepcopy(intake, {id(intake.store): fork_store})
        fork.event = lambda **_: None
        writer = RolloutWriter(fork_store, RUN, key.writer.worker_id, private_key=key.private)
        batch_key = writer.upload(episodes, version, seq=seq)
        fork.take(trainer_version)
        return batch_key in {b.key for b in fork.pool.batches()}


def measure(cadence: int, batches: int, max_lag: int, seed: int) -> dict:
    """One run: the attacker makes a batch every ``cadence`` trainer versions (the honest worker
    every version); returns the choices per attacker batch and the honest worker's fate."""
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        store, run_key = LocalStore(Path(tmp) / "store"), generate_private_key()
        cfg = RunConfig.from_dict({"name": RUN, "seed": 3, "env": ENV,
                                   "rollout": {"group_size": 2, "groups_per_cohort": 2},
                                   "trainer": {"groups_per_step": 10**6, "max_lag": max_lag},
                                   "trust": {"replay": False, "audit": {"enabled": False},
                                             "reward_range": [0.0, 1.0]}})
        ledger = Ledger(Path(tmp) / "ledger.jsonl", lambda: {})
        attacker, honest = Key(store, run_key, "attacker"), Key(store, run_key, "honest")
        intake = Intake(cfg, store, run_key, vocab_size=700, metric_types={}, ledger=ledger, float_scorer=_Scorer(),
                        int8=None, make_env=_make_env)
        n_items = intake.n_items
        choices, honest_sent, v = [], [], 0
        intake.take(v)
        while len(choices) < batches:
            for key in (honest, attacker) if v % cadence == 0 else (honest,):
                key.ticket(store)
            intake.take(v)  # the trainer's poll at version v (binds the tickets)
            for key in (honest, attacker) if v % cadence == 0 else (honest,):
                got = key.work(store, run_key, cfg, n_items)
                if got is None:
                    raise RuntimeError(f"{key.writer.worker_id}'s number {key.seq} was not bound")
                a, bound = got
                if key is honest:
                    honest_sent.append(key.writer.upload(_episodes(cfg, key, a, v if bound is None else bound, rng),
                                                         v if bound is None else bound, seq=key.seq))
                else:
                    held = range(max(0, v - max_lag), v + 1)
                    ok = [u for u in held if _accepted_in_fork(intake, store, key, _episodes(cfg, key, a, u, rng), u,
                                                               v, key.seq)]
                    choices.append(len(ok))
                    pick = int(rng.choice(ok)) if ok else v if bound is None else bound
                    key.writer.upload(_episodes(cfg, key, a, pick, rng), pick, seq=key.seq)
                key.seq += 1
            v += 1
            intake.take(v)
        rec = intake.gate.records.get(honest.writer.key_id)
        return {"cadence": cadence, "attacker_batches": len(choices), "versions_held": max_lag + 1,
                "mean_choices": float(np.mean(choices)), "share_with_a_choice": float(np.mean([c >= 2 for c in choices])),
                "share_with_none": float(np.mean([c == 0 for c in choices])),
                "honest_batches": len(honest_sent), "honest_taken": rec.accepted_batches if rec else 0,
                "honest_strikes": rec.strikes if rec else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=24, help="attacker batches per cadence")
    ap.add_argument("--max-lag", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="8 attacker batches per cadence")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    logging.disable(logging.WARNING)
    batches = 8 if a.quick else a.batches
    rows = [measure(c, batches, a.max_lag, a.seed) for c in (1, a.max_lag + 1)]
    rule = "bound (ticket + binding)" if BOUND else "version floor, no binding"
    print(f"rule: {rule}; trainer.max_lag {a.max_lag}: the attacker holds {a.max_lag + 1} versions; "
          "baseline: an honest worker in the same run (1 version, 1 choice)")
    print("| attacker cadence (versions per batch) | attacker batches | mean versions it could choose | "
          "ratio vs honest | batches with >= 2 choices | honest batches accepted | honest strikes |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['cadence']} | {r['attacker_batches']} | {r['mean_choices']:.2f} | {r['mean_choices'] / 1:.2f}x | "
              f"{r['share_with_a_choice']:.0%} | {r['honest_taken']}/{r['honest_batches']} | {r['honest_strikes']} |")
    if a.json:
        a.json.write_text(json.dumps({"rule": rule, "bound": BOUND, "max_lag": a.max_lag, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
