"""A pipeline in the real fleet against one whole-model worker: throughput, memory and what the trainer's checks saw.

Every run is real ``stoa trainer`` / ``stoa worker`` / ``stoa stage`` processes meeting in a local
store (``stoa.testing.chaos.ChaosRun`` with no faults), every trust check at its default (replay,
every episode's draws re-derived and its log mu re-scored in int8). The rollout side is, in turn:

* ``worker``: one whole-model ``stoa worker`` (the baseline);
* ``pipeline``: ``stoa worker --stages N --pipeline p0`` (the driver, stage 0) and ``stoa stage
  --stage i/N`` for i = 1 .. N-1, each stage behind its own emulated link
  (``stoa.testing.links``: one-way latency on every chunk, a rate cap each way), the stage
  announcing the link's port (``--advertise``) so the driver reaches it only through the link.
  The pipeline runs at every ``--latency-ms`` over links of ``--mbit`` (fast enough that latency
  is what varies), the longer pipelines at the first latency, and one run over ``--home-mbit``
  links: the last stage returns the logits the driver draws from (``[rows, vocab]`` float32 a
  decode step), so a home link's rate shows there. The bytes each link carried are reported.

Per run: the worker's or driver's generated tokens/s (model tokens of its uploaded cohorts over
the seconds their rollouts took, from its last log lines), batches accepted and rejected by the
trainer, ``trust/claim_gap_max`` (the largest |claimed log mu - the trainer's int8 re-score| over
every token checked) beside the audit floor the trainer calibrated and
``audit.spot_check_tolerance``, groups trained / lost / trained twice, wall time, and every
process's peak RSS (``VmHWM``, sampled from ``/proc`` every 0.25 s while it lives). Every process
shares this one machine; the worker, driver and stages are given ``--threads`` each.

The real model (SmolLM2-135M-Instruct, ``python -m stoa.testing.realmodel``) runs the example
``examples/smollm2_addition.toml`` with ``--set`` overrides (few steps, the torch engine, a small
eval); ``--quick`` runs a random 2-layer model on the synthetic task (``benchmarks/chaos.py``'s
run), 2 steps, one 2-stage pipeline at 0 ms.

    python benchmarks/pipeline_fleet.py [--quick] [--json out.json] [--steps 4] [--stages 2,4]
        [--latency-ms 0,20,50] [--mbit 1000] [--home-mbit 100] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.chaos import CONFIG  # noqa: E402
from stoa.testing.chaos import ChaosRun  # noqa: E402

EXAMPLE = ROOT / "examples" / "smollm2_addition.toml"
_GENERATED = re.compile(r"generated (\d+) model tokens in ([\d.]+) s of rollouts")
_UPLOADED = re.compile(r"(\d+) batches \((\d+) episodes\) uploaded this session")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vm_hwm_mib(pid: int) -> float | None:
    """A live process's own peak resident memory (MiB), or None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class FleetRun(ChaosRun):
    """A fault-free :class:`ChaosRun` whose one worker is a whole-model worker or a pipeline (a
    driver and ``stages - 1`` stage processes, each stage behind its own link), with ``--set``
    overrides for the trainer and every process's peak RSS sampled while it runs."""

    def __init__(self, config: Path, root: Path, run_name: str, key: Path, public_key: str, *, sets: dict,
                 stages: int, one_way_ms: float, mbit: float, threads: int, env: dict[str, str],
                 cap_mib: float | None = None):
        super().__init__(config, root, run_name, key, public_key, workers=1, env=env)
        self.cap = [] if cap_mib is None else ["--max-memory-mb", f"{cap_mib:.1f}"]
        self.sets, self.stages, self.one_way_ms, self.mbit, self.threads = sets, stages, one_way_ms, mbit, threads
        self.links: list = []
        self.link_bytes: list[dict[str, int]] = []  # per stage link: bytes up (driver to stage) and down
        self.peak_rss: dict[str, float] = {}
        self._sampling = threading.Event()

    def _trainer(self, resume: bool = False) -> None:
        sets = [a for k, v in self.sets.items() for a in ("--set", f"{k}={json.dumps(v)}")]
        self._spawn("trainer", ["trainer", str(self.config), "--store", self.store_url(), "--key", str(self.key),
                                "--run-dir", str(self.run_dir), *sets] + (["--resume"] if resume else []))

    def _worker(self, wid: str) -> None:
        from benchmarks.pipeline import Links
        from stoa.testing.links import LinkProfile

        common = ["--store", self.store_url(), "--run", self.run_name, "--public-key", self.public_key,
                  "--threads", str(self.threads)]
        if self.stages == 1:
            self._spawn("worker", ["worker", *common, "--id", wid, "--cache", str(self._cache(wid))])
            return
        driver_key = _key_of(self._cache(wid) / "worker.key")  # each side names the other's key
        stage_keys = ",".join(_key_of(self._cache(f"stage{i}") / "stage.key") for i in range(1, self.stages))
        for i in range(1, self.stages):
            port = free_port()
            link = Links(port, [LinkProfile(f"stage{i}", self.mbit, self.mbit, rtt_ms=2 * self.one_way_ms)],
                         self.root, f"link{i}")
            self.links.append(link)
            self._spawn(f"stage{i}", ["stage", *common, "--stage", f"{i}/{self.stages}", "--pipeline", "p0",
                                      "--cache", str(self._cache(f"stage{i}")), "--port", str(port),
                                      "--advertise", f"127.0.0.1:{link.ports[0]}", "--driver-key", driver_key,
                                      *self.cap])
        self._spawn("worker", ["worker", *common, "--id", wid, "--cache", str(self._cache(wid)),
                               "--stages", str(self.stages), "--pipeline", "p0", "--stage-keys", stage_keys, *self.cap])

    def _sample(self) -> None:
        while not self._sampling.wait(0.25):
            for name, p in list(self.procs.items()):
                if (m := vm_hwm_mib(p.pid)) is not None:
                    self.peak_rss[name] = max(self.peak_rss.get(name, 0.0), m)

    def run(self, timeout: float = 600.0) -> float:
        sampler = threading.Thread(target=self._sample, daemon=True)
        sampler.start()
        try:
            return super().run(timeout)
        finally:
            self._sampling.set()
            sampler.join(5)
            for link in self.links:
                link.close()
                st = json.loads(link.stats.read_text())[0] if link.stats.exists() else {}
                self.link_bytes.append({"up": st.get("bytes_up", 0), "down": st.get("bytes_down", 0)})


