"""A long fleet run with worker churn: memory, open files and store objects over time.

Real ``stoa trainer`` / ``stoa worker`` processes on a tiny model and the synthetic search task
(``stoa.testing.soak``) meet in a local store, or with ``--s3`` in a real S3 server (SeaweedFS on
loopback, reached through the fault proxy of ``stoa.testing.storefaults`` with no fault injected).
After the first RL step the fleet runs ``--calm`` seconds undisturbed (the baseline), then for
``--seconds`` one worker leaves every ``--churn`` seconds (SIGTERM or SIGKILL, drawn from
``--seed``) and another joins in its place (the same identity again or a new one); ``worker-0``
never leaves. At the end the trainer is stopped (SIGTERM) and resumed to finish the run, and what
was trained, lost or trained twice is counted.

Every ``--sample`` seconds each process's resident memory, open descriptors and threads are read
from ``/proc`` and the store is listed by kind. The first table gives, per process, its level in
the first and last fifth of its life, their ratio, and the least-squares slope over the rest of
its life (per hour); the second gives, per kind of store object, its count at the end of the
calm baseline, its maximum, at the end of the churn, and what bounds it.

    python benchmarks/soak.py [--quick] [--json out.json] [--seconds 3600] [--calm 600] [--churn 60] [--keep DIR] [--s3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.chaos import CONFIG  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a churn every 5 s for 20 s after 5 calm seconds")
    ap.add_argument("--json", type=Path, help="write the results (and every sample) here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=3600.0, help="length of the churned stretch")
    ap.add_argument("--calm", type=float, default=600.0, help="length of the churn-free baseline before it")
    ap.add_argument("--churn", type=float, default=60.0, help="seconds between a worker leaving and the next")
    ap.add_argument("--sample", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="copy the run (store, logs, trainer folder) here at the end; with --s3 the "
                    "store stays in the server, which is stopped with the benchmark")
    ap.add_argument("--s3", action="store_true", help="meet in a real S3 server (SeaweedFS) instead of a local folder")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped: the fleet is stopped with it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from stoa.fleet.config import load_config
    from stoa.testing.chaos import verify
    from stoa.testing.soak import RETENTION, SoakRun, summary
    from stoa.transport.signing import generate_private_key, load_public_key, save_keypair

    if args.quick:
        args.seconds, args.calm, args.churn, args.sample = 20.0, 5.0, 5.0, 1.0
    with contextlib.ExitStack() as stack:
        s3 = None
        if args.s3:
            from stoa.testing.seaweed import SeaweedFS
            s3 = stack.enter_context(SeaweedFS.start())
        root = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        config = root / "run.toml"
        config.write_text(CONFIG.format(seed=args.seed, steps=10**6))
        key, pub = save_keypair(generate_private_key(), root / "keys", "run")
        run = SoakRun(config, root / "fleet", load_config(config).name, key, str(pub), args.workers,
                      env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}, seed=args.seed, s3=s3,
                      seconds=args.seconds, calm_s=args.calm, churn_s=args.churn, sample_s=args.sample)
        t0 = time.time()
        wall = run.run(timeout=args.seconds + args.calm + 900)
        got = verify(run, load_public_key(pub))
        got.pop("workers")
        res = summary(run.samples)
        if args.keep:
            shutil.copytree(root, args.keep, ignore=shutil.ignore_patterns("held"))
    print(f"soak benchmark: seed {args.seed}, {args.workers} workers, {args.calm:g} s calm then {args.seconds:g} s "
          f"with a churn every {args.churn:g} s ({len(run.churns)} churns, {len(run.identities)} identities), "
          f"sampled every {args.sample:g} s; wall {wall:.0f} s; "
          f"{'S3 (SeaweedFS)' if args.s3 else 'local store'}")
    print("| process | life s | RSS MB end of calm / end of life | ratio | RSS slope MB/h calm / churn "
          "| fds end of calm / end of life | fds max | fds slope /h calm / churn | threads max |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    fmt = lambda x: "-" if x is None else f"{x:+.1f}"  # noqa: E731
    num = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    for p in sorted(res["procs"], key=lambda p: (not p["name"].startswith("trainer"), p["born"], p["pid"])):
        if p["samples"] < 3:
            continue
        ratio = "-" if p["rss_mb_calm"] is None else f"{p['rss_mb_last'] / p['rss_mb_calm']:.3f}"
        print(f"| {p['name']} (pid {p['pid']}) | {p['seconds']:.0f} | {num(p['rss_mb_calm'])} / {p['rss_mb_last']:.1f} "
              f"| {ratio} | {fmt(p['rss_mb_calm_per_h'])} / {fmt(p['rss_mb_churn_per_h'])} | {num(p['fds_calm'])} / "
              f"{p['fds_last']:.1f} | {p['fds_max']} | {fmt(p['fds_calm_per_h'])} / {fmt(p['fds_churn_per_h'])} | "
              f"{p['threads_max']} |")
    print("| store objects | end of calm | max | end of churn | after the finish | what bounds it |")
    print("|---|---:|---:|---:|---:|---|")
    for kind, d in sorted(res["store"].items()):
        print(f"| {kind} | {d['calm_end']} | {d['max']} | {d['churn_end']} | {d['end']} | "
              f"{RETENTION.get(kind, '?')} |")
    print("| control document bytes | end of calm | max | end of churn | after the finish |")
    print("|---|---:|---:|---:|---:|")
    for name, d in res["bytes"].items():
        print(f"| {name} | {d['calm_end']} | {d['max']} | {d['churn_end']} | {d['end']} |")
    print("| local disk MB | end of calm | max | end of churn | after the finish |")
    print("|---|---:|---:|---:|---:|")
    for what, d in res["disk"].items():
        print(f"| {what} | {d['calm_end']:.2f} | {d['max']:.2f} | {d['churn_end']:.2f} | {d['end']:.2f} |")
    print(f"finished {got['finished']}; groups trained {got['groups_trained']}, lost {got['groups_lost']}, trained "
          f"twice {got['trained_twice']}; trainer resumed {got['resumed']}x")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "wall_s": round(wall, 1),
                                         "bench_s": round(time.time() - t0, 1), "verify": got, "churns": run.churns,
                                         "identities": run.identities, **res, "samples": run.samples}, indent=1)
                             + "\n")


if __name__ == "__main__":
    main()
