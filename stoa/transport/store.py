"""Object stores: the only place where the trainer and the workers meet.

An :class:`ObjectStore` is a flat map from string keys to immutable byte strings, with the
semantics every S3-compatible service offers:

* ``put`` replaces an object atomically: a reader sees the old bytes or the new ones, never a
  partial write. ``put_if_absent`` creates an object only if no object has the key, and exactly
  one of several racing writers wins.
* ``get`` returns a whole object or raises :class:`KeyNotFound`; ``list`` returns the keys under a
  prefix in sorted order; ``delete`` is idempotent.

Two implementations: :class:`LocalStore` (a directory; temp file + fsync + rename) and
:class:`S3Store` (boto3; AWS S3, Cloudflare R2, MinIO, SeaweedFS). :func:`open_store` picks one
from a URL. Keys are ``/``-separated relative paths and are checked by :func:`validate_key`
before any I/O, so no key can escape a LocalStore's root or a S3Store's prefix.
"""

from __future__ import annotations

import base64
import hashlib
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import parse_qs, urlparse

__all__ = [
    "KeyNotFound",
    "LocalStore",
    "ObjectStore",
    "S3Config",
    "S3Store",
    "StoreError",
    "open_store",
    "validate_key",
]

MAX_KEY_BYTES = 1024
RESERVED_SEGMENT = ".stoa-tmp"
"""First key segment reserved for LocalStore's temp files; never a valid key."""


class StoreError(RuntimeError):
    """An object store operation failed (after retries); the message names the key and cause."""


