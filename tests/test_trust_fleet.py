"""Untrusted workers in a real fleet: 2 honest workers and one of every adversary kind, at once.

Real processes (`stoa trainer`, `stoa worker`, `stoa worker --adversary KIND`) meet in a real
store with an enrolled roster. What must hold: no adversary's episode is trained on (except a
colder sampler's batches whose every token the honest rule also draws), each is banned (or,
unenrolled, has every batch refused) by its first confirmed forgery or its second rejected batch,
with the reason in the quarantine and in its record, and the honest workers lose nothing to the
checks. The test stops the run (SIGTERM) once every adversary has met its fate and
12 steps are trained. One shared run keeps this under ~2 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from stoa.fleet.config import load_config
from stoa.fleet.metrics import read_metrics
from stoa.fleet.trust.binding import TICKETS_AHEAD, read_bindings
from stoa.testing.adversaries import KINDS, Selective
from stoa.transport.exchange import parse_rollout_key
from stoa.transport.identity import enroll_worker, list_bans, load_or_create_worker_key
from stoa.transport.signing import generate_private_key, key_id, load_private_key, save_keypair
from stoa.transport.store import KeyNotFound, LocalStore
from stoa.types import Episode, Segment

from helpers import tiny_fleet_config

pytestmark = pytest.mark.slow

BAN_AFTER = 2
"""``trust.ban_after``: every adversary that is banned is banned by its first confirmed forgery or
its second rejected batch (in the poll that judged it), whatever the versions between them (a
copier uploads only once it finds a fresh batch of another worker to copy, and on a quiet machine
the trainer makes several versions a second meanwhile); every later batch of its key is refused
unread."""

CONFIG = tiny_fleet_config(
    "trust", warmstart={"mix": {"oracle": 0.5, "guess": 0.5}, "practice_answer_only": 0},
    trainer={"steps": 5000, "checkpoint_every": 4, "skip_zero_variance_groups": False},
    learner={"lr": 1e-5}, pulse={"anchor_every": 50},
    trust={"mode": "enrolled", "max_worker_share": 0.5, "ban_after": BAN_AFTER})

MIN_STEPS = 12
"""The run is stopped (SIGTERM: checkpoint, report) once it has trained this many steps and every
adversary has met its fate; its 5,000 steps are only a cap (the test stops it within a minute or two).
The tiny model's steps take a fraction of a second, so a quiet machine's honest workers can carry
the trainer through 100 steps while the last adversaries are still loading; a copier uploads only
once it finds a fresh batch to copy, so a fixed run length could end between its first strike and
its ban."""

NEEDLES = {
    "flip-rewards": "reward: claimed 1.0",
    "forge-metrics": "claimed True, replay gives False",  # a declared bool metric forged
    "zero-logprobs": "do not match their log mu",
    "shuffle-logprobs": "do not match their log mu",
    "other-model": "do not match their log mu",
    "forge-observations": "observation differs",
    "copy": "not the assigned work",
    "framer": "not the assigned work",
    "copy-variant": "sampling rule does not draw",
    "cold-sampler": "sampling rule does not draw",
    "selective": "",  # genuine episodes, none refused: its gaps are counted and flagged instead
    "unenrolled": "not enrolled",
}


def _check_cold_sampler(store: LocalStore, run: str, run_key, kid: str, ledger: list[dict], seen: dict[str, bytes],
                        cache: Path) -> None:
    """A batch sampled colder can still hold only tokens the honest rule also draws: that is an
    honest batch and may be trained on, and the first one off the rule bans. How often that
    happens is the tiny model's statistics, not the check's (a quiet machine's trainer is many
    versions on when the late adversaries join, and the more peaked that policy, the more a
    0.7 T sampler's tokens coincide with the rule's). So: every episode of each trained group is
    re-derived here, token by token, from the batch as the store held it, and each trained group
    came before the sampler's first batch off the rule (re-derived too) and was trained before it
    was judged."""
    judged = [i for i, e in enumerate(ledger) if e.get("category") == "sampling"
              and "/rollouts/adv-cold-sampler/" in e.get("rejected", "")]
    assert judged, "the cold sampler has no batch refused by the sampling check"
    off, first_off = min([judged[0]] + [i for i, e in enumerate(ledger) if e.get("banned") == kid]), ledger[judged[0]]["rejected"]
    trained = {g.split("/", 1)[1]: i for i, e in enumerate(ledger) for g in e.get("trained", []) if g.startswith(kid + "/")}
    number = {k: parsed[1] for k in seen if (parsed := parse_rollout_key(run, k)) is not None}
    quarantined = first_off.replace("/rollouts/", "/quarantine/", 1)
    blobs = {k: b for k, b in seen.items() if k in number and any(g.startswith(f"{kid[:16]}-s{number[k]}-g") for g in trained)}
    band, got = _rederive(store, run, run_key, {**blobs, quarantined: store.get(quarantined)}, cache)
    eps, margins = got.pop(quarantined)
    assert any((m < -band).any() for m in margins), (first_off, [float(m.min()) for m in margins if m.size])
    checked = set()
    for k, (eps, margins) in got.items():
        assert number[k] < parse_rollout_key(run, first_off)[1], (k, first_off)
        for e, m in zip(eps, margins):
            if e.group_id in trained:
                assert (m >= -band).all(), (k, e.group_id, e.sample_index, float(m.min()))
                checked.add(e.group_id)
    assert checked == set(trained), ("trained cold groups whose batch the test never saw", set(trained) - checked)
    assert all(i < off for i in trained.values()), (trained, off)
    print(f"cold sampler: {len(trained)} groups trained, every token the rule's draw; first off the rule: {first_off}")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def _trained(run_dir) -> tuple[int, float]:
    """Optimizer steps so far, and the banned-worker count of the newest step's metrics."""
    train = [row for row in read_metrics(run_dir / "metrics.jsonl") if row["kind"] == "train"]
    return len(train), (train[-1]["trust/banned_workers"] if train else 0)


