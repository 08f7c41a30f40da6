"""Applying PULSE deltas (:mod:`stoa.transport.pulse_codec`) to weight states: as fresh arrays
(:func:`apply_delta`), in place (:func:`apply_delta_inplace`, :func:`apply_deltas_inplace`),
in place only if the result has the expected :func:`~stoa.transport.pulse_state.state_hash`
(:func:`apply_deltas_verified`), and to a pipeline stage's share of the state
(:func:`apply_delta_share`, :func:`apply_deltas_share_verified`).

Every blob is decoded and validated before the first write, so a bad blob leaves the state
untouched. Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from stoa.transport.pulse_codec import decode_delta
from stoa.transport.pulse_state import UINT, PulseError, feed, new_hasher, state_hash

__all__ = [
    "ShareMismatch",
    "apply_delta",
    "apply_delta_inplace",
    "apply_delta_share",
    "apply_deltas_inplace",
    "apply_deltas_share_verified",
    "apply_deltas_verified",
]


class ShareMismatch(PulseError):
    """:func:`apply_deltas_share_verified` refused: a blob does not decode, or a part of the share
    does not reach its expected hash. ``step`` is 0 for the share passed in (the base), ``i`` for
    the state after the ``i``-th blob; ``group`` names the part (None for a blob that does not decode)."""

    def __init__(self, message: str, step: int, group: str | None):
        super().__init__(message)
        self.step, self.group = step, group


def apply_delta_inplace(state: dict[str, np.ndarray], blob: bytes) -> list[str]:
    """Apply a delta by writing into ``state``'s arrays; returns the names that changed, sorted.

    The whole blob is decoded and validated before the first write, so a bad blob leaves
    ``state`` untouched. Changed arrays must be C-contiguous and writeable (a live MLX engine
    shares these buffers with its model).
    """
    return apply_deltas_inplace(state, [blob])


def apply_deltas_inplace(state: dict[str, np.ndarray], blobs: Sequence[bytes]) -> list[str]:
    """Apply ``blobs`` in order by writing into ``state``'s arrays, without checking the result;
    returns the names that changed, sorted.

    Every blob is decoded and validated before the first write, so a bad blob leaves ``state``
    untouched. The result is not hashed: the caller checks it (``WeightSubscriber`` does so in the
    background with ``check="background"``), or uses :func:`apply_deltas_verified`.
    """
    decoded, changes = _decode_for_write(state, blobs)
    for entries in decoded:
        _write(state, entries)
    return sorted(changes)


def _decode_for_write(state: Mapping[str, np.ndarray], blobs: Sequence[bytes]
                      ) -> tuple[list[list[tuple[str, np.ndarray, np.ndarray]]], dict[str, list[tuple[np.ndarray, np.ndarray]]]]:
    """Decode every blob against ``state`` and check that each array it changes can be written in
    place: (the decoded blobs in order, name -> its (selector, diffs) in order). Writes nothing."""
    decoded = [decode_delta(state, blob) for blob in blobs]
    changes: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for entries in decoded:
        for name, sel, d in entries:
            changes.setdefault(name, []).append((sel, d))
    for name in changes:
        a = state[name]
        if not (a.flags.c_contiguous and a.flags.writeable):
            raise PulseError(f"{name!r}: in-place apply needs a C-contiguous, writeable array")
    return decoded, changes


def apply_deltas_verified(state: dict[str, np.ndarray], blobs: Sequence[bytes], expect_hash: str) -> list[str]:
    """Apply ``blobs`` in order by writing into ``state``'s arrays, only if the result's
    :func:`state_hash` is ``expect_hash``; returns the names that changed, sorted.

    Every blob is decoded and the result's hash computed (one changed tensor copied at a time)
    before the first write, so on a bad blob or a hash mismatch (:class:`PulseError`) ``state``
    is untouched. Extra memory: the decoded deltas plus a copy of the largest changed tensor.
    """
    decoded, changes = _decode_for_write(state, blobs)

    class _After(Mapping):  # the state the deltas lead to, built one tensor at a time
        def __getitem__(self, name: str) -> np.ndarray:
            if name not in changes:
                return state[name]
            new = np.array(state[name], copy=True, order="C")
            for sel, d in changes[name]:
                _write({name: new}, [(name, sel, d)])
            return new

        def __iter__(self):
            return iter(state)

        def __len__(self) -> int:
            return len(state)

    got = state_hash(_After())
    if got != expect_hash:
        raise PulseError(f"the deltas lead to state {got[:12]}..., not the expected {expect_hash[:12]}...; "
                         "nothing was written")
    for entries in decoded:
        _write(state, entries)
    return sorted(changes)


def _write(state: Mapping[str, np.ndarray], decoded: list[tuple[str, np.ndarray, np.ndarray]]) -> None:
    for name, sel, d in decoded:
        flat = state[name].reshape(-1).view(UINT[d.itemsize])
        flat[sel] += d  # wrapping add in the unsigned ring undoes the encoder's subtraction


class _Shape(Mapping):
    """A whole state's layout with only ``share``'s arrays present: the others are zero-byte
    read-only stand-ins of the right dtype and shape (enough to decode a delta against)."""

    def __init__(self, share: Mapping[str, np.ndarray], layout: Mapping[str, tuple[np.dtype, tuple[int, ...]]]):
        self.share, self.layout = share, layout

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.share:
            return self.share[name]
        dt, shape = self.layout[name]
        return np.broadcast_to(np.zeros((), dt), shape)

    def __iter__(self):
        return iter(self.layout)

    def __len__(self) -> int:
        return len(self.layout)


def _check_share(share: Mapping[str, np.ndarray], layout: Mapping[str, tuple[np.dtype, tuple[int, ...]]]) -> None:
    if set(share) - set(layout):
        raise PulseError(f"share holds tensors the layout lacks: {sorted(set(share) - set(layout))[:5]}")
    for n, a in share.items():
        if (a.dtype, tuple(a.shape)) != (np.dtype(layout[n][0]), tuple(layout[n][1])):
            raise PulseError(f"{n!r}: the share's array does not fit the layout")


def _writeable(share: Mapping[str, np.ndarray], names: Iterable[str]) -> None:
    for n in names:
        if not (share[n].flags.c_contiguous and share[n].flags.writeable):
            raise PulseError(f"{n!r}: in-place apply needs a C-contiguous, writeable array")


def apply_delta_share(share: dict[str, np.ndarray], layout: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
                      blob: bytes, expect_hash: str | None = None) -> list[str]:
    """Apply a whole-state delta to ``share``, a part of the state (a pipeline stage's tensors),
    by writing into its arrays; returns the names of ``share`` that changed, sorted.

    ``layout``: name -> (dtype, shape) of *every* tensor of the whole state (the delta's
    fingerprint covers them all; a stage knows them from the model's config without holding
    them). The whole blob is decoded and checked (crc32, fingerprint, every entry) before the
    first write; entries for tensors outside the share are skipped. Given ``expect_hash`` (the
    :func:`state_hash` the share must reach), nothing is written unless the result has it.
    """
    _check_share(share, layout)
    mine = [(n, sel, d) for n, sel, d in decode_delta(_Shape(share, layout), blob) if n in share]
    _writeable(share, (n for n, _, _ in mine))
    if expect_hash is not None:
        after = dict(share)
        for n, sel, d in mine:
            after[n] = np.array(share[n], copy=True, order="C")
            _write(after, [(n, sel, d)])
        got = state_hash(after)
        if got != expect_hash:
            raise PulseError(f"the delta leads the share to {got[:12]}..., not the expected {expect_hash[:12]}...; "
                             "nothing was written")
    _write(share, mine)
    return sorted(n for n, _, _ in mine)


def apply_deltas_share_verified(share: dict[str, np.ndarray], layout: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
                                blobs: Sequence[bytes], expect: Sequence[Mapping[str, str]],
                                group: Callable[[str], str], base_known: bool = False) -> list[str]:
    """Apply whole-state deltas ``blobs`` in order to ``share`` (as :func:`apply_delta_share`),
    only if every part of the share reaches its expected hash at every step; returns the names
    of ``share`` that changed, sorted.

    The share is split into parts by ``group`` (name -> part); ``expect[0]`` gives each part's
    :func:`state_hash` in ``share`` as passed in, ``expect[i]`` after the ``i``-th blob. A part
    is hashed at each step where a blob changed it; where none did, its expected hash must equal
    the step before. With ``base_known`` the share passed in is known to match ``expect[0]``
    (just verified); otherwise its parts that no blob changes are hashed as they are, and the
    changed ones through their first hash after a change. Every blob is decoded before anything
    is hashed, and nothing is written unless every check passes (:class:`ShareMismatch` says
    which step and part failed). Extra memory: the decoded deltas plus one tensor's copy.
    """
    if len(expect) != len(blobs) + 1:
        raise ValueError(f"expect needs {len(blobs) + 1} entries (the base and one per blob), got {len(expect)}")
    _check_share(share, layout)
    shape = _Shape(share, layout)
    changes: dict[str, list[tuple[int, np.ndarray, np.ndarray]]] = {}
    decoded = []
    for i, blob in enumerate(blobs, 1):
        try:
            mine = [(n, sel, d) for n, sel, d in decode_delta(shape, blob) if n in share]
        except PulseError as e:
            raise ShareMismatch(f"blob {i}: {e}", i, None) from None
        decoded.append(mine)
        for n, sel, d in mine:
            changes.setdefault(n, []).append((i, sel, d))
    _writeable(share, changes)
    parts: dict[str, list[str]] = {}
    for n in sorted(share):
        parts.setdefault(group(n), []).append(n)
    for g, names in sorted(parts.items()):
        steps = sorted({i for n in names for i, _, _ in changes.get(n, ())})
        hashed = steps if base_known or steps else [0]
        hashers = {i: new_hasher() for i in hashed}
        for n in names:
            cur, mine = share[n], changes.get(n, [])
            if 0 in hashers:
                feed(hashers[0], n, cur)
            if mine:
                cur = np.array(cur, copy=True, order="C")
            for i in steps:
                for j, sel, d in mine:
                    if j == i:
                        _write({n: cur}, [(n, sel, d)])
                feed(hashers[i], n, cur)
        got: str | None = None
        for i in range(len(blobs) + 1):
            want = expect[i].get(g)
            if want is None:
                raise ShareMismatch(f"no expected hash for part {g!r} at step {i}", i, g)
            if i in hashers:
                got = hashers[i].hexdigest()
            elif got is None:  # the base, known to match
                got = want
            if got != want:
                at = "as passed in" if i == 0 else f"after blob {i}"
                raise ShareMismatch(f"part {g!r} {at} hashes to {got[:12]}..., not the expected {want[:12]}...; "
                                    "nothing was written", i, g)
    for mine in decoded:
        _write(share, mine)
    return sorted(changes)


def apply_delta(prev_state: Mapping[str, np.ndarray], blob: bytes) -> dict[str, np.ndarray]:
    """The state ``blob`` turns ``prev_state`` into, as fresh arrays; ``prev_state`` is not modified."""
    decoded = decode_delta(prev_state, blob)
    new = {k: np.array(v, copy=True, order="C") for k, v in prev_state.items()}
    _write(new, decoded)
    return new