class KeyNotFound(StoreError, KeyError):
    """No object has this key."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "key not found"


@runtime_checkable
class ObjectStore(Protocol):
    """A flat key -> bytes store with atomic whole-object writes.

    Keys are relative ``/``-separated paths (see :func:`validate_key`). Every method raises
    ``ValueError`` on an invalid key and :class:`StoreError` when the backend fails after its
    retries.
    """

    def put(self, key: str, data: bytes) -> None:
        """Create or replace the object at ``key``. Atomic: readers never see partial bytes."""
        ...

    def get(self, key: str) -> bytes:
        """Return the object's bytes. Raises :class:`KeyNotFound` if there is none."""
        ...

    def exists(self, key: str) -> bool:
        """Whether an object has this key."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """All keys that start with ``prefix`` (a plain string prefix, not only a folder), sorted."""
        ...

    def delete(self, key: str) -> None:
        """Remove the object; deleting a missing key is not an error."""
        ...

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create the object only if the key is free. Returns True if this call created it.

        Atomic against concurrent writers: of several racing calls exactly one returns True.
        """
        ...


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise ``ValueError`` saying why.

    Rules: a non-empty ``str`` of at most 1024 UTF-8 bytes; ``/``-separated segments that are
    non-empty and not ``.`` or ``..``; no leading ``/`` (absolute) or trailing ``/``; no
    backslash and no control characters; the first segment is not the reserved ``.stoa-tmp``.
    """
    if not isinstance(key, str):
        raise ValueError(f"object key must be a str, got {type(key).__name__}")
    if not key:
        raise ValueError("object key is empty")
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise ValueError(f"object key is over {MAX_KEY_BYTES} bytes: {key[:60]!r}...")
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise ValueError(f"object key {key!r} contains a control character")
    if "\\" in key:
        raise ValueError(f"object key {key!r} contains a backslash")
    if key.startswith("/"):
        raise ValueError(f"object key {key!r} is absolute; keys are relative paths")
    parts = key.split("/")
    if any(p == "" for p in parts):
        raise ValueError(f"object key {key!r} has an empty path segment")
    if any(p in (".", "..") for p in parts):
        raise ValueError(f"object key {key!r} has a '.' or '..' segment")
    if parts[0] == RESERVED_SEGMENT:
        raise ValueError(f"object key {key!r} uses the reserved prefix {RESERVED_SEGMENT!r}")
    return key


def _validate_prefix(prefix: str) -> str:
    if not isinstance(prefix, str):
        raise ValueError(f"prefix must be a str, got {type(prefix).__name__}")
    if prefix:
        validate_key(prefix + "x")  # a prefix is a key with its tail cut anywhere
    return prefix


def _as_bytes(data: Any) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"object data must be bytes, got {type(data).__name__}")


# ---------------------------------------------------------------------------------------------
# LocalStore
# ---------------------------------------------------------------------------------------------


class LocalStore:
    """A directory as an object store. Key ``a/b/c`` is the file ``root/a/b/c``.

    Writes go to ``root/.stoa-tmp/`` first, are fsynced, then renamed into place (``put``) or
    hard-linked (``put_if_absent``, which fails atomically if the name exists), and the target
    directory is fsynced, so a crash leaves either the old object or the whole new one.
    Unlike S3, a key cannot also be the folder of other keys (``a/b`` beside ``a/b/c``).
    """

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().resolve()
        self._tmp = self.root / RESERVED_SEGMENT
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._sweep_tmp()

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*validate_key(key).split("/"))

    def _sweep_tmp(self, max_age_s: float = 24 * 3600) -> None:
        # Temp files of writers that crashed mid-put; a day-old one is not in use.
        now = time.time()
        for p in self._tmp.iterdir():
            try:
                if now - p.stat().st_mtime > max_age_s:
                    p.unlink()
            except OSError:
                pass

    def _write_tmp(self, data: bytes) -> str:
        fd, tmp = tempfile.mkstemp(dir=self._tmp, prefix="put-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            _unlink_quiet(tmp)
            raise
        return tmp

    def _makedirs(self, d: Path) -> None:
        missing = []
        while not d.exists():
            missing.append(d)
            d = d.parent
        for m in reversed(missing):
            try:
                m.mkdir()
            except FileExistsError:
                pass
            _fsync_dir(m.parent)

    def put(self, key: str, data: bytes) -> None:
        path, data = self._path(key), _as_bytes(data)
        tmp = self._write_tmp(data)
        try:
            for attempt in range(5):
                self._makedirs(path.parent)
                try:
                    os.replace(tmp, path)
                    break
                except FileNotFoundError:  # a concurrent delete pruned the empty folder
                    if attempt == 4:
                        raise
            _fsync_dir(path.parent)
        except OSError as e:
            _unlink_quiet(tmp)
            raise StoreError(f"{self}: put {key!r} failed: {e}") from e

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path, data = self._path(key), _as_bytes(data)
        tmp = self._write_tmp(data)
        try:
            for attempt in range(5):
                self._makedirs(path.parent)
                try:
                    os.link(tmp, path)  # fails atomically if the name exists
                    break
                except FileExistsError:
                    return False
                except FileNotFoundError:
                    if attempt == 4:
                        raise
            _fsync_dir(path.parent)
            return True
        except OSError as e:
            raise StoreError(f"{self}: put_if_absent {key!r} failed (the filesystem needs hard links): {e}") from e
        finally:
            _unlink_quiet(tmp)

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise KeyNotFound(f"{self}: no object {key!r}") from None
        except OSError as e:
            raise StoreError(f"{self}: get {key!r} failed: {e}") from e

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        prefix = _validate_prefix(prefix)
        folder = prefix.rpartition("/")[0]
        top = self.root.joinpath(*folder.split("/")) if folder else self.root
        out = []
        for dirpath, dirnames, filenames in os.walk(top):
            rel = os.path.relpath(dirpath, self.root)
            rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            if not rel:
                dirnames[:] = [d for d in dirnames if d != RESERVED_SEGMENT]
            # Prune folders that cannot hold a match.
            dirnames[:] = [d for d in dirnames if (rel + d + "/").startswith(prefix) or prefix.startswith(rel + d + "/")]
            out.extend(rel + f for f in filenames if (rel + f).startswith(prefix))
        return sorted(out)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except (FileNotFoundError, IsADirectoryError):
            return
        except OSError as e:
            raise StoreError(f"{self}: delete {key!r} failed: {e}") from e
        # Drop emptied folders so listings stay cheap; a concurrent put recreates them.
        d = path.parent
        while d != self.root:
            try:
                d.rmdir()
            except OSError:
                break
            d = d.parent


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories
    finally:
        os.close(fd)


def _unlink_quiet(p: str) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# S3Store
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class S3Config:
    """Tuning for :class:`S3Store`."""

    max_attempts: int = 8
    """Attempts per request (botocore's standard mode: backoff with jitter on throttling, 5xx, timeouts)."""
    connect_timeout_s: float = 10.0
    """Seconds to open a connection."""
    read_timeout_s: float = 60.0
    """Seconds to wait for data on an open connection."""
    multipart_threshold: int = 64 << 20
    """Objects at least this large are uploaded in parts."""
    part_size: int = 16 << 20
    """Size of each part of a multipart upload (S3 needs >= 5 MiB except the last)."""
    addressing_style: str | None = None
    """``"path"``, ``"virtual"`` or None (path-style when an endpoint URL is given, else auto)."""
    profile: str | None = None
    """AWS profile name; None uses the standard credential chain (environment, config files, roles)."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_attempts <= 50:
            raise ValueError(f"max_attempts must be in [1, 50], got {self.max_attempts}")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        if self.part_size < 5 << 20:
            raise ValueError(f"part_size must be >= 5 MiB (S3's minimum), got {self.part_size}")
        if self.multipart_threshold < self.part_size:
            raise ValueError("multipart_threshold must be >= part_size")
        if self.addressing_style not in (None, "path", "virtual", "auto"):
            raise ValueError(f"addressing_style must be 'path', 'virtual', 'auto' or None, got {self.addressing_style!r}")


_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}  # HEAD answers carry no body, hence "404"
_PRECONDITION_CODES = {"PreconditionFailed", "412"}
_CONFLICT_CODES = {"ConditionalRequestConflict", "409"}
_RESEND_CODES = {"BadDigest"}  # the body was damaged on the way: send it again


class S3Store:
    """An S3 bucket (optionally under a key prefix) as an object store.

    Works with AWS S3, Cloudflare R2 (``region="auto"``), MinIO and SeaweedFS. Credentials come
    from the standard AWS environment variables or profile. Requests are retried with backoff;
    objects of ``config.multipart_threshold`` bytes or more go up in parts. ``put_if_absent``
    sends ``If-None-Match: *``, which S3 (since 2024), R2, MinIO and SeaweedFS honour.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        *,
        config: S3Config = S3Config(),
        client: Any = None,
    ):
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix)
        self.bucket, self.prefix, self.endpoint_url, self.config = bucket, prefix, endpoint_url, config
        self._client = client if client is not None else self._make_client(endpoint_url, region, config)

    @staticmethod
    def _make_client(endpoint_url: str | None, region: str | None, config: S3Config) -> Any:
        import boto3
        from botocore.config import Config as BotoConfig

        style = config.addressing_style or ("path" if endpoint_url else "auto")
        boto_cfg = BotoConfig(
            retries={"mode": "standard", "total_max_attempts": config.max_attempts},
            connect_timeout=config.connect_timeout_s,
            read_timeout=config.read_timeout_s,
            s3={"addressing_style": style},
            # No trailing CRC checksums (third-party servers differ in support); uploads carry
            # Content-MD5 instead, which all of them check.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        session = boto3.session.Session(profile_name=config.profile)
        return session.client("s3", endpoint_url=endpoint_url, region_name=region, config=boto_cfg)

    def __repr__(self) -> str:
        where = f" at {self.endpoint_url}" if self.endpoint_url else ""
        return f"S3Store(s3://{self.bucket}/{self.prefix}{where})"

    def _full(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _fail(self, op: str, key: str, e: Exception) -> StoreError:
        return StoreError(f"{self}: {op} {key!r} failed: {_describe(e)}")

    def put(self, key: str, data: bytes) -> None:
        full, data = self._full(key), _as_bytes(data)
        for attempt in range(self.config.max_attempts):
            try:
                if len(data) >= self.config.multipart_threshold:
                    self._multipart(full, data, {})
                else:
                    self._client.put_object(Bucket=self.bucket, Key=full, Body=data, ContentMD5=_md5(data))
                return
            except Exception as e:
                if _error_code(e) in _RESEND_CODES and attempt + 1 < self.config.max_attempts:
                    _sleep_backoff(attempt)
                    continue
                raise self._fail("put", key, e) from e

    def put_if_absent(self, key: str, data: bytes) -> bool:
        full, data = self._full(key), _as_bytes(data)
        for attempt in range(self.config.max_attempts):
            try:
                if len(data) >= self.config.multipart_threshold:
                    self._multipart(full, data, {"IfNoneMatch": "*"})
                else:
                    self._client.put_object(Bucket=self.bucket, Key=full, Body=data, IfNoneMatch="*",
                                            ContentMD5=_md5(data))
                return True
            except Exception as e:
                code = _error_code(e)
                if code in _PRECONDITION_CODES:
                    # After a retried request the winner may be our own first attempt.
                    if _retry_attempts(e) > 0 and self._get_quiet(full) == data:
                        return True
                    return False
                if code in _CONFLICT_CODES | _RESEND_CODES and attempt + 1 < self.config.max_attempts:
                    _sleep_backoff(attempt)  # S3 asks callers to retry racing conditional writes
                    continue
                raise self._fail("put_if_absent", key, e) from e
        raise AssertionError("unreachable")  # pragma: no cover

    def _multipart(self, full: str, data: bytes, complete_args: dict[str, str]) -> Any:
        c, size = self._client, self.config.part_size
        upload_id = c.create_multipart_upload(Bucket=self.bucket, Key=full)["UploadId"]
        try:
            parts = []
            for n, start in enumerate(range(0, len(data), size), start=1):
                part = data[start:start + size]
                r = c.upload_part(Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=n, Body=part,
                                  ContentMD5=_md5(part))
                parts.append({"PartNumber": n, "ETag": r["ETag"]})
            return c.complete_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id,
                                               MultipartUpload={"Parts": parts}, **complete_args)
        except BaseException:
            try:
                c.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            except Exception:
                pass  # the bucket's lifecycle rules clean up what an abort cannot
            raise

    def _get_quiet(self, full: str) -> bytes | None:
        try:
            return self._client.get_object(Bucket=self.bucket, Key=full)["Body"].read()
        except Exception:
            return None

    def get(self, key: str) -> bytes:
        full = self._full(key)
        from botocore.exceptions import ClientError

        for attempt in range(self.config.max_attempts):
            try:
                resp = self._client.get_object(Bucket=self.bucket, Key=full)
                body = resp["Body"].read()
                expected = resp.get("ContentLength")
                if expected is not None and len(body) != expected:
                    raise _ShortRead(f"read {len(body)} of {expected} bytes")
                return body
            except ClientError as e:
                if _error_code(e) in _MISSING_CODES:
                    raise KeyNotFound(f"{self}: no object {key!r}") from None
                raise self._fail("get", key, e) from e
            except Exception as e:
                # botocore retries the request but not a body stream that breaks midway.
                if attempt + 1 >= self.config.max_attempts:
                    raise self._fail("get", key, e) from e
                _sleep_backoff(attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    def exists(self, key: str) -> bool:
        full = self._full(key)
        try:
            self._client.head_object(Bucket=self.bucket, Key=full)
            return True
        except Exception as e:
            if _error_code(e) in _MISSING_CODES:
                return False
            raise self._fail("exists", key, e) from e

    def list(self, prefix: str = "") -> list[str]:
        prefix = _validate_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""
        out = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base + prefix)
            for page in pages:
                out.extend(obj["Key"][len(base):] for obj in page.get("Contents", ()))
        except Exception as e:
            raise self._fail("list", prefix, e) from e
        return sorted(out)

    def delete(self, key: str) -> None:
        full = self._full(key)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=full)
        except Exception as e:
            if _error_code(e) in _MISSING_CODES:
                return
            raise self._fail("delete", key, e) from e


