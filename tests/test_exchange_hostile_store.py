"""The rollout exchange and the control files against a hostile or unlucky store: keys the reader
cannot address, stray names, oversized objects, a failing object, per-poll caps (the bounds in
docs/transport.md), and signed progress / finished / evaluation documents. Store-level cases run
on a LocalStore and a real S3 server."""

from __future__ import annotations

import json

import pytest

from stoa.transport.exchange import (
    PollLimits,
    Progress,
    RolloutReader,
    RolloutWriter,
    is_finished,
    mark_finished,
    read_progress,
    write_progress,
)
from stoa.transport.signing import SignatureError, generate_private_key, read_signed, sign_document
from stoa.transport.store import LocalStore, StoreError, validate_key
from stoa.types import Limits
from test_chain_hostile_store import CountingStore, plant
from test_exchange import RUN, episodes


@pytest.fixture(scope="module")
def key():
    return generate_private_key()


def odd_keys(store) -> list[str]:
    """Keys under rollouts/ that validate_key refuses but the store can hold."""
    base = f"{RUN}/rollouts/"
    keys = [base + f"w\x01{i}/s000000000000-v000000000001.episodes" for i in range(10)]  # control characters
    keys += [base + "back\\slash/s000000000000-v000000000001.episodes"]
    if isinstance(store, LocalStore):
        keys += [base + "/".join(["d" * 200] * 6) + "/x.episodes"]  # over 1024 bytes, through nested folders
    else:
        keys += [base, base + "w1/", base + "w1//s000000000000-v000000000001.episodes"]  # console folder markers
    return keys


# --------------------------------------------------------------------------------------------
# Names the reader cannot handle never stop a poll
# --------------------------------------------------------------------------------------------


def test_unaddressable_keys_are_skipped_and_reported_never_raised(store):
    for k in odd_keys(store):
        plant(store, k, b"junk")
    listed = store.list(f"{RUN}/rollouts/")
    bad = [k for k in listed if not _valid(k)]
    assert len(bad) >= 10  # the store really lists names its own API refuses
    normalized = [k for k in listed if _valid(k)]  # SeaweedFS turns // and \\ into /: valid junk
    honest = RolloutWriter(store, RUN, "w1").upload(episodes("w1", 1), 1)
    long_name = f"{RUN}/rollouts/w1/" + "/".join(["n" * 200] * 4)  # a valid key, but no batch name
    store.put(long_name, b"x")
    reader = RolloutReader(store, RUN, vocab_size=50)
    for first in (True, False):  # every poll skips them again, and still never raises
        got = reader.poll()
        assert [b.key for b in got] == ([honest] if first else [])
        rep = reader.last_report
        assert rep.skipped == len(bad) and 1 <= len(rep.skipped_examples) <= 8
        assert all(len(e) <= 125 and "\x01" not in e for e in rep.skipped_examples)
    assert reader.consumed == 1 and reader.quarantined == 1 + len(normalized) and not store.exists(long_name)
    assert [k for k in store.list(f"{RUN}/rollouts/") if _valid(k)] == [honest]
    dests = [k for k in store.list(f"{RUN}/quarantine/_misnamed/") if not k.endswith(".reason.json")]
    assert all(len(d.rpartition("/")[2]) == 32 for d in dests)  # a fixed-length hash, never the name
    why = {json.loads(store.get(d + ".reason.json"))["key"]: json.loads(store.get(d + ".reason.json")) for d in dests}
    assert "object name" in why[long_name]["reason"]
    assert reader.prune() == 0  # prune, too, passes over them


def _valid(k: str) -> bool:
    try:
        validate_key(k)
        return True
    except ValueError:
        return False


def test_an_oversized_object_is_quarantined_without_being_downloaded(tmp_path):
    inner = LocalStore(tmp_path)
    w = RolloutWriter(inner, RUN, "w")
    small = w.upload(episodes("w", 1, n=1), 1)
    big = w.upload(episodes("w", 1, n=64), 1)
    assert len(inner.get(big)) > 2 * len(inner.get(small))
    store = CountingStore(inner)
    reader = RolloutReader(store, RUN, limits=Limits(max_bytes=len(inner.get(small)) + 10))
    got = reader.poll()
    assert [b.key for b in got] == [small] and reader.quarantined == 1
    assert [k for k, _ in store.gets] == [small]  # the big one was never read
    why = json.loads(inner.get(f"{RUN}/quarantine/w/{big.rpartition('/')[2]}.reason.json"))
    assert "deleted unread" in why["reason"] and why["copied"] is False and not inner.exists(big)
    assert RolloutWriter(inner, RUN, "w").next_seq == 2  # the reason file keeps the numbering