def _withheld(store, run: str, kid: str) -> int:
    """The selective worker's withheld count in the trainer's newest trust report (0 before one)."""
    try:
        report = json.loads(json.loads(store.get(f"{run}/trust.json"))["body"])
    except KeyNotFound:
        return 0
    return int(report["workers"].get(kid, {}).get("withheld", 0))


class Watch(threading.Thread):
    """What the store shows during the run, read every 50 ms (the trainer deletes the batches it
    has consumed at each checkpoint, and its bindings document holds only live bindings):
    ``cold``, every batch the cold sampler uploaded (object key -> bytes), to re-derive afterwards;
    per honest worker, ``bound`` (number -> the version the trainer's signed bindings bound it to)
    and ``uploaded`` (the numbers whose object was seen)."""

    def __init__(self, store: LocalStore, run: str, pub, honest: dict[str, str]):
        super().__init__(daemon=True)
        self.store, self.name, self.pub, self.honest = store, run, pub, honest  # worker id -> key id
        self.cold: dict[str, bytes] = {}
        self.bound: dict[str, dict[int, int]] = {w: {} for w in honest}
        self.uploaded: dict[str, set[int]] = {w: set() for w in honest}
        self.stop = threading.Event()
        self.ticks, self.trouble = 0, ""

    def run(self) -> None:
        while not self.stop.wait(0.05):
            try:
                self._tick()
                self.ticks += 1
            except Exception as e:  # a document replaced while read: the next tick reads it
                self.trouble = f"{type(e).__name__}: {e}"

    def _tick(self) -> None:
        for k in self.store.list(f"{self.name}/rollouts/adv-cold-sampler/"):
            if k not in self.cold:
                try:
                    self.cold[k] = self.store.get(k)
                except KeyNotFound:
                    pass
        for w in self.honest:
            self.uploaded[w] |= {p[1] for p in (parse_rollout_key(self.name, k)
                                                for k in self.store.list(f"{self.name}/rollouts/{w}/")) if p}
        bound, _ = read_bindings(self.store, self.name, self.pub)
        for w, kid in self.honest.items():
            for seq, b in bound.get(kid, {}).items():
                self.bound[w].setdefault(seq, b.version)

    def left_stale(self, w: str, max_seq: int, max_lag: int) -> int:
        """Numbers up to ``max_seq`` of honest worker ``w`` that no object ever held and that the
        trainer's bindings show went stale before the worker got to them: a worker that leaves
        number n tickets the next numbers as it moves past it (``TICKETS_AHEAD``), and the trainer
        binds those to its version then, more than ``max_lag`` past n's."""
        bound = self.bound[w]
        return sum(1 for n, v in bound.items() if n <= max_seq and n not in self.uploaded[w]
                   and any(bound.get(m, -1) > v + max_lag for m in range(n + 1, n + 1 + TICKETS_AHEAD)))


