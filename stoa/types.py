"""The episode: one multi-turn rollout at token level, and its wire format.

An episode is what a worker uploads and what the trainer learns from. It is kept at token level
from sampling to the loss and is never re-tokenized: the tokens the model sampled are exactly the
tokens the trainer scores.

Layout of one episode's token sequence::

    prompt_tokens | segment 0 | segment 1 | ... | segment n-1

Each segment is either

* ``kind="model"``: tokens the policy sampled, each with its *behaviour log-probability*
  ``logprobs[i] = log mu(tokens[i] | everything before it)`` under the distribution actually
  sampled from (temperature applied). These tokens are trained on (loss mask 1).
* ``kind="env"``: tokens the environment inserted (tool output such as ``<information>...``,
  chat-template glue). ``logprobs`` is ``None``; they are context only (loss mask 0).

Wire format (``encode_episodes`` / ``decode_episodes``): ``b"STEP"``, one byte codec version,
one byte compression (0 = none, 1 = zstd, one frame), then a msgpack map with the keys
``"format"``, ``"version"``, ``"episodes": [...]`` in that order, where arrays travel as raw
little-endian bytes (int32 tokens, float32 log-probs). No pickle anywhere; every field is checked
on decode and any violation raises :class:`EpisodeError` naming the episode and the field.

Decoding cost is bounded by :class:`Limits` before the work is done: the stored size is checked
first, a zstd frame that declares more than ``max_decompressed_bytes`` is refused from its header,
and the payload is decompressed as a stream that stops at that cap, parsed one episode at a time
(a segment count is checked from its array header, before any segment is read). Work and memory
are linear in the decompressed bytes, and a batch holds at most ``max_batch_segments`` segments.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import msgpack
import numpy as np
import zstandard

__all__ = [
    "Category",
    "Episode",
    "EpisodeError",
    "Limits",
    "Segment",
    "Verdict",
    "decode_episodes",
    "encode_episodes",
]

FORMAT_NAME = "stoa.episodes"
FORMAT_VERSION = 1
_MAGIC = b"STEP"
_CODEC_VERSION = 1
_RAW, _ZSTD = 0, 1

MetricValue = bool | int | float | str | None

Category = Literal["replay", "duplicate", "invalid", "audit", "sampling", "assignment", "refused", "unverifiable",
                   "future", "banned", "unsigned", "signature", "size", "misnamed"]
"""Why a trainer refused a batch (its quarantine, ledger line, event row and the sender's record):
``signature``, ``size``, ``misnamed`` and ``invalid`` come from reading and decoding the object;
``unsigned`` and ``refused`` (a key the roster refuses, a newcomer past its quota) from who sent it;
``replay``, ``duplicate``, ``audit``, ``sampling``, ``assignment`` and ``unverifiable`` from
checking its content (``docs/trust.md``); ``future``: a version the trainer has not reached (no
strike: a tampered store can show an honest worker such a label); ``banned``: queued when its key
was banned."""


@dataclass(frozen=True)
class Verdict:
    """Why a batch is refused: what every check returns (``None`` to pass), from the reader's
    screen of a seal to the trainer's review of the content."""

    category: Category
    reason: str
    ban: bool = False
    """A confirmed forgery: the sending key is banned at once (with ``reason``)."""


class EpisodeError(ValueError):
    """An episode or episode batch is malformed. The message says which episode and field."""


@dataclass(frozen=True)
class Limits:
    """Bounds enforced when decoding untrusted bytes (every one ``>= 1``)."""

    max_bytes: int = 64 << 20
    """Largest accepted encoded blob (bytes, as stored)."""
    max_decompressed_bytes: int = 256 << 20
    """Largest accepted payload after decompression (guards against zstd bombs)."""
    max_episodes: int = 65_536
    """Most episodes in one batch."""
    max_tokens_per_episode: int = 1 << 17
    """Most tokens (prompt + all segments) in one episode."""
    max_segments: int = 256
    """Most segments in one episode (a Search-R1 episode of 4 turns has about 8)."""
    max_batch_segments: int = 1 << 18
    """Most segments in one batch; bounds decode time (~4 us each on one core) and memory."""
    max_metrics: int = 64
    """Most entries in one episode's ``metrics``."""
    max_string: int = 4096
    """Longest accepted string field (ids, metric strings)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Limits.{f.name}={v!r} must be an int >= 1")


DEFAULT_LIMITS = Limits()


@dataclass
class Segment:
    """A run of consecutive tokens from one source.

    Attributes:
        kind: ``"model"`` (sampled by the policy, trained on) or ``"env"`` (inserted by the
            environment or the chat template; context only).
        tokens: int32 array ``[n]`` of token ids, ``n >= 1``.
        logprobs: for ``"model"``: float32 array ``[n]``, the behaviour log-probability of each
            sampled token (finite, ``<= 0``). For ``"env"``: ``None``.
    """

    kind: Literal["model", "env"]
    tokens: np.ndarray
    logprobs: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.tokens = np.ascontiguousarray(self.tokens, dtype=np.int32)
        if self.logprobs is not None:
            self.logprobs = np.ascontiguousarray(self.logprobs, dtype=np.float32)


@dataclass
class Episode:
    """One multi-turn rollout, at token level.

    Attributes:
        prompt_tokens: int32 ``[p]``, the tokenized prompt (chat template applied).
        segments: model and environment segments in the order they occurred.
        reward: scalar reward of the whole episode (finite).
        metrics: per-episode facts for logging and evaluation, e.g. ``searched``,
            ``num_searches``, ``answer``, ``correct``. Values are bool, int, finite float,
            str or None.
        policy_version: version of the weights that sampled every model token (a worker never
            swaps weights inside an episode).
        worker_id: the worker that generated it.
        env_id: gymnasium id of the environment, e.g. ``"stoa/PaperSearchQA-v0"``.
        group_id: id of the prompt; the G samples of one prompt share it (group advantages).
        sample_index: index of this sample within its group, ``0 <= sample_index``.
        temperature: sampling temperature (``> 0``); behaviour log-probs are under it.
        top_p: nucleus mass (``1.0`` = off); see the rollout engine for how log-probs are
            recorded when it is on.
        item_index: the dataset item the episode was played on (``env.reset(options={"index":
            item_index})``), so the trainer can replay it; ``None`` when unknown. Travels on the
            wire only when set (key ``"item"``, a non-negative int).
    """

    prompt_tokens: np.ndarray
    segments: list[Segment]
    reward: float
    metrics: dict[str, MetricValue] = field(default_factory=dict)
    policy_version: int = 0
    worker_id: str = ""
    env_id: str = ""
    group_id: str = ""
    sample_index: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    item_index: int | None = None

    def __post_init__(self) -> None:
        self.prompt_tokens = np.ascontiguousarray(self.prompt_tokens, dtype=np.int32)

    # -- token-level views used by learners ------------------------------------------------
    def tokens(self) -> np.ndarray:
        """All token ids, prompt first: int32 ``[T]``."""
        return np.concatenate([self.prompt_tokens, *(s.tokens for s in self.segments)])

    def __len__(self) -> int:
        return len(self.prompt_tokens) + sum(len(s.tokens) for s in self.segments)

    def loss_mask(self) -> np.ndarray:
        """bool ``[T]``: True exactly at model-sampled tokens."""
        parts = [np.zeros(len(self.prompt_tokens), bool)]
        parts += [np.full(len(s.tokens), s.kind == "model") for s in self.segments]
        return np.concatenate(parts)

    def behavior_logprobs(self) -> np.ndarray:
        """float32 ``[T]``: behaviour log-prob at model tokens, 0 elsewhere."""
        parts = [np.zeros(len(self.prompt_tokens), np.float32)]
        for s in self.segments:
            parts.append(s.logprobs if s.kind == "model" else np.zeros(len(s.tokens), np.float32))
        return np.concatenate(parts)

    @property
    def num_model_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.segments if s.kind == "model")

    def validate(self, vocab_size: int | None = None, limits: Limits = DEFAULT_LIMITS) -> None:
        """Raise :class:`EpisodeError` unless every field is well-formed (see module docs)."""
        _validate(self, vocab_size, limits, where="episode")


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------


def encode_episodes(episodes: list[Episode], *, compress: bool = True) -> bytes:
    """Serialize a batch of episodes (one object per upload). Validates before writing."""
    body = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "episodes": [_to_wire(i, ep) for i, ep in enumerate(episodes)],
    }
    payload = msgpack.packb(body, use_bin_type=True)
    if compress:
        return _MAGIC + bytes([_CODEC_VERSION, _ZSTD]) + zstandard.ZstdCompressor(level=3).compress(payload)
    return _MAGIC + bytes([_CODEC_VERSION, _RAW]) + payload


def _to_wire(i: int, ep: Episode) -> dict[str, Any]:
    _validate(ep, None, DEFAULT_LIMITS, where=f"episode {i}")
    return {
        "prompt": ep.prompt_tokens.astype("<i4").tobytes(),
        "segments": [
            {
                "kind": s.kind,
                "tokens": s.tokens.astype("<i4").tobytes(),
                "logprobs": None if s.logprobs is None else s.logprobs.astype("<f4").tobytes(),
            }
            for s in ep.segments
        ],
        "reward": float(ep.reward),
        "metrics": dict(ep.metrics),
        "policy_version": int(ep.policy_version),
        "worker_id": ep.worker_id,
        "env_id": ep.env_id,
        "group_id": ep.group_id,
        "sample_index": int(ep.sample_index),
        "temperature": float(ep.temperature),
        "top_p": float(ep.top_p),
        **({} if ep.item_index is None else {"item": int(ep.item_index)}),
    }


# ---------------------------------------------------------------------------------------------
# Decoding (untrusted input)
# ---------------------------------------------------------------------------------------------

_EPISODE_KEYS = {
    "prompt", "segments", "reward", "metrics", "policy_version", "worker_id", "env_id",
    "group_id", "sample_index", "temperature", "top_p",
}
_SEGMENT_KEYS = {"kind", "tokens", "logprobs"}
_TOP_KEYS = ("format", "version", "episodes")
_READ_SIZE = 1 << 16
# Largest zstd window accepted: the encoder's level 3 uses 2 MiB; a bigger one only costs memory.
_MAX_WINDOW = 1 << 23


def decode_episodes(
    blob: bytes, *, vocab_size: int | None = None, limits: Limits = DEFAULT_LIMITS
) -> list[Episode]:
    """Parse and validate a batch written by :func:`encode_episodes`.

    Args:
        blob: the stored bytes (untrusted).
        vocab_size: if given, every token id must lie in ``[0, vocab_size)``.
        limits: size bounds, each checked before the work it bounds (see the module docs).

    Raises:
        EpisodeError: on any malformation; the message names the episode index and field.
    """
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise EpisodeError(f"expected bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    if len(blob) > limits.max_bytes:
        raise EpisodeError(f"batch is {len(blob)} bytes, over the limit of {limits.max_bytes}")
    if len(blob) < 6 or blob[:4] != _MAGIC:
        raise EpisodeError("not a stoa episode batch (bad magic bytes)")
    if blob[4] != _CODEC_VERSION:
        raise EpisodeError(f"unsupported episode codec version {blob[4]} (this reader: {_CODEC_VERSION})")
    cap = limits.max_decompressed_bytes
    if blob[5] == _ZSTD:
        frame = memoryview(blob)[6:]
        try:
            declared = zstandard.frame_content_size(frame)
        except zstandard.ZstdError as e:
            raise EpisodeError(f"corrupt zstd payload: {e}") from None
        if declared > cap:
            raise EpisodeError(f"zstd frame declares {declared} bytes, over the limit of {cap}")
        dctx = zstandard.ZstdDecompressor(max_window_size=_MAX_WINDOW)
        raw: Any = dctx.stream_reader(frame, read_size=_READ_SIZE, read_across_frames=True)
    elif blob[5] == _RAW:
        declared, raw = len(blob) - 6, io.BytesIO(blob)  # shares the bytes, no copy
        raw.seek(6)
    else:
        raise EpisodeError(f"unknown compression flag {blob[5]}")
    source = _CappedSource(raw, cap)
    try:
        episodes = _read_batch(source, vocab_size, limits)
        if source.read(1):
            raise EpisodeError("trailing bytes after the episode batch")
    except EpisodeError:
        raise
    except zstandard.ZstdError as e:
        raise EpisodeError(f"corrupt zstd payload: {e}") from None
    except msgpack.OutOfData:
        raise EpisodeError("corrupt msgpack payload: truncated") from None
    except ValueError as e:
        if "exceeds max_" in str(e):  # msgpack's own length caps, set from the limits in _unpacker
            raise EpisodeError(f"a field is over the limit ({limits.max_tokens_per_episode} tokens, "
                               f"{limits.max_string} characters): {e}") from None
        raise EpisodeError(f"corrupt msgpack payload: ValueError: {e}") from None
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise EpisodeError(f"corrupt msgpack payload: {type(e).__name__}: {e}") from None
    finally:
        raw.close()
    if declared >= 0 and source.total != declared:
        raise EpisodeError(f"payload is {source.total} bytes, the zstd frame declares {declared}")
    return episodes


class _CappedSource:
    """A file-like view of the payload that refuses to yield more than ``cap`` bytes in total."""

    def __init__(self, raw: Any, cap: int) -> None:
        self._raw, self._cap, self.total = raw, cap, 0

    def read(self, n: int = -1) -> bytes:
        want = self._cap + 1 - self.total if n is None or n < 0 else min(n, self._cap + 1 - self.total)
        data = self._raw.read(max(want, 1))
        self.total += len(data)
        if self.total > self._cap:
            raise EpisodeError(f"decompressed payload over the limit of {self._cap} bytes")
        return data


def _unpacker(source: _CappedSource, limits: Limits) -> msgpack.Unpacker:
    # One unpack() call holds at most one segment, prompt or metrics map: bound that, not the batch.
    max_bin = 4 * limits.max_tokens_per_episode
    max_str = 4 * limits.max_string  # UTF-8 bytes of max_string characters
    item = 2 * max_bin + limits.max_metrics * 2 * (max_str + 16) + _READ_SIZE
    return msgpack.Unpacker(
        source, raw=False, strict_map_key=True, use_list=True, read_size=_READ_SIZE, max_buffer_size=item,
        max_str_len=max_str, max_bin_len=max_bin, max_ext_len=0,
        max_array_len=max(limits.max_episodes, limits.max_segments), max_map_len=max(limits.max_metrics, 16),
    )


def _read_batch(source: _CappedSource, vocab_size: int | None, limits: Limits) -> list[Episode]:
    u = _unpacker(source, limits)
    try:
        n = u.read_map_header()
    except ValueError as e:
        raise EpisodeError(f"corrupt msgpack payload: the top level is not a map ({e})") from None
    if n != len(_TOP_KEYS):
        raise EpisodeError(f"the top-level map has {n} keys, expected {list(_TOP_KEYS)}")
    for name in _TOP_KEYS[:2]:
        key = u.unpack()
        if key != name:
            raise EpisodeError(f"unexpected top-level key {key!r} (expected {name!r}; keys {list(_TOP_KEYS)} in order)")
        value = u.unpack()
        if name == "format" and value != FORMAT_NAME:
            raise EpisodeError(f"format is {value!r}, expected {FORMAT_NAME!r}")
        if name == "version" and (value != FORMAT_VERSION or isinstance(value, bool)):
            raise EpisodeError(f"format version {value!r} is not supported (expected {FORMAT_VERSION})")
    key = u.unpack()
    if key != "episodes":
        raise EpisodeError(f"unexpected top-level key {key!r} (expected 'episodes')")
    try:
        count = u.read_array_header()
    except ValueError:
        raise EpisodeError("'episodes' is not a list") from None
    if count > limits.max_episodes:
        raise EpisodeError(f"{count} episodes, over the limit of {limits.max_episodes}")
    budget = [limits.max_batch_segments]
    out = []
    for i in range(count):
        ep = _read_episode(u, f"episode {i}", limits, budget)
        _validate(ep, vocab_size, limits, where=f"episode {i}")
        out.append(ep)
    try:
        extra = u.unpack()
    except msgpack.OutOfData:
        return out
    raise EpisodeError(f"trailing data after the episode batch ({type(extra).__name__})")


def _bin(b: Any, itemsize: int, dtype: str, where: str) -> bytes:
    if not isinstance(b, bytes):
        raise EpisodeError(f"{where}: expected raw bytes, got {type(b).__name__}")
    if len(b) % itemsize:
        raise EpisodeError(f"{where}: {len(b)} bytes is not a whole number of {dtype} values")
    return b


def _read_episode(u: msgpack.Unpacker, where: str, limits: Limits, budget: list[int]) -> Episode:
    """One episode, read field by field; segments are counted from their header before reading."""
    try:
        n = u.read_map_header()
    except ValueError:
        raise EpisodeError(f"{where}: not a map") from None
    if n > 2 * len(_EPISODE_KEYS):
        raise EpisodeError(f"{where}: {n} keys, expected {sorted(_EPISODE_KEYS)}")
    d: dict[str, Any] = {}
    for _ in range(n):
        key = u.unpack()
        if not isinstance(key, str) or key in d:
            raise EpisodeError(f"{where}: bad or duplicate key {key!r}")
        d[key] = _read_segments(u, f"{where}.segments", limits, budget) if key == "segments" else u.unpack()
    item = d.pop("item", None)
    if item is not None and (not isinstance(item, int) or isinstance(item, bool)):
        raise EpisodeError(f"{where}.item: wrong type {type(item).__name__}")
    if set(d) != _EPISODE_KEYS:
        missing, extra = sorted(_EPISODE_KEYS - set(d)), sorted(set(d) - _EPISODE_KEYS)
        raise EpisodeError(f"{where}: wrong keys (missing {missing}, unexpected {extra})")
    for key, types in (("reward", (int, float)), ("temperature", (int, float)), ("top_p", (int, float)),
                       ("policy_version", (int,)), ("sample_index", (int,)), ("worker_id", (str,)),
                       ("env_id", (str,)), ("group_id", (str,)), ("metrics", (dict,))):
        if not isinstance(d[key], types) or isinstance(d[key], bool):
            raise EpisodeError(f"{where}.{key}: wrong type {type(d[key]).__name__}")
    prompt = np.frombuffer(_bin(d["prompt"], 4, "<i4", f"{where}.prompt"), "<i4").astype(np.int32)
    return Episode(
        prompt_tokens=prompt,
        segments=d["segments"],
        reward=float(d["reward"]),
        metrics=d["metrics"],
        policy_version=d["policy_version"],
        worker_id=d["worker_id"],
        env_id=d["env_id"],
        group_id=d["group_id"],
        sample_index=d["sample_index"],
        temperature=float(d["temperature"]),
        top_p=float(d["top_p"]),
        item_index=item,
    )


def _read_segments(u: msgpack.Unpacker, where: str, limits: Limits, budget: list[int]) -> list[Segment]:
    """All segments of one episode as views into one token array and one log-prob array."""
    try:
        n = u.read_array_header()
    except ValueError:
        raise EpisodeError(f"{where}: not a list") from None
    if n > limits.max_segments:
        raise EpisodeError(f"{where}: {n} segments, over the limit of {limits.max_segments}")
    budget[0] -= n
    if budget[0] < 0:
        raise EpisodeError(f"{where}: the batch has more than {limits.max_batch_segments} segments "
                           "(max_batch_segments)")
    kinds, toks, lps = [], [], []
    for j in range(n):
        s = u.unpack()
        w = f"{where}[{j}]"
        if not isinstance(s, dict) or s.keys() != _SEGMENT_KEYS:
            raise EpisodeError(f"{w}: expected a map with keys {sorted(_SEGMENT_KEYS)}")
        kind, lp = s["kind"], s["logprobs"]
        if kind != "model" and kind != "env":
            raise EpisodeError(f"{w}.kind: {kind!r} is not 'model' or 'env'")
        kinds.append(kind)
        toks.append(_bin(s["tokens"], 4, "<i4", f"{w}.tokens"))
        lps.append(None if lp is None else _bin(lp, 4, "<f4", f"{w}.logprobs"))
    # One conversion per episode, then per-segment slices (views): cost linear in bytes.
    tok_all = np.frombuffer(b"".join(toks), "<i4").astype(np.int32)
    lp_all = np.frombuffer(b"".join(b for b in lps if b is not None), "<f4").astype(np.float32)
    out, t0, l0 = [], 0, 0
    for kind, t, lp in zip(kinds, toks, lps):
        t1 = t0 + len(t) // 4
        if lp is None:
            out.append(Segment(kind, tok_all[t0:t1]))
        else:
            l1 = l0 + len(lp) // 4
            out.append(Segment(kind, tok_all[t0:t1], lp_all[l0:l1]))
            l0 = l1
        t0 = t1
    return out


def _validate(ep: Episode, vocab_size: int | None, limits: Limits, where: str) -> None:
    def fail(msg: str) -> None:
        raise EpisodeError(f"{where}: {msg}")

    if not isinstance(ep.segments, list) or not ep.segments:
        fail("an episode needs at least one segment")
    if len(ep.segments) > limits.max_segments:
        fail(f"{len(ep.segments)} segments, over the limit of {limits.max_segments}")
    if ep.prompt_tokens.ndim != 1 or len(ep.prompt_tokens) == 0:
        fail("prompt_tokens must be a non-empty 1-D array")
    names, arrays, model = ["prompt"], [ep.prompt_tokens], []
    for j, s in enumerate(ep.segments):
        w = f"segments[{j}]"
        if not isinstance(s, Segment):
            fail(f"{w} is a {type(s).__name__}, not a Segment")
        if s.kind not in ("model", "env"):
            fail(f"{w}.kind {s.kind!r} is not 'model' or 'env'")
        if s.tokens.ndim != 1 or len(s.tokens) == 0:
            fail(f"{w}.tokens must be a non-empty 1-D array")
        names.append(f"{w}.tokens")
        arrays.append(s.tokens)
        if s.kind == "model":
            if s.logprobs is None:
                fail(f"{w}: a model segment needs logprobs")
            if s.logprobs.shape != s.tokens.shape:
                fail(f"{w}: {len(s.logprobs)} logprobs for {len(s.tokens)} tokens")
            model.append((w, s.logprobs))
        elif s.logprobs is not None:
            fail(f"{w}: an env segment carries no logprobs")
    total = sum(len(a) for a in arrays)
    if total > limits.max_tokens_per_episode:
        fail(f"{total} tokens, over the limit of {limits.max_tokens_per_episode}")
    if not model:
        fail("no model tokens")
    # Whole-episode reductions; a second pass names the segment only when one fails.
    tokens = np.concatenate(arrays)
    if int(tokens.min()) < 0:
        name, a = next((n, a) for n, a in zip(names, arrays) if int(a.min()) < 0)
        fail(f"{name}: negative token id {int(a.min())}")
    if vocab_size is not None and int(tokens.max()) >= vocab_size:
        name, a = next((n, a) for n, a in zip(names, arrays) if int(a.max()) >= vocab_size)
        fail(f"{name}: token id {int(a.max())} outside the vocabulary (size {vocab_size})")
    logprobs = np.concatenate([lp for _, lp in model])
    if not np.isfinite(logprobs).all():
        fail(f"{next(w for w, lp in model if not np.isfinite(lp).all())}.logprobs: non-finite value")
    if (logprobs > 0).any():
        w, lp = next((w, lp) for w, lp in model if (lp > 0).any())
        fail(f"{w}.logprobs: positive log-probability {float(lp.max())}")
    if not isinstance(ep.reward, (int, float)) or not math.isfinite(ep.reward):
        fail(f"reward {ep.reward!r} is not a finite number")
    if not isinstance(ep.temperature, (int, float)) or not (math.isfinite(ep.temperature) and ep.temperature > 0):
        fail(f"temperature {ep.temperature!r} must be finite and > 0")
    if not isinstance(ep.top_p, (int, float)) or not (0 < ep.top_p <= 1):
        fail(f"top_p {ep.top_p!r} must lie in (0, 1]")
    if ep.item_index is not None and (not isinstance(ep.item_index, int) or isinstance(ep.item_index, bool)
                                      or ep.item_index < 0):
        fail(f"item_index {ep.item_index!r} must be None or a non-negative int")
    for key in ("policy_version", "sample_index"):
        v = getattr(ep, key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            fail(f"{key} {v!r} must be a non-negative int")
    for key in ("worker_id", "env_id", "group_id"):
        v = getattr(ep, key)
        if not isinstance(v, str) or len(v) > limits.max_string:
            fail(f"{key} must be a string of at most {limits.max_string} characters")
    if not isinstance(ep.metrics, dict) or len(ep.metrics) > limits.max_metrics:
        fail(f"metrics must be a map of at most {limits.max_metrics} entries")
    for k, v in ep.metrics.items():
        if not isinstance(k, str) or len(k) > limits.max_string:
            fail(f"metric key {k!r} is not a short string")
        if isinstance(v, float) and not math.isfinite(v):
            fail(f"metric {k!r} is not finite")
        if isinstance(v, str) and len(v) > limits.max_string:
            fail(f"metric {k!r} is a string over {limits.max_string} characters")
        if v is not None and not isinstance(v, (bool, int, float, str)):
            fail(f"metric {k!r} has unsupported type {type(v).__name__}")
