"""What an object store is: the :class:`ObjectStore` protocol, its errors and the rules for keys.

An :class:`ObjectStore` is a flat map from string keys to immutable byte strings, with the
semantics every S3-compatible service offers:

* ``put`` replaces an object atomically: a reader sees the old bytes or the new ones, never a
  partial write. ``put_if_absent`` creates an object only if no object has the key, and exactly
  one of several racing writers wins.
* ``get`` returns a whole object or raises :class:`KeyNotFound`; with ``max_bytes`` it refuses
  a larger object (:class:`ObjectTooLarge`) before its body is downloaded. ``get_range`` returns
  exactly the bytes ``[start, end)`` of an object (one ranged GET, one file read), or raises
  :class:`RangeNotSatisfiable` when the object ends before ``end``. ``list`` returns the
  keys under a prefix in sorted order, optionally only those after a key (``start_after``), so
  a poll costs what is new, not what exists; ``delete`` is idempotent.

Keys are ``/``-separated relative paths, checked by :func:`validate_key` before any I/O. This
module imports only :mod:`stoa.errors`: both implementations build on it (``LocalStore`` in
:mod:`stoa.transport.store`, ``S3Store`` in :mod:`stoa.transport.s3`), and :mod:`stoa.transport.store`
names all of it for its callers.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from stoa.errors import ExpectedFailure

__all__ = ["KeyNotFound", "MAX_KEY_BYTES", "ObjectStore", "ObjectTooLarge", "RESERVED_SEGMENT", "RangeNotSatisfiable",
           "StoreError", "as_bytes", "check_max_bytes", "check_range", "validate_key", "validate_prefix",
           "validate_start_after"]


MAX_KEY_BYTES = 1024
RESERVED_SEGMENT = ".stoa-tmp"
"""First key segment reserved for LocalStore's temp files; never a valid key."""


class StoreError(ExpectedFailure, RuntimeError):
    """An object store operation failed (after retries); the message names the key and cause."""


class KeyNotFound(StoreError, KeyError):
    """No object has this key."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "key not found"


class ObjectTooLarge(StoreError):
    """The object is larger than the caller's ``max_bytes``; its body was not downloaded.

    Attributes:
        key: the object's key.
        size: the object's size in bytes, as the store reported it.
        max_bytes: the limit the caller gave.
    """

    def __init__(self, message: str, key: str, size: int, max_bytes: int):
        super().__init__(message)
        self.key, self.size, self.max_bytes = key, size, max_bytes


class RangeNotSatisfiable(StoreError):
    """A ranged read asked for bytes past the object's end; nothing was returned.

    Attributes:
        key: the object's key.
        size: the object's size in bytes, as the store reported it.
        end: the end of the range asked for.
    """

    def __init__(self, message: str, key: str, size: int, end: int):
        super().__init__(message)
        self.key, self.size, self.end = key, size, end


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

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """Return the object's bytes. Raises :class:`KeyNotFound` if there is none.

        With ``max_bytes`` (an int >= 0), an object larger than that raises
        :class:`ObjectTooLarge` without its body being read: the size comes from the same
        open file / response that would deliver the bytes, so an object that grows between a
        size check and the read cannot slip past the limit.
        """
        ...

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object: exactly ``end - start`` of them, or an error.

        ``0 <= start <= end`` (else ``ValueError``). Raises :class:`KeyNotFound` if there is no
        object and :class:`RangeNotSatisfiable` if it is shorter than ``end`` (a truncated or
        replaced object); a reply of any other length is a :class:`StoreError`. The bytes are the
        store's: the caller verifies them against what it expects (a signed hash).
        """
        ...

    def size(self, key: str) -> int:
        """The object's size in bytes. Raises :class:`KeyNotFound` if there is none."""
        ...

    def exists(self, key: str) -> bool:
        """Whether an object has this key."""
        ...

    def list(self, prefix: str = "", start_after: str | None = None) -> list[str]:
        """Keys that start with ``prefix`` (a plain string prefix, not only a folder), sorted.

        With ``start_after``, only keys that sort strictly after it (by code point, which is
        S3's UTF-8 byte order). A poller that remembers the last key it saw lists only what is
        new: on S3 that is one request per 1000 new keys instead of per 1000 existing ones.
        """
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


def validate_prefix(prefix: str) -> str:
    if not isinstance(prefix, str):
        raise ValueError(f"prefix must be a str, got {type(prefix).__name__}")
    if prefix:
        validate_key(prefix + "x")  # a prefix is a key with its tail cut anywhere
    return prefix


def validate_start_after(start_after: str | None) -> str | None:
    if start_after is not None and not isinstance(start_after, str):
        raise ValueError(f"start_after must be a str or None, got {type(start_after).__name__}")
    return start_after or None


def check_max_bytes(max_bytes: int | None) -> int | None:
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
        raise ValueError(f"max_bytes must be an int >= 0 or None, got {max_bytes!r}")
    return max_bytes


def check_range(start: Any, end: Any) -> tuple[int, int]:
    """``(start, end)`` if ``0 <= start <= end`` are ints, else ``ValueError``."""
    for v in (start, end):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"a byte range is two ints, got {start!r}, {end!r}")
    if not 0 <= start <= end:
        raise ValueError(f"a byte range needs 0 <= start <= end, got [{start}, {end})")
    return start, end


def as_bytes(data: Any) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"object data must be bytes, got {type(data).__name__}")
