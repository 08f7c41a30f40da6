"""The episode format: round trips, and every kind of bad input refused with a clear message."""

import math

import msgpack
import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from stoa.types import Episode, EpisodeError, Limits, Segment, decode_episodes, encode_episodes


def make_episode(**overrides) -> Episode:
    fields = dict(
        prompt_tokens=np.array([1, 5, 9, 2], np.int32),
        segments=[
            Segment("model", np.array([11, 12, 13]), np.array([-0.1, -2.5, 0.0])),
            Segment("env", np.array([40, 41])),
            Segment("model", np.array([14]), np.array([-0.7])),
        ],
        reward=1.0,
        metrics={"searched": True, "num_searches": 1, "answer": "Mertil", "em": 1.0, "note": None},
        policy_version=7,
        worker_id="mac-mini-3",
        env_id="stoa/SyntheticSearch-v0",
        group_id="q-000042",
        sample_index=3,
        temperature=1.0,
        top_p=1.0,
    )
    fields.update(overrides)
    return Episode(**fields)


def assert_same(a: Episode, b: Episode) -> None:
    np.testing.assert_array_equal(a.prompt_tokens, b.prompt_tokens)
    assert len(a.segments) == len(b.segments)
    for x, y in zip(a.segments, b.segments):
        assert x.kind == y.kind
        np.testing.assert_array_equal(x.tokens, y.tokens)
        if x.logprobs is None:
            assert y.logprobs is None
        else:
            np.testing.assert_array_equal(x.logprobs, y.logprobs)
    for f in ("reward", "metrics", "policy_version", "worker_id", "env_id", "group_id",
              "sample_index", "temperature", "top_p"):
        assert getattr(a, f) == getattr(b, f), f


@pytest.mark.parametrize("compress", [True, False])
def test_round_trip_batch(compress):
    eps = [make_episode(sample_index=i, reward=float(i) / 3) for i in range(5)]
    out = decode_episodes(encode_episodes(eps, compress=compress), vocab_size=64)
    assert len(out) == 5
    for a, b in zip(eps, out):
        assert_same(a, b)


def test_token_level_views():
    ep = make_episode()
    np.testing.assert_array_equal(ep.tokens(), [1, 5, 9, 2, 11, 12, 13, 40, 41, 14])
    np.testing.assert_array_equal(ep.loss_mask(), [0, 0, 0, 0, 1, 1, 1, 0, 0, 1])
    np.testing.assert_allclose(ep.behavior_logprobs(), [0, 0, 0, 0, -0.1, -2.5, 0.0, 0, 0, -0.7], rtol=1e-6)
    assert len(ep) == 10 and ep.num_model_tokens == 4


@settings(max_examples=60, deadline=None)
@given(
    segs=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 50_000), min_size=1, max_size=20)),
        min_size=1, max_size=6,
    ).filter(lambda s: any(m for m, _ in s)),
    prompt=st.lists(st.integers(0, 50_000), min_size=1, max_size=30),
    reward=st.floats(-1e6, 1e6),
    temp=st.floats(0.01, 5.0),
)
def test_round_trip_property(segs, prompt, reward, temp):
    rng = np.random.default_rng(len(prompt))
    segments = [
        Segment("model", np.array(t), -rng.exponential(size=len(t))) if m else Segment("env", np.array(t))
        for m, t in segs
    ]
    ep = make_episode(prompt_tokens=np.array(prompt), segments=segments, reward=reward, temperature=temp)
    (back,) = decode_episodes(encode_episodes([ep]), vocab_size=50_001)
    assert_same(ep, back)


# --- bad episodes, caught at encode time and at decode time ---------------------------------

