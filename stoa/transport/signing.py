"""Run keys and signed JSON documents: what lets a worker trust an object it reads from the store.

A run has one ed25519 key pair. The trainer holds the private key and signs everything that
steers the fleet (the weight pointer and manifests, the run config, ``progress.json``, the
"run finished" marker, evaluation results); workers hold the public key and refuse anything
that does not verify.

**Envelope.** A signed document is the JSON object::

    {"format": "stoa.signed/1", "kind": KIND, "key_id": KEY_ID, "body": BODY_TEXT, "signature": SIG}

where ``BODY_TEXT`` is the body as compact JSON text (sorted keys, no NaN), ``KEY_ID`` is
:func:`key_id` of the signer's public key, and ``SIG`` is the base64 ed25519 signature over
``b"stoa.signed/1\\0" + KIND + b"\\0" + BODY_TEXT``. The kind is inside the signed message, so a
signed pointer cannot be replayed as a manifest, nor a manifest as a finished marker.

**What a signature does not cover.** Where a document lives: a genuine document copied to
another key (another run, another version) still verifies. Bodies therefore name what they are
about (``run``, ``version``) and readers check it: :func:`read_signed` takes the fields that
must match (``expect``).

**Key files.** :func:`save_keypair` writes ``<name>.key`` (PKCS#8 PEM, mode 0600) and
``<name>.pub`` (SubjectPublicKeyInfo PEM) by writing a fresh file and renaming it over the old
one, so an overwritten key never keeps an earlier, more permissive mode. Keys also load from
32 raw bytes or 64 hex characters.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from stoa.errors import ExpectedFailure
from stoa.transport.store import KeyNotFound, ObjectStore, ObjectTooLarge

__all__ = [
    "MAX_DOCUMENT_BYTES",
    "SignatureError",
    "generate_private_key",
    "key_id",
    "load_private_key",
    "load_public_key",
    "open_document",
    "read_signed",
    "save_keypair",
    "sign_document",
]

_SIGNED = "stoa.signed/1"
MAX_DOCUMENT_BYTES = 1 << 20
"""Default size limit of a signed document read from the store (bytes)."""


class SignatureError(ExpectedFailure, RuntimeError):
    """A document does not verify: unsigned, signed by another key, of another kind, a bad
    signature, not a parseable envelope (truncated or corrupted), too large, or its signed body
    names another run or version than the reader expects. The message says which."""


# ---------------------------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------------------------


def generate_private_key() -> Ed25519PrivateKey:
    """A new ed25519 private key for signing a run's documents."""
    return Ed25519PrivateKey.generate()


def _raw_public(pub: Ed25519PublicKey) -> bytes:
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public_key: Ed25519PublicKey) -> str:
    """A short fingerprint of a public key (16 hex characters of its sha256)."""
    return hashlib.sha256(_raw_public(public_key)).hexdigest()[:16]


def _read_key_source(src: Any) -> bytes:
    if isinstance(src, (bytes, bytearray, memoryview)):
        return bytes(src)
    if isinstance(src, str) and len(src) == 64 and all(c in "0123456789abcdefABCDEF" for c in src):
        return bytes.fromhex(src)
    if isinstance(src, (str, os.PathLike)):
        return Path(src).expanduser().read_bytes()
    raise TypeError(f"expected key bytes, a hex string or a file path, got {type(src).__name__}")


