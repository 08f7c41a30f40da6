"""A worker against a failing or hostile store: it never dies of the store (backs off, retries,
says so), throttles closed when the progress document is missing or forged, keeps its identity
and weights across restarts, and answers a wrong run or a missing key with one clear line and
its documented exit status (docs/volunteer.md)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from helpers import random_episodes, tiny_fleet_config
from stoa.fleet.config import load_config
from stoa.fleet.run import publish_run
from stoa.fleet.worker import EXIT_NO_RUN, Worker
from stoa.transport.chain import WeightPublisher
from stoa.transport.exchange import Progress, RolloutWriter, write_progress
from stoa.transport.signing import generate_private_key
from stoa.transport.store import LocalStore, StoreError

RUN = "vol"


class FlakyStore:
    """A LocalStore that fails every call for a while once armed (as a store outage would)."""

    def __init__(self, inner: LocalStore):
        self.inner, self.failing, self.failures = inner, 0, 0
        self.arm_on_upload = 0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*a, **kw):
            if self.failing > 0:
                self.failing -= 1
                self.failures += 1
                raise StoreError(f"simulated outage on {name}")
            out = attr(*a, **kw)
            if name in ("put", "put_if_absent") and "/rollouts/" in a[0] and self.arm_on_upload:
                self.failing, self.arm_on_upload = self.arm_on_upload, 0
            return out

        return call

    def __str__(self) -> str:
        return str(self.inner)


def _publish_tiny_run(tmp_path, tiny_model, store, key):
    pytest.importorskip("mlx.core", reason="the worker's engine needs mlx")
    from stoa.backends.engine import make_engine

    cfg_path = tmp_path / "vol.toml"
    cfg_path.write_text(tiny_fleet_config(RUN, rollout={"max_outstanding": 0, "cohorts_per_version": 0}))
    cfg = load_config(cfg_path)
    publish_run(store, RUN, cfg, tiny_model, key)
    pub = WeightPublisher(store, RUN, key, anchor_every=50)
    state = {k: v.copy() for k, v in make_engine(tiny_model, "mlx").state.items()}
    pub.publish(1, state)
    return pub, state


def test_a_store_outage_never_ends_a_worker(tiny_model, tmp_path, caplog):
    """Attack / accident: the store fails 40 calls in a row mid-run (old code: the worker exited on
    the first failed read, or after 8 failed syncs)."""
    key = generate_private_key()
    store = FlakyStore(LocalStore(tmp_path / "store"))
    _publish_tiny_run(tmp_path, tiny_model, store.inner, key)
    w = Worker(store, RUN, key.public_key(), "w0", tmp_path / "cache", max_batches=3)
    w.backoff_base_s, w.backoff_max_s = 0.01, 0.05
    store.arm_on_upload = 40
    with caplog.at_level(logging.INFO, logger="stoa.worker"):
        assert w.run() == 0
    assert w.batches == 3 and store.failures == 40
    text = caplog.text
    assert "simulated outage" in text and "retrying in" in text and "store reachable again" in text


def test_progress_that_is_missing_or_forged_means_wait(tmp_path):
    """Attack: delete or forge progress.json. Old code counted "0 outstanding" and raced on."""
    store, key = LocalStore(tmp_path / "store"), generate_private_key()
    w = Worker(store, RUN, key.public_key(), "w0", tmp_path / "cache")
    writer = RolloutWriter(store, RUN, "w0")
    writer.next_seq = 5  # five batches uploaded
    assert w._outstanding(writer) == 5  # nothing known to be taken yet
    write_progress(store, RUN, Progress({"w0": 3}), key)
    assert w._outstanding(writer) == 2
    store.delete(f"{RUN}/progress.json")
    assert w._outstanding(writer) == 2  # missing: what was taken before, not "all taken"
    write_progress(store, RUN, Progress({"w0": 5}), generate_private_key())  # forged
    assert w._outstanding(writer) == 2
    write_progress(store, RUN, Progress({"w0": 1}), key)  # an older one, replayed
    assert w._outstanding(writer) == 2
    write_progress(store, RUN, Progress({"w0": 5}), key)
    assert w._outstanding(writer) == 0


def test_numbers_a_worker_left_never_hold_it_back(tmp_path):
    """A worker that leaves numbers without uploading (their binding expired while it loaded or
    slept) used to count them as outstanding forever: the trainer never settles a number nobody
    uploads, so after ``rollout.max_outstanding`` such gaps the worker waited for good (seen in the
    trust fleet: a late joiner left its first two numbers and never made a batch)."""
    from stoa.transport.sequence import RememberingWriter, SequenceFile, write_floors

    store, key = LocalStore(tmp_path / "store"), generate_private_key()
    w = Worker(store, RUN, key.public_key(), "w0", tmp_path / "cache")
    me = generate_private_key()
    remember = SequenceFile(tmp_path / "cache" / "sequence.json")
    writer = RememberingWriter(store, RUN, "w0", me, remember)
    writer.skip_to(2, left=True)  # numbers 0 and 1 given up
    assert writer.left == 2 and w._outstanding(writer) == 0
    batch = random_episodes(4, 50)
    for e in batch:
        e.worker_id, e.policy_version = "w0", 0
    writer.upload(batch, 0, seq=writer.next_seq)  # number 2
    assert w._outstanding(writer) == 1
    write_progress(store, RUN, Progress({"w0": 1}), key)
    assert w._outstanding(writer) == 0

    again = RememberingWriter(store, RUN, "w0", me, remember)  # a restart keeps the count
    assert (again.next_seq, again.left) == (3, 2) and w._outstanding(again) == 0
    writer.skip_to(5)  # a number planted ahead (skip_taken) is not a gap of ours
    assert writer.left == 2

    # A lost cache: the worker jumps to the trainer's floor, and the numbers below it that the
    # trainer never settled (the gaps of the life it forgot) stop counting.
    write_floors(store, RUN, {"w1": 9}, key)
    write_progress(store, RUN, Progress({"w0": 1, "w1": 6}), key)
    w1 = Worker(store, RUN, key.public_key(), "w1", tmp_path / "cache1")
    w1.writer = RememberingWriter(store, RUN, "w1", me, SequenceFile(tmp_path / "cache1" / "sequence.json"))
    assert w1._outstanding(w1.writer) == 0
    w1._heed_roster()
    assert w1.writer.next_seq == 9 and w1._outstanding(w1.writer) == 0


def _stoa(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "stoa", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_a_wrong_run_names_the_runs_found_and_a_missing_key_fails_at_once(tmp_path, tiny_model):
    key = generate_private_key()
    store = LocalStore(tmp_path / "store")
    cfg_path = tmp_path / "vol.toml"
    cfg_path.write_text(tiny_fleet_config(RUN))
    publish_run(store, RUN, load_config(cfg_path), tiny_model, key)
    pub = key.public_key().public_bytes_raw().hex()
    r = _stoa("worker", "--store", str(tmp_path / "store"), "--run", "vlo", "--public-key", pub,
              "--cache", str(tmp_path / "c"))
    assert r.returncode == EXIT_NO_RUN and "no run 'vlo'" in r.stderr and "runs found there: vol" in r.stderr
    assert "Traceback" not in r.stderr
    r = _stoa("worker", "--store", str(tmp_path / "store"), "--run", RUN, "--public-key", str(tmp_path / "run.pub"))
    assert r.returncode == 2 and "cannot be read" in r.stderr and "Traceback" not in r.stderr
    r = _stoa("worker", "--store", str(tmp_path / "store"), "--run", RUN, "--public-key", pub,
              "--key", str(tmp_path / "nope.key"))
    assert r.returncode == 2 and "no key file" in r.stderr


def test_the_worker_path_imports_no_trainer_framework(tmp_path, tiny_model):
    """`stoa[worker]` ships without torch, megatron, tensorboard and matplotlib: a whole worker
    session (join, generate, upload) with those imports blocked."""
    pytest.importorskip("mlx.core", reason="the worker's engine needs mlx")
    key = generate_private_key()
    store = LocalStore(tmp_path / "store")
    _publish_tiny_run(tmp_path, tiny_model, store, key)
    code = f"""