class OneBadGet:
    """A store whose get fails (a StoreError) for one key until healed."""

    def __init__(self, inner, key):
        self.inner, self.key = inner, key

    def get(self, key, max_bytes=None):
        if key == self.key:
            raise StoreError(f"simulated failure reading {key}")
        return self.inner.get(key, max_bytes=max_bytes)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_store_error_on_one_object_leaves_it_for_the_next_poll(tmp_path):
    inner = LocalStore(tmp_path)
    keys = [RolloutWriter(inner, RUN, w).upload(episodes(w, 1), 1) for w in ("a", "b", "c")]
    flaky = OneBadGet(inner, keys[1])
    reader = RolloutReader(flaky, RUN)
    assert [b.key for b in reader.poll()] == [keys[0], keys[2]]
    assert "left for the next poll" in reader.last_report.problems[0]
    flaky.key = None
    assert [b.key for b in reader.poll()] == [keys[1]] and reader.poll() == []


# --------------------------------------------------------------------------------------------
# Per-poll caps: the memory a poll may cost (docs/transport.md, "Bounds")
# --------------------------------------------------------------------------------------------


def test_poll_takes_at_most_its_caps_and_delivers_everything_exactly_once(tmp_path):
    inner = LocalStore(tmp_path)
    w = RolloutWriter(inner, RUN, "w")
    keys = [w.upload(episodes("w", v, n=4, tag=v), v) for v in range(10)]
    size = max(len(inner.get(k)) for k in keys)
    store = CountingStore(inner)
    reader = RolloutReader(store, RUN, poll_limits=PollLimits(max_batches=3))
    got = reader.poll()
    assert len(got) == 3 and reader.last_report.deferred == 7 and len(store.gets) == 3
    store.gets.clear()
    got += reader.poll(max_bytes=1)  # the first object of a poll is always taken
    assert len(got) == 4 and len(store.gets) == 1
    store.gets.clear()
    got += reader.poll(max_bytes=2 * size, max_batches=100)
    assert len(store.gets) <= 3 and reader.last_report.bytes_read <= 2 * size + size
    while batch := reader.poll():
        got += batch
        assert reader.last_report.bytes_read <= max(PollLimits().max_bytes, Limits().max_bytes)
    assert [b.key for b in got] == keys and reader.consumed == 10
    with pytest.raises(ValueError):
        PollLimits(max_batches=0)


def test_a_flood_of_stray_names_is_cleaned_up_within_the_caps(tmp_path):
    store = LocalStore(tmp_path)
    for i in range(30):
        store.put(f"{RUN}/rollouts/junk{i}/notes.txt", b"x" * 100)
    honest = RolloutWriter(store, RUN, "w").upload(episodes("w", 1), 1)
    reader = RolloutReader(store, RUN, poll_limits=PollLimits(max_batches=8))
    assert [b.key for b in reader.poll()] == [honest]  # honest batches come first
    assert reader.last_report.quarantined == 8 and reader.last_report.deferred == 22  # junk has its own budget
    polls = 1
    while reader.last_report.deferred:
        reader.poll()
        polls += 1
        assert reader.last_report.quarantined <= 8
    assert polls == 4 and reader.quarantined == 30 and store.list(f"{RUN}/rollouts/") == [honest]


# --------------------------------------------------------------------------------------------
# Signed control files
# --------------------------------------------------------------------------------------------


def test_progress_is_signed_bounded_and_typed(store, key):
    w = RolloutWriter(store, RUN, "w1")
    for v in range(3):
        w.upload(episodes("w1", v), v)
    reader = RolloutReader(store, RUN)
    reader.poll(max_batches=2)
    assert read_progress(store, RUN, key.public_key()) is None
    write_progress(store, RUN, reader.progress(), key)
    p = read_progress(store, RUN, key.public_key())
    assert p.taken == {"w1": 2} and p.outstanding("w1", w.next_seq) == 1 and p.outstanding("new", 4) == 4

    # Unsigned, signed by another key, or copied from another run: refused, with a reason.
    store.put(f"{RUN}/progress.json", json.dumps({"workers": {"w1": {"done": 99, "extra": []}}}).encode())
    with pytest.raises(SignatureError, match="unsigned|not a signed envelope"):
        read_progress(store, RUN, key.public_key())
    write_progress(store, RUN, Progress({"w1": 99}), generate_private_key())
    with pytest.raises(SignatureError, match="not this run's key"):
        read_progress(store, RUN, key.public_key())
    write_progress(store, "runs/other", Progress({"w1": 99}), key)
    store.put(f"{RUN}/progress.json", store.get("runs/other/progress.json"))
    with pytest.raises(SignatureError, match="run"):
        read_progress(store, RUN, key.public_key())

    # Bounded: at most 4096 workers, those that matter most kept.
    many = Progress({f"w{i}": 1 for i in range(5000)} | {"big": 50})
    write_progress(store, RUN, many, key)
    p = read_progress(store, RUN, key.public_key())
    assert len(p.taken) == 4096 and p.taken["big"] == 50
    assert len(store.get(f"{RUN}/progress.json")) < 1 << 20


