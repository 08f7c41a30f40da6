"""Shares: the fixed split of a weight state that lets a pipeline stage verify only its part.

Rule ``stoa.shares.layer/1`` assigns every tensor name of a state to one share:

* ``layer.<i>``: names starting ``model.layers.<i>.`` (one share per decoder layer);
* ``embed``: names starting ``model.embed_tokens.``;
* ``head``: everything else (the final norm, an untied ``lm_head``).

A stage of layers ``[a, b)`` of an ``L``-layer model holds exactly the shares ``layer.a`` ..
``layer.<b-1>``, plus ``embed`` when it is the first stage (or the last with a tied head), plus
``head`` when it is the last (:func:`stage_shares`). One share per layer is the only split under
which a stage of *any* contiguous range verifies exactly its own tensors, never a neighbour's;
the cost is one signed hash per layer in each manifest (about 80 bytes a layer).

The publisher signs, per version, each share's :func:`stoa.transport.pulse.state_hash` (the
sub-state's, computed in the same pass as the whole state's hash) and, for an anchor, the size
and sha256 of its safetensors header: a stage reads and checks the header, then range-reads the
spans the header gives for its tensors, and checks them against its shares' hashes
(:class:`stoa.transport.subscriber.ShareSubscriber`). This module is pure: the rule, and range
reading of a tensor file through a caller's ``read(start, end)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping

import numpy as np

from stoa.transport import tensorfile

__all__ = ["MAX_SHARES", "SHARE_RULE", "check_share_key", "read_header", "read_spans", "share_of", "stage_names",
           "stage_shares"]

SHARE_RULE = "stoa.shares.layer/1"
"""The rule's name, signed in every manifest that carries shares."""
MAX_SHARES = 4096
"""Most shares a manifest may sign (a 4094-layer model); a state with more is published without shares."""
_LAYER = re.compile(r"model\.layers\.(\d{1,6})\.")
_KEY = re.compile(r"embed|head|layer\.(?:0|[1-9]\d{0,5})")


def share_of(name: str) -> str:
    """The share ``name`` belongs to under :data:`SHARE_RULE`."""
    m = _LAYER.match(name)
    if m:
        return f"layer.{int(m.group(1))}"
    return "embed" if name.startswith("model.embed_tokens.") else "head"


def check_share_key(key: object) -> bool:
    """Whether ``key`` can name a share (``embed``, ``head`` or ``layer.<i>``, no leading zeros)."""
    return isinstance(key, str) and _KEY.fullmatch(key) is not None


def stage_shares(part: tuple[int, int], layers: int, tied: bool) -> list[str]:
    """The shares a stage of layers ``part = (a, b)`` of a ``layers``-layer model holds."""
    a, b = part
    if not 0 <= a < b <= layers:
        raise ValueError(f"a stage's layers [{a}, {b}) must lie in [0, {layers})")
    out = [f"layer.{i}" for i in range(a, b)]
    if a == 0 or (b == layers and tied):
        out.append("embed")
    if b == layers:
        out.append("head")
    return out


def stage_names(names: Iterable[str], part: tuple[int, int], layers: int, tied: bool) -> list[str]:
    """The entries of a state (``names``: every name of the whole state) that a stage of layers
    ``part`` holds: those of its :func:`stage_shares`. Sorted."""
    keep = set(stage_shares(part, layers, tied))
    return sorted(n for n in names if share_of(n) in keep)


def read_header(read: Callable[[int, int], bytes], size: int
                ) -> tuple[bytes, dict[str, tuple[np.dtype, tuple[int, ...], int, int]]]:
    """The header bytes of a tensor file of ``size`` bytes read by ranges (``read(start, end)``
    returns bytes ``[start, end)``), and its :func:`stoa.transport.tensorfile.index`. Two reads:
    the 8-byte length, then the JSON."""
    first = read(0, 8)
    head = first + read(8, 8 + tensorfile.header_length(first))
    return head, tensorfile.index(head, size)


def read_spans(read: Callable[[int, int], bytes], index: Mapping[str, tuple[np.dtype, tuple[int, ...], int, int]],
               names: Collection[str]) -> tuple[dict[str, np.ndarray], int]:
    """The tensors ``names`` of a file whose :func:`~stoa.transport.tensorfile.index` is ``index``,
    read by ranges: each run of adjacent wanted tensors in one ``read``. Returns writeable arrays
    and the bytes read. A read that returns another length raises ``ValueError``."""
    spans = sorted((index[n][2], index[n][3], n) for n in names)
    out: dict[str, np.ndarray] = {}
    got, i = 0, 0
    while i < len(spans):
        j = i
        while j + 1 < len(spans) and spans[j + 1][0] == spans[j][1]:
            j += 1
        a, b = spans[i][0], spans[j][1]
        buf = read(a, b)
        if len(buf) != b - a:
            raise ValueError(f"a range read of [{a}, {b}) returned {len(buf)} bytes")
        got += len(buf)
        for s0, s1, n in spans[i:j + 1]:
            dt, shape = index[n][0], index[n][1]
            out[n] = np.frombuffer(buf, dt, count=(s1 - s0) // dt.itemsize, offset=s0 - a).reshape(shape).copy()
        i = j + 1
    return out, got
