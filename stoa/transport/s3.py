"""The S3 object store: AWS S3, Cloudflare R2, MinIO, SeaweedFS (see :mod:`stoa.transport.store`).

One retry layer, botocore's (configured by :class:`S3Config`); our code adds only what botocore
cannot see: a body that breaks after the headers arrived continues with a ranged GET from its
last byte, and a body damaged on the way up (the server's BadDigest) is sent once more.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote, urlparse, urlunparse

from stoa.transport.objects import (
    KeyNotFound,
    ObjectTooLarge,
    RangeNotSatisfiable,
    StoreError,
    as_bytes,
    check_max_bytes,
    check_range,
    validate_prefix,
    validate_start_after,
    validate_key,
)

__all__ = ["S3Config", "S3Store"]

log = logging.getLogger(__name__)




@dataclass(frozen=True)
class S3Config:
    """Tuning for :class:`S3Store`. Retries are botocore's alone (one layer)."""

    max_attempts: int = 8
    """Attempts per request, including the first (botocore retries throttling, 5xx, timeouts, resets)."""
    retry_mode: Literal["standard", "adaptive"] = "standard"
    """botocore's retry mode: ``standard`` (exponential backoff with full jitter, capped at 20 s) or
    ``adaptive`` (standard plus a client-side rate limiter that slows down after throttling)."""
    connect_timeout_s: float = 10.0
    """Seconds to open a connection."""
    read_timeout_s: float = 60.0
    """Seconds of silence on an open connection before it counts as dead. The timeout is per socket
    read, so it measures progress: a slow link that keeps delivering bytes never trips it."""
    multipart_threshold: int = 64 << 20
    """Objects at least this large are uploaded in parts."""
    part_size: int = 16 << 20
    """Size of each part of a multipart upload (S3 needs >= 5 MiB except the last)."""
    download_part_size: int = 8 << 20
    """Objects larger than this are downloaded in ranged GETs of this size."""
    max_concurrency: int = 4
    """Ranged GETs of one download in flight at once."""
    max_resumes: int = 6
    """A download whose connection breaks mid-body continues from the last byte received; this many
    consecutive breaks without a new byte end it."""
    addressing_style: str | None = None
    """``"path"``, ``"virtual"`` or None (path-style when an endpoint URL is given, else auto)."""
    profile: str | None = None
    """AWS profile name; None uses the standard credential chain (environment, config files, roles)."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_attempts <= 50:
            raise ValueError(f"max_attempts must be in [1, 50], got {self.max_attempts}")
        if self.retry_mode not in ("standard", "adaptive"):
            raise ValueError(f"retry_mode must be 'standard' or 'adaptive', got {self.retry_mode!r}")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        if self.part_size < 5 << 20:
            raise ValueError(f"part_size must be >= 5 MiB (S3's minimum), got {self.part_size}")
        if self.multipart_threshold < self.part_size:
            raise ValueError("multipart_threshold must be >= part_size")
        if self.download_part_size < 64 << 10:
            raise ValueError(f"download_part_size must be >= 64 KiB, got {self.download_part_size}")
        if not 1 <= self.max_concurrency <= 64:
            raise ValueError(f"max_concurrency must be in [1, 64], got {self.max_concurrency}")
        if not 0 <= self.max_resumes <= 100:
            raise ValueError(f"max_resumes must be in [0, 100], got {self.max_resumes}")
        if self.addressing_style not in (None, "path", "virtual", "auto"):
            raise ValueError(f"addressing_style must be 'path', 'virtual', 'auto' or None, got {self.addressing_style!r}")


_MISSING_CODES = {"NoSuchKey", "404", "NotFound"}  # HEAD answers carry no body, hence "404"
_PRECONDITION_CODES = {"PreconditionFailed", "412"}
_CONFLICT_CODES = {"ConditionalRequestConflict", "409"}
_RANGE_CODES = {"InvalidRange", "416"}
_RESEND_CODES = {"BadDigest"}  # the body was damaged on the way: send it again
_READ_CHUNK = 64 << 10  # a read that breaks loses what it had buffered: keep the loss small
_MAX_CONTINUATIONS = 256  # per ranged piece, progress or not: a hard bound on one download's requests


class _Changed(Exception):
    """The object was replaced or deleted during a multi-request download."""


class S3Store:
    """An S3 bucket (optionally under a key prefix) as an object store.

    Works with AWS S3, Cloudflare R2 (``region="auto"``), MinIO and SeaweedFS. Credentials come
    from ``credentials=(access_key, secret_key)``, the endpoint URL's userinfo
    (``https://KEY:SECRET@host``), or the standard AWS environment variables or profile; a
    secret never appears in ``repr``, ``str`` or error messages. botocore retries every request
    with backoff and jitter (:class:`S3Config`); objects of ``config.multipart_threshold`` bytes
    or more go up in parts; objects over ``config.download_part_size`` come down in parallel
    ranged GETs pinned to one version by ``If-Match``; a body that breaks midway continues with
    a ranged GET from the last byte received. ``put_if_absent`` sends ``If-None-Match: *``,
    which S3 (since 2024), R2, MinIO and SeaweedFS honour.
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
        credentials: tuple[str, str] | None = None,
    ):
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix)
        endpoint_url, url_creds = _split_userinfo(endpoint_url)
        credentials = credentials or url_creds
        self._secrets = tuple(s for s in (credentials or ()) if s)
        self.bucket, self.prefix, self.endpoint_url, self.config = bucket, prefix, endpoint_url, config
        self._client = client if client is not None else self._make_client(endpoint_url, region, config, credentials)
        self._counts = _counters(self._client)

    @property
    def stats(self) -> dict[str, int]:
        """What this store's client went through so far (they only grow; shared by stores on one client):
        ``requests`` (HTTP attempts), ``retries`` (attempts after a request's first: 5xx, throttling,
        timeouts, resets), ``resumed_reads`` (downloads continued after a broken body), ``resent``
        (bodies sent again after a damaged upload or a conflict), ``errors`` (operations that failed)."""
        c = self._counts
        return {"requests": c["attempts"], "retries": max(0, c["attempts"] - c["calls"]) + c["retried_bodies"],
                "resumed_reads": c["resumed_reads"], "resent": c["resent"], "errors": c["errors"]}

    @staticmethod
    def _make_client(endpoint_url: str | None, region: str | None, config: S3Config,
                     credentials: tuple[str, str] | None) -> Any:
        import boto3
        from botocore.config import Config as BotoConfig

        style = config.addressing_style or ("path" if endpoint_url else "auto")
        boto_cfg = BotoConfig(
            retries={"mode": config.retry_mode, "total_max_attempts": config.max_attempts},
            connect_timeout=config.connect_timeout_s,
            read_timeout=config.read_timeout_s,
            max_pool_connections=max(10, 2 * config.max_concurrency),
            s3={"addressing_style": style},
            # No trailing CRC checksums (third-party servers differ in support); uploads carry
            # Content-MD5 instead, which all of them check.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        session = boto3.session.Session(profile_name=config.profile)
        keys = {"aws_access_key_id": credentials[0], "aws_secret_access_key": credentials[1]} if credentials else {}
        return session.client("s3", endpoint_url=endpoint_url, region_name=region, config=boto_cfg, **keys)

    def __repr__(self) -> str:
        where = f" at {self.endpoint_url}" if self.endpoint_url else ""
        return f"S3Store(s3://{self.bucket}/{self.prefix}{where})"

    def _full(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _redact(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        return text

    def _fail(self, op: str, key: str, e: Exception) -> StoreError:
        self._counts["errors"] += 1
        return StoreError(self._redact(f"{self}: {op} {key!r} failed: {_describe(e)}"))

    def put(self, key: str, data: bytes) -> None:
        full, data = self._full(key), as_bytes(data)
        for attempt in range(2):
            try:
                if len(data) >= self.config.multipart_threshold:
                    self._multipart(full, data, {})
                else:
                    self._client.put_object(Bucket=self.bucket, Key=full, Body=data, ContentMD5=_md5(data))
                return
            except Exception as e:
                # botocore does not retry a 4xx; BadDigest means our bytes were damaged on the
                # way (Content-MD5 caught it), so we send them once more ourselves.
                if _error_code(e) in _RESEND_CODES and attempt == 0:
                    self._counts["resent"] += 1
                    continue
                raise self._fail("put", key, e) from e

    def put_if_absent(self, key: str, data: bytes) -> bool:
        full, data = self._full(key), as_bytes(data)
        resent = False
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
                    if _retry_attempts(e) > 0 and self._get_or_none(key, len(data)) == data:
                        return True
                    return False
                if code in _RESEND_CODES and not resent:
                    resent = True  # damaged on the way (see put)
                    self._counts["resent"] += 1
                    continue
                if code in _CONFLICT_CODES and attempt + 1 < self.config.max_attempts:
                    # S3 answers 409 to racing conditional writes and asks callers to retry;
                    # botocore does not, so this (bounded, jittered) loop is the only layer.
                    self._counts["resent"] += 1
                    _sleep_backoff(attempt)
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

    def _get_or_none(self, key: str, max_bytes: int) -> bytes | None:
        try:
            return self.get(key, max_bytes=max_bytes)
        except StoreError:
            return None

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        full, limit = self._full(key), check_max_bytes(max_bytes)
        for attempt in range(2):
            try:
                return self._download(full, key, limit)
            except _Changed as e:
                if attempt:  # replaced twice during our download: report, do not spin
                    raise StoreError(self._redact(f"{self}: get {key!r} failed: {e}")) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def get_range(self, key: str, start: int, end: int) -> bytes:
        from botocore.exceptions import ClientError

        full, (start, end) = self._full(key), check_range(start, end)
        if start == end:  # no HTTP range names zero bytes
            size = self.size(key)
            if end > size:
                raise RangeNotSatisfiable(f"{self}: {key!r} is {size} bytes; cannot read [{start}, {end})", key, size, end)
            return b""
        for attempt in range(2):
            try:
                resp = self._request("get_range", key, full, Range=f"bytes={start}-{end - 1}")
            except ClientError:  # 416: the object ends before start
                size = self.size(key)
                raise RangeNotSatisfiable(f"{self}: {key!r} is {size} bytes; cannot read [{start}, {end})",
                                          key, size, end) from None
            total, length = _total_size(resp), int(resp.get("ContentLength", -1))
            if not resp.get("ContentRange") or _range_start(resp) != start:
                resp["Body"].close()
                raise StoreError(f"{self}: get_range {key!r}: the server ignored a ranged GET (bytes={start}-{end - 1})")
            if total < end:
                resp["Body"].close()
                raise RangeNotSatisfiable(f"{self}: {key!r} is {total} bytes; cannot read [{start}, {end})",
                                          key, total, end)
            if length != end - start:
                resp["Body"].close()
                raise StoreError(f"{self}: get_range {key!r}: {length} bytes announced for [{start}, {end})")
            buf = bytearray(end - start)
            try:
                self._fill(full, key, buf, start, end, resp.get("ETag"), resp, base=start)
                return bytes(buf)
            except _Changed as e:
                if attempt:
                    raise StoreError(self._redact(f"{self}: get_range {key!r} failed: {e}")) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _request(self, op: str, key: str, full: str, **kw: Any) -> dict:
        from botocore.exceptions import ClientError
        from urllib3.exceptions import HTTPError as BrokenBody

        for attempt in range(self.config.max_attempts):
            try:
                return self._client.get_object(Bucket=self.bucket, Key=full, **kw)
            except ClientError as e:
                code = _error_code(e)
                if code in _MISSING_CODES:
                    raise KeyNotFound(f"{self}: no object {key!r}") from None
                if code in _PRECONDITION_CODES and "IfMatch" in kw:
                    raise _Changed(f"{key!r} was replaced during the download") from None
                if code in _RANGE_CODES:
                    raise
                raise self._fail(op, key, e) from e
            except BrokenBody as e:
                # botocore reads a GET's error answer (404, 412, 5xx) outside its retry layer, so
                # a connection that breaks inside that body reaches us raw: ask again.
                if attempt + 1 >= self.config.max_attempts:
                    raise self._fail(op, key, e) from e
                self._counts["retried_bodies"] += 1
                _sleep_backoff(attempt)
            except Exception as e:
                raise self._fail(op, key, e) from e
        raise AssertionError("unreachable")  # pragma: no cover

    def _download(self, full: str, key: str, limit: int | None) -> bytes:
        from botocore.exceptions import ClientError

        # The first ranged GET tells the size (Content-Range) before any body byte is read, and
        # asks for at most limit+1 bytes, so an object over the limit is never downloaded.
        first = self.config.download_part_size if limit is None else min(self.config.download_part_size, limit + 1)
        try:
            resp = self._request("get", key, full, Range=f"bytes=0-{max(first, 1) - 1}")
        except ClientError:  # 416: a zero-byte object has no byte 0
            resp = self._request("get", key, full)
        total = _total_size(resp)
        if limit is not None and total > limit:
            resp["Body"].close()
            raise ObjectTooLarge(f"{self}: {key!r} is {total} bytes, over the {limit}-byte limit", key, total, limit)
        etag = resp.get("ETag")
        got = min(total, int(resp.get("ContentLength", total)))
        buf = bytearray(total)
        self._fill(full, key, buf, 0, got, etag, resp)
        step = self.config.download_part_size
        pieces = [(s, min(s + step, total)) for s in range(got, total, step)]
        if len(pieces) == 1 or self.config.max_concurrency == 1:
            for s, e in pieces:
                self._fill(full, key, buf, s, e, etag, None)
        elif pieces:
            with ThreadPoolExecutor(min(self.config.max_concurrency, len(pieces))) as pool:
                for f in [pool.submit(self._fill, full, key, buf, s, e, etag, None) for s, e in pieces]:
                    f.result()
        return bytes(buf)

    def _fill(self, full: str, key: str, buf: bytearray, start: int, end: int, etag: str | None,
              resp: dict | None, base: int = 0) -> None:
        """Read the object's bytes [start, end) into ``buf`` from ``start - base`` on; continue after
        a broken body from where it stopped."""
        view, pos, stalled = memoryview(buf), start, 0
        for _ in range(_MAX_CONTINUATIONS):
            if pos >= end:
                return
            if resp is None:
                kw = {"Range": f"bytes={pos}-{end - 1}"}
                if etag:
                    kw["IfMatch"] = etag
                resp = self._request("get", key, full, **kw)
                if etag and resp.get("ETag") not in (None, etag):
                    resp["Body"].close()
                    raise _Changed(f"{key!r} was replaced during the download")
                if _range_start(resp) != pos:
                    resp["Body"].close()
                    raise StoreError(f"{self}: get {key!r}: the server ignored a ranged GET (bytes={pos}-)")
            body, before = resp["Body"], pos
            try:
                while pos < end:
                    chunk = body.read(min(_READ_CHUNK, end - pos))
                    if not chunk:
                        raise _ShortRead(f"read {pos - start} of {end - start} bytes")
                    view[pos - base:pos - base + len(chunk)] = chunk
                    pos += len(chunk)
            except Exception as e:
                # botocore retries requests, but cannot see a body that breaks after the
                # headers arrived; we continue with a ranged GET (no byte is fetched twice).
                stalled = 0 if pos > before else stalled + 1
                if stalled > self.config.max_resumes:
                    raise self._fail("get", key, e) from e
                self._counts["resumed_reads"] += 1
                log.info("%s: get %r broke at byte %d (%s); continuing", self, key, pos, _describe(e))
                if stalled:
                    _sleep_backoff(stalled)
            finally:
                body.close()
                resp = None
        raise StoreError(f"{self}: get {key!r} failed: over {_MAX_CONTINUATIONS} broken connections")

    def size(self, key: str) -> int:
        full = self._full(key)
        try:
            return int(self._client.head_object(Bucket=self.bucket, Key=full)["ContentLength"])
        except Exception as e:
            if _error_code(e) in _MISSING_CODES:
                raise KeyNotFound(f"{self}: no object {key!r}") from None
            raise self._fail("size", key, e) from e

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
            return True
        except KeyNotFound:
            return False

    def list(self, prefix: str = "", start_after: str | None = None) -> list[str]:
        prefix, after = validate_prefix(prefix), validate_start_after(start_after)
        base = f"{self.prefix}/" if self.prefix else ""
        kw = {"Bucket": self.bucket, "Prefix": base + prefix}
        if after is not None:
            kw["StartAfter"] = _just_below(base + after)
        out = []
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(**kw):
                out.extend(obj["Key"][len(base):] for obj in page.get("Contents", ()))
        except Exception as e:
            raise self._fail("list", prefix, e) from e
        return sorted(k for k in out if after is None or k > after)

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


def _counters(client: Any) -> dict[str, int]:
    """Counters kept on the boto3 client: one API call is one ``before-call`` event and each of its
    HTTP attempts one ``before-send`` event, so retries = attempts - calls."""
    counts = getattr(client, "_stoa_counts", None)
    if counts is None:
        counts = dict.fromkeys(("calls", "attempts", "retried_bodies", "resumed_reads", "resent", "errors"), 0)
        events = getattr(getattr(client, "meta", None), "events", None)
        if events is not None:
            def on(name: str) -> Any:
                def count(**_: Any) -> None:
                    counts[name] += 1
                return count
            events.register("before-call.s3", on("calls"), unique_id="stoa-count-calls")
            events.register("before-send.s3", on("attempts"), unique_id="stoa-count-attempts")
        try:
            client._stoa_counts = counts
        except AttributeError:
            pass
    return counts


def _total_size(resp: dict) -> int:
    """The whole object's size from a (ranged) GET response: Content-Range's total, else Content-Length."""
    cr = resp.get("ContentRange")
    if cr:
        total = cr.rpartition("/")[2]
        if total.isdigit():
            return int(total)
    return int(resp.get("ContentLength", 0))


def _range_start(resp: dict) -> int:
    cr = resp.get("ContentRange") or ""
    head = cr.partition(" ")[2].partition("-")[0]
    return int(head) if head.isdigit() else 0


def _just_below(s: str) -> str:
    """A string a little below ``s`` that names no folder; the caller filters out the extra keys.

    SeaweedFS lists folder by folder and skips a whole folder when StartAfter names it exactly
    (``a/b`` skips ``a/b/c``, which S3 lists); asking from just below avoids that.
    """
    c = ord(s[-1]) - 1 if s else 0
    if c == ord("/"):
        c -= 1
    return s[:-1] + chr(c) + "\U0010ffff" if c > 32 and not 0xD800 <= c <= 0xDFFF else s


def _split_userinfo(url: str | None) -> tuple[str | None, tuple[str, str] | None]:
    """``https://KEY:SECRET@host/...`` -> (``https://host/...``, (KEY, SECRET))."""
    if not url:
        return url, None
    p = urlparse(url)
    if "@" not in p.netloc:
        return url, None
    userinfo, _, host = p.netloc.rpartition("@")
    user, sep, secret = userinfo.partition(":")
    if not (user and sep and secret):
        raise ValueError("an endpoint URL with userinfo needs both KEY and SECRET (https://KEY:SECRET@host)")
    return urlunparse(p._replace(netloc=host)), (unquote(user), unquote(secret))


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
    time.sleep(random.uniform(0, min(cap, base * 2**attempt)))  # full jitter: racing clients spread out
