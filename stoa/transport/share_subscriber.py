"""A pipeline stage's side of the weight chain: :class:`ShareSubscriber` follows it like
:class:`~stoa.transport.weight_subscriber.WeightSubscriber` but reads and verifies only the
tensors of its layers (the shares of :mod:`stoa.transport.shares`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from stoa.transport import pulse, shares, tensorfile
from stoa.transport.manifest import MANIFEST_FORMAT_WHOLE, Manifest, Pointer
from stoa.transport.store import KeyNotFound, ObjectStore, RangeNotSatisfiable
from stoa.transport.sync import ChainError, RouteCorrupt, State, SyncResult, same_bytes, sha256_hex
from stoa.transport.weight_subscriber import WeightSubscriber

__all__ = ["ShareSubscriber"]

log = logging.getLogger(__name__)


class ShareSubscriber(WeightSubscriber):
    """A pipeline stage's side: follows a run's signed chain for the tensors of its layers only.

    Args:
        store, run, public_key: as for :class:`WeightSubscriber`.
        part: the stage's layers ``(a, b)``.
        layers: the model's number of decoder layers.
        tied: whether the head is tied to the embeddings (the last stage then holds them too).

    :meth:`sync` works as :meth:`WeightSubscriber.sync` (same pointer, signature, hash-chain and
    route checks; ``have`` is the stage's share) and returns the share of the head version:
    the tensors of :func:`stoa.transport.shares.stage_shares`. From an anchor it reads the
    safetensors header with one range read, checks it against the signed size and sha256, then
    range-reads each run of its tensors at the spans the header gives and checks each share
    against its signed hash; a mismatch is read once more, then routed around. Deltas are
    fetched whole and checked against their signed sha256, then applied to the share
    (:func:`stoa.transport.pulse.apply_deltas_share_verified`): each share is checked against
    its signed hash at every version of the route, and nothing is written unless all match.
    A manifest without per-share hashes (format ``/2``) is refused with :class:`ChainError`.
    The result is always checked before it is returned (``check="now"``).
    """

    def __init__(self, store: ObjectStore, run: str, public_key: Any, part: tuple[int, int], layers: int,
                 tied: bool):
        super().__init__(store, run, public_key)
        self.part, self.layers, self.tied = (int(part[0]), int(part[1])), int(layers), bool(tied)
        self.keys = frozenset(shares.stage_shares(self.part, self.layers, self.tied))
        """The shares this stage holds."""
        self.layout: dict[str, tuple[np.dtype, tuple[int, ...]]] | None = None
        """The whole state's layout (name -> (dtype, shape)) from the last verified anchor header:
        what deltas are decoded against. None until an anchor was read."""

    def sync(self, have: tuple[int, State] | None = None, apply_inplace: bool = False,
             version: int | None = None, check: str = "now") -> SyncResult:
        """:meth:`WeightSubscriber.sync` for this stage's share (``have``: ``(version, share)``)."""
        if check != "now":
            raise ValueError("a stage checks its share before it is used: check must be 'now'")
        return super().sync(have, apply_inplace, version, check)

    def names(self, layout: Mapping[str, Any]) -> list[str]:
        """This stage's tensors among the names of ``layout`` (a whole state's), sorted."""
        return sorted(n for n in layout if shares.share_of(n) in self.keys)

    def _signed(self, m: Manifest) -> dict[str, str]:
        if m.shares is None:
            raise ChainError(f"version {m.version} of run {self.run!r} signs no per-share hashes (a "
                             f"{MANIFEST_FORMAT_WHOLE} manifest): a stage cannot verify its layers from it. Publish "
                             "with shares (WeightPublisher(shares=True), the default), or run whole-model workers")
        h = m.shares.hashes
        n = sum(k.startswith("layer.") for k in h)
        missing = sorted(k for k in self.keys if k.startswith("layer.") and k not in h)
        if n != self.layers or missing:
            raise ChainError(f"version {m.version} signs {n} layer shares{f' (not {missing[:3]})' if missing else ''}; "
                             f"this stage holds layers {self.part} of a {self.layers}-layer model")
        return h

    def _matches(self, state: State, m: Manifest) -> bool:
        signed = self._signed(m)
        if self.layout is None or sorted(state) != self.names(self.layout):
            return False
        try:
            got = pulse.state_hashes(state, shares.share_of)[1]
        except pulse.PulseError:
            return False
        return all(signed.get(k) == v for k, v in got.items())

    def _anchor_cost(self, m: Manifest) -> int:
        if self.layout is None:
            return m.anchor.bytes  # type: ignore[union-attr]
        mine = sum(int(np.prod(shape)) * np.dtype(dt).itemsize for n, (dt, shape) in self.layout.items()
                   if shares.share_of(n) in self.keys)
        return max(1, m.anchor.bytes * mine // max(m.full_state_bytes, 1))  # type: ignore[union-attr]

    def _range(self, key: str, start: int, end: int) -> bytes:
        b = self.store.get_range(key, start, end)
        self._read += len(b)
        return b

    def _anchor_share(self, m: Manifest, expect: Mapping[str, str], problems: list[str]
                      ) -> tuple[State, dict[str, tuple[np.dtype, tuple[int, ...]]]]:
        """This stage's share of ``m``'s anchor by range reads, checked against the signed hashes."""
        key, route = self._keys.payload(m.version, "anchor"), (m.version, "anchor")
        hdr = m.shares.anchor_header  # type: ignore[union-attr]
        assert hdr is not None and m.anchor is not None  # Manifest.parse: an anchor has a signed header
        msg = ""
        for attempt in range(2):
            try:
                head = self._range(key, 0, hdr.bytes)
                if sha256_hex(head) != hdr.sha256:
                    msg = f"{key}: its header ({hdr.bytes} bytes) does not have the signed sha256 {hdr.sha256[:12]}..."
                else:
                    try:
                        idx = tensorfile.index(head, m.anchor.bytes)
                        ok = 8 + tensorfile.header_length(head) == hdr.bytes
                    except tensorfile.TensorFileError as e:
                        raise RouteCorrupt(route, f"{key}: the signed header does not parse: {e}") from None
                    if not ok or len(idx) != m.tensors or {shares.share_of(n) for n in idx} != set(expect):
                        raise RouteCorrupt(route, f"{key}: the signed header does not describe the signed tensors and "
                                              "shares; routing around it")
                    share, _ = shares.read_spans(lambda a, b: self._range(key, a, b), idx,
                                                 self.names(idx))
                    got = pulse.state_hashes(share, shares.share_of)[1]
                    bad = sorted(k for k, v in got.items() if v != expect[k])
                    if not bad:
                        return share, {n: (v[0], v[1]) for n, v in idx.items()}
                    msg = f"{key}: the tensors read for shares {bad[:4]} do not match their signed hashes"
            except KeyNotFound:
                raise RouteCorrupt(route, f"{key} is gone (retention deleted it while syncing); planning another "
                                      "route") from None
            except (RangeNotSatisfiable, ValueError) as e:
                msg = f"{key}: {e} (truncated or replaced)"
            if attempt == 0:
                problems.append(msg + "; reading again")
            log.warning("%s", msg)
        raise RouteCorrupt(route, msg + "; routing around it")

    def _execute(self, ptr: Pointer, target: Manifest, anchor: int | None, deltas: list[int],
                 chain: dict[int, Manifest], have: tuple[int, State] | None, inplace: bool,
                 problems: list[str], defer: bool = False) -> SyncResult:
        base = anchor if anchor is not None else have[0]  # type: ignore[index]
        expect = [self._signed(chain[v]) for v in [base, *deltas]]
        blobs = [self._payload(chain[v], "delta", problems) for v in deltas]  # all verified before any write
        if anchor is None:
            assert have is not None
            route: tuple[int, str] = (have[0], "have")
            if self.layout is None or sorted(have[1]) != self.names(self.layout):
                raise RouteCorrupt(route, f"the held share is not the tensors of layers {self.part} of a layout this "
                                      "subscriber read; re-joining from an anchor")
            layout, base_known = self.layout, False
            work = have[1] if inplace else {k: np.array(a, copy=True, order="C") for k, a in have[1].items()}
        else:
            route, base_known = (anchor, "anchor"), True
            work, layout = self._anchor_share(chain[anchor], expect[0], problems)
        try:
            changed = pulse.apply_deltas_share_verified(work, layout, blobs, expect, shares.share_of, base_known)
        except pulse.ShareMismatch as e:
            bad = route if not base_known or e.step == 0 else (deltas[e.step - 1], "delta")
            raise RouteCorrupt(bad, f"layers {self.part} from {route[1]} {route[0]}: {e}") from None
        except pulse.PulseError as e:
            raise RouteCorrupt(route, f"layers {self.part} from {route[1]} {route[0]}: {e}") from None
        self.layout = layout
        applied = ([(anchor, "anchor")] if anchor is not None else []) + [(v, "delta") for v in deltas]
        used_inplace = anchor is None and inplace
        if anchor is not None:
            changed = sorted(work)
            old = have[1] if have is not None else None
            if inplace and old is not None and sorted(old) == sorted(work) and all(
                    old[n].shape == work[n].shape and old[n].dtype == work[n].dtype and old[n].flags.writeable
                    for n in work):
                changed = [n for n in work if not same_bytes(old[n], work[n])]
                for n in changed:
                    np.copyto(old[n], work[n])
                work, used_inplace = old, True
        return SyncResult(ptr.version, work, self._read, applied, changed, used_inplace, problems, target,
                          ptr.manifest_sha256)
