"""The order a rollout poll reads new objects in: workers take turns.

A poll reads a bounded number of objects (``PollLimits``). Sorted only by the version in their
names, one worker's many objects (64 tiny junk files named ``v000000000000`` in its own prefix,
which a per-worker credential allows) would fill every poll and starve everyone else. Taken in
turns, each worker's objects still come oldest version first, and in each round every worker with
something new gets one read: one worker's backlog never pushes another's batches out of a poll.
"""

from __future__ import annotations

__all__ = ["in_turns"]


def in_turns(pending: list[tuple[int, str, int, str]]) -> list[tuple[int, str, int, str]]:
    """``(version, worker, seq, key)`` items: round by round, one per worker (its oldest version,
    then lowest number, first); within a round, oldest version first."""
    turn: dict[str, int] = {}
    ranked = []
    for item in sorted(pending):
        turn[item[1]] = turn.get(item[1], -1) + 1
        ranked.append((turn[item[1]], item))
    return [item for _, item in sorted(ranked)]
