"""Every duplicate check of the trainer's intake, in one place.

Two prints, both remembered across polls and bounded:

* the payload's sha256: a batch whose episode bytes were accepted before (a replayed, copied or
  re-numbered batch) is a duplicate; the last ``max_hashes`` are part of the intake's checkpoint;
* one print per group and sender (its samples' tokens and log-probs, whatever the ids): a batch
  that repeats a group its sender's key uploaded before, in this poll or among the last 65,536
  groups, is a duplicate, and so is the other copy in the same poll (neither is known to be the
  original). A group whose samples are all alike has no print: a near-deterministic policy
  repeats such a group honestly, and it carries no advantage to train on anyway. Sealed batches
  whose every token is re-derived from their assigned seed (``redraws``; the trainer's check of
  every episode) get no print either: a converged policy also repeats mixed groups honestly (the same
  item drawn twice, 7 samples of one answer and 1 of another in both: seen in the addition
  example), and a repeated group under another number's seed is not its draws, which that check
  refuses unless the draws coincide, which is honest work.

Copies across keys are not compared here: with assigned work a copy relabelled as the copier's
own fails the assignment or the sampling check (:mod:`stoa.fleet.trust.review`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from stoa.transport import layout
from stoa.transport.exchange import Batch
from stoa.types import Episode

__all__ = ["Copies", "group_prints"]

MAX_GROUP_PRINTS = 1 << 16
"""(sender, group) prints remembered across polls."""


def group_prints(episodes: Sequence[Episode]) -> list[str]:
    """A content print per group of a batch (see the module docstring); none for a group whose
    samples are all alike."""
    groups: dict[str, list[bytes]] = {}
    for ep in episodes:
        h = hashlib.sha256(ep.prompt_tokens.tobytes())
        for seg in ep.segments:
            h.update(seg.kind.encode() + seg.tokens.tobytes())
            if seg.logprobs is not None:
                h.update(seg.logprobs.tobytes())
        groups.setdefault(ep.group_id, []).append(h.digest())
    return [hashlib.sha256(b"".join(sorted(d))).hexdigest()[:32] for d in groups.values() if len(set(d)) > 1]


def _shown(key: str) -> str:
    return repr(key[:120]) + ("..." if len(key) > 120 else "")


class Copies:
    """The intake's memory of what it was sent (see the module docstring).

    Args:
        max_hashes: accepted payload hashes remembered (``trust.max_hashes``).
    """

    def __init__(self, max_hashes: int):
        self.max_hashes = max_hashes
        self.hashes: dict[str, None] = {}  # accepted payload sha256 (32 hex), oldest first
        self.groups: dict[str, None] = {}  # sender:group prints of batches read, oldest first

    def sift(self, batches: Sequence[Batch], redraws: bool = False) -> tuple[list[Batch], list[tuple[Batch, str]]]:
        """``(fresh, duplicates)``: ``batches`` (one poll's, in order) less the copies, and each
        copy with its reason. ``redraws``: every token of a sealed batch will be re-derived from
        its assigned seed, so its groups get no print (the module docstring;
        :attr:`stoa.fleet.trust.roster.Admission.redraws`)."""
        dups: list[tuple[Batch, str]] = []
        loaded = []
        for b in batches:
            digest = b.sha256[:32]
            if digest in self.hashes:
                dups.append((b, "duplicate: the same episode bytes were accepted before (a replayed, copied or "
                                "re-numbered batch)"))
                continue
            self.hashes[digest] = None
            loaded.append(b)
        while len(self.hashes) > self.max_hashes:
            del self.hashes[next(iter(self.hashes))]
        seen: dict[str, int] = {}  # sender:group print -> index of the first batch of this poll
        bad: dict[int, str] = {}
        prints = []
        for i, b in enumerate(loaded):
            sender = b.key_id or f"worker:{b.worker_id}"
            mine = [] if redraws and b.key_id else [f"{sender}:{fp}" for fp in group_prints(b.episodes)]
            prints.append(mine)
            for fp in mine:
                if fp in self.groups:
                    bad[i] = "duplicate: repeats a group this key uploaded in an earlier batch"
                elif fp in seen:
                    j = seen[fp]
                    bad[i] = f"duplicate: repeats a group of {_shown(loaded[j].key)} uploaded by the same key"
                    if j != i:  # the first copy goes too: neither is known to be the original
                        bad.setdefault(j, f"duplicate: a group of it is repeated in {_shown(b.key)} by the same key")
                else:
                    seen[fp] = i
        fresh = []
        for i, b in enumerate(loaded):
            for fp in prints[i]:  # a copy refused here still rules out the next one
                self.groups[fp] = None
            if i in bad:
                dups.append((b, bad[i]))
            else:
                fresh.append(b)
        while len(self.groups) > MAX_GROUP_PRINTS:
            del self.groups[next(iter(self.groups))]
        order = {b.key: i for i, b in enumerate(batches)}
        dups.sort(key=lambda d: order[d[0].key])
        return fresh, dups

    def state(self, pending: Iterable[Batch] = ()) -> list[str]:
        """The payload hashes to checkpoint, less those of ``pending`` batches (delivered again
        after a restart from the checkpoint: not duplicates)."""
        again = {b.sha256[:32] for b in pending}
        return [h for h in self.hashes if h not in again]

    def restore(self, hashes: object) -> None:
        if not isinstance(hashes, list) or not all(isinstance(h, str) and layout.HEX32.fullmatch(h) for h in hashes):
            raise ValueError("malformed state: hashes must be a list of 32 hex characters each")
        self.hashes = dict.fromkeys(hashes[-self.max_hashes:])