import sys
for name in ("torch", "megatron", "tensorboard", "matplotlib"):
    sys.modules[name] = None  # import raises ImportError; importlib.util.find_spec says absent
from stoa.cli import main
sys.argv = ["stoa", "worker", "--store", {str(tmp_path / 'store')!r}, "--run", {RUN!r}, "--public-key",
            {key.public_key().public_bytes_raw().hex()!r}, "--cache", {str(tmp_path / 'cache')!r}, "--max-batches", "1"]
main()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1 batches" in r.stderr and store.list(f"{RUN}/rollouts/")
    assert "blocked" not in r.stderr


def test_a_store_never_reached_ends_a_starting_worker_with_status_5(tmp_path, caplog):
    from stoa.fleet.worker import EXIT_UNREACHABLE

    key = generate_private_key()
    store = FlakyStore(LocalStore(tmp_path / "store"))
    store.failing = 10**9
    w = Worker(store, RUN, key.public_key(), "w0", tmp_path / "cache", wait_seconds=0.3)
    w.backoff_base_s, w.backoff_max_s = 0.01, 0.05
    with caplog.at_level(logging.INFO, logger="stoa.worker"):
        assert w.run() == EXIT_UNREACHABLE
    assert "cannot reach the store" in caplog.text and "credentials" in caplog.text


