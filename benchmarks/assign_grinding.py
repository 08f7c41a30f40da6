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

A key a try leaves no flag, and is priced in compute, not gaps: make a key, spend its probation
(``trust.probation_batches`` accepted batches, never trained), ticket salted numbers, read what
they are bound to, upload only the bound work with enough groups on the chosen items, abandon the
key. Two rules, on the same grinder:

* **before** (a key held up to 8 bindings from the start): one probation buys every look the
  withholding flag allows, all bound in one poll (a key with fewer than 8 numbers is never
  judged, one with more may leave 30% of them as gaps);
* **after** (the rule now, :mod:`stoa.fleet.trust.binding`): a *fresh* key (no accepted salted
  batch since it gained standing) holds one binding at a time, and a bound number it leaves
  undelivered costs its standing: a probation again. So each declined look costs a probation;
  once a look is kept, the key is no longer fresh and reads every unflagged look more.

In an open fleet each try is a new key; in an enrolled fleet keys are the operator's (a key is
kept, it has no probation to start with, and its abandoned numbers are its gaps), so the figure to
read there is also keys per kept batch.

Measured per probation length: probation batches per kept batch, the compute spent per steered group
(groups played, probation included), and against the fleet: the grinder's compute, as a multiple
of an honest fleet's, that takes the chosen items' share of all trained groups from 10% to 20%.

Pure computation: no store, no model.

    python benchmarks/assign_grinding.py [--keys 2000] [--keep 4] [--batches 6] [--usable 12]
        [--at-least N] [--probation 1,4,16] [--quick] [--json PATH]

(With one group a batch, rows at 4 groups a batch, kept with >= 2 on the chosen items, come too.)
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


def unflagged_looks(numbers: int, gaps: int = 0) -> int:
    """Bound numbers a key with ``numbers`` numbers (``gaps`` of them gaps) may read at once and
    still never be flagged as a withholder, were only the last one uploaded: fewer than 8 numbers
    in all, or gaps within 30% of them."""
    return max([0] + [n for n in range(1, MAX_BOUND + 1)
                      if numbers + n < RIPE or (gaps + n - 1) / (numbers + n) <= FLAG_RATE])


def a_key_a_try(run_key, chosen: set[int], n_items: int, groups: int, usable: int, probation: int,
                at_least: int, rule: str, enrolled: bool, seed: str) -> dict[str, float]:
    """Grind until ``usable`` batches are kept (a kept batch has at least ``at_least`` of its
    ``groups`` groups on ``chosen``), never flagged.

    ``rule = "before"``: a key spends its probation (none when ``enrolled``), reads every bound
    number it may at once (:func:`unflagged_looks`), uploads the kept ones and is abandoned.
    ``rule = "after"`` (a fresh key holds one binding; an abandoned one costs its standing): a key
    spends its probation and reads one bound number; kept, it is uploaded and the key, no longer
    fresh, reads every unflagged look more at once; not kept, the look costs a probation. In an open
    fleet a new key takes each try (the same price as the old key's probation, and no gap on a key
    it keeps); in an ``enrolled`` fleet keys are the operator's, so a key is kept and its
    abandoned numbers are its gaps."""
    keys = looks = probation_spent = kept = hits = 0

    def look(kid: str, seq: int) -> int:
        nonlocal looks
        looks += 1
        k = sum(i in chosen for i in items(run_key, kid, seq, n_items, groups, True))
        return k if k >= at_least else -1

    def upload_burst(kid: str, seq: int, numbers: int, gaps: int) -> None:
        nonlocal kept, hits
        for s in range(seq, seq + unflagged_looks(numbers, gaps)):
            if (k := look(kid, s)) >= 0:
                kept, hits = kept + 1, hits + k

    while kept < usable:
        kid = hashlib.sha256(f"{seed}-{keys}".encode()).hexdigest()[:16]
        keys += 1
        first = 0 if enrolled else probation
        probation_spent += first
        if rule == "before":
            upload_burst(kid, first, first, 0)
            continue
        seq, gaps = first, 0
        while (k := look(kid, seq)) < 0:
            if not enrolled:
                break  # a new key for the next try
            seq, gaps = seq + 1 + probation, gaps + 1  # the number left, then a probation again
            probation_spent += probation
        else:
            kept, hits = kept + 1, hits + k
            upload_burst(kid, seq + 1, seq + 1, gaps)
    trained = kept * groups
    spent = (probation_spent + kept) * groups  # groups played: probation, then the kept batches
    # (0.1 F + hits r) / (F + trained r) = 0.2 for an honest fleet's F trained groups: r = 0.1 F / (hits - 0.2 trained)
    per_fleet = 0.1 * spent / (hits - 0.2 * trained) if hits > 0.2 * trained else float("inf")
    return {"fleet": "enrolled" if enrolled else "open", "rule": rule, "probation": probation, "groups": groups,
            "at_least": at_least, "keys_per_kept_batch": keys / kept, "looks_per_kept_batch": looks / kept,
            "probation_batches_per_kept_batch": probation_spent / kept, "share_on_chosen": hits / trained,
            "trained_groups": trained, "compute_per_steered_group": spent / hits, "fleet_compute_to_double_share": per_fleet}


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
    honest = rows["bound (now)"]["honest"]
    tries = []
    for enrolled in (False, True):
        for p in (int(x) for x in a.probation.split(",")):
            for g, at_least in ((a.groups, a.at_least or a.groups), *(((4, 2),) if a.groups == 1 else ())):
                for rule in ("before", "after"):
                    tries.append(a_key_a_try(run_key, chosen, a.items, g, usable, p, at_least, rule, enrolled,
                                             f"try{p}-{g}-{enrolled}"))
    print(f"\na key a try ({usable} kept batches a row; never flagged; honest keys {honest:.1%} on the chosen 10%)")
    print("before: a key reads every bound number it may at once; after: a fresh key holds one binding, and "
          "a look it declines costs a probation")
    print("| fleet | probation batches | groups a batch (kept with) | rule | keys per kept batch | "
          "probation batches per kept batch | grinder's groups on the chosen 10% | groups played per steered group | "
          "x an honest fleet's compute to take the chosen share from 10% to 20% |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|")
    for r in tries:
        print(f"| {r['fleet']} | {r['probation']} | {r['groups']} (>= {r['at_least']}) | {r['rule']} | "
              f"{r['keys_per_kept_batch']:.2f} | {r['probation_batches_per_kept_batch']:.1f} | "
              f"{r['share_on_chosen']:.0%} | {r['compute_per_steered_group']:.1f} | "
              f"{r['fleet_compute_to_double_share']:.2f}x |")
    if a.json:
        a.json.write_text(json.dumps({"keys": n_keys, "keep": a.keep, "batches": a.batches, "items": a.items,
                                      "groups": a.groups, "rows": rows, "a_key_a_try": tries}, indent=2) + "\n")


if __name__ == "__main__":
    main()
