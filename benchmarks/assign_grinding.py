"""Key grinding against assigned work: how much of a grinder's salted work lands on items it chose.

A grinder makes many keys, does one probation batch with each (so the trainer publishes each key's
salt), computes every key's future salted assignments, and keeps the keys whose next batches fall
most on a chosen tenth of the items. This prints the share of the kept keys' groups on the chosen
items against the share of honest keys (10% expected). Pure computation: no store, no model.

    python benchmarks/assign_grinding.py [--keys 2000] [--keep 4] [--batches 6]
"""

from __future__ import annotations

import argparse
import hashlib

from stoa.fleet.trust.assign import assignment
from stoa.transport.identity import assignment_salt
from stoa.transport.signing import generate_private_key


def share(run_key, run: str, kids: list[str], chosen: set[int], n_items: int, groups: int, batches: int) -> float:
    hit = total = 0
    for kid in kids:
        salt = assignment_salt(run_key, run, kid)
        for seq in range(1, batches + 1):  # seq 0 was the probation batch
            items = assignment(0, kid, seq, n_items, groups, salt).items
            hit += sum(i in chosen for i in items)
            total += len(items)
    return hit / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=2000)
    ap.add_argument("--keep", type=int, default=4)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--items", type=int, default=1000)
    ap.add_argument("--groups", type=int, default=1)
    a = ap.parse_args()
    run, run_key = "runs/grind", generate_private_key()
    chosen = set(range(a.items // 10))
    kids = [hashlib.sha256(f"k{i}".encode()).hexdigest()[:32] for i in range(a.keys)]
    scored = sorted(kids, key=lambda k: -share(run_key, run, [k], chosen, a.items, a.groups, a.batches))
    kept, honest = scored[: a.keep], kids[: a.keep * 10]
    print(f"grinder: {a.keys} keys tried, {a.keep} kept, {a.keep * a.batches * a.groups} trained groups: "
          f"{share(run_key, run, kept, chosen, a.items, a.groups, a.batches):.0%} on the chosen 10% of items")
    print(f"honest: {len(honest)} keys: {share(run_key, run, honest, chosen, a.items, a.groups, a.batches):.0%}")


if __name__ == "__main__":
    main()
