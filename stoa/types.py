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
one byte compression (0 = none, 1 = zstd), then a msgpack map ``{"format", "version",
"episodes": [...]}`` where arrays travel as raw little-endian bytes (int32 tokens, float32
log-probs). No pickle anywhere; every field is checked on decode and any violation raises
:class:`EpisodeError` naming the episode and the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import numpy as np
import zstandard

__all__ = [
    "Episode",
    "EpisodeError",
    "Limits",
    "Segment",
    "decode_episodes",
    "encode_episodes",
]

FORMAT_NAME = "stoa.episodes"
FORMAT_VERSION = 1
_MAGIC = b"STEP"
_CODEC_VERSION = 1
_RAW, _ZSTD = 0, 1

MetricValue = bool | int | float | str | None


class EpisodeError(ValueError):
    """An episode or episode batch is malformed. The message says which episode and field."""


@dataclass(frozen=True)
class Limits:
    """Bounds enforced when decoding untrusted bytes."""

    max_bytes: int = 64 << 20
    """Largest accepted encoded blob (bytes, as stored)."""
    max_decompressed_bytes: int = 256 << 20
    """Largest accepted payload after decompression (guards against zstd bombs)."""
    max_episodes: int = 65_536
    """Most episodes in one batch."""
    max_tokens_per_episode: int = 1 << 17
    """Most tokens (prompt + all segments) in one episode."""
    max_segments: int = 1024
    """Most segments in one episode."""
    max_metrics: int = 64
    """Most entries in one episode's ``metrics``."""
    max_string: int = 4096
    """Longest accepted string field (ids, metric strings)."""


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
    }


# ---------------------------------------------------------------------------------------------
# Decoding (untrusted input)
# ---------------------------------------------------------------------------------------------

_EPISODE_KEYS = {
    "prompt", "segments", "reward", "metrics", "policy_version", "worker_id", "env_id",
    "group_id", "sample_index", "temperature", "top_p",
}
_SEGMENT_KEYS = {"kind", "tokens", "logprobs"}


