"""A home-internet fleet on one machine: PULSE deltas vs full checkpoints over shaped links to real S3.

A trainer publishes real weight versions into a real S3 server (SeaweedFS on loopback) through
a datacenter link; 14 sync-only followers (``stoa.fleet.worker.follower``, the production subscriber
path) and 2 generating workers follow the chain, each through its own emulated home link
(``stoa.testing.links``: a per-link asyncio proxy with token-bucket bandwidth per direction,
latency, jitter, and for one link random resets and stalls). Each workload runs twice: with
PULSE (deltas, an anchor every ``--anchor-every`` versions) and with a full checkpoint every
version and no deltas (``anchor_every=1`` and ``anchor_if_delta_over`` ~ 0: with ``anchor_every=1``
alone each version would keep its delta beside its anchor and followers would still take it).

Workloads:

* ``synthetic``: a Llama-shaped model of >= 100M parameters (``benchmarks/pulse.py``'s shapes)
  taking bf16 Adam steps at steady state with the learning rate bisected so that 0.5% of the
  int8 codes change per version (``pulse.py``'s ``adam_step``/``tune_lr``), re-quantized with
  the trainer's keep policy. Versions are computed before the timed phase, so the trainer's
  compute does not steal this machine's CPU from the emulated fleet.
* ``tiny``: a tiny Qwen2 (``stoa.models.tiny``) trained for real with torch AdamW (as
  ``pulse.py`` does); each optimizer step is quantized against the previous version and published.

What is emulated, exactly: (1) the links (user-space shaping; see ``stoa.testing.links``);
(2) training compute: a step lasts ``--train-s`` seconds (the synthetic model's step is a sleep;
the tiny model's real step is padded to it); (3) generation: each generating worker syncs to the
head (real sync), "generates" for ``--gen-s`` seconds (a sleep), then uploads a real rollout
batch (``--batch-episodes`` episodes of ``--batch-tokens`` tokens, ``stoa.types`` wire format,
``RolloutWriter``) through its link. The trainer takes ``--batches-per-step`` batches per step
(``RolloutReader``), accepting batches at most ``--max-staleness`` versions old; its idle
fraction is the wall time spent waiting for batches over the trainer loop in steady state: the
loop starts once the generating workers have joined, and the first step's wait (the pipeline
filling: one generation) is excluded and reported apart (``trainer_idle_fraction_incl_fill``,
``trainer_step_waits_s``). The default
provisioning is balanced (``gen_s == train_s``, 2 workers, 2 batches per step): the workers
generate exactly as fast as the trainer consumes, so what the trainer waits for is weight sync
and upload.

Reported per link class: cold-join seconds (follower start to first verified version),
per-version sync seconds p50/p95 (one successful ``sync`` call: until the new weights are written
and usable) and seconds until verified (until the signed state hash was checked; with ``--check
background``, the default and what ``stoa worker`` does, the hash runs after the write, beside
generation, and a worker uploads nothing made with those weights before it passed; with ``--check
now`` both are the same), bytes moved per follower,
versions behind HEAD (sampled every 0.25 s), failures recovered (follower-level) and faults the
link injected; for the trainer, the idle fraction. ``--json PATH`` writes everything, with
top-level keys for the synthetic model's 50 Mbit/s class.

    python benchmarks/fleet_wan.py [--quick] [--json out.json] [--params 110e6]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pulse import BF16, adam_step, init_weight, llama_shapes, tune_lr

from stoa.fleet.worker.follower import Follower, FollowerConfig
from stoa.testing.links import SHAPING, LinkNet, LinkProfile
from stoa.testing.seaweed import SeaweedFS
from stoa.testing.synthetic import synthetic_episodes
from stoa.transport.chain import SYNC_CHECKS, WeightPublisher
from stoa.transport.exchange import RolloutReader, RolloutWriter
from stoa.transport.quant import RequantPolicy, quantize_state
from stoa.transport.signing import generate_private_key
from stoa.transport.store import S3Config, S3Store, StoreError

# (class, down Mbit/s, up Mbit/s, RTT ms, jitter ms, resets/GB, stalls/GB, followers)
FOLLOWER_LINKS = [
    ("fiber300", 300, 50, 10, 2, 0, 0, 2),
    ("cable100", 100, 20, 25, 5, 0, 0, 3),
    ("dsl50", 50, 10, 40, 5, 0, 0, 4),
    ("dsl25", 25, 5, 80, 10, 0, 0, 2),
    ("overseas50", 50, 10, 150, 20, 0, 0, 2),
    ("flaky10", 10, 2, 60, 30, 40, 20, 1),
]
GENERATOR_LINKS = [("cable100", 100, 20, 25, 5), ("dsl50", 50, 10, 40, 5)]
MAIN_CLASS = "dsl50"
S3_CFG = dict(max_attempts=8, read_timeout_s=10, connect_timeout_s=5)


@dataclass
class Workload:
    name: str
    versions: list[dict[str, np.ndarray]]  # version 1 .. N states (int8 layout)
    params: int
    train_s: float
    note: str


# --- workloads ---------------------------------------------------------------------------------------

def synthetic_workload(params: float, n: int, rate: float, train_s: float, seed: int = 2) -> Workload:
    shapes = llama_shapes(params)
    if params < 50e6:  # --quick: the layers alone (the 24.6M-parameter embedding would dominate)
        shapes = {k: v for k, v in shapes.items() if "embed" not in k}
    policy = RequantPolicy()
    lr = tune_lr(rate, policy, seed=1)
    floats = {name: init_weight(np.random.default_rng([seed, j]), name, s) for j, (name, s) in enumerate(shapes.items())}
    bf = lambda: {k: v.astype(BF16) for k, v in floats.items()}
    state = quantize_state(bf())
    state = quantize_state(bf(), previous=state, policy=policy)  # a steady-state version (see pulse.py)
    versions = [state]
    for v in range(1, n):
        for j, name in enumerate(shapes):
            if floats[name].ndim == 2:
                floats[name] = adam_step(np.random.default_rng([seed, j, v]), floats[name], lr)
        state = quantize_state(bf(), previous=state, policy=policy)
        versions.append(state)
    codes = [k for k, a in versions[0].items() if a.dtype == np.uint8]
    changed = np.mean([sum(int((a[k] != b[k]).sum()) for k in codes) / sum(a[k].size for k in codes)
                       for a, b in zip(versions, versions[1:])])
    n_params = sum(math.prod(s) for s in shapes.values())
    return Workload("synthetic", versions, n_params, train_s,
                    f"{n_params / 1e6:.0f}M bf16 Adam steps, lr {lr:.2e}, {100 * changed:.2f}% codes changed/version")


def tiny_workload(n: int, train_s: float, lr: float = 1e-5) -> tuple[Workload, float]:
    """Real torch AdamW steps on a tiny Qwen2; returns the workload and the mean real step seconds."""
    import torch
    from transformers import AutoModelForCausalLM

    from stoa.models.tiny import TinyConfig, build_tiny

    words = ("the kinase binds a receptor in neurons and regulates expression of protein which "
             "gene does Kavorin inhibit in hepatocytes answer search information").split()
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, 12)) for _ in range(800)]
    cfg = TinyConfig(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                     intermediate_size=1024)
    policy = RequantPolicy()
    with tempfile.TemporaryDirectory() as d:
        path = build_tiny(Path(d) / "tiny", texts, cfg)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    tied = model.config.tie_word_embeddings
    batch = torch.from_numpy(rng.integers(0, model.config.vocab_size, (8, 64)))

    def export() -> dict[str, np.ndarray]:
        sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        if tied:
            sd.pop("lm_head.weight", None)  # mlx_lm drops the tied head too
        return sd

    state = quantize_state(export())
    versions, step_s = [], []
    for _ in range(n + 1):
        t = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        state = quantize_state(export(), previous=state, policy=policy)
        step_s.append(time.perf_counter() - t)
        versions.append(state)
    versions = versions[1:]  # the first kept version is the one-off settling step
    n_params = int(sum(p.numel() for p in model.parameters()))
    return Workload("tiny", versions, n_params, train_s,
                    f"tiny Qwen2 {n_params / 1e6:.1f}M, torch AdamW lr {lr:g}"), float(np.mean(step_s[1:]))


# --- one run -------------------------------------------------------------------------------------------

def percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


class _Links:
    """The run's links: in a process of their own (default; no interpreter lock shared with the
    fleet), or in this process (``--in-process``). Gives endpoints, then counters at the end."""

    def __init__(self, profiles: list[LinkProfile], s3: SeaweedFS, in_process: bool, tmp: Path):
        self.net = self.proc = None
        if in_process:
            self.net = LinkNet(("127.0.0.1", s3.port))
            self.links = [self.net.add(p) for p in profiles]
            self.ports = [lk.port for lk in self.links]
            return
        spec, self.ready, self.stats_file = tmp / "links.json", tmp / "ready.json", tmp / "stats.json"
        spec.write_text(json.dumps([asdict(p) for p in profiles]))
        self.proc = subprocess.Popen([sys.executable, "-m", "stoa.testing.links", "--upstream", f"127.0.0.1:{s3.port}",
                                      "--links", str(spec), "--ready", str(self.ready), "--stats", str(self.stats_file)])
        for _ in range(300):
            if self.ready.exists():
                break
            time.sleep(0.1)
        self.ports = json.loads(self.ready.read_text())["ports"]

    def endpoint(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def close(self) -> list[dict]:
        """Stop the links; per link: counters, request count, request times and Range headers."""
        if self.net is not None:
            out = [{"name": lk.profile.name, **vars(lk.stats), "requests": len(lk.requests),
                    "request_kinds": lk.request_kinds(), "request_times": [r.t for r in lk.requests]}
                   for lk in self.links]
            self.net.close()
            return out
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        return json.loads(self.stats_file.read_text())


def _follower_procs(specs: list[tuple[str, str]], url_for, public_hex: str, args, tmp: Path, env: dict):
    """Start one ``python -m stoa.fleet.worker.follower`` per (name, endpoint)."""
    procs = []
    for name, endpoint in specs:
        out = tmp / f"{name}.jsonl"
        procs.append((name, out, subprocess.Popen(
            [sys.executable, "-m", "stoa.fleet.worker.follower", "--store", url_for(endpoint), "--run", "run",
             "--public-key", public_hex, "--name", name, "--poll", str(args.poll_s), "--duration", "3600",
             "--read-timeout", str(S3_CFG["read_timeout_s"]), "--check", args.check, "--out", str(out)],
            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / f"{name}.log", "w"))))
    return procs


def _read_follower(name: str, out: Path) -> dict:
    lines = [json.loads(x) for x in out.read_text().splitlines() if x.strip()] if out.exists() else []
    start = next((x["t"] for x in lines if x["type"] == "start"), None)
    return {"name": name, "start": start, "records": [x for x in lines if x["type"] == "record"],
            "failures": sum(x["type"] == "failure" for x in lines)}


def _from_follower(f: Follower, start: float) -> dict:
    return {"name": f.name, "start": start, "records": [asdict(r) for r in f.records], "failures": len(f.failures)}


def run_mode(wl: Workload, mode: str, s3: SeaweedFS, bucket: str, args) -> dict:
    prefix = f"{wl.name}-{mode}-{uuid.uuid4().hex[:6]}"
    key = generate_private_key()
    anchor_every = 1 if mode == "full" else args.anchor_every
    store = lambda endpoint: S3Store(bucket, prefix, endpoint_url=endpoint, credentials=s3.credentials,  # noqa: E731
                                     config=S3Config(**S3_CFG))
    url_for = lambda endpoint: f"s3://{bucket}/{prefix}?endpoint={endpoint}"  # noqa: E731
    env = dict(os.environ, AWS_ACCESS_KEY_ID=s3.credentials[0], AWS_SECRET_ACCESS_KEY=s3.credentials[1],
               AWS_DEFAULT_REGION="us-east-1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    out: dict = {"mode": mode, "anchor_every": anchor_every, "followers_as": "threads" if args.in_process else "processes"}
    profiles = [LinkProfile("datacenter", 1000, 1000, rtt_ms=2)]
    profiles += [LinkProfile(f"gen-{cls}", down, up, rtt, jit, seed=900 + i)
                 for i, (cls, down, up, rtt, jit) in enumerate(GENERATOR_LINKS)]
    names = []
    for i, (cls, down, up, rtt, jit, resets, stalls, count) in enumerate(FOLLOWER_LINKS):
        if args.classes and cls not in args.classes.split(","):
            continue
        count = args.per_class or (count if not args.quick else max(1, count // 2))
        for j in range(count):
            profiles.append(LinkProfile(cls, down, up, rtt, jit, resets, stalls, stall_s=4, seed=100 * i + j))
            names.append(f"{cls}-{j}")
    first_follower = 1 + len(GENERATOR_LINKS)
    tmp = Path(tempfile.mkdtemp(prefix="fleet-wan-"))
    links = _Links(profiles, s3, args.in_process, tmp)
    procs: list = []
    try:
        dc = links.endpoint(0)
        # A scheduled anchor keeps its delta (see stoa.transport.chain), so anchor_every=1 alone
        # would still let followers take deltas; full mode also drops every delta.
        pub = WeightPublisher(store(dc), "run", key, anchor_every=anchor_every, keep_anchors=args.keep_anchors,
                              anchor_if_delta_over=1e-12 if mode == "full" else 0.5)
        reader = RolloutReader(store(dc), "run")
        gens = [(f"gen{i}", links.endpoint(1 + i), Follower(store(links.endpoint(1 + i)), "run", key.public_key(),
                                                             FollowerConfig(poll_s=0.2, check=args.check), name=f"gen{i}"))
                for i in range(len(GENERATOR_LINKS))]
        publishes: list[dict] = []

        def publish(v: int) -> None:
            for _ in range(100):  # a trainer waits out store trouble
                try:
                    r = pub.publish(v, wl.versions[v - 1])
                    publishes.append({"version": v, "kind": r.kind, "bytes": r.bytes_written, "seconds": r.seconds,
                                      "t": time.time()})
                    return
                except StoreError as e:
                    print(f"  publish {v} failed ({e}); retrying", flush=True)
                    time.sleep(1)
            raise RuntimeError(f"could not publish version {v}")

        publish(1)
        stop = threading.Event()
        t_start = time.monotonic()
        specs = [(n, links.endpoint(first_follower + i)) for i, n in enumerate(names)]
        threads: list[threading.Thread] = []
        if args.in_process:
            in_proc = [Follower(store(ep), "run", key.public_key(), FollowerConfig(poll_s=args.poll_s, check=args.check), name=n)
                       for n, ep in specs]
            started = time.time()
            threads += [threading.Thread(target=f.run, kwargs={"stop": stop, "duration_s": 3600}, daemon=True)
                        for f in in_proc]
        else:
            procs = _follower_procs(specs, url_for, key.public_key().public_bytes_raw().hex(), args, tmp, env)
        uploads: list[tuple[str, int]] = []
        cycles: list[tuple[float, float]] = []  # (sync s, upload s) of each generation cycle

        def generate(name: str, endpoint: str, f: Follower) -> None:
            writer = RolloutWriter(store(endpoint), "run", name)
            for n in range(10_000):  # bounded; stops with the run
                if stop.is_set():
                    return
                t_sync = time.perf_counter()
                try:
                    f.poll()  # sync to the head before generating, as a worker does between cohorts
                except Exception as e:  # noqa: BLE001 - a failed sync is retried next round
                    print(f"  {name}: sync failed: {e}", flush=True)
                    stop.wait(1)
                    continue
                if f.version is None:
                    stop.wait(0.2)
                    continue
                used, sync_s = f.version, time.perf_counter() - t_sync
                if stop.wait(args.gen_s):
                    return
                eps = synthetic_episodes(args.batch_episodes, args.batch_tokens, 32000, seed=n, policy_version=used,
                                         worker_id=name)
                t_up = time.perf_counter()
                try:
                    writer.upload(eps, policy_version=used)
                    uploads.append((name, used))
                    cycles.append((sync_s, time.perf_counter() - t_up))
                except StoreError as e:
                    print(f"  {name}: upload failed: {e}", flush=True)

        threads += [threading.Thread(target=generate, args=g, daemon=True) for g in gens]
        for t in threads:
            t.start()

        # The trainer starts once the generating workers have joined (their cold join is the same
        # anchor download in both modes and is reported as fleet_start_s).
        deadline = time.monotonic() + args.max_wait_s
        while any(f.version is None for _, _, f in gens) and time.monotonic() < deadline:
            time.sleep(0.1)
        fleet_start = time.monotonic() - t_start
        # The trainer: wait for batches, train, publish.
        waits: list[float] = []
        pool: list = []
        taken = stale = 0
        t_loop = time.monotonic()
        for v in range(2, len(wl.versions) + 1):
            step = v - 1  # the version being trained on
            t_wait = time.monotonic()
            deadline = t_wait + args.max_wait_s
            while True:
                pool = [b for b in pool if b.version >= step - args.max_staleness]
                if len(pool) >= args.batches_per_step or time.monotonic() > deadline:
                    break
                try:
                    got = reader.poll()
                except StoreError:
                    got = []
                stale += sum(b.version < step - args.max_staleness for b in got)
                pool += got
                if len(pool) < args.batches_per_step:
                    time.sleep(0.2)  # the trainer's default poll interval (trainer.poll_seconds)
            waits.append(time.monotonic() - t_wait)
            taken += min(len(pool), args.batches_per_step)
            pool = pool[args.batches_per_step:]
            time.sleep(wl.train_s)  # the step's compute (see the module docstring)
            publish(v)
        t_trainer = time.monotonic() - t_loop
        time.sleep(args.grace_s)  # late followers finish the newest version
        stop.set()
        for _, _, p in procs:
            p.send_signal(signal.SIGTERM)
        for _, _, p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        for t in threads:
            t.join(30)
        followers = ([_from_follower(f, started) for f in in_proc] if args.in_process
                     else [_read_follower(n, o) for n, o, _ in procs])
    finally:
        for _, _, p in procs:
            if p.poll() is None:
                p.kill()
        link_stats = links.close()
    # Steady state: the first step's wait is the pipeline filling (one generation), reported apart.
    out.update(
        trainer_idle_fraction=sum(waits[1:]) / (t_trainer - waits[0]),
        trainer_idle_fraction_incl_fill=sum(waits) / t_trainer, trainer_wall_s=t_trainer,
        trainer_step_waits_s=waits, fleet_start_s=fleet_start,
        batches_taken=taken, batches_stale=stale, uploads=len(uploads), versions=len(wl.versions),
        publish=publishes, wall_s=time.monotonic() - t_start, shaping=SHAPING,
        generator_sync_seconds=[r.seconds for _, _, f in gens for r in f.records if r.kind == "sync"],
        generator_cycle_sync_s_mean=float(np.mean([c[0] for c in cycles])) if cycles else None,
        generator_cycle_upload_s_mean=float(np.mean([c[1] for c in cycles])) if cycles else None,
        load_average=os.getloadavg()[0], gen_s=args.gen_s,
        trainer_requests=link_stats[0]["request_kinds"],  # publishes, rollout polls and retention
    )
    polls_sum = sum(len(f["records"]) for f in followers)
    out["requests_per_follower_sync"] = (sum(ls["requests"] for ls in link_stats[first_follower:]) / max(1, polls_sum))
    # Versions behind HEAD, sampled every 0.25 s from the publish times and each follower's records.
    pub_t = np.array([p["t"] for p in publishes])
    grid = np.arange(pub_t[0], pub_t[-1] + args.grace_s, 0.25)
    head_at = np.searchsorted(pub_t, grid, side="right")  # versions 1..N are published in order
    out["classes"] = {}
    for cls, *_ in FOLLOWER_LINKS:
        idx = [i for i, f in enumerate(followers) if f["name"].startswith(cls + "-")]
        if not idx:
            continue
        fs, lks = [followers[i] for i in idx], [link_stats[first_follower + i] for i in idx]
        syncs = [r for f in fs for r in f["records"] if r["kind"] == "sync"]
        joins = [f["records"][0]["t_end"] - f["start"] for f in fs
                 if f["records"] and f["records"][0]["kind"] == "join" and f["start"]]
        behind: list[int] = []
        not_joined = 0
        for f in fs:
            ends = np.array([r["t_end"] for r in f["records"]])
            held = np.array([r["to_version"] for r in f["records"]])
            k = np.searchsorted(ends, grid, side="right")
            ok = k > 0
            not_joined += int((~ok).sum())
            behind += list(head_at[ok] - held[k[ok] - 1])
        hist = {str(a): int(c) for a, c in zip(*np.unique(np.minimum(behind, 5), return_counts=True))} if behind else {}
        secs = [r["seconds"] for r in syncs]
        vsecs = [r.get("verified_seconds", r["seconds"]) for r in syncs]
        out["classes"][cls] = {
            "followers": len(fs), "joined": sum(bool(f["records"]) for f in fs),
            "cold_join_s": joins, "cold_join_s_median": percentile(joins, 50),
            "sync_s_p50": percentile(secs, 50), "sync_s_p95": percentile(secs, 95), "syncs": len(syncs),
            "verified_s_p50": percentile(vsecs, 50), "verified_s_p95": percentile(vsecs, 95),
            "sync_cpu_s_mean": float(np.mean([r["cpu_seconds"] for r in syncs])) if syncs else None,
            "bytes_per_follower": float(np.mean([sum(r["bytes_read"] for r in f["records"]) for f in fs])),
            "link_bytes_down": sum(ls["bytes_down"] for ls in lks),
            "behind_hist": hist, "behind_mean": float(np.mean(behind)) if behind else None,
            "not_joined_fraction": not_joined / max(1, len(grid) * len(fs)),
            "failures_recovered": sum(r["failures"] for f in fs for r in f["records"]),
            "failures": sum(f["failures"] for f in fs),
            "faults_injected": sum(ls["resets"] + ls["stalls"] for ls in lks),
            "requests": sum(ls["requests"] for ls in lks),
            "final_versions": [f["records"][-1]["to_version"] if f["records"] else None for f in fs],
        }
    return out


# --- report --------------------------------------------------------------------------------------------

def fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.1f}x"


def print_table(name: str, note: str, res: dict) -> None:
    p, f = res["pulse"], res["full"]
    print(f"\n### {name}: {note}")
    print(f"trainer idle (steady state): PULSE {100 * p['trainer_idle_fraction']:.1f}% vs full "
          f"{100 * f['trainer_idle_fraction']:.1f}%; with the first step's pipeline fill "
          f"{100 * p['trainer_idle_fraction_incl_fill']:.1f}% vs {100 * f['trainer_idle_fraction_incl_fill']:.1f}% "
          f"(batches taken {p['batches_taken']} / {f['batches_taken']}, stale dropped {p['batches_stale']} / "
          f"{f['batches_stale']}); generating worker per batch: sync {fmt(p['generator_cycle_sync_s_mean'])} / "
          f"{fmt(f['generator_cycle_sync_s_mean'])} s, upload {fmt(p['generator_cycle_upload_s_mean'])} / "
          f"{fmt(f['generator_cycle_upload_s_mean'])} s, generate {p['gen_s']:g} s; shaping: {p['shaping']}; "
          f"load average {p['load_average']:.1f} / {f['load_average']:.1f}")
    head = ("class", "n", "cold join s P/F", "sync p50 s P/F", "sync p95 s P/F", "p95 full/PULSE",
            "verified p95 s P/F", "verified p95 full/PULSE", "sync CPU s P/F",
            "MB/follower P/F", "behind mean P/F", "behind hist PULSE", "behind hist full", "fail rec P/F", "faults P/F")
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for cls in p["classes"]:
        a, b = p["classes"][cls], f["classes"].get(cls)
        if b is None:
            continue
        print(" | ".join([
            cls, str(a["followers"]), f"{fmt(a['cold_join_s_median'], 1)} / {fmt(b['cold_join_s_median'], 1)}",
            f"{fmt(a['sync_s_p50'])} / {fmt(b['sync_s_p50'])}", f"{fmt(a['sync_s_p95'])} / {fmt(b['sync_s_p95'])}",
            ratio(b["sync_s_p95"], a["sync_s_p95"]), f"{fmt(a['verified_s_p95'])} / {fmt(b['verified_s_p95'])}",
            ratio(b["verified_s_p95"], a["verified_s_p95"]),
            f"{fmt(a['sync_cpu_s_mean'])} / {fmt(b['sync_cpu_s_mean'])}",
            f"{a['bytes_per_follower'] / 1e6:.1f} / {b['bytes_per_follower'] / 1e6:.1f}",
            f"{fmt(a['behind_mean'])} / {fmt(b['behind_mean'])}", json.dumps(a["behind_hist"]), json.dumps(b["behind_hist"]),
            f"{a['failures_recovered']} / {b['failures_recovered']}", f"{a['faults_injected']} / {b['faults_injected']}"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small model, few versions, 7 followers; < 1 min")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--params", type=float, default=110e6, help="synthetic model size (>= 100M for the report)")
    ap.add_argument("--versions", type=int, default=14, help="versions published per run")
    ap.add_argument("--rate", type=float, default=0.005, help="int8 code change rate of the synthetic steps")
    ap.add_argument("--anchor-every", type=int, default=10, help="PULSE runs: an anchor every K versions")
    ap.add_argument("--train-s", type=float, default=6.0, help="seconds per training step (emulated compute)")
    ap.add_argument("--gen-s", type=float, default=None, help="seconds to generate one batch (default: --train-s)")
    ap.add_argument("--batches-per-step", type=int, default=2)
    ap.add_argument("--batch-episodes", type=int, default=128)
    ap.add_argument("--batch-tokens", type=int, default=512)
    ap.add_argument("--max-staleness", type=int, default=3,
                    help="oldest batch version a step accepts: step - this (the trainer's default max_lag)")
    ap.add_argument("--max-wait-s", type=float, default=300, help="longest a step waits for batches")
    ap.add_argument("--poll-s", type=float, default=1.0, help="followers' poll interval when in sync")
    ap.add_argument("--grace-s", type=float, default=10.0, help="seconds after the last publish before stopping")
    ap.add_argument("--workloads", default="synthetic,tiny")
    ap.add_argument("--classes", default="", help="only these follower link classes (comma-separated)")
    ap.add_argument("--per-class", type=int, default=0, help="followers per class (default: the fleet's mix)")
    ap.add_argument("--check", choices=SYNC_CHECKS, default="background",
                    help="how followers check each synced state's signed hash: beside (as stoa worker does; "
                         "the sync seconds are until the weights are usable, the verified seconds until the hash "
                         "passed) or before writing (both the same)")
    ap.add_argument("--in-process", action="store_true",
                    help="followers as threads and links in this process (they then share one interpreter lock)")
    ap.add_argument("--keep-anchors", type=int, default=None,
                    help="publisher retention (default: keep everything; with anchors every version a count "
                         "window deletes anchors slow links are still downloading)")
    args = ap.parse_args(argv)
    if args.quick:
        args.params, args.versions, args.train_s, args.grace_s = 8e6, 5, 1.0, 2.0
        args.batch_episodes, args.poll_s, args.workloads = 32, 0.5, "synthetic"
    args.gen_s = args.train_s if args.gen_s is None else args.gen_s
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    t0 = time.perf_counter()
    results: dict = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                     "shaping": SHAPING, "workloads": {}}
    with SeaweedFS.start() as s3:
        bucket = s3.make_bucket("fleet-wan")
        for name in args.workloads.split(","):
            print(f"[{time.perf_counter() - t0:.0f}s] building the {name} workload", flush=True)
            if name == "synthetic":
                wl = synthetic_workload(args.params, args.versions, args.rate, args.train_s)
            elif name == "tiny":
                wl, real_step = tiny_workload(args.versions, args.train_s)
                wl.note += f", real step {real_step:.2f} s padded to {args.train_s:g} s"
            else:
                raise SystemExit(f"unknown workload {name!r}")
            results["workloads"][name] = {"note": wl.note, "params": wl.params,
                                          "state_bytes": sum(a.nbytes for a in wl.versions[0].values())}
            for mode in ("pulse", "full"):
                print(f"[{time.perf_counter() - t0:.0f}s] {name} / {mode}", flush=True)
                results["workloads"][name][mode] = run_mode(wl, mode, s3, bucket, args)
            print_table(name, wl.note, results["workloads"][name])
            del wl
    syn = results["workloads"].get("synthetic")
    if syn and MAIN_CLASS in syn["pulse"]["classes"]:
        p, f = syn["pulse"]["classes"][MAIN_CLASS], syn["full"]["classes"][MAIN_CLASS]
        results.update(
            sync_seconds_p95_pulse=p["sync_s_p95"], sync_seconds_p95_full=f["sync_s_p95"],
            sync_seconds_p50_pulse=p["sync_s_p50"], sync_seconds_p50_full=f["sync_s_p50"],
            sync_p95_ratio_full_over_pulse=(f["sync_s_p95"] / p["sync_s_p95"]
                                            if p["sync_s_p95"] and f["sync_s_p95"] else None),
            verified_seconds_p95_pulse=p["verified_s_p95"], verified_seconds_p95_full=f["verified_s_p95"],
            check=args.check,
            cold_join_seconds_pulse=p["cold_join_s_median"], cold_join_seconds_full=f["cold_join_s_median"],
            trainer_idle_fraction_pulse=syn["pulse"]["trainer_idle_fraction"],
            trainer_idle_fraction_full=syn["full"]["trainer_idle_fraction"],
            main_class=MAIN_CLASS, params=syn["params"],
        )
        print(f"\n{MAIN_CLASS}, {syn['params'] / 1e6:.0f}M model, check {args.check}: p95 sync PULSE "
              f"{fmt(p['sync_s_p95'])} s vs full {fmt(f['sync_s_p95'])} s ({ratio(f['sync_s_p95'], p['sync_s_p95'])}); "
              f"p95 until verified {fmt(p['verified_s_p95'])} s vs {fmt(f['verified_s_p95'])} s "
              f"({ratio(f['verified_s_p95'], p['verified_s_p95'])}); trainer idle PULSE "
              f"{100 * results['trainer_idle_fraction_pulse']:.1f}% vs full {100 * results['trainer_idle_fraction_full']:.1f}%")
    print(f"Total {time.perf_counter() - t0:.0f} s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs.")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