def test_progress_says_which_numbers_are_settled_within_its_bounds_and_old_documents_still_read(store, key):
    """Which of a worker's numbers are settled (its floor, the 4 highest above it): what a worker
    throttles on, so junk under its id that the trainer never settles holds it back not at all."""
    top = 10**12 - 1
    ids = [f"{i:04d}" + "x" * 60 for i in range(4096)]  # the longest ids, the largest numbers: the worst case
    many = Progress({w: top for w in ids}, 1.0, {w: (top - 9, (top - 4, top - 3, top - 2, top - 1)) for w in ids})
    write_progress(store, RUN, many, key)
    assert len(store.get(f"{RUN}/progress.json")) < 1 << 20
    p = read_progress(store, RUN, key.public_key())
    assert p.settled[ids[0]] == (top - 9, (top - 4, top - 3, top - 2, top - 1))

    reader = RolloutReader(store, RUN)
    reader._settle("w", 0)
    for n in (2, 5, 6, 7, 9):  # 1 held by junk nobody reads, 3, 4 and 8 uploaded, not read yet
        reader._settle("w", n)
    write_progress(store, RUN, reader.progress(), key)
    p = read_progress(store, RUN, key.public_key())
    assert p.settled["w"] == (1, (5, 6, 7, 9)) and p.taken["w"] == 6
    assert p.unsettled("w", [0, 3, 8, 10]) == [8, 10]  # 3 lies below a full list: read past
    assert p.unsettled("other", [0, 1]) == [0, 1]

    # A document of an older trainer (counts only) reads, without numbers; an older worker reads
    # only "taken" from a newer one (its parser ignores what it does not know).
    write_progress(store, RUN, Progress({"w": 3}), key)
    p = read_progress(store, RUN, key.public_key())
    assert p.settled is None and p.taken == {"w": 3}

    for bad in ({"w": [1, [5, 5]]}, {"w": [3, [2]]}, {"w": [0, [1, 2, 3, 4, 5]]}, {"w": [0]}, {"bad id!": [0, []]}):
        body = Progress({"w": 1}, 1.0).to_body(RUN) | {"settled": bad}
        store.put(f"{RUN}/progress.json", sign_document("progress", body, key))
        with pytest.raises(SignatureError, match="settled"):
            read_progress(store, RUN, key.public_key())


def test_finished_marker_counts_only_when_it_verifies(store, key):
    assert not is_finished(store, RUN, key.public_key())
    store.put(f"{RUN}/finished.json", b"{}")  # planted by anyone with write access
    assert not is_finished(store, RUN, key.public_key())
    mark_finished(store, RUN, generate_private_key(), version=3)
    assert not is_finished(store, RUN, key.public_key())
    mark_finished(store, "runs/other", key, version=3)
    store.put(f"{RUN}/finished.json", store.get("runs/other/finished.json"))  # genuine, for another run
    assert not is_finished(store, RUN, key.public_key())
    store.put(f"{RUN}/finished.json", b"x" * (2 << 20))
    assert not is_finished(store, RUN, key.public_key())
    mark_finished(store, RUN, key, version=3)
    assert is_finished(store, RUN, key.public_key())


def test_read_signed_refuses_a_genuine_document_replayed_elsewhere(store, key):
    """What an "evaluation done" check needs: v5's genuine result copied to v6 must not count."""
    def ev(v):
        return f"{RUN}/eval/v{v:012d}.json"

    store.put(ev(5), sign_document("eval", {"run": RUN, "version": 5, "metrics": {"pass@1": 0.5}}, key))
    body = read_signed(store, ev(5), "eval", key.public_key(), expect={"run": RUN, "version": 5})
    assert body["metrics"] == {"pass@1": 0.5}
    assert read_signed(store, ev(6), "eval", key.public_key()) is None
    store.put(ev(6), store.get(ev(5)))
    with pytest.raises(SignatureError, match="version=5"):
        read_signed(store, ev(6), "eval", key.public_key(), expect={"run": RUN, "version": 6})
    with pytest.raises(SignatureError, match="expected a 'run-finished'"):
        read_signed(store, ev(5), "run-finished", key.public_key())
    store.put(ev(7), b"{" * 100_000)  # deep nesting: refused, not a RecursionError
    with pytest.raises(SignatureError):
        read_signed(store, ev(7), "eval", key.public_key())
    with pytest.raises(SignatureError, match="over the 100-byte limit"):
        read_signed(store, ev(5), "eval", key.public_key(), max_bytes=100)


