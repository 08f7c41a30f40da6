"""What the trainers of one run write to each other, and the checks on reading it.

Every object lives under ``<run>/outer/`` (the store is shared with untrusted workers, so every
read is checked)::

    trainers/r<rank>.json                     a trainer's heartbeat (MAC)
    deals/v<version>/r<rank>/<i>.episodes      one inner step's groups dealt to a trainer, then
    deals/v<version>/r<rank>/<i>.json          its manifest: sha256, bytes (signed, the run's key)
    updates/v<version>/r<rank>.safetensors    a trainer's outer update from version's weights, then
    updates/v<version>/r<rank>.json           its manifest: sha256, bytes, norm, items (MAC)
    merged/v<version>.safetensors             the merged outer step from version's weights, then
    merged/v<version>.json                    its manifest: the version it publishes, who is in (signed)
    base/v<version>.safetensors               the float weights of version (joining, rejoining), then
    base/v<version>.json                      its manifest (signed)

Payload first, manifest last: a reader sees a manifest only once its payload is complete, and
takes the payload only when it matches the manifest's hash. What the coordinator writes is signed
with the run's key (:mod:`stoa.transport.signing`); what the other trainers write carries an
HMAC-SHA256 under the run's *outer secret*, a file the operator gives its trainers only (workers
never see it). Versions are the chain's (``<version:012d>``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stoa.fleet.outer.codec import Encoded, UpdateError, decode_update, fp32_bytes
from stoa.transport import tensorfile
from stoa.transport.signing import SignatureError, open_document, sign_document
from stoa.transport.store import KeyNotFound, ObjectStore, ObjectTooLarge
from stoa.types import Episode, decode_episodes, encode_episodes

__all__ = ["Beat", "OuterExchange", "make_secret", "read_secret"]

_MAX_DOC = 1 << 20
_MAX_WORK = 256 << 20
_SECRET_FORMAT = "stoa.outer-secret/1"


def make_secret(path: str | Path) -> Path:
    """Write a new outer secret (32 random bytes, hex) to ``path`` (mode 0600) unless one is there."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": _SECRET_FORMAT, "secret": secrets.token_hex(32)}) + "\n")
        path.chmod(0o600)
    return path


def read_secret(path: str | Path) -> bytes:
    """The outer secret in ``path`` (ValueError when the file is not one)."""
    try:
        body = json.loads(Path(path).read_text())
        raw = bytes.fromhex(body["secret"]) if body.get("format") == _SECRET_FORMAT else b""
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not an outer secret ({e})") from None
    if len(raw) < 16:
        raise ValueError(f"{path} is not an outer secret")
    return raw


@dataclass(frozen=True)
class Beat:
    """A trainer's heartbeat: where it stands."""

    rank: int
    base: int
    """The version whose merged weights it holds (-1 while it joins)."""
    trained: int
    """Items of ``base``'s round it has trained."""
    seq: int
    """Grows with every beat (freshness is judged by the reader's clock, not the writer's)."""


def _v(version: int) -> str:
    return f"v{int(version):012d}"