BAD = {
    "length mismatch": (lambda: make_episode(segments=[Segment("model", np.array([1, 2]), np.array([-1.0]))]),
                        "2 tokens"),
    "non-finite logprob": (lambda: make_episode(segments=[Segment("model", np.array([1]), np.array([np.nan]))]),
                           "non-finite"),
    "positive logprob": (lambda: make_episode(segments=[Segment("model", np.array([1]), np.array([0.5]))]),
                         "positive"),
    "env with logprobs": (lambda: make_episode(segments=[Segment("model", np.array([1]), np.array([-1.0])),
                                                         Segment("env", np.array([1]), np.array([-1.0]))]),
                          "env segment"),
    "model without logprobs": (lambda: make_episode(segments=[Segment("model", np.array([1]))]), "needs logprobs"),
    "no model tokens": (lambda: make_episode(segments=[Segment("env", np.array([1]))]), "no model tokens"),
    "empty segment": (lambda: make_episode(segments=[Segment("model", np.array([], np.int32), np.array([]))]),
                      "non-empty"),
    "negative token": (lambda: make_episode(prompt_tokens=np.array([3, -1])), "negative token"),
    "inf reward": (lambda: make_episode(reward=math.inf), "reward"),
    "zero temperature": (lambda: make_episode(temperature=0.0), "temperature"),
    "top_p above 1": (lambda: make_episode(top_p=1.5), "top_p"),
    "negative version": (lambda: make_episode(policy_version=-1), "policy_version"),
    "bad metric type": (lambda: make_episode(metrics={"x": [1, 2]}), "unsupported type"),
    "nan metric": (lambda: make_episode(metrics={"x": float("nan")}), "not finite"),
    "bad kind": (lambda: make_episode(segments=[Segment("tool", np.array([1]), None)]), "kind"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_encode_refuses(case):
    build, msg = BAD[case]
    with pytest.raises(EpisodeError, match=msg):
        encode_episodes([build()])


def _wire(**changes):
    """A valid encoded single-episode payload with raw wire-level edits applied."""
    ep = make_episode()
    body = msgpack.unpackb(encode_episodes([ep], compress=False)[6:], raw=False)
    d = body["episodes"][0]
    for k, v in changes.items():
        if v is KeyError:
            del d[k]
        else:
            d[k] = v
    return b"STEP\x01\x00" + msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize(
    "blob, msg",
    [
        (b"", "bad magic"),
        (b"PK\x03\x04garbage", "bad magic"),
        (b"STEP\x09\x00", "codec version"),
        (b"STEP\x01\x07xx", "compression flag"),
        (b"STEP\x01\x01not zstd at all", "corrupt zstd"),
        (b"STEP\x01\x00\xc1\xc1", "corrupt msgpack"),
        (b"STEP\x01\x00" + msgpack.packb([1, 2]), "not a map"),
        (b"STEP\x01\x00" + msgpack.packb({"format": "other", "version": 1, "episodes": []}), "format"),
        (b"STEP\x01\x00" + msgpack.packb({"format": "stoa.episodes", "version": 99, "episodes": []}), "version"),
        (_wire(reward="1.0"), "reward: wrong type"),
        (_wire(policy_version=True), "policy_version: wrong type"),
        (_wire(prompt=b"\x01\x00\x00"), "whole number"),
        (_wire(prompt=[1, 2, 3]), "raw bytes"),
        (_wire(extra_field=1), "unexpected"),
        (_wire(worker_id=KeyError), "missing"),
        (_wire(segments={"kind": "model"}), "not a list"),
    ],
)
def test_decode_refuses_malformed(blob, msg):
    with pytest.raises(EpisodeError, match=msg):
        decode_episodes(blob)


def test_decode_refuses_out_of_vocabulary():
    blob = encode_episodes([make_episode()])
    assert decode_episodes(blob, vocab_size=42)  # max id is 41
    with pytest.raises(EpisodeError, match="outside the vocabulary"):
        decode_episodes(blob, vocab_size=41)


def test_decode_refuses_oversize():
    eps = [make_episode(sample_index=i) for i in range(50)]
    blob = encode_episodes(eps, compress=False)
    with pytest.raises(EpisodeError, match="over the limit"):
        decode_episodes(blob, limits=Limits(max_bytes=len(blob) - 1))
    with pytest.raises(EpisodeError, match="50 episodes"):
        decode_episodes(blob, limits=Limits(max_episodes=49))
    long = make_episode(prompt_tokens=np.arange(5000) % 7)
    with pytest.raises(EpisodeError, match="5006 tokens"):
        decode_episodes(encode_episodes([long]), limits=Limits(max_tokens_per_episode=5000))


def test_decode_refuses_decompression_bomb():
    bomb = zstandard.ZstdCompressor().compress(b"\x00" * (8 << 20))
    with pytest.raises(EpisodeError):
        decode_episodes(b"STEP\x01\x01" + bomb, limits=Limits(max_decompressed_bytes=1 << 20))


def test_truncated_blobs_never_crash():
    blob = encode_episodes([make_episode(), make_episode(sample_index=1)])
    for cut in range(0, len(blob), 7):
        with pytest.raises(EpisodeError):
            decode_episodes(blob[:cut])


# --- bounds checked before the work: zstd bombs, segment floods -----------------------------


def _zstd_stream(chunks, size=None) -> bytes:
    """A real zstd frame fed chunk by chunk; ``size`` is written into its header when given."""
    c = zstandard.ZstdCompressor(level=1).compressobj(**({} if size is None else {"size": size}))
    return b"".join([*(c.compress(x) for x in chunks), c.flush()])


def _peak_bytes(fn) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_bomb_declaring_one_gib_is_refused_from_its_header():
    zeros = bytes(1 << 20)
    bomb = _zstd_stream([zeros] * 1024, size=1 << 30)
    assert len(bomb) < 64 << 10 and zstandard.frame_content_size(bomb) == 1 << 30

    def decode():
        with pytest.raises(EpisodeError, match=f"declares {1 << 30} bytes, over the limit of {256 << 20}"):
            decode_episodes(b"STEP\x01\x01" + bomb)

    assert _peak_bytes(decode) < 1 << 20  # nothing was decompressed


def test_bomb_without_declared_size_is_stopped_by_the_cap():
    # A valid, very repetitive batch: each episode is fine, the total is what is too big.
    ep = encode_episodes([make_episode()], compress=False)[6:]
    body = msgpack.unpackb(ep, raw=False)
    one = msgpack.packb(body["episodes"][0], use_bin_type=True)
    n = 4_000
    assert n * len(one) > 2 * (1 << 18)
    head = msgpack.packb({"format": "stoa.episodes", "version": 1}, use_bin_type=True)[1:]
    payload = b"\x83" + head + msgpack.packb("episodes") + b"\xdd" + n.to_bytes(4, "big")
    bomb = _zstd_stream([payload, *([one] * n)])
    assert zstandard.frame_content_size(bomb) == -1 and len(bomb) < 32 << 10
    limits = Limits(max_decompressed_bytes=1 << 18)

    def decode():
        with pytest.raises(EpisodeError, match=f"decompressed payload over the limit of {1 << 18} bytes"):
            decode_episodes(b"STEP\x01\x01" + bomb, limits=limits)

    assert _peak_bytes(decode) < 16 << 20
    # The same stream under a cap it fits in decodes completely.
    assert len(decode_episodes(b"STEP\x01\x01" + bomb)) == n


def test_zero_bomb_without_declared_size_is_refused_at_the_first_byte():
    bomb = _zstd_stream([bytes(1 << 20)] * 64)

    def decode():
        with pytest.raises(EpisodeError, match="not a map"):
            decode_episodes(b"STEP\x01\x01" + bomb)

    assert _peak_bytes(decode) < 4 << 20


def test_nothing_may_follow_the_batch():
    blob = encode_episodes([make_episode()])
    with pytest.raises(EpisodeError, match="trailing"):  # a second zstd frame
        decode_episodes(blob + zstandard.ZstdCompressor().compress(b"\x00"))
    with pytest.raises(EpisodeError, match="trailing"):
        decode_episodes(encode_episodes([make_episode()], compress=False) + b"\x00")


def _segment_flood(n_segments: int, n_episodes: int) -> bytes:
    # Built at wire level: the encoder itself refuses more than Limits().max_segments.
    ep = make_episode(segments=[Segment("model", np.array([1]), np.array([-0.5])), Segment("env", np.array([2]))])
    wire = msgpack.unpackb(encode_episodes([ep], compress=False)[6:], raw=False)["episodes"][0]
    wire["segments"] = [wire["segments"][j % 2] for j in range(n_segments)]
    body = {"format": "stoa.episodes", "version": 1, "episodes": [wire] * n_episodes}
    return b"STEP\x01\x01" + zstandard.ZstdCompressor().compress(msgpack.packb(body, use_bin_type=True))


def test_segments_per_episode_are_bounded():
    assert Limits().max_segments == 256
    blob = _segment_flood(257, 1)
    with pytest.raises(EpisodeError, match="257 segments, over the limit of 256"):
        decode_episodes(blob)
    assert len(decode_episodes(_segment_flood(256, 1))[0].segments) == 256
    with pytest.raises(EpisodeError, match="episode 0.segments: 20 segments, over the limit of 10"):
        decode_episodes(_segment_flood(20, 1), limits=Limits(max_segments=10))
    # The count is read from the array header: a header claiming a million is refused before
    # any segment is read (the body here is truncated right after it).
    payload = (b"\x83" + msgpack.packb("format") + msgpack.packb("stoa.episodes") + msgpack.packb("version")
               + b"\x01" + msgpack.packb("episodes") + b"\x91\x81" + msgpack.packb("segments")
               + b"\xdd" + (1 << 20).to_bytes(4, "big"))
    with pytest.raises(EpisodeError, match="1048576 segments, over the limit"):
        decode_episodes(b"STEP\x01\x00" + payload)


def test_segments_per_batch_are_bounded():
    blob = _segment_flood(100, 50)
    assert len(decode_episodes(blob)) == 50
    with pytest.raises(EpisodeError, match="more than 4999 segments"):
        decode_episodes(blob, limits=Limits(max_batch_segments=4999))


def _python_calls(fn) -> int:
    """Python and C-function calls made by ``fn``: a count of the work, independent of timing."""
    import sys

    count = 0

    def prof(frame, event, arg):
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def test_decode_work_is_linear_in_segments():
    # A few bytes of zstd expand to many tiny segments; the decoder's work per segment must be
    # constant (no re-scan of earlier segments, no per-episode work that grows with the batch).
    small, large = _segment_flood(256, 8), _segment_flood(256, 32)
    calls_small = _python_calls(lambda: decode_episodes(small))
    calls_large = _python_calls(lambda: decode_episodes(large))
    assert calls_large <= 4.2 * calls_small
    assert calls_large / (256 * 32) < 40  # calls per segment, all in all


def test_limits_are_checked_at_construction():
    with pytest.raises(ValueError, match="max_segments"):
        Limits(max_segments=0)
    with pytest.raises(ValueError, match="max_batch_segments"):
        Limits(max_batch_segments=True)
