"""The int8 weight states a spot-check may still need, held on disk and memory-mapped.

A trainer must be able to re-score an episode under the exact weights that sampled it, i.e.
under any of the last ``max_lag + 1`` published states. Held in RAM that is ``max_lag + 1``
full states (79 GB for an 8B model at ``max_lag`` 8); held here it is disk, and RAM holds only
the pages of the state being read.

Layout of ``directory``: one ``v<version>.safetensors`` file per held state and its commit marker
``v<version>.json`` (``{"version", "sha256", "bytes", "state_hash"}``: the SHA-256 of the whole data
file computed while writing it, and the publisher's state hash when the caller gave one). Both are written to a temporary name, fsynced and renamed, data
first, so a crash leaves either a complete pair or debris that :class:`HeldStates` removes when it
reopens the directory. Files are plain safetensors (a JSON header and raw little-endian arrays);
nothing is ever unpickled. A file is hashed again the first time a process reads it; a mismatch
raises :class:`CorruptStateError` and the file is moved to ``quarantine/``.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from stoa.transport import tensorfile

__all__ = ["CorruptStateError", "HeldStates"]

_NAME = re.compile(r"^v(\d{12})\.(safetensors|json)$")


class CorruptStateError(RuntimeError):
    """A held state's file does not match the hash recorded when it was written."""


class _View(Mapping[str, np.ndarray]):
    """Read-only arrays over one memory-mapped file; the mapping lives as long as any array does."""

    def __init__(self, arrays: dict[str, np.ndarray], nbytes: int) -> None:
        self._arrays, self.nbytes = arrays, nbytes

    def __getitem__(self, k: str) -> np.ndarray:
        return self._arrays[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)


