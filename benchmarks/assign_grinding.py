"""Key grinding against assigned work: how much of a grinder's trained work lands on items it chose.

A grinder makes many keys, does one probation batch with each (so the trainer publishes each key's
salt), predicts every key's future work from what it then knows, and keeps the keys whose next
batches fall most on a chosen tenth of the items. Three rules, measured in one run on the same keys:

* **salt only** (the rule before batch bindings): a key's work is ``hash(run seed, key, number,
  salt)``, all known once the salt is out, so the prediction is the work;
* **bound** (the rule now): each number's work also mixes in the beacon the trainer binds to it
  when it is due (:mod:`stoa.fleet.trust.binding`), so the kept keys' real work is drawn anew;
* **bound, dropping misses**: under the bound rule, a key that uploads only the bound numbers
  landing on chosen items and leaves the others as gaps: it chooses what is trained only by
  withholding most of its numbers, which the trainer counts per key (the withheld rate below).

Honest keys (10% expected) are the baseline. Pure computation: no store, no model.

    python benchmarks/assign_grinding.py [--keys 2000] [--keep 4] [--batches 6] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from stoa.fleet.trust.assign import assignment
from stoa.fleet.trust.binding import beacon
from stoa.transport.identity import assignment_salt
from stoa.transport.signing import generate_private_key

RUN = "runs/grind"


def items(run_key, kid: str, seq: int, n_items: int, groups: int, bound: bool) -> tuple[int, ...]:
    salt = assignment_salt(run_key, RUN, kid)
    b = beacon(run_key, RUN, kid, seq, version=seq) if bound else None  # the version it is bound to: any
    return assignment(0, kid, seq, n_items, groups, salt, b).items


def share(run_key, kids: list[str], chosen: set[int], n_items: int, groups: int, batches: int, bound: bool) -> float:
    hit = total = 0
    for kid in kids:
        for seq in range(1, batches + 1):  # seq 0 was the probation batch
            got = items(run_key, kid, seq, n_items, groups, bound)
            hit += sum(i in chosen for i in got)
            total += len(got)
    return hit / total


def dropping_misses(run_key, kids: list[str], chosen: set[int], n_items: int, groups: int,
                    batches: int) -> tuple[float, float]:
    """(share of the uploaded groups on chosen items, share of the numbers left as gaps) for keys
    that upload a bound number only when all of its items are chosen ones."""
    kept = gaps = 0
    for kid in kids:
        for seq in range(1, batches + 1):
            if set(items(run_key, kid, seq, n_items, groups, True)) <= chosen:
                kept += 1
            else:
                gaps += 1
    return (1.0 if kept else 0.0), gaps / (kept + gaps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=2000)
    ap.add_argument("--keep", type=int, default=4)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--items", type=int, default=1000)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="200 keys")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    n_keys = 200 if a.quick else a.keys
    run_key = generate_private_key()
    chosen = set(range(a.items // 10))
    kids = [hashlib.sha256(f"k{i}".encode()).hexdigest()[:16] for i in range(n_keys)]
    # The grinder ranks keys by what it can compute once their salts are out: the salt-only work.
    scored = sorted(kids, key=lambda k: -share(run_key, [k], chosen, a.items, a.groups, a.batches, False))
    kept, honest = scored[: a.keep], kids[: a.keep * 10]
    args = (chosen, a.items, a.groups, a.batches)
    rows = {
        "salt only (before)": {"grinder": share(run_key, kept, *args, False), "honest": share(run_key, honest, *args, False)},
        "bound (now)": {"grinder": share(run_key, kept, *args, True), "honest": share(run_key, honest, *args, True)},
    }
    hit, gaps = dropping_misses(run_key, kids[: max(a.keep * 10, 100)], *args)
    rows["bound, dropping misses"] = {"grinder": hit, "honest": rows["bound (now)"]["honest"], "withheld": gaps}
    groups = a.keep * a.batches * a.groups
    print(f"{n_keys} keys tried, {a.keep} kept ({groups} trained groups each rule); chosen: 10% of {a.items} items")
    print("| rule | grinder's groups on the chosen 10% | honest keys | ratio | grinder's numbers left as gaps |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['grinder']:.1%} | {r['honest']:.1%} | {r['grinder'] / max(r['honest'], 1e-9):.1f}x | "
              f"{r.get('withheld', 0.0):.0%} |")
    if a.json:
        a.json.write_text(json.dumps({"keys": n_keys, "keep": a.keep, "batches": a.batches, "items": a.items,
                                      "groups": a.groups, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