def _rederive(store: LocalStore, run: str, run_key, blobs: dict[str, bytes], cache: Path):
    """Per batch blob: its episodes and each one's sampling margins, re-derived here from the
    assigned seed (recomputed from the run key, the batch's key and number, and the version its
    number was bound to) under its version's int8 weights from the weight chain."""
    from stoa.backends.engine import make_engine
    from stoa.fleet.run import fetch_run
    from stoa.fleet.trust.assign import assignment
    from stoa.fleet.trust.binding import beacon
    from stoa.transport.chain import WeightSubscriber
    from stoa.transport.identity import assignment_salt, open_sealed
    from stoa.types import decode_episodes

    cfg, model_dir = fetch_run(store, run, run_key.public_key(), cache)  # the run's own config and model
    n_items = len(cfg.env.make(cfg.env.train_split).unwrapped)
    sub, out = WeightSubscriber(store, run, run_key.public_key()), {}
    for where, blob in blobs.items():
        seal, payload = open_sealed(blob)
        eps = decode_episodes(payload)
        work = assignment(cfg.seed, seal.key_id, seal.seq, n_items, cfg.rollout.groups_per_cohort,
                          assignment_salt(run_key, run, seal.key_id), beacon(run_key, run, seal.key_id, seal.seq, seal.version))
        assert sorted((e.group_id, e.item_index) for e in eps) == sorted(
            (g, i) for g, i in zip(work.group_ids, work.items) for _ in range(cfg.rollout.group_size)), (where, work)
        weights = sub.sync(None, version=seal.version)
        assert weights.version == seal.version, where
        engine = make_engine(model_dir, cfg.rollout.engine, state=dict(weights.state), version=seal.version,
                             mode=cfg.rollout.engine_mode, config=cfg.rollout.engine_config(cfg.model.prompt_format),
                             worker_id="test")
        out[where] = (eps, engine.sampling_margins(eps, [work.seed] * len(eps), drift=cfg.trust.audit.sampling_band / 2))
    return cfg.trust.audit.sampling_band, out