class HeldStates:
    """Weight states by version, on disk under ``directory``, the newest ``keep`` of them.

    ``put`` writes one (atomically; replaces nothing: a version is written once), ``get`` maps one
    read-only, ``prune(min_version)`` drops older ones, ``drop(version)`` one, ``versions()`` lists
    what is held, ``state_hash(version)`` the state hash recorded with one. A new
    instance on an existing directory finds the states a previous process held.
    """

    def __init__(self, directory: str | Path, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory, self.keep = Path(directory), int(keep)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._held: dict[int, dict] = {}
        self._verified: set[int] = set()
        self._recover()
        self._trim()

    # -- paths ----------------------------------------------------------------------------------
    def _data(self, v: int) -> Path:
        return self.directory / f"v{v:012d}.safetensors"

    def _marker(self, v: int) -> Path:
        return self.directory / f"v{v:012d}.json"

    def _recover(self) -> None:
        """Index complete (data + marker) pairs; remove temporaries and half-written pairs."""
        found: dict[int, set[str]] = {}
        for p in self.directory.iterdir():
            m = _NAME.match(p.name)
            if m is None:
                if p.name.endswith(".tmp"):
                    p.unlink(missing_ok=True)
                continue
            found.setdefault(int(m.group(1)), set()).add(m.group(2))
        for v, kinds in found.items():
            if kinds == {"safetensors", "json"}:
                try:
                    rec = json.loads(self._marker(v).read_text())
                    if rec.get("version") != v or not isinstance(rec.get("sha256"), str):
                        raise ValueError("bad marker")
                    if self._data(v).stat().st_size != rec.get("bytes"):
                        raise ValueError("size differs from the marker")
                except (ValueError, OSError):
                    self._quarantine(v, "unreadable marker or truncated file")
                    continue
                self._held[v] = rec
            else:  # data without its marker: a put that did not finish
                self._data(v).unlink(missing_ok=True)
                self._marker(v).unlink(missing_ok=True)

    def _quarantine(self, v: int, why: str) -> None:
        q = self.directory / "quarantine"
        q.mkdir(exist_ok=True)
        for p in (self._data(v), self._marker(v)):
            if p.exists():
                os.replace(p, q / p.name)
        (q / f"v{v:012d}.reason").write_text(why + "\n")
        self._held.pop(v, None)
        self._verified.discard(v)

    def _fsync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- API ------------------------------------------------------------------------------------
    def versions(self) -> list[int]:
        """Held versions, oldest first."""
        return sorted(self._held)

    def __contains__(self, version: object) -> bool:
        return version in self._held

    def nbytes(self) -> int:
        """Bytes on disk of every held state."""
        return sum(int(r["bytes"]) for r in self._held.values())

    def state_hash(self, version: int) -> str | None:
        """The state hash recorded with ``version`` by :meth:`put` (None: not held, or none given)."""
        h = self._held.get(int(version), {}).get("state_hash")
        return h if isinstance(h, str) else None

    def put(self, version: int, state: Mapping[str, np.ndarray], state_hash: str | None = None) -> None:
        """Write ``state`` as ``version`` (streamed from the arrays: no copy in RAM), then drop
        all but the newest ``keep`` versions. A version already held is refused (:meth:`drop` it
        first to replace it). ``state_hash`` (the publisher's name for the state) is recorded."""
        version = int(version)
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        if version in self._held:
            raise ValueError(f"version {version} is already held")
        arrays = {}
        for name, a in state.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
            a = np.asarray(a)
            arrays[name] = a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a
        digest = hashlib.sha256()
        try:
            size = tensorfile.write(self._data(version), [(n, a.dtype, a.shape) for n, a in arrays.items()],
                                    ([a] for a in arrays.values()), digest=digest)
        except tensorfile.TensorFileError as e:
            raise ValueError(f"cannot hold version {version}: {e}") from None
        rec = {"version": version, "sha256": digest.hexdigest(), "bytes": size, "state_hash": state_hash}
        mtmp = self._marker(version).with_name(self._marker(version).name + ".tmp")
        with open(mtmp, "w") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(mtmp, self._marker(version))
        self._fsync_dir()
        self._held[version] = rec
        self._verified.add(version)  # hashed from the very bytes just written
        self._trim()

    def get(self, version: int) -> Mapping[str, np.ndarray] | None:
        """The state of ``version`` as read-only memory-mapped arrays, or None when not held.

        The first read of a version in this process hashes its file; a mismatch quarantines it
        and raises :class:`CorruptStateError`. The arrays stay valid after the version is pruned.
        """
        version = int(version)
        rec = self._held.get(version)
        if rec is None:
            return None
        path = self._data(version)
        try:
            with open(path, "rb") as f:
                if version not in self._verified:
                    digest = hashlib.sha256()
                    for block in iter(lambda: f.read(8 << 20), b""):
                        digest.update(block)
                    if digest.hexdigest() != rec["sha256"]:
                        self._quarantine(version, f"sha256 {digest.hexdigest()} != recorded {rec['sha256']}")
                        raise CorruptStateError(f"held state v{version} is corrupt (hash mismatch); quarantined")
                    self._verified.add(version)
                size = os.fstat(f.fileno()).st_size
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except FileNotFoundError:
            self._held.pop(version, None)
            return None
        try:
            return _View(self._parse(mm, size), size)
        except ValueError as e:
            self._quarantine(version, f"malformed file: {e}")
            raise CorruptStateError(f"held state v{version} is malformed: {e}") from None

    @staticmethod
    def _parse(mm: mmap.mmap | None, size: int) -> dict[str, np.ndarray]:
        if mm is None or size < 8:
            raise ValueError("file too short")
        return tensorfile.read(mm).tensors

    def drop(self, version: int) -> None:
        """Forget ``version`` (marker first: a crash in between leaves data without a marker, which reopening removes)."""
        self._marker(version).unlink(missing_ok=True)
        self._data(version).unlink(missing_ok=True)
        self._held.pop(version, None)
        self._verified.discard(version)

    def prune(self, min_version: int) -> list[int]:
        """Drop every held version below ``min_version``; returns the versions dropped."""
        gone = [v for v in self._held if v < min_version]
        for v in gone:
            self._data(v).unlink(missing_ok=True)
            self._marker(v).unlink(missing_ok=True)
            self._held.pop(v, None)
            self._verified.discard(v)
        return sorted(gone)

    def _trim(self) -> None:
        held = self.versions()
        if len(held) > self.keep:
            self.prune(held[-self.keep])