def test_ctrl_c_finishes_the_upload_and_says_what_it_did(tmp_path, tiny_model):
    import signal
    import time

    key = generate_private_key()
    store = LocalStore(tmp_path / "store")
    _publish_tiny_run(tmp_path, tiny_model, store, key)
    p = subprocess.Popen([sys.executable, "-m", "stoa", "worker", "--store", str(tmp_path / "store"), "--run", RUN,
                          "--public-key", key.public_key().public_bytes_raw().hex(), "--cache", str(tmp_path / "c")],
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not store.list(f"{RUN}/rollouts/") and time.time() < deadline and p.poll() is None:
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-2000:]
    assert "Ctrl-C again to stop at once" in err and "stopped by a signal:" in err
    assert "kept in" in err and (tmp_path / "c" / "weights.safetensors").exists()


def test_a_key_restarted_under_another_id_is_told_which_id_is_its_own(tmp_path, tiny_model, caplog):
    """An honest worker restarted with its own key under a new --id used to be refused batch by
    batch with no signal to it; now it stops at once, naming the id the roster binds its key to."""
    from stoa.fleet.worker import EXIT_CONFIG
    from stoa.transport.identity import enroll_worker

    key, mine, other, fresh = (generate_private_key() for _ in range(4))
    store = LocalStore(tmp_path / "store")
    _publish_tiny_run(tmp_path, tiny_model, store, key)
    enroll_worker(store, RUN, key, mine, "alice")  # what its first accepted batch does in an open run
    enroll_worker(store, RUN, key, other, "bob")
    for wid, k in (("alice-2", mine), ("bob", fresh)):
        w = Worker(store, RUN, key.public_key(), wid, tmp_path / f"cache-{wid}", private_key=k, wait_seconds=5)
        with caplog.at_level(logging.INFO, logger="stoa.worker"):
            assert w.run() == EXIT_CONFIG
        assert not store.list(f"{RUN}/rollouts/")  # nothing uploaded that the trainer would refuse
    assert "is bound to worker id 'alice'" in caplog.text and "--id alice" in caplog.text
    assert "worker id 'bob' belongs to another key" in caplog.text


def test_a_worker_with_its_salt_makes_each_number_under_the_version_bound_to_it(tmp_path, tiny_model):
    """Version rerolls: a worker holding several versions made its batch under the one it liked,
    and its items did not depend on the version. Now a worker with its salt tickets each number,
    waits for the trainer's binding, and makes the number with exactly the bound version (here
    older than the head it joined at) and the items the binding's beacon names."""
    import threading

    from stoa.fleet.trust.assign import assignment
    from stoa.fleet.trust.binding import Binder
    from stoa.transport.exchange import RolloutReader
    from stoa.transport.identity import assignment_salt, enroll_worker

    key, wkey = generate_private_key(), generate_private_key()
    store = LocalStore(tmp_path / "store")
    pub, state = _publish_tiny_run(tmp_path, tiny_model, store, key)
    for v in (2, 3):
        pub.publish(v, state)
    enroll_worker(store, RUN, key, wkey.public_key(), "w0")  # enrolled: its salt is published, no probation
    binder, stop = Binder(store, RUN, key), threading.Event()

    def trainer() -> None:  # the trainer's polls: every new ticket is bound to version 2
        while not stop.is_set():
            listing = binder.listing()
            binder.poll(2, listing.keys(), listing=listing)
            stop.wait(0.05)

    polls = threading.Thread(target=trainer, daemon=True)
    polls.start()
    try:
        w = Worker(store, RUN, key.public_key(), "w0", tmp_path / "cache", max_batches=2, private_key=wkey)
        assert w.run() == 0 and w.batches == 2
    finally:
        stop.set()
        polls.join()
    cfg = load_config(tmp_path / "vol.toml")
    batches = RolloutReader(store, RUN, vocab_size=10**6).poll()
    assert sorted((b.seq, b.version) for b in batches) == [(0, 2), (1, 2)]
    n_items = len(cfg.env.make(cfg.env.train_split).unwrapped)
    for b in batches:
        bound = binder.bound_to(w.key_id, b.seq)
        want = assignment(cfg.seed, w.key_id, b.seq, n_items, cfg.rollout.groups_per_cohort,
                          assignment_salt(key, RUN, w.key_id), bound.beacon)
        assert {(e.group_id, e.item_index) for e in b.episodes} == set(zip(want.group_ids, want.items))
        assert {e.policy_version for e in b.episodes} == {2}
