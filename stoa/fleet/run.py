"""What a run keeps in the object store besides weights and rollouts.

Layout under ``<run>/``::

    config.json            signed: the resolved RunConfig + sha256 of every model file
    model/<file>           the model folder minus weights (config.json, tokenizer files)
    weights/...            the PULSE version chain (stoa.transport.chain)
    rollouts/...           episode batches (stoa.transport.exchange)
    quarantine/...         rejected batches, each with a reason
    workers/<id>.json      heartbeats (unsigned: workers hold no key; validated on read); the trainer
                           deletes one 10 minutes old (stoa.fleet.trainer.fleetwatch.FORGET_S)
    eval/v<version>.json   held-out evaluation results (signed by the trainer)

Workers trust only what the run's key signed: the config and the model files are checked against
``config.json`` before use.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stoa.fleet.config import RunConfig
from stoa.transport import layout
from stoa.transport.signing import SignatureError, open_document, sign_document
from stoa.transport.store import KeyNotFound, ObjectStore, ObjectTooLarge, StoreError

__all__ = ["MODEL_FILES", "Heartbeat", "delete_heartbeat", "fetch_run", "publish_run", "read_heartbeats",
           "write_heartbeat"]

MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "generation_config.json", "chat_template.jinja", "vocab.json", "merges.txt")
"""Files of an HF folder a worker needs besides the weights (those present are shipped)."""
_MAX_MODEL_FILE = 64 << 20
_MAX_HEARTBEAT = 16 << 10
_MAX_RUN_CONFIG = 4 << 20
MAX_HEARTBEATS = 4096
"""Most heartbeats :func:`read_heartbeats` reads (the rest are reported as unread)."""


def publish_run(store: ObjectStore, run: str, config: RunConfig, model_dir: Path, private_key: Any) -> None:
    """Upload the model's non-weight files and the signed run config (files first, config last).
    ``config.json`` goes up normalized (:func:`stoa.models.hfconfig.normalized`)."""
    from stoa.models.hfconfig import load

    files = {}
    for name in MODEL_FILES:
        p = Path(model_dir) / name
        if p.exists():
            # Workers get the normalized config: every field explicit, RoPE in both layouts.
            data = (json.dumps(load(model_dir), indent=2, sort_keys=True) + "\n").encode() if name == "config.json" \
                else p.read_bytes()
            store.put(layout.model_file(run, name), data)
            files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    body = {"config": json.loads(config.to_json()), "model_files": files, "created": time.time()}
    store.put(layout.config(run), sign_document("run-config", body, private_key))


def fetch_run(store: ObjectStore, run: str, public_key: Any, cache_dir: Path) -> tuple[RunConfig, Path]:
    """Verify and read a run's config and model files; returns ``(config, local model folder)``.

    Raises:
        KeyNotFound: the run has no config yet.
        stoa.transport.chain.SignatureError / IntegrityError: anything unsigned, forged or corrupted.
    """
    try:
        blob = store.get(layout.config(run), max_bytes=_MAX_RUN_CONFIG)
    except ObjectTooLarge as e:
        raise SignatureError(f"{layout.config(run)}: {e.size} bytes, over the {_MAX_RUN_CONFIG}-byte limit") from None
    body = open_document(blob, "run-config", public_key, layout.config(run))
    config = RunConfig.from_dict(body["config"], resolve_objective=False)  # workers never run the objective
    files = body.get("model_files")
    if not isinstance(files, dict) or "config.json" not in files:
        raise ValueError(f"{layout.config(run)} lists no model files")
    out = Path(cache_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, meta in files.items():
        if name not in MODEL_FILES or not isinstance(meta, dict) or meta.get("bytes", 1 << 62) > _MAX_MODEL_FILE:
            raise ValueError(f"{layout.config(run)} lists an unexpected model file {name!r}")
        try:
            data = store.get(layout.model_file(run, name), max_bytes=int(meta.get("bytes", 0)))
        except ObjectTooLarge:
            data = b""  # larger than the signed size: never downloaded, reported as a mismatch below
        if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            from stoa.transport.chain import IntegrityError

            raise IntegrityError(f"{layout.model_file(run, name)} does not match the sha256 in the signed run config")
        tmp = out / f".{name}.tmp"
        tmp.write_bytes(data)
        tmp.replace(out / name)
    return config, out


@dataclass(frozen=True)
class Heartbeat:
    """A worker's periodic report (``<run>/workers/<worker_id>.json``)."""

    worker_id: str
    version: int
    """Policy version the worker holds."""
    status: str
    """``starting``, ``generating``, ``waiting`` (for a newer version), ``stopped``."""
    episodes: int
    """Episodes uploaded since the worker started."""
    batches: int
    """Batches uploaded since the worker started."""
    episodes_per_s: float
    tokens_per_s: float
    """Sampled tokens per second over the last cohort."""
    mode: str
    """Engine compute mode."""
    host: str
    time: float
    """Unix time of the report."""
    sync_bytes: int = 0
    """Bytes read from the weight channel since the worker started."""
    store_retries: int = 0
    """Store requests the worker's client retried since it started (5xx, throttling, timeouts, resets)."""
    trouble: str = ""
    """What is failing now and being retried (the store, or the worker's own cache disk), or empty."""

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()

    @classmethod
    def parse(cls, blob: bytes) -> Heartbeat:
        if len(blob) > _MAX_HEARTBEAT:
            raise ValueError("heartbeat too large")
        d = json.loads(blob)
        types = {"worker_id": str, "version": int, "status": str, "episodes": int, "batches": int,
                 "episodes_per_s": (int, float), "tokens_per_s": (int, float), "mode": str, "host": str,
                 "time": (int, float), "sync_bytes": int, "store_retries": int, "trouble": str}
        optional = {"sync_bytes", "store_retries", "trouble"}  # absent in older workers' heartbeats
        if not isinstance(d, dict) or set(d) - set(types) or any(
                not isinstance(d.get(k), t) for k, t in types.items() if k in d or k not in optional):
            raise ValueError("malformed heartbeat")
        if not all(math.isfinite(d[k]) for k in ("episodes_per_s", "tokens_per_s", "time")):
            raise ValueError("heartbeat has non-finite numbers")
        return cls(**d)


def write_heartbeat(store: ObjectStore, run: str, hb: Heartbeat) -> None:
    store.put(layout.heartbeat(run, hb.worker_id), hb.to_json())


def delete_heartbeat(store: ObjectStore, run: str, worker_id: str) -> bool:
    """Delete a worker's heartbeat; False when ``worker_id`` is not a valid id or the store failed."""
    if not layout.WORKER_ID.fullmatch(worker_id):
        return False
    try:
        store.delete(layout.heartbeat(run, worker_id))
    except StoreError:
        return False
    return True


def read_heartbeats(store: ObjectStore, run: str, max_workers: int = MAX_HEARTBEATS) -> tuple[list[Heartbeat], list[str]]:
    """Every worker's last heartbeat (at most ``max_workers``, each at most 16 KiB, refused unread
    when larger), and the keys that did not parse or were left unread (reported, never raised)."""
    beats, bad = [], []
    keys = store.list(layout.heartbeats(run))
    for key in keys[:max_workers]:
        try:
            beats.append(Heartbeat.parse(store.get(key, max_bytes=_MAX_HEARTBEAT)))
        except KeyNotFound:
            continue
        except Exception:
            bad.append(key)
    return beats, bad + keys[max_workers:]