# --------------------------------------------------------------------------------------------
# Second pass: planted sequence numbers, decoded size per poll, copies under one key, heartbeats
# --------------------------------------------------------------------------------------------


def test_planted_sequence_numbers_cannot_stop_a_running_writer(tmp_path):
    """Attack: 1,100 objects planted under a running worker's name, at the numbers it would take
    next. Old code stepped one number per try and gave up after 1,000 ("no free sequence number")."""
    store = LocalStore(tmp_path)
    writer = RolloutWriter(store, RUN, "w", private_key=generate_private_key())
    writer.upload(episodes("w", 1), 1)
    for seq in range(1, 1101):
        store.put(f"{RUN}/rollouts/w/s{seq:012d}-v000000000001.episodes", b"planted")
    calls = CountingStore(store)
    writer.store = calls
    key = writer.upload(episodes("w", 1, tag=1), 1)
    assert key.endswith("s000000001101-v000000000001.episodes")
    assert len(calls.gets) <= 2  # one look at the taken number, not a read per planted object


def _bomb(worker: str, version: int, tokens: int, tag: int, n: int = 1) -> list:
    """A valid batch whose token arrays compress to almost nothing (all zeros)."""
    import numpy as np

    from stoa.types import Episode, Segment

    return [Episode(prompt_tokens=np.zeros(tokens, np.int32),
                    segments=[Segment("model", np.zeros(tokens, np.int32), np.zeros(tokens, np.float32))],
                    reward=0.0, policy_version=version, worker_id=worker, group_id=f"b{tag}", sample_index=i)
            for i in range(n)]


def test_a_poll_holds_at_most_its_decoded_budget(tmp_path):
    """Attack: small sealed uploads that decode to megabytes each. Old code bounded a poll by
    stored bytes only (22 KiB of them made one poll hold 366 MiB)."""
    store = LocalStore(tmp_path)
    writer = RolloutWriter(store, RUN, "m", private_key=generate_private_key())
    for i in range(12):
        writer.upload(_bomb("m", 1, 60_000, i), 1)  # 720 kB of int32 + float32 each
    stored = sum(store.size(k) for k in store.list(f"{RUN}/rollouts/"))
    budget = 2 << 20
    reader = RolloutReader(store, RUN, poll_limits=PollLimits(max_decoded_bytes=budget))
    got, polls = [], 0
    while polls < 20:
        batch = reader.poll()
        polls += 1
        held = sum(e.prompt_tokens.nbytes + sum(s.tokens.nbytes + (0 if s.logprobs is None else s.logprobs.nbytes)
                                                for s in e.segments) for b in batch for e in b.episodes)
        assert held <= budget and reader.last_report.decoded_bytes <= budget
        got += batch
        if not reader.last_report.deferred:
            break
    assert len(got) == 12 and polls >= 4 and reader.quarantined == 0  # nothing lost, only spread out
    print(f"\n12 uploads, {stored} stored bytes, decode to {12 * 720_000} bytes; each poll held <= {budget}")
    # An object that could never fit a poll is refused before it is decoded.
    writer.upload(_bomb("m", 1, 60_000, 99, n=2), 1)
    small = RolloutReader(store, RUN, poll_limits=PollLimits(max_decoded_bytes=1 << 20))
    small.restore(reader.state())
    assert small.poll() == [] and small.last_report.rejected[0].category == "size"


def test_heartbeats_are_read_with_a_size_cap(tmp_path):
    """Attack: a 4 MiB heartbeat object. Old code downloaded it whole before refusing it."""
    from stoa.fleet.run import Heartbeat, read_heartbeats, write_heartbeat

    store = LocalStore(tmp_path)
    write_heartbeat(store, RUN, Heartbeat("good", 1, "generating", 1, 1, 1.0, 1.0, "int8", "h", 1.0))
    store.put(f"{RUN}/workers/huge.json", b"{" + b" " * (4 << 20) + b"}")
    calls = CountingStore(store)
    beats, bad = read_heartbeats(calls, RUN)
    assert [b.worker_id for b in beats] == ["good"] and bad == [f"{RUN}/workers/huge.json"]
    assert sum(n for _, n in calls.gets) < 16 << 10