def decode_episodes(
    blob: bytes, *, vocab_size: int | None = None, limits: Limits = DEFAULT_LIMITS
) -> list[Episode]:
    """Parse and validate a batch written by :func:`encode_episodes`.

    Args:
        blob: the stored bytes (untrusted).
        vocab_size: if given, every token id must lie in ``[0, vocab_size)``.
        limits: size bounds.

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
    if blob[5] == _ZSTD:
        try:
            payload = zstandard.ZstdDecompressor().decompress(
                blob[6:], max_output_size=limits.max_decompressed_bytes
            )
        except zstandard.ZstdError as e:
            raise EpisodeError(f"corrupt zstd payload: {e}") from None
        if len(payload) > limits.max_decompressed_bytes:
            raise EpisodeError("decompressed payload over the size limit")
    elif blob[5] == _RAW:
        payload = blob[6:]
    else:
        raise EpisodeError(f"unknown compression flag {blob[5]}")
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_bin_len=limits.max_decompressed_bytes)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise EpisodeError(f"corrupt msgpack payload: {type(e).__name__}: {e}") from None
    if not isinstance(body, dict):
        raise EpisodeError("payload is not a map")
    if body.get("format") != FORMAT_NAME:
        raise EpisodeError(f"format is {body.get('format')!r}, expected {FORMAT_NAME!r}")
    if body.get("version") != FORMAT_VERSION:
        raise EpisodeError(f"format version {body.get('version')!r} is not supported (expected {FORMAT_VERSION})")
    if set(body) != {"format", "version", "episodes"}:
        raise EpisodeError(f"unexpected top-level keys {sorted(set(body) - {'format', 'version', 'episodes'})}")
    raw = body["episodes"]
    if not isinstance(raw, list):
        raise EpisodeError("'episodes' is not a list")
    if len(raw) > limits.max_episodes:
        raise EpisodeError(f"{len(raw)} episodes, over the limit of {limits.max_episodes}")
    out = []
    for i, d in enumerate(raw):
        ep = _from_wire(d, f"episode {i}", limits)
        _validate(ep, vocab_size, limits, where=f"episode {i}")
        out.append(ep)
    return out


def _array(b: Any, dtype: str, where: str) -> np.ndarray:
    if not isinstance(b, bytes):
        raise EpisodeError(f"{where}: expected raw bytes, got {type(b).__name__}")
    itemsize = np.dtype(dtype).itemsize
    if len(b) % itemsize:
        raise EpisodeError(f"{where}: {len(b)} bytes is not a whole number of {dtype} values")
    return np.frombuffer(b, dtype=dtype).astype(dtype[1:], copy=True)


def _from_wire(d: Any, where: str, limits: Limits) -> Episode:
    if not isinstance(d, dict):
        raise EpisodeError(f"{where}: not a map")
    if set(d) != _EPISODE_KEYS:
        missing, extra = sorted(_EPISODE_KEYS - set(d)), sorted(set(d) - _EPISODE_KEYS)
        raise EpisodeError(f"{where}: wrong keys (missing {missing}, unexpected {extra})")
    segs_raw = d["segments"]
    if not isinstance(segs_raw, list):
        raise EpisodeError(f"{where}.segments: not a list")
    if len(segs_raw) > limits.max_segments:
        raise EpisodeError(f"{where}: {len(segs_raw)} segments, over the limit of {limits.max_segments}")
    segments = []
    for j, s in enumerate(segs_raw):
        w = f"{where}.segments[{j}]"
        if not isinstance(s, dict) or set(s) != _SEGMENT_KEYS:
            raise EpisodeError(f"{w}: expected a map with keys {sorted(_SEGMENT_KEYS)}")
        if s["kind"] not in ("model", "env"):
            raise EpisodeError(f"{w}.kind: {s['kind']!r} is not 'model' or 'env'")
        lp = None if s["logprobs"] is None else _array(s["logprobs"], "<f4", f"{w}.logprobs")
        segments.append(Segment(s["kind"], _array(s["tokens"], "<i4", f"{w}.tokens"), lp))
    for key, types in (("reward", (int, float)), ("temperature", (int, float)), ("top_p", (int, float)),
                       ("policy_version", (int,)), ("sample_index", (int,)), ("worker_id", (str,)),
                       ("env_id", (str,)), ("group_id", (str,)), ("metrics", (dict,))):
        if not isinstance(d[key], types) or isinstance(d[key], bool):
            raise EpisodeError(f"{where}.{key}: wrong type {type(d[key]).__name__}")
    return Episode(
        prompt_tokens=_array(d["prompt"], "<i4", f"{where}.prompt"),
        segments=segments,
        reward=float(d["reward"]),
        metrics=d["metrics"],
        policy_version=d["policy_version"],
        worker_id=d["worker_id"],
        env_id=d["env_id"],
        group_id=d["group_id"],
        sample_index=d["sample_index"],
        temperature=float(d["temperature"]),
        top_p=float(d["top_p"]),
    )


def _validate(ep: Episode, vocab_size: int | None, limits: Limits, where: str) -> None:
    def fail(msg: str) -> None:
        raise EpisodeError(f"{where}: {msg}")

    if not isinstance(ep.segments, list) or not ep.segments:
        fail("an episode needs at least one segment")
    if len(ep.segments) > limits.max_segments:
        fail(f"{len(ep.segments)} segments, over the limit of {limits.max_segments}")
    if ep.prompt_tokens.ndim != 1 or len(ep.prompt_tokens) == 0:
        fail("prompt_tokens must be a non-empty 1-D array")
    total = len(ep.prompt_tokens)
    arrays = [("prompt", ep.prompt_tokens)]
    n_model = 0
    for j, s in enumerate(ep.segments):
        w = f"segments[{j}]"
        if not isinstance(s, Segment):
            fail(f"{w} is a {type(s).__name__}, not a Segment")
        if s.kind not in ("model", "env"):
            fail(f"{w}.kind {s.kind!r} is not 'model' or 'env'")
        if s.tokens.ndim != 1 or len(s.tokens) == 0:
            fail(f"{w}.tokens must be a non-empty 1-D array")
        total += len(s.tokens)
        arrays.append((f"{w}.tokens", s.tokens))
        if s.kind == "model":
            n_model += len(s.tokens)
            if s.logprobs is None:
                fail(f"{w}: a model segment needs logprobs")
            if s.logprobs.shape != s.tokens.shape:
                fail(f"{w}: {len(s.logprobs)} logprobs for {len(s.tokens)} tokens")
            if not np.all(np.isfinite(s.logprobs)):
                fail(f"{w}.logprobs: non-finite value")
            if np.any(s.logprobs > 0):
                fail(f"{w}.logprobs: positive log-probability {float(s.logprobs.max())}")
        elif s.logprobs is not None:
            fail(f"{w}: an env segment carries no logprobs")
    if total > limits.max_tokens_per_episode:
        fail(f"{total} tokens, over the limit of {limits.max_tokens_per_episode}")
    if n_model == 0:
        fail("no model tokens")
    for name, a in arrays:
        if a.size and int(a.min()) < 0:
            fail(f"{name}: negative token id {int(a.min())}")
        if vocab_size is not None and a.size and int(a.max()) >= vocab_size:
            fail(f"{name}: token id {int(a.max())} outside the vocabulary (size {vocab_size})")
    if not isinstance(ep.reward, (int, float)) or not math.isfinite(ep.reward):
        fail(f"reward {ep.reward!r} is not a finite number")
    if not isinstance(ep.temperature, (int, float)) or not (math.isfinite(ep.temperature) and ep.temperature > 0):
        fail(f"temperature {ep.temperature!r} must be finite and > 0")
    if not isinstance(ep.top_p, (int, float)) or not (0 < ep.top_p <= 1):
        fail(f"top_p {ep.top_p!r} must lie in (0, 1]")
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