def test_the_selective_worker_withholds_by_taste_but_never_goes_silent(tmp_path):
    """Successes are withheld, and every other batch without one, but never more than
    ``max_in_a_row`` in a row: its gaps always show (a gap is seen only when a later number of
    the same key arrives), however fast the policy learns to solve every batch. Its withheld
    numbers are left (not waited on as outstanding), so it never stalls itself. No timing."""
    from stoa.transport.sequence import RememberingWriter, SequenceFile

    writer = RememberingWriter(LocalStore(tmp_path / "store"), "trust", "adv-selective", generate_private_key(),
                               SequenceFile(tmp_path / "sequence.json"))
    adv = Selective(SimpleNamespace(), SimpleNamespace(worker_id="adv-selective", writer=writer))

    def batch(solved: bool) -> list[Episode]:
        turn = [Segment("model", np.array([3], np.int32), np.zeros(1, np.float32))]
        return [Episode(np.array([1, 2], np.int32), turn, reward=float(solved), metrics={"em": solved},
                        env_id="stoa/SyntheticSearch-v0", group_id="0", sample_index=i) for i in range(2)]

    def upload(pattern: str) -> str:  # "s" solved, "u" unsolved -> "U" uploaded, "." withheld
        out = ""
        for c in pattern:
            seq = writer.next_seq
            kept = adv.forge(batch(c == "s"))
            assert writer.next_seq == seq + (not kept)  # a withheld batch's number is spent
            if kept:
                writer.next_seq += 1  # the worker uploads it under its number
            out += "U" if kept else "."
        return out

    assert upload("uuuu") == ".U.U"  # every other batch without a success
    assert upload("ssssssss") == "...U...U"  # successes: withheld, but at most 3 in a row
    assert upload("sssuuu") == "...UU."  # the 5th without a success uploaded, forced; the 7th withheld
    assert adv.withheld == 12 and writer.next_seq == 18 and writer.left == 12


