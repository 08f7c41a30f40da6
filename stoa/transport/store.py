"""Object stores: the only place where the trainer and the workers meet.

An :class:`ObjectStore` is a flat map from string keys to immutable byte strings with the
semantics every S3-compatible service offers; the protocol, its errors and the key rules are in
:mod:`stoa.transport.objects` and are named here too.

Two implementations: :class:`LocalStore` (a directory; temp file + fsync + rename; symbolic
links refused anywhere under the root) and :class:`S3Store` (``stoa.transport.s3``, importable
from here too; boto3; AWS S3, Cloudflare R2, MinIO, SeaweedFS; large downloads in parallel
ranged GETs that resume after a broken connection). :func:`open_store` picks one from a URL. Keys are ``/``-separated relative paths
and are checked by :func:`validate_key` before any I/O, so no key can escape a LocalStore's
root or a S3Store's prefix.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlparse

if TYPE_CHECKING:
    from stoa.transport.s3 import S3Config, S3Store

__all__ = [
    "KeyNotFound",
    "LocalStore",
    "ObjectStore",
    "ObjectTooLarge",
    "RangeNotSatisfiable",
    "S3Config",
    "S3Store",
    "StoreError",
    "StoreURLError",
    "open_store",
    "validate_key",
]


from stoa.errors import ExpectedFailure
from stoa.transport.objects import (  # the contract every store keeps, named here for its callers
    RESERVED_SEGMENT,
    KeyNotFound,
    ObjectStore,
    ObjectTooLarge,
    RangeNotSatisfiable,
    StoreError,
    as_bytes,
    check_max_bytes,
    check_range,
    validate_key,
    validate_prefix,
    validate_start_after,
)


# ---------------------------------------------------------------------------------------------
# LocalStore
# ---------------------------------------------------------------------------------------------

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_LINK_ERRNOS = {errno.ELOOP, errno.ENOTDIR}  # what O_NOFOLLOW (| O_DIRECTORY) answers on a link


class _Link(Exception):
    """A path segment is a symbolic link (internal; becomes a StoreError)."""


class LocalStore:
    """A directory as an object store. Key ``a/b/c`` is the file ``root/a/b/c``.

    Writes go to ``root/.stoa-tmp/`` first, are fsynced, then renamed into place (``put``) or
    hard-linked (``put_if_absent``, which fails atomically if the name exists), and the target
    directory is fsynced, so a crash leaves either the old object or the whole new one.
    Unlike S3, a key cannot also be the folder of other keys (``a/b`` beside ``a/b/c``).

    Symbolic links are refused anywhere under the root: every operation walks the key one
    folder at a time from an open descriptor of the root with ``O_NOFOLLOW``, so a planted
    link (to a file or a folder, even one swapped in mid-operation) can neither make ``get``
    read a file from outside the root nor make ``put`` write outside it. ``get``, ``size``
    and ``delete`` on a link raise :class:`StoreError` saying so; ``list`` skips links and
    ``exists`` is False for them (a link is never an object).
    """

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            os.close(self._dir_fd(RESERVED_SEGMENT, create=True))
        except _Link:
            raise StoreError(f"{self}: {RESERVED_SEGMENT} is a symbolic link; refusing to write through it") from None
        self._sweep_tmp()

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    # Descriptor walking: every folder is opened relative to its parent with O_NOFOLLOW.

    def _dir_fd(self, folder: str, create: bool = False) -> int:
        """An open descriptor of ``root/folder`` ("" is the root); raises _Link on a link."""
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for seg in folder.split("/") if folder else ():
                try:
                    nfd = os.open(seg, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(seg, dir_fd=fd)
                        _fsync_fd(fd)
                    except FileExistsError:
                        pass
                    nfd = os.open(seg, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno in _LINK_ERRNOS and _is_link(seg, fd):
                        raise _Link(seg) from None
                    raise
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _parent_fd(self, key: str, create: bool = False) -> tuple[int, str]:
        folder, _, name = validate_key(key).rpartition("/")
        return self._dir_fd(folder, create), name

    def _refused(self, op: str, key: str) -> StoreError:
        return StoreError(f"{self}: {op} {key!r} refused: a symbolic link is on its path "
                          "(links are never followed; they could lead outside the store)")

    def _sweep_tmp(self, max_age_s: float = 24 * 3600) -> None:
        # Temp files of writers that crashed mid-put; a day-old one is not in use.
        now = time.time()
        fd = self._dir_fd(RESERVED_SEGMENT)
        try:
            for name in os.listdir(fd):
                try:
                    if now - os.stat(name, dir_fd=fd, follow_symlinks=False).st_mtime > max_age_s:
                        os.unlink(name, dir_fd=fd)
                except OSError:
                    pass
        finally:
            os.close(fd)

    def _write_tmp(self, data: bytes) -> tuple[int, str]:
        """Write ``data`` to a fresh temp file; return (descriptor of the temp folder, its name)."""
        tfd = self._dir_fd(RESERVED_SEGMENT, create=True)
        name = f"put-{secrets.token_hex(8)}"
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600, dir_fd=tfd)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            except BaseException:
                _unlink_quiet(name, tfd)
                raise
        except BaseException:
            os.close(tfd)
            raise
        return tfd, name

    def _install(self, op: str, key: str, data: bytes, link: bool) -> bool:
        data = as_bytes(data)
        validate_key(key)
        try:
            tfd, tmp = self._write_tmp(data)
        except _Link:
            raise self._refused(op, key) from None
        except OSError as e:
            raise StoreError(f"{self}: {op} {key!r} failed: {e}") from e
        try:
            for attempt in range(5):
                dfd, name = self._parent_fd(key, create=True)
                try:
                    if link:
                        os.link(tmp, name, src_dir_fd=tfd, dst_dir_fd=dfd, follow_symlinks=False)
                    else:
                        os.replace(tmp, name, src_dir_fd=tfd, dst_dir_fd=dfd)  # replaces a link, never follows it
                    _fsync_fd(dfd)
                    return True
                except FileExistsError:
                    if link:
                        return False
                    raise
                except FileNotFoundError:  # a concurrent delete pruned the empty folder
                    if attempt == 4:
                        raise
                finally:
                    os.close(dfd)
            raise AssertionError("unreachable")  # pragma: no cover
        except _Link:
            raise self._refused(op, key) from None
        except OSError as e:
            hint = " (the filesystem needs hard links)" if link else ""
            raise StoreError(f"{self}: {op} {key!r} failed{hint}: {e}") from e
        finally:
            _unlink_quiet(tmp, tfd)
            os.close(tfd)

    def put(self, key: str, data: bytes) -> None:
        self._install("put", key, data, link=False)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self._install("put_if_absent", key, data, link=True)

    def _open_file(self, op: str, key: str) -> int:
        try:
            dfd, name = self._parent_fd(key)
        except _Link:
            raise self._refused(op, key) from None
        except (FileNotFoundError, NotADirectoryError):
            raise KeyNotFound(f"{self}: no object {key!r}") from None
        except OSError as e:
            raise StoreError(f"{self}: {op} {key!r} failed: {e}") from e
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | _CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            raise KeyNotFound(f"{self}: no object {key!r}") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise self._refused(op, key) from None
            raise StoreError(f"{self}: {op} {key!r} failed: {e}") from e
        finally:
            os.close(dfd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder is not an object
            os.close(fd)
            raise KeyNotFound(f"{self}: no object {key!r}")
        return fd

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        limit = check_max_bytes(max_bytes)
        fd = self._open_file("get", key)
        with os.fdopen(fd, "rb") as f:
            size = os.fstat(fd).st_size
            if limit is not None and size > limit:
                raise ObjectTooLarge(f"{self}: {key!r} is {size} bytes, over the {limit}-byte limit", key, size, limit)
            try:
                data = f.read() if limit is None else f.read(limit + 1)  # a file growing in place stays bounded
            except OSError as e:
                raise StoreError(f"{self}: get {key!r} failed: {e}") from e
        if limit is not None and len(data) > limit:
            raise ObjectTooLarge(f"{self}: {key!r} grew past the {limit}-byte limit while read", key, len(data), limit)
        return data

    def get_range(self, key: str, start: int, end: int) -> bytes:
        start, end = check_range(start, end)
        fd = self._open_file("get_range", key)
        try:
            size = os.fstat(fd).st_size
            if end > size:
                raise RangeNotSatisfiable(f"{self}: {key!r} is {size} bytes; cannot read [{start}, {end})",
                                          key, size, end)
            parts, pos = [], start
            while pos < end:  # pread may return less than asked (signals, large reads)
                chunk = os.pread(fd, end - pos, pos)
                if not chunk:
                    break
                parts.append(chunk)
                pos += len(chunk)
        except OSError as e:
            raise StoreError(f"{self}: get_range {key!r} failed: {e}") from e
        finally:
            os.close(fd)
        data = b"".join(parts)
        if len(data) != end - start:  # truncated in place while read
            raise RangeNotSatisfiable(f"{self}: {key!r} ended at {start + len(data)} while [{start}, {end}) was read",
                                      key, start + len(data), end)
        return data

    def size(self, key: str) -> int:
        fd = self._open_file("size", key)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def exists(self, key: str) -> bool:
        try:
            dfd, name = self._parent_fd(key)
        except (_Link, OSError):
            return False
        try:
            return stat.S_ISREG(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode)
        except OSError:
            return False
        finally:
            os.close(dfd)

    def list(self, prefix: str = "", start_after: str | None = None) -> list[str]:
        prefix, after = validate_prefix(prefix), validate_start_after(start_after)
        folder = prefix.rpartition("/")[0]
        try:
            fd = self._dir_fd(folder)
        except _Link:
            raise self._refused("list", prefix) from None
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise StoreError(f"{self}: list {prefix!r} failed: {e}") from e
        out: list[str] = []
        try:
            self._scan(fd, folder + "/" if folder else "", prefix, after, out)
        finally:
            os.close(fd)
        return sorted(out)

    def _scan(self, fd: int, rel: str, prefix: str, after: str | None, out: list[str]) -> None:
        with os.scandir(fd) as it:
            entries = list(it)
        for e in entries:
            name = rel + e.name
            if e.is_dir(follow_symlinks=False):
                d = name + "/"
                if (not rel and e.name == RESERVED_SEGMENT) or not (d.startswith(prefix) or prefix.startswith(d)):
                    continue
                if after is not None and d < after and not after.startswith(d):
                    continue  # every key in this folder sorts before start_after
                try:
                    sub = os.open(e.name, _DIR_FLAGS, dir_fd=fd)
                except OSError:
                    continue  # removed, or swapped for a link, since the scan
                try:
                    self._scan(sub, d, prefix, after, out)
                finally:
                    os.close(sub)
            elif e.is_file(follow_symlinks=False) and name.startswith(prefix) and (after is None or name > after):
                out.append(name)

    def delete(self, key: str) -> None:
        parts = validate_key(key).split("/")
        try:
            dfd, name = self._parent_fd(key)
        except _Link:
            raise self._refused("delete", key) from None
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise self._refused("delete", key)
            if stat.S_ISDIR(st.st_mode):
                return
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            return
        except OSError as e:
            raise StoreError(f"{self}: delete {key!r} failed: {e}") from e
        finally:
            os.close(dfd)
        # Drop emptied folders so listings stay cheap; a concurrent put recreates them.
        for depth in range(len(parts) - 1, 0, -1):
            try:
                pfd, name = self._parent_fd("/".join(parts[:depth]))
            except (_Link, OSError):
                break
            try:
                os.rmdir(name, dir_fd=pfd)
            except OSError:
                break
            finally:
                os.close(pfd)


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories


def _unlink_quiet(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# open_store
# ---------------------------------------------------------------------------------------------


class StoreURLError(ExpectedFailure, ValueError):
    """A store location that names no usable store (the message says what to write instead)."""

    exit_code = 2


_SCHEME_HINTS = {
    "r2": "Cloudflare R2 speaks S3: s3://BUCKET/PREFIX?endpoint=https://ACCOUNT_ID.r2.cloudflarestorage.com&region=auto",
    "gs": "Google Cloud Storage speaks S3 with HMAC keys: s3://BUCKET/PREFIX?endpoint=https://storage.googleapis.com",
    "http": "an S3 server at a URL is s3://BUCKET/PREFIX?endpoint=URL",
    "minio": "MinIO speaks S3: s3://BUCKET/PREFIX?endpoint=http://HOST:9000",
}
_SCHEME_HINTS.update(gcs=_SCHEME_HINTS["gs"], https=_SCHEME_HINTS["http"], s3a="write s3:// (s3a and s3n are Hadoop's names)")
_SCHEME_HINTS["s3n"] = _SCHEME_HINTS["s3a"]


def open_store(url: str | os.PathLike[str], *, s3_config: S3Config | None = None,
               create: bool = True) -> LocalStore | S3Store:
    """Open a store from a location string.

    * ``/some/dir``, ``relative/dir`` or ``file:///some/dir``: a :class:`LocalStore`. With
      ``create=False`` (readers such as ``stoa status``) a folder that does not exist is a
      :class:`StoreURLError`, not a new empty store.
    * ``s3://bucket`` or ``s3://bucket/prefix``: an :class:`S3Store`. The endpoint comes from
      ``?endpoint=URL`` in the URL, else ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (unset
      means AWS itself); the region from ``?region=`` or the standard AWS settings.
      Credentials may ride in the URL (``s3://KEY:SECRET@bucket/prefix``) or the endpoint's
      userinfo (``?endpoint=https://KEY:SECRET@host``); they are never shown in reprs or errors.
      ``?read_timeout=SECONDS`` and ``?max_attempts=N`` override those of :class:`S3Config`.

    Raises:
        StoreURLError: a location that names no store (unknown scheme, no bucket, bad query),
            with the spelling to use instead.
    """
    if isinstance(url, os.PathLike):
        return _local(os.fspath(url), create)
    if not isinstance(url, str) or not url:
        raise StoreURLError(f"store location must be a non-empty string, got {url!r}")
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return _local(parsed.netloc + parsed.path, create)
    if parsed.scheme == "s3":
        creds = None
        userinfo, at, bucket = parsed.netloc.rpartition("@")
        if at:
            user, sep, secret = userinfo.partition(":")
            if not (user and sep and secret):
                raise StoreURLError("an s3:// URL with credentials needs both: s3://KEY:SECRET@bucket/prefix")
            creds = (unquote(user), unquote(secret))
        shown = _redact_url(url)
        if not bucket:
            raise StoreURLError(f"{shown!r}: an s3:// URL needs a bucket name: s3://BUCKET/PREFIX")
        query = {k: v[-1] for k, v in parse_qs(parsed.query).items()}
        unknown = set(query) - {"endpoint", "region", "read_timeout", "max_attempts"}
        if unknown:
            raise StoreURLError(f"{shown!r}: unknown query parameters {sorted(unknown)} "
                                "(known: endpoint, region, read_timeout, max_attempts)")
        endpoint = query.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        from dataclasses import replace

        from stoa.transport.s3 import S3Config, S3Store

        try:
            tuning = {k: float(query[k]) if k == "read_timeout" else int(query[k])
                      for k in ("read_timeout", "max_attempts") if k in query}
            config = replace(s3_config or S3Config(), **{("read_timeout_s" if k == "read_timeout" else k): v
                                                         for k, v in tuning.items()})
            return S3Store(bucket, parsed.path.strip("/"), endpoint_url=endpoint, region=query.get("region"),
                           config=config, credentials=creds)
        except ValueError as e:
            raise StoreURLError(f"{shown!r}: {_redact_url(str(e))}") from None
    if parsed.scheme and len(parsed.scheme) > 1:  # one letter: a Windows drive
        import difflib

        hint = _SCHEME_HINTS.get(parsed.scheme) or next(
            (f"did you mean {m}://?" for m in difflib.get_close_matches(parsed.scheme, ["s3", "file"], 1, 0.5)),
            "use a path, file:///PATH or s3://BUCKET/PREFIX")
        raise StoreURLError(f"{_redact_url(url)!r}: unknown store scheme {parsed.scheme!r}: {hint}")
    return _local(url, create)


def _local(path: str, create: bool) -> LocalStore:
    if not create and not Path(path).expanduser().is_dir():
        raise StoreURLError(f"no store at {path}: the folder does not exist (check --store)")
    return LocalStore(path)


def _redact_url(text: str) -> str:
    """Blank the userinfo of every URL in ``text`` (``scheme://KEY:SECRET@`` -> ``scheme://***@``)."""
    return re.sub(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s?#]*@", r"\1***@", text)


def __getattr__(name: str) -> Any:
    # S3Config and S3Store live in stoa.transport.s3 (imported on first use: it needs boto3 only then).
    if name in ("S3Config", "S3Store"):
        from stoa.transport import s3

        return getattr(s3, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
