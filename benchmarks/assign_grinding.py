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

Honest keys (10% expected) are the baseline.

Two more strategies leave no flag, and are priced in compute, not gaps:

* **a key a try, one look**: make a key, spend its probation (``trust.probation_batches``
  accepted batches, never trained), ticket its first salted number, read the bound work, upload
  it only when enough of its groups fall on the chosen items, else abandon the key (its bound
  number lies above every number it delivered: no gap is counted);
* **a key a try, every look the flag allows**: the same, but ticket several numbers at once (a key
  may hold 8 bindings: all bound in one poll), upload those that fall on the chosen items and
  leave the rest as gaps, as many as stay unflagged: a key with fewer than 8 numbers is never
  judged, and one with more may leave 30% of them as gaps (the range of a fleet of honest keys
  without gaps).

Measured per probation length: probation batches per kept batch, the compute spent per steered group
(groups played, probation included), and against the fleet: the grinder's compute, as a multiple
of an honest fleet's, that takes the chosen items' share of all trained groups from 10% to 20%.

Pure computation: no store, no model.

    python benchmarks/assign_grinding.py [--keys 2000] [--keep 4] [--batches 6] [--usable 12]
        [--at-least N] [--probation 1,4,16] [--quick] [--json PATH]
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


RIPE, FLAG_RATE, MAX_BOUND = 8, 0.30, 8  # records._RIPE_SEQS; an honest fleet's flag limit; binding.MAX_BOUND_PER_KEY


def unflagged_looks(probation: int) -> int:
    """Bound numbers a fresh key may read at once and still never be flagged as a withholder, were
    only the last one uploaded: fewer than 8 numbers in all, or gaps within 30% of them."""
    return max(n for n in range(1, MAX_BOUND + 1)
               if probation + n < RIPE or (n - 1) / (probation + n) <= FLAG_RATE)


def a_key_a_try(run_key, chosen: set[int], n_items: int, groups: int, usable: int, probation: int,
                at_least: int, looks: int, seed: str) -> dict[str, float]:
    """Try keys until ``usable`` batches are kept: each key spends ``probation`` accepted batches,
    then reads the bound work of its next ``looks`` numbers and uploads those with at least
    ``at_least`` of their ``groups`` groups on ``chosen``."""
    tries = kept = hits = 0
    while kept < usable:
        kid = hashlib.sha256(f"{seed}-{tries}".encode()).hexdigest()[:16]
        tries += 1
        for seq in range(probation, probation + looks):
            k = sum(i in chosen for i in items(run_key, kid, seq, n_items, groups, True))
            if k >= at_least:
                kept, hits = kept + 1, hits + k
    trained = kept * groups
    spent = (tries * probation + kept) * groups  # groups played: every try's probation, then the kept batches
    # (0.1 F + hits r) / (F + trained r) = 0.2 for an honest fleet's F trained groups: r = 0.1 F / (hits - 0.2 trained)
    per_fleet = 0.1 * spent / (hits - 0.2 * trained) if hits > 0.2 * trained else float("inf")
    return {"probation": probation, "looks": looks, "groups": groups, "at_least": at_least,
            "tries_per_kept_batch": tries / kept, "probation_batches_per_kept_batch": tries * probation / kept,
            "share_on_chosen": hits / trained, "trained_groups": trained,
            "compute_per_steered_group": spent / hits, "fleet_compute_to_double_share": per_fleet}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=2000)
    ap.add_argument("--keep", type=int, default=4)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--items", type=int, default=1000)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--usable", type=int, default=12, help="batches a key-a-try grinder keeps, a row")
    ap.add_argument("--at-least", type=int, default=0, help="chosen groups a kept batch needs (default: all)")
    ap.add_argument("--probation", default="1,4,16", help="probation lengths (trust.probation_batches) to measure")
    ap.add_argument("--quick", action="store_true", help="200 keys; 4 kept batches a row")
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
    usable = 4 if a.quick else a.usable
    at_least = a.at_least or a.groups
    honest = rows["bound (now)"]["honest"]
    tries = []
    for p in (int(x) for x in a.probation.split(",")):
        for name, looks in (("one look", 1), ("every unflagged look", unflagged_looks(p))):
            tries.append({"strategy": name, **a_key_a_try(run_key, chosen, a.items, a.groups, usable, p, at_least,
                                                          looks, f"try{p}-{looks}")})
    print(f"\na key a try ({usable} kept batches a row, {a.groups} group(s) a batch, kept with >= {at_least} on "
          f"chosen items; never flagged; honest keys {honest:.1%} on the chosen 10%)")
    print("| probation batches a key | strategy | bound numbers read a key | probation batches per kept batch | "
          "grinder's groups on the chosen 10% | compute per steered group (groups played) | "
          "x an honest fleet's compute to take the chosen share from 10% to 20% |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in tries:
        print(f"| {r['probation']} | {r['strategy']} | {r['looks']} | {r['probation_batches_per_kept_batch']:.1f} | "
              f"{r['share_on_chosen']:.0%} | {r['compute_per_steered_group']:.1f} | "
              f"{r['fleet_compute_to_double_share']:.2f}x |")
    if a.json:
        a.json.write_text(json.dumps({"keys": n_keys, "keep": a.keep, "batches": a.batches, "items": a.items,
                                      "groups": a.groups, "rows": rows, "a_key_a_try": tries}, indent=2) + "\n")


if __name__ == "__main__":
    main()
