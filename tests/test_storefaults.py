"""S3Store against a real S3 server (SeaweedFS) through the fault proxy (stoa.testing.storefaults):
every kind of store fault costs retries, never a wrong answer, and each one is counted."""

from __future__ import annotations

import os
import uuid
from urllib.parse import urlparse

import pytest

from stoa.testing.storefaults import FaultProxy, FaultRates
from stoa.transport.store import KeyNotFound, S3Config, S3Store

from conftest import S3_ENDPOINT

pytestmark = pytest.mark.s3

CONFIG = S3Config(read_timeout_s=1.0, max_attempts=4, multipart_threshold=5 << 20, part_size=5 << 20,
                  download_part_size=256 << 10)


@pytest.fixture
def proxy():
    if not S3_ENDPOINT:
        pytest.skip("no S3 server: STOA_TEST_S3_ENDPOINT is unset (scripts/test.sh starts SeaweedFS and sets it)")
    u = urlparse(S3_ENDPOINT)
    with FaultProxy((u.hostname, u.port), seed=7) as p:
        yield p


def _store(proxy: FaultProxy, bucket: str, config: S3Config = CONFIG) -> S3Store:
    return S3Store(bucket, f"f-{uuid.uuid4().hex[:12]}", endpoint_url=proxy.endpoint, config=config)


def test_a_missing_object_whose_error_answer_breaks_is_still_missing(proxy, s3_bucket):
    # botocore reads a GET's 404 body outside its retry layer; a reset inside it must cost a
    # retry, not turn "no such object" into a store failure.
    store = _store(proxy, s3_bucket)
    proxy.inject("reset", lambda r: r.method == "GET")
    with pytest.raises(KeyNotFound):
        store.get("absent.json")
    assert proxy.injected["reset"] == 1 and store.stats["retries"] == 1, store.stats


@pytest.mark.parametrize("kind", ["error-500", "slowdown-503", "timeout", "reset"])
def test_each_fault_on_each_operation_costs_one_retry(proxy, s3_bucket, kind):
    store = _store(proxy, s3_bucket)
    data = os.urandom(600 << 10)  # three ranged GETs of 256 KiB: a reset lands mid-body
    ops = [("put_if_absent", lambda: store.put_if_absent("a", data), True),
           ("put", lambda: store.put("b", data), None),
           ("get", lambda: store.get("a"), data),
           ("size", lambda: store.size("b"), len(data)),
           ("list", lambda: store.list(""), ["a", "b"]),
           ("put_if_absent taken", lambda: store.put_if_absent("a", b"other"), False),
           ("delete", lambda: store.delete("b"), None)]
    for name, op, want in ops:
        before = store.stats
        proxy.inject(kind)
        assert op() == want, name
        after = store.stats
        assert after["retries"] + after["resumed_reads"] > before["retries"] + before["resumed_reads"], (name, after)
        assert after["errors"] == 0, (name, after)
    assert proxy.injected[kind] == len(ops)
    assert not store.exists("b") and store.get("a") == data


def test_slow_answers_are_waited_for(proxy, s3_bucket):
    store = _store(proxy, s3_bucket)
    proxy.set_rates(FaultRates(slow=1.0, slow_s=0.3))  # under the 1 s read timeout: no retry
    store.put("a", b"x")
    assert store.get("a") == b"x" and store.stats["retries"] == 0
    assert proxy.injected["slow"] == store.stats["requests"] >= 2


def test_a_stalled_multipart_upload_is_retried_part_by_part(proxy, s3_bucket):
    store = _store(proxy, s3_bucket)
    data = os.urandom(11 << 20)  # three parts of at most 5 MiB
    proxy.set_rates(FaultRates(hold_s=2.0))  # the stall outlasts the 1 s read timeout
    proxy.inject("multipart-stall", lambda r: r.is_upload_part)
    assert store.put_if_absent("big", data)
    assert proxy.injected["multipart-stall"] == 1 and store.stats["retries"] >= 1, store.stats
    assert store.get("big") == data


def test_a_conditional_multipart_upload_whose_completion_answer_is_lost_still_succeeds(proxy, s3_bucket):
    # The server completes the upload; the client times out and asks again: the object is ours.
    store = _store(proxy, s3_bucket)
    data = os.urandom(6 << 20)
    proxy.set_rates(FaultRates(hold_s=2.0))
    proxy.inject("timeout", lambda r: r.method == "POST" and "uploadId=" in r.target)
    assert store.put_if_absent("big", data) is True
    assert store.get("big") == data and proxy.injected["timeout"] == 1


def test_faults_at_seeded_rates_leave_every_answer_right(proxy, s3_bucket):
    store = _store(proxy, s3_bucket, S3Config(read_timeout_s=1.0, max_attempts=8, download_part_size=64 << 10))
    proxy.set_rates(FaultRates(error_500=0.05, slowdown_503=0.05, timeout=0.02, reset=0.1, slow=0.05,
                               hold_s=1.5, slow_s=0.1))
    blobs = {f"k{i}": os.urandom(100_000 + i) for i in range(12)}
    for k, v in blobs.items():
        assert store.put_if_absent(k, v)
    assert store.list("") == sorted(blobs)
    for k, v in blobs.items():
        assert store.get(k) == v
    hit = sum(proxy.injected.values())
    assert hit >= 5 and store.stats["errors"] == 0, (proxy.injected, store.stats)
    assert len(proxy.events) == hit