class _ShortRead(IOError):
    pass


def _error_code(e: Exception) -> str | None:
    """The S3 error code, or the HTTP status as a string when the server gave no code."""
    resp = getattr(e, "response", None)
    if not isinstance(resp, dict):
        return None
    code = resp.get("Error", {}).get("Code")
    status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code or (str(status) if status else None)


def _md5(data: bytes) -> str:
    # Content-MD5 lets every S3-compatible server reject a body damaged in transit.
    return base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()


def _retry_attempts(e: Exception) -> int:
    resp = getattr(e, "response", None) or {}
    return int(resp.get("ResponseMetadata", {}).get("RetryAttempts", 0) or 0)


def _describe(e: Exception) -> str:
    code = _error_code(e)
    return f"{code}: {e}" if code else f"{type(e).__name__}: {e}"


def _sleep_backoff(attempt: int, base: float = 0.1, cap: float = 10.0) -> None:
    time.sleep(random.uniform(0, min(cap, base * 2**attempt)))


# ---------------------------------------------------------------------------------------------
# open_store
# ---------------------------------------------------------------------------------------------


def open_store(url: str | os.PathLike[str], *, s3_config: S3Config = S3Config()) -> LocalStore | S3Store:
    """Open a store from a location string.

    * ``/some/dir``, ``relative/dir`` or ``file:///some/dir``: a :class:`LocalStore`.
    * ``s3://bucket`` or ``s3://bucket/prefix``: an :class:`S3Store`. The endpoint comes from
      ``?endpoint=URL`` in the URL, else ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (unset
      means AWS itself); the region from ``?region=`` or the standard AWS settings.
    """
    if isinstance(url, os.PathLike):
        return LocalStore(url)
    if not isinstance(url, str) or not url:
        raise ValueError(f"store location must be a non-empty string, got {url!r}")
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return LocalStore(parsed.netloc + parsed.path)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"{url!r}: an s3:// URL needs a bucket name")
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        unknown = set(query) - {"endpoint", "region"}
        if unknown:
            raise ValueError(f"{url!r}: unknown query parameters {sorted(unknown)} (known: endpoint, region)")
        endpoint = query.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        return S3Store(parsed.netloc, parsed.path.strip("/"), endpoint_url=endpoint, region=query.get("region"),
                       config=s3_config)
    if parsed.scheme and len(parsed.scheme) > 1:  # one letter: a Windows drive
        raise ValueError(f"{url!r}: unsupported store scheme {parsed.scheme!r} (use a path, file:// or s3://)")
    return LocalStore(url)