def test_two_honest_workers_and_every_adversary(tmp_path):
    assert set(NEEDLES) == set(KINDS)
    config = tmp_path / "trust.toml"
    config.write_text(CONFIG)
    store_dir, run_dir, run = tmp_path / "store", tmp_path / "run", "trust"
    store = LocalStore(store_dir)
    run_key, run_pub = save_keypair(generate_private_key(), tmp_path / "keys", "run")
    workers = {"honest-0": None, "honest-1": None, **{f"adv-{k}": k for k in KINDS}}
    keys = {w: tmp_path / "keys" / f"{w}.key" for w in workers}
    for w, path in keys.items():
        load_or_create_worker_key(path)
    # One enrollment through the CLI, the rest through the library it wraps.
    r = subprocess.run([sys.executable, "-m", "stoa", "enroll", str(keys["honest-0"].with_suffix(".pub")), "--store",
                        str(store_dir), "--run", run, "--key", str(run_key), "--worker-id", "honest-0"],
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "enrolled honest-0" in r.stdout, r.stderr
    for w, kind in workers.items():
        if w != "honest-0" and kind != "unenrolled":
            enroll_worker(store, run, run_key, load_or_create_worker_key(keys[w]), w)

    kid_of = {w: key_id(load_or_create_worker_key(keys[w]).public_key()) for w in workers}
    procs: dict[str, subprocess.Popen] = {}
    watch = Watch(store, run, run_pub, {w: kid_of[w] for w in ("honest-0", "honest-1")})

    def spawn(name: str, args: list[str]) -> None:
        procs[name] = subprocess.Popen([sys.executable, "-m", "stoa", *args], env=_env(),
                                       stdout=open(tmp_path / f"{name}.log", "ab"), stderr=subprocess.STDOUT)

    try:
        spawn("trainer", ["trainer", str(config), "--store", str(store_dir), "--key", str(run_key),
                          "--run-dir", str(run_dir)])
        watch.start()
        for w, kind in workers.items():
            spawn(w, ["worker", "--store", str(store_dir), "--run", run, "--public-key", str(run_pub), "--id", w,
                      "--cache", str(tmp_path / "cache" / w), "--key", str(keys[w]),
                      *(["--adversary", kind] if kind else [])])
        must_ban = {kid_of[w] for w, kind in workers.items() if kind not in (None, "selective", "unenrolled")}
        deadline = time.monotonic() + 480
        waiting_for = "the trainer's first step"
        while procs["trainer"].poll() is None and time.monotonic() < deadline:
            steps, banned = _trained(run_dir)
            unenrolled = bool(store.list(f"{run}/quarantine/adv-unenrolled/"))
            unbanned = sorted(w for w, kind in workers.items() if kid_of[w] in must_ban - set(list_bans(store, run, run_pub)[0]))
            # A withheld batch shows only when a later one of the same worker arrives: wait for one
            # (the selective worker uploads at least one batch of every 4 it makes: one comes).
            withheld = _withheld(store, run, kid_of["adv-selective"])
            if steps >= MIN_STEPS and banned >= len(must_ban) and unenrolled and not unbanned and withheld:
                procs["trainer"].send_signal(signal.SIGTERM)
                break
            waiting_for = (f"{steps} steps of {MIN_STEPS}, {banned} banned in the metrics of {len(must_ban)}, "
                           f"unenrolled quarantined: {unenrolled}, ban documents missing for {unbanned}, "
                           f"batches withheld by the selective worker: {withheld}")
            time.sleep(1.0)
        assert procs["trainer"].wait(timeout=120) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        for w in ("honest-0", "honest-1"):
            procs[w].send_signal(signal.SIGTERM)  # a stopped run has no finished marker
            assert procs[w].wait(timeout=60) == 0
    finally:
        watch.stop.set()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    watch.join(timeout=30)
    assert watch.ticks > 0, watch.trouble

    stopped = [row for row in read_metrics(run_dir / "metrics.jsonl") if row.get("event") == "stopped"]
    assert stopped and stopped[-1]["rl_step"] >= MIN_STEPS, (
        f"the trainer was not stopped by the test; it was waiting for: {waiting_for}\n"
        + (tmp_path / "trainer.log").read_text()[-3000:])
    bans, _ = list_bans(store, run, run_pub)
    report = json.loads(json.loads(store.get(f"{run}/trust.json"))["body"])
    by_name = {rec["worker_id"]: (kid, rec) for kid, rec in report["workers"].items()}
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    trained_by_key: dict[str, int] = {}
    for entry in ledger:
        for g in entry.get("trained", []):
            trained_by_key[g.split("/")[0]] = trained_by_key.get(g.split("/")[0], 0) + 2  # group_size episodes
    assert len([e for e in ledger if "trained" in e]) == stopped[-1]["rl_step"]

    first_rejected: dict[str, int] = {}
    for w, kind in workers.items():
        if kind is None:
            continue
        kid = kid_of[w]
        _, rec = by_name[w]
        if kind == "selective":  # withholding can be counted, never proven: flagged, not banned
            assert rec["withheld"] > 0 and not rec["banned"], rec
            # Flagged once 8 numbers show a rate, where the fleet's range allows: with three keys in
            # good standing, an honest key's late gaps (15% on a loaded machine) widen the range past
            # any rate (docs/trust.md); the withholder's rate still stands above the honest ones.
            honest = [by_name[h][1]["withheld_rate"] for h in ("honest-0", "honest-1")]
            assert rec["withholding_flagged"] or rec["withheld_rate"] > max(honest) or rec["max_seq"] < 7, (rec, honest)
            assert rec["rejected_batches"] == 0, rec
            continue
        uploaded = json.loads(store.get(f"{run}/workers/{w}.json"))["episodes"]
        assert uploaded > 0, w
        if kind == "cold-sampler":
            _check_cold_sampler(store, run, load_private_key(run_key), kid, ledger, watch.cold, tmp_path / "probe")
        else:
            assert trained_by_key.get(kid, 0) <= 0.01 * uploaded, (w, trained_by_key.get(kid), uploaded)
        reasons = " | ".join(json.loads(store.get(k))["reason"] for k in store.list(f"{run}/quarantine/{w}/")
                             if k.endswith(".reason.json"))
        assert NEEDLES[kind] in reasons, (w, reasons[:2000])
        if kind == "unenrolled":
            assert rec["accepted_batches"] == 0 and set(rec["rejected"]) == {"refused"}, rec
            continue
        assert rec["banned"] and kid in bans, (w, rec)
        # Its batches judged and rejected, by the trainer's version then (one per poll): the ban
        # comes with the BAN_AFTER-th at the latest, so any judged after it were in the same poll
        # (reviewed together); every later batch of the key is refused unread.
        judged = sorted(e["version"] for e in ledger if "rejected" in e and f"/rollouts/{w}/" in e["rejected"]
                        and e["category"] not in ("refused", "banned"))
        assert judged and set(judged[BAN_AFTER - 1:]) <= {judged[min(len(judged), BAN_AFTER) - 1]}, (w, judged)
        first_rejected[w] = judged[0]
        assert NEEDLES[kind] in rec["banned"] or NEEDLES[kind] in rec["last_reason"], (w, rec)
        assert any(e.get("banned") == kid for e in ledger)
    for w in ("honest-0", "honest-1"):
        _, rec = by_name[w]
        assert rec["rejected_batches"] == 0 and not rec["banned"] and rec["accepted_batches"] >= 3, rec
        # An honest worker leaves no gap except a batch that came too late (an overloaded machine)
        # or a number whose binding went stale before the worker got to it, as the trainer's own
        # bindings show (not the count of numbers the worker says it left, which nothing bounds).
        stale = watch.left_stale(w, rec["max_seq"], load_config(config).trainer.max_lag)
        assert rec["withheld"] <= rec["late_batches"] + stale and not rec["withholding_flagged"], (rec, stale)
        assert trained_by_key.get(kid_of[w], 0) > 0

    # Every refusal took the one path: quarantined, a ledger line and an event row, with one category.
    reasons = [k for k in store.list(f"{run}/quarantine/") if k.endswith(".reason.json")]
    quarantined = {json.loads(store.get(k))["key"] for k in reasons if "/_tickets/" not in k}
    tickets = {json.loads(store.get(k))["key"] for k in reasons if "/_tickets/" in k}  # a banned key's, say
    assert tickets == {e["refused_ticket"] for e in ledger if "refused_ticket" in e}
    events = {r["batch"]: r["category"] for r in read_metrics(run_dir / "metrics.jsonl")
              if r["kind"] == "event" and r.get("event") == "rejected"}
    ledgered = {e["rejected"]: e["category"] for e in ledger if "rejected" in e}
    assert quarantined and quarantined == set(events) == set(ledgered), (quarantined ^ set(events), quarantined ^ set(ledgered))
    assert events == ledgered
    train = [row for row in read_metrics(run_dir / "metrics.jsonl") if row["kind"] == "train"]
    last = train[-1]
    assert last["trust/banned_workers"] == len(KINDS) - 2 and last["trust/rejected/refused"] >= 1
    assert all(0 < row["memory/peak_rss_gib"] < 64 for row in train)
    step_s = sum(row["time/step_s"] for row in train)
    check_s = (last["trust/replay_s"] + last["trust/audit_s"] + last["trust/spot_check_s"] + last["trust/sampling_s"]
               + last["trust/episode_check_s"])
    print(f"\ntrust checks {check_s:.2f} s vs {step_s:.2f} s of optimizer steps over {len(train)} steps "
          f"(ratio {(step_s + check_s) / step_s:.2f}); replayed {last['trust/episodes_replayed']:.0f}, checked "
          f"{last['trust/episodes_checked']:.0f} episodes; "
          f"{last['trust/sampled_tokens_checked']:.0f} sampled tokens re-derived, "
          f"{last['trust/sampled_tokens_ambiguous']:.0f} ambiguous")
    print("banned at version (first rejected batch at): " + ", ".join(
        f"{kind} v{bans[kid_of[w]].version} ({first_rejected[w]})"
        for w, kind in workers.items() if kid_of.get(w) in bans))
    r = subprocess.run([sys.executable, "-m", "stoa", "status", "--store", str(store_dir), "--run", run,
                        "--public-key", str(run_pub)], env={**_env(), "COLUMNS": "250"}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "trust (mode enrolled" in r.stdout and "adv-copy" in r.stdout, r.stdout + r.stderr