def load_private_key(src: Ed25519PrivateKey | bytes | str | os.PathLike[str]) -> Ed25519PrivateKey:
    """An ed25519 private key from a key object, 32 raw bytes, 64 hex chars, PEM (PKCS#8) bytes, or a file of either."""
    if isinstance(src, Ed25519PrivateKey):
        return src
    data = _read_key_source(src)
    if len(data) == 32:
        return Ed25519PrivateKey.from_private_bytes(data)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:
        raise ValueError(f"not an ed25519 private key (raw 32 bytes or unencrypted PEM): {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"expected an ed25519 private key, got {type(key).__name__}")
    return key


def load_public_key(src: Ed25519PublicKey | Ed25519PrivateKey | bytes | str | os.PathLike[str]) -> Ed25519PublicKey:
    """An ed25519 public key from a key object, 32 raw bytes, 64 hex chars, PEM bytes, or a file of either."""
    if isinstance(src, Ed25519PublicKey):
        return src
    if isinstance(src, Ed25519PrivateKey):
        return src.public_key()
    data = _read_key_source(src)
    if len(data) == 32:
        return Ed25519PublicKey.from_public_bytes(data)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as e:
        raise ValueError(f"not an ed25519 public key (raw 32 bytes or PEM): {e}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"expected an ed25519 public key, got {type(key).__name__}")
    return key


def _write_new(path: Path, data: bytes, mode: int, overwrite: bool) -> None:
    """Write ``data`` to a fresh file of ``mode`` beside ``path``, then move it into place."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        os.fchmod(fd, mode)  # the umask may have narrowed it; never widened
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, path)  # replaces a link itself, never writes through it
        else:
            os.link(tmp, path)  # fails if the name was taken meanwhile
    finally:
        tmp.unlink(missing_ok=True)


def save_keypair(private_key: Ed25519PrivateKey, directory: str | os.PathLike[str], name: str = "run",
                 overwrite: bool = False) -> tuple[Path, Path]:
    """Write ``<name>.key`` (PKCS#8 PEM, mode 0600) and ``<name>.pub`` (PEM, 0644); return their paths.

    Each file is written new and renamed into place, so the private key ends with mode 0600
    even when it replaces (``overwrite=True``) a file that had a wider mode.

    Raises:
        FileExistsError: either file exists and ``overwrite`` is False.
    """
    d = Path(directory).expanduser()
    d.mkdir(parents=True, exist_ok=True)
    priv, pub = d / f"{name}.key", d / f"{name}.pub"
    if not overwrite and (priv.exists() or pub.exists()):
        raise FileExistsError(f"{priv} or {pub} exists; refusing to overwrite a key")
    pem = private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    _write_new(priv, pem, 0o600, overwrite)
    _write_new(pub, private_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                          serialization.PublicFormat.SubjectPublicKeyInfo),
               0o644, overwrite)
    return priv, pub


# ---------------------------------------------------------------------------------------------
# Signed documents
# ---------------------------------------------------------------------------------------------


def _message(kind: str, body: bytes) -> bytes:
    return _SIGNED.encode() + b"\0" + kind.encode() + b"\0" + body


def sign_document(kind: str, body: Mapping[str, Any], private_key: Any) -> bytes:
    """``body`` (JSON-serializable, no NaN) as a document of ``kind`` signed with the run's key.

    ``private_key`` is anything :func:`load_private_key` accepts. Returns the envelope's bytes.
    """
    key = load_private_key(private_key)
    text = json.dumps(dict(body), sort_keys=True, allow_nan=False, separators=(",", ":"))
    sig = key.sign(_message(kind, text.encode()))
    env = {"format": _SIGNED, "kind": kind, "key_id": key_id(key.public_key()), "body": text,
           "signature": base64.b64encode(sig).decode()}
    return json.dumps(env, indent=1).encode()


def open_document(blob: bytes, kind: str, public_key: Any, where: str = "document") -> dict[str, Any]:
    """Verify a :func:`sign_document` envelope of ``kind`` and return its body (a dict).

    ``where`` names the object in error messages. Raises :class:`SignatureError` for anything
    that does not verify (see its docstring); never another exception for untrusted bytes.
    """
    pub = load_public_key(public_key)
    try:
        env = json.loads(blob)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, TypeError) as e:
        raise SignatureError(f"{where}: not valid JSON ({e}); truncated or corrupted") from None
    if not isinstance(env, dict) or not isinstance(env.get("body"), str):
        raise SignatureError(f"{where}: not a signed envelope")
    if env.get("format") != _SIGNED or not isinstance(env.get("signature"), str):
        raise SignatureError(f"{where}: unsigned (no {_SIGNED} signature); refusing it")
    if env.get("kind") != kind:
        raise SignatureError(f"{where}: a signed {str(env.get('kind'))[:64]!r}, expected a {kind!r}")
    if env.get("key_id") != key_id(pub):
        raise SignatureError(f"{where}: signed by key {str(env.get('key_id'))[:64]!r}, "
                             f"not this run's key {key_id(pub)}")
    try:
        sig = base64.b64decode(env["signature"], validate=True)
        pub.verify(sig, _message(kind, env["body"].encode()))
    except (InvalidSignature, ValueError, TypeError, UnicodeEncodeError):
        raise SignatureError(f"{where}: bad ed25519 signature; refusing it") from None
    try:
        body = json.loads(env["body"])
    except (json.JSONDecodeError, RecursionError) as e:  # signed, but not by our encoder
        raise SignatureError(f"{where}: signed body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise SignatureError(f"{where}: signed body is not an object")
    return body


def read_signed(store: ObjectStore, key: str, kind: str, public_key: Any, *,
                expect: Mapping[str, Any] | None = None, max_bytes: int = MAX_DOCUMENT_BYTES) -> dict[str, Any] | None:
    """Read and verify the signed document of ``kind`` at ``key``; None if there is no object.

    ``expect``: body fields that must have these values (e.g. ``{"run": run, "version": v}``),
    so a genuine document copied to another key is refused. An object larger than
    ``max_bytes`` is refused without being downloaded. Use it for every control file whose
    existence changes behaviour ("run finished", "version evaluated"): a present but invalid
    document must count as absent for deciding, and be reported.

    Raises:
        SignatureError: the object exists but does not verify, is too large, or its body does
            not match ``expect``.
        stoa.transport.store.StoreError: the store failed (after its retries).
    """
    try:
        blob = store.get(key, max_bytes=max_bytes)
    except KeyNotFound:
        return None
    except ObjectTooLarge as e:
        raise SignatureError(f"{key}: {e.size} bytes, over the {max_bytes}-byte limit of a signed {kind!r}") from None
    body = open_document(blob, kind, public_key, key)
    for field, want in (expect or {}).items():
        if body.get(field) != want:
            raise SignatureError(f"{key}: signed {kind!r} has {field}={repr(body.get(field))[:80]}, "
                                 f"expected {want!r} (a genuine document copied to another place?)")
    return body
