"""What the trainer has published, recorded in its own run folder, and the one way it publishes.

The store is not trusted (``docs/trust.md``): anyone with write access to it can delete the
pointer, put back an older signed one, or delete manifests. The trainer's run folder is trusted.
``<run_dir>/published.json`` names the newest version this trainer started to publish, written
(fsynced, renamed) *before* that version's first store write, and its state hash once the store
took it. From that record:

* a version label is used once: a publish at or below the recorded version is refused
  (:class:`PublishRefused`), so one label never names two states, whatever the store says;
* a resume numbers its next version above the checkpoint, the store's head *and* the record
  (:func:`next_version`), and says what the store lost when its head is below the record;
* a version's int8 state is held for spot-checks only once the store has taken that version,
  and a held state whose hash differs from the published one is replaced
  (:meth:`stoa.fleet.trainer.policies.HeldPolicies.keep`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from stoa.fleet.trainer.policies import HeldPolicies
    from stoa.transport.chain import PublishResult, WeightPublisher

__all__ = ["Published", "PublishRefused", "PublishedRecord", "next_version", "publish_once"]

_FORMAT = "stoa.published/1"


class PublishRefused(RuntimeError):
    """A version at or below what this run folder has already published."""


@dataclass(frozen=True)
class Published:
    """The newest version this trainer started to publish."""

    version: int
    state_hash: str | None
    """:func:`stoa.transport.pulse.state_hash` of its weights; None while the store has not taken it
    (or a crash came first: the label is used up all the same)."""


class PublishedRecord:
    """``<run_dir>/published.json``: read it, or replace it atomically (temporary file, fsync, rename)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "published.json"

    def read(self) -> Published | None:
        """The record, or None when this run folder has published nothing. A record that cannot
        be read raises ``ValueError`` (the folder is the trainer's own: never guess past it)."""
        try:
            body = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise ValueError(f"{self.path} cannot be read ({e}); it records the newest version this run "
                             "published, so the trainer will not guess one") from None
        v, h = (body.get("version"), body.get("state_hash")) if isinstance(body, dict) else (None, None)
        if not isinstance(body, dict) or body.get("format") != _FORMAT or isinstance(v, bool) \
                or not isinstance(v, int) or v < 0 or not (h is None or isinstance(h, str)):
            raise ValueError(f"{self.path} is not a {_FORMAT} record: {str(body)[:200]}")
        return Published(v, h)

    def write(self, rec: Published) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps({"format": _FORMAT, "version": rec.version, "state_hash": rec.state_hash}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def next_version(record: PublishedRecord, checkpoint: int | None, head: int | None) -> tuple[int, str | None]:
    """The version to publish next: one above the checkpoint's, the store's head and the record,
    whichever is highest; and, when the store's head is below the record, what the store lost."""
    rec = record.read()
    known = [v for v in (checkpoint, head, None if rec is None else rec.version) if v is not None]
    version = max(known) + 1 if known else 0
    if rec is None or (head is not None and head >= rec.version):
        return version, None
    where = "its pointer is gone" if head is None else f"its head is version {head}"
    return version, (f"the store lost published versions: {where}, but this run folder published up to version "
                     f"{rec.version}; those labels are never used again, publishing version {version} next")


def publish_once(record: PublishedRecord, publisher: WeightPublisher, policies: HeldPolicies, version: int,
                 state: dict[str, np.ndarray], metadata: dict[str, Any]) -> PublishResult:
    """Publish ``state`` as ``version`` and hold it for spot-checks, in the crash-safe order: the
    record (the label is used up), the store's writes, the record's state hash, the held state."""
    rec = record.read()
    if rec is not None and version <= rec.version:
        raise PublishRefused(f"version {version} is not above version {rec.version}, which this run folder "
                             "already published (a label names one state)")
    record.write(Published(version, None))
    result = publisher.publish(version, state, metadata)
    record.write(Published(version, result.state_hash))
    policies.keep(version, state, result.state_hash)
    return result