def _key_of(path: Path) -> str:
    """The key id of the key at ``path`` (made now when absent, as the process would at its start)."""
    from stoa.transport.identity import load_or_create_worker_key
    from stoa.transport.signing import key_id

    return key_id(load_or_create_worker_key(path).public_key())


def memory_needs(cfg, stages: int) -> tuple[float, float]:
    """(the largest stage's need, the whole model's need) in MiB, as `--max-memory-mb` counts them
    (``Stage.memory().total``: int8 share, float weights computed with, full KV cache), on the
    model's own weights in the run's engine mode."""
    from stoa.backends.torch.engine import pretrained_state
    from stoa.backends.torch.pipeline import Stage, split_layers

    path = Path(cfg.model.path).expanduser()
    state = pretrained_state(path)
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    rc = cfg.rollout

    def need(part):
        return Stage(path, part, state, rc.engine_mode).memory().total(rc.max_batch, rc.max_episode_tokens) / 2**20

    return max(need(p) for p in split_layers(layers, stages)), need((0, layers))


def one_run(root: Path, config: Path, sets: dict, stages: int, one_way_ms: float, mbit: float, args) -> dict:
    from stoa.fleet.config import load_config
    from stoa.fleet.metrics import read_metrics
    from stoa.testing.chaos import verify
    from stoa.transport.signing import generate_private_key, load_public_key, save_keypair

    root.mkdir(parents=True)
    cfg = load_config(config, sets)
    key, pub = save_keypair(generate_private_key(), root / "keys", "run")
    memory = None
    if args.memory_cap and stages > 1:  # each process capped halfway between its need and the whole model's
        stage_need, whole = memory_needs(cfg, stages)
        memory = {"stage_need_mib": round(stage_need, 1), "whole_need_mib": round(whole, 1),
                  "cap_mib": round((stage_need + whole) / 2, 1)}
    run = FleetRun(config, root / "fleet", cfg.name, key, str(pub), sets=sets, stages=stages, one_way_ms=one_way_ms,
                   mbit=mbit, threads=args.threads, cap_mib=memory["cap_mib"] if memory else None,
                   env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    wall = run.run(timeout=args.timeout)
    bad = {n: p.returncode for n, p in run.procs.items() if p.returncode != 0}
    if bad:
        raise AssertionError(f"exit statuses {bad}:\n" + "\n".join(run.log(n)[-2000:] for n in bad))
    got = verify(run, load_public_key(pub))
    got.pop("workers")
    rows = read_metrics(run.run_dir / "metrics.jsonl")
    train = [r for r in rows if r.get("kind") == "train"]
    last = train[-1]
    floors = [r["trust/audit_floor"] for r in rows if "trust/audit_floor" in r]
    m = _GENERATED.findall(run.log("worker"))
    if not m:
        raise AssertionError("the worker logged no generated tokens:\n" + run.log("worker")[-2000:])
    tokens, seconds = int(m[-1][0]), float(m[-1][1])
    uploaded = sum(int(b) for b, _ in _UPLOADED.findall(run.log("worker")))
    return {"rollout": "worker" if stages == 1 else "pipeline", "stages": stages,
            "one_way_ms": one_way_ms if stages > 1 else None, "link_mbit": mbit if stages > 1 else None,
            "link_bytes": run.link_bytes,
            "steps": len(train), "generated_tokens": tokens, "rollout_s": round(seconds, 2),
            "tokens_per_s": tokens / seconds, "batches_uploaded": uploaded,
            "accepted_batches": int(last["trust/accepted_batches"]), "rejected_batches": int(last["trust/rejected_batches"]),
            "quarantined_batches": int(last["dropped/quarantined_batches"]),
            "probation_batches": int(last["trust/probation_batches"]),
            "episodes_checked": int(last.get("trust/episodes_checked", 0)),
            "episodes_replayed": int(last.get("trust/episodes_replayed", 0)),
            "claim_gap_max": last.get("trust/claim_gap_max"), "audit_floor": floors[-1] if floors else None,
            "spot_check_tolerance": cfg.trust.audit.spot_check_tolerance,
            "sampling_band": cfg.trust.audit.sampling_band,
            "wall_s": round(wall, 1), "rl_s": round(rows[-1]["time"] - train[0]["time"], 1),
            "peak_rss_mib": {k: round(v, 1) for k, v in sorted(run.peak_rss.items())}, "memory": memory, **got}


def quick_config(root: Path) -> tuple[Path, dict]:
    root.mkdir(parents=True, exist_ok=True)
    config = root / "quick.toml"
    config.write_text(CONFIG.format(seed=0, steps=2))
    return config, {"model.tiny.num_layers": 2, "model.tiny.hidden_size": 128, "rollout.engine": "torch"}


def real_config(args) -> tuple[Path, dict]:
    from stoa.testing import realmodel

    if realmodel.cached() is None:
        raise SystemExit("the real model is not built: python -m stoa.testing.realmodel (or run with --quick)")
    return EXAMPLE, {"trainer.steps": args.steps, "rollout.engine": "torch", "eval.num_questions": args.eval_questions,
                     "model.path": str(realmodel.cached())}


def print_table(results: dict) -> None:
    base = results["runs"][0]
    print(f"\n{results['model']}: {base['steps']} RL steps a run; every process on one machine ({os.cpu_count()} CPUs)")
    print("| rollout | stages | link each way | one-way latency | tokens/s | vs worker | accepted / rejected | claim gap max "
          "| audit floor | tolerance | groups trained / lost / twice | link kB down a token | wall s | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results["runs"]:
        lat = "-" if r["one_way_ms"] is None else f"{r['one_way_ms']:g} ms"
        gap = "-" if r["claim_gap_max"] is None else f"{r['claim_gap_max']:.2e}"
        floor = "-" if r["audit_floor"] is None else f"{r['audit_floor']:.4f}"
        rss = ", ".join(f"{k} {v:.0f}" for k, v in r["peak_rss_mib"].items())
        down = " / ".join(f"{b['down'] / r['generated_tokens'] / 1e3:.1f}" for b in r["link_bytes"]) or "-"
        rate = "-" if r["link_mbit"] is None else f"{r['link_mbit']:g} Mbit/s"
        print(f"| {r['rollout']} | {r['stages']} | {rate} | {lat} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / base['tokens_per_s']:.2f} | {r['accepted_batches']} / {r['rejected_batches']} | "
              f"{gap} | {floor} | {r['spot_check_tolerance']:g} | {r['groups_trained']} / {r['groups_lost']} / "
              f"{r['trained_twice']} | {down} | {r['wall_s']:.0f} | {rss} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a random 2-layer model, 2 steps, the worker and one "
                    "2-stage pipeline at 0 ms")
    ap.add_argument("--json", type=Path, help="write the results here (after every run)")
    ap.add_argument("--steps", type=int, default=4, help="RL steps a run (the real model)")
    ap.add_argument("--eval-questions", type=int, default=32, help="eval.num_questions (the real model)")
    ap.add_argument("--stages", default="2,4", help="pipeline lengths; the first is run at every latency")
    ap.add_argument("--latency-ms", default="0,20,50", help="one-way latency between the driver and each stage")
    ap.add_argument("--mbit", type=float, default=1000.0, help="each stage link's rate each way (Mbit/s)")
    ap.add_argument("--home-mbit", type=float, default=100.0,
                    help="one more run: the first pipeline length at the first latency over links of this rate (0: none)")
    ap.add_argument("--threads", type=int, default=1, help="--threads of the worker, the driver and every stage")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may take")
    ap.add_argument("--memory-cap", action="store_true",
                    help="the real model: run every stage and driver with --max-memory-mb halfway between its "
                         "need and the whole model's (which one whole-model worker would exceed)")
    ap.add_argument("--keep", type=Path, help="copy every run's logs and trainer folder (metrics, ledger) here")
    args = ap.parse_args()
    if args.quick and args.memory_cap:
        ap.error("--memory-cap needs the real model (the quick run's model is built by its trainer)")
    if args.quick:
        args.stages, args.latency_ms, args.home_mbit = "2", "0", 0.0
    stages = [int(x) for x in args.stages.split(",")]
    lats = [float(x) for x in args.latency_ms.split(",")]
    plan = ([(1, 0.0, 0.0)] + [(stages[0], lat, args.mbit) for lat in lats] + [(n, lats[0], args.mbit) for n in stages[1:]]
            + ([(stages[0], lats[0], args.home_mbit)] if args.home_mbit else []))
    t0 = time.time()
    results: dict = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     "cpus": os.cpu_count(), "runs": []}
    with tempfile.TemporaryDirectory(prefix="stoa-pipeline-fleet-") as td:
        tmp = Path(td)
        config, sets = quick_config(tmp) if args.quick else real_config(args)
        results["model"] = "random 2-layer model (hidden 128)" if args.quick else "SmolLM2-135M-Instruct"
        results["config"], results["sets"] = config.name, sets
        for k, (n, lat, mbit) in enumerate(plan):
            print(f"[{time.time() - t0:.0f}s] " + ("worker" if n == 1 else f"{n}-stage pipeline, {lat:g} ms, {mbit:g} Mbit/s"),
                  flush=True)
            row = one_run(tmp / f"run{k}", config, sets, n, lat, mbit, args)
            row["ratio"] = row["tokens_per_s"] / (results["runs"][0]["tokens_per_s"] if results["runs"] else row["tokens_per_s"])
            row["load_average"] = os.getloadavg()[0]
            results["runs"].append(row)
            if args.keep:
                shutil.copytree(tmp / f"run{k}" / "fleet", args.keep / f"run{k}", ignore=shutil.ignore_patterns(
                    "cache", "store", "checkpoints", "model", "held"))
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(results, indent=2) + "\n")
    results["wall_s"] = round(time.time() - t0, 1)
    print_table(results)
    print(f"total {results['wall_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