class OuterExchange:
    """Reads and writes one run's ``outer/`` objects; counts the bytes each way in :attr:`bytes`.

    Args:
        store, run: the run's store and name.
        secret: the outer secret (MAC of what non-coordinator trainers write).
        public_key: the run's public key (what the coordinator signs).
        private_key: the run's private key, on the coordinator only.
    """

    def __init__(self, store: ObjectStore, run: str, secret: bytes, public_key: Any, private_key: Any = None):
        self.store, self.run, self.secret = store, run, secret
        self.public_key, self.private_key = public_key, private_key
        self.bytes: Counter[str] = Counter()
        self._seq = int(time.time() * 1000)

    def _k(self, *parts: str) -> str:
        return "/".join((self.run, "outer", *parts))

    # -- envelopes -----------------------------------------------------------------------------
    def _signed(self, kind: str, body: dict[str, Any]) -> bytes:
        return sign_document(f"outer-{kind}", {"run": self.run, **body}, self.private_key)

    def _mac(self, kind: str, body: dict[str, Any]) -> bytes:
        text = json.dumps({"kind": kind, "run": self.run, **body}, sort_keys=True, allow_nan=False,
                          separators=(",", ":"))
        mac = hmac.new(self.secret, text.encode(), hashlib.sha256).hexdigest()
        return json.dumps({"body": text, "mac": mac}).encode()

    def _get(self, key: str, max_bytes: int) -> bytes | None:
        try:
            return self.store.get(key, max_bytes=max_bytes)
        except KeyNotFound:
            return None
        except ObjectTooLarge:
            raise UpdateError(f"{key}: over {max_bytes} bytes") from None

    def _open_signed(self, key: str, kind: str) -> dict[str, Any] | None:
        blob = self._get(key, _MAX_DOC)
        if blob is None:
            return None
        try:
            body = open_document(blob, f"outer-{kind}", self.public_key, key)
        except SignatureError as e:
            raise UpdateError(str(e)) from None
        if body.get("run") != self.run:
            raise UpdateError(f"{key}: for run {str(body.get('run'))[:60]!r}")
        return body

    def _open_mac(self, key: str, kind: str) -> dict[str, Any] | None:
        blob = self._get(key, _MAX_DOC)
        if blob is None:
            return None
        try:
            env = json.loads(blob)
            text, mac = env["body"], env["mac"]
            ok = isinstance(mac, str) and hmac.compare_digest(
                mac, hmac.new(self.secret, text.encode(), hashlib.sha256).hexdigest())
            body = json.loads(text) if ok else None
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise UpdateError(f"{key}: not a trainer document ({type(e).__name__})") from None
        if not ok:
            raise UpdateError(f"{key}: bad MAC (not written by a trainer of this run)")
        if not isinstance(body, dict) or body.get("kind") != kind or body.get("run") != self.run:
            raise UpdateError(f"{key}: not a {kind!r} of this run")
        return body

    def _payload(self, key: str, meta: dict[str, Any], max_bytes: int) -> bytes:
        size, digest = meta.get("bytes"), meta.get("sha256")
        if not isinstance(size, int) or not isinstance(digest, str) or size > max_bytes:
            raise UpdateError(f"{key}: bad size {size!r} or hash in its manifest")
        blob = self._get(key, size)
        if blob is None or len(blob) != size or hashlib.sha256(blob).hexdigest() != digest:
            raise UpdateError(f"{key}: missing, or does not match its manifest's size and sha256")
        return blob

    # -- heartbeats ----------------------------------------------------------------------------
    def beat(self, rank: int, base: int, trained: int) -> None:
        self._seq += 1
        self.store.put(self._k("trainers", f"r{rank}.json"),
                       self._mac("beat", {"rank": rank, "base": base, "trained": trained, "seq": self._seq}))

    def beats(self) -> dict[int, Beat]:
        """Every readable heartbeat by rank (a forged or torn one is left out)."""
        out = {}
        for key in self.store.list(self._k("trainers", "")):
            try:
                b = self._open_mac(key, "beat")
                if b is not None and all(isinstance(b.get(f), int) for f in ("rank", "base", "trained", "seq")):
                    out[b["rank"]] = Beat(b["rank"], b["base"], b["trained"], b["seq"])
            except UpdateError:
                continue
        return out

    # -- work (the coordinator deals, a trainer reads) -----------------------------------------
    def put_work(self, version: int, rank: int, index: int, episodes: list[Episode]) -> int:
        blob = encode_episodes(episodes)
        stem = self._k("deals", _v(version), f"r{rank}", f"{index:04d}")
        self.store.put(stem + ".episodes", blob)
        doc = self._signed("work", {"version": version, "rank": rank, "index": index, "bytes": len(blob),
                                    "sha256": hashlib.sha256(blob).hexdigest()})
        self.store.put(stem + ".json", doc)
        self.bytes["work_out"] += len(blob) + len(doc)
        return len(blob) + len(doc)

    def work(self, version: int, rank: int, skip: set[int], vocab_size: int) -> list[tuple[int, list[Episode]]]:
        """The items dealt to ``rank`` for ``version``'s round, except the indexes in ``skip``, in order."""
        out = []
        for key in sorted(self.store.list(self._k("deals", _v(version), f"r{rank}", ""))):
            if not key.endswith(".json"):
                continue
            meta = self._open_signed(key, "work")
            if meta is None or meta.get("version") != version or meta.get("rank") != rank:
                raise UpdateError(f"{key}: a work manifest for another round or trainer")
            if meta["index"] in skip:
                continue
            blob = self._payload(key[: -len(".json")] + ".episodes", meta, _MAX_WORK)
            self.bytes["work_in"] += len(blob)
            out.append((meta["index"], decode_episodes(blob, vocab_size=vocab_size)))
        return out

    # -- updates (a trainer writes, the coordinator reads) -------------------------------------
    def put_update(self, version: int, rank: int, enc: Encoded, info: dict[str, Any]) -> int:
        stem = self._k("updates", _v(version), f"r{rank}")
        self.store.put(stem + ".safetensors", enc.blob)
        doc = self._mac("update", {"version": version, "rank": rank, "bytes": enc.bytes, "sha256": enc.sha256, **info})
        self.store.put(stem + ".json", doc)
        self.bytes["update_out"] += enc.bytes + len(doc)
        return enc.bytes + len(doc)

    def update(self, version: int, rank: int, shapes: dict[str, tuple[int, ...]]
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
        """``rank``'s update from ``version`` (manifest, decoded arrays), or None while absent.

        Raises:
            UpdateError: it is there but fails a check (MAC, hash, format, shapes, finite values).
        """
        stem = self._k("updates", _v(version), f"r{rank}")
        meta = self._open_mac(stem + ".json", "update")
        if meta is None:
            return None
        if meta.get("version") != version or meta.get("rank") != rank:
            raise UpdateError(f"{stem}.json: an update for another round or trainer")
        bound = 2 * fp32_bytes(shapes) + (1 << 20)
        blob = self._payload(stem + ".safetensors", meta, bound)
        self.bytes["update_in"] += len(blob)
        return meta, decode_update(blob, shapes)

    # -- merged steps and bases (the coordinator writes, every trainer reads) -----------------
    def put_merged(self, version: int, to_version: int, enc: Encoded, included: list[int], dropped: list[int]) -> int:
        stem = self._k("merged", _v(version))
        self.store.put(stem + ".safetensors", enc.blob)
        doc = self._signed("merged", {"version": version, "to_version": to_version, "bytes": enc.bytes,
                                      "sha256": enc.sha256, "included": included, "dropped": dropped})
        self.store.put(stem + ".json", doc)
        self.bytes["merged_out"] += enc.bytes + len(doc)
        return enc.bytes + len(doc)

    def merged(self, version: int, shapes: dict[str, tuple[int, ...]]
               ) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
        """The merged step from ``version``'s weights (manifest, decoded arrays), or None while absent."""
        stem = self._k("merged", _v(version))
        meta = self._open_signed(stem + ".json", "merged")
        if meta is None:
            return None
        if meta.get("version") != version or not isinstance(meta.get("to_version"), int) \
                or meta["to_version"] <= version or not isinstance(meta.get("included"), list):
            raise UpdateError(f"{stem}.json: a merged manifest for another round")
        blob = self._payload(stem + ".safetensors", meta, 2 * fp32_bytes(shapes) + (1 << 20))
        self.bytes["merged_in"] += len(blob)
        return meta, decode_update(blob, shapes)

    def put_base(self, version: int, state: dict[str, np.ndarray]) -> int:
        stem = self._k("base", _v(version))
        blob = tensorfile.encode({k: np.ascontiguousarray(v, np.float32) for k, v in state.items()})
        self.store.put(stem + ".safetensors", blob)
        doc = self._signed("base", {"version": version, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
                                    "shapes": {k: list(v.shape) for k, v in state.items()}})
        self.store.put(stem + ".json", doc)
        self.bytes["base_out"] += len(blob) + len(doc)
        return len(blob) + len(doc)

    def newest_base(self) -> int | None:
        keys = [k for k in self.store.list(self._k("base", "")) if k.endswith(".json")]
        versions = []
        for k in keys:
            try:
                versions.append(int(k.rsplit("/", 1)[-1][1:13]))
            except ValueError:
                continue
        return max(versions) if versions else None

    def base(self, version: int) -> dict[str, np.ndarray]:
        """The float weights of ``version`` (checked: signature, hash, float32, finite, the listed shapes)."""
        stem = self._k("base", _v(version))
        meta = self._open_signed(stem + ".json", "base")
        if meta is None or meta.get("version") != version or not isinstance(meta.get("shapes"), dict):
            raise UpdateError(f"{stem}.json: missing, or a base of another version")
        shapes = {k: tuple(v) for k, v in meta["shapes"].items()}
        blob = self._payload(stem + ".safetensors", meta, fp32_bytes(shapes) + (1 << 20))
        self.bytes["base_in"] += len(blob)
        try:
            t = tensorfile.read(blob).tensors
        except tensorfile.TensorFileError as e:
            raise UpdateError(f"{stem}: {e}") from None
        if set(t) != set(shapes) or any(a.dtype != np.float32 or a.shape != shapes[k] or not np.isfinite(a).all()
                                        for k, a in t.items()):
            raise UpdateError(f"{stem}: tensors do not match its manifest, or are not finite float32")
        return {k: np.array(a) for k, a in t.items()}

    # -- garbage ---------------------------------------------------------------------------------
    def prune(self, version: int, keep_from: int) -> None:
        """Delete ``version``'s work and updates, and merged steps and bases older than ``keep_from``."""
        for key in self.store.list(self._k("deals", _v(version), "")) + self.store.list(self._k("updates", _v(version), "")):
            self.store.delete(key)
        for folder in ("merged", "base"):
            for key in self.store.list(self._k(folder, "")):
                name = key.rsplit("/", 1)[-1]
                if name[:1] == "v" and name[1:13].isdigit() and int(name[1:13]) < keep_from:
                    self.store.delete(key)
