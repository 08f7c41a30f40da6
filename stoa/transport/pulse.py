"""PULSE: exact sparse deltas between weight states, full-state anchors, and state hashes.

This module is the codec's one import path (``from stoa.transport import pulse``); each job
lives in its own module, all pure functions with no I/O:

* :mod:`stoa.transport.pulse_state`: what a state is (a flat ``dict[str, numpy.ndarray]`` of the
  dtypes in :data:`DTYPES`), its hash (:func:`state_hash`, :func:`state_hashes`), its layout
  (:func:`layout_of`) and :class:`PulseError`.
* :mod:`stoa.transport.pulse_codec`: the wire formats and their description: deltas
  (:func:`encode_delta`; decoded against the state they apply to) and anchors
  (:func:`encode_state`, :func:`decode_state`: safetensors files).
* :mod:`stoa.transport.pulse_apply`: applying deltas to a state, fresh (:func:`apply_delta`), in
  place (:func:`apply_delta_inplace`, :func:`apply_deltas_inplace`), checked against the expected
  hash before any write (:func:`apply_deltas_verified`), or to a pipeline stage's share
  (:func:`apply_delta_share`, :func:`apply_deltas_share_verified`, :class:`ShareMismatch`).

Decoders treat every byte as untrusted: any inconsistency raises :class:`PulseError`, and a bad
blob leaves the state it was applied to untouched. ``docs/pulse.md`` has the measurements.
"""

from __future__ import annotations

from stoa.transport.pulse_apply import (
    ShareMismatch,
    apply_delta,
    apply_delta_inplace,
    apply_delta_share,
    apply_deltas_inplace,
    apply_deltas_share_verified,
    apply_deltas_verified,
)
from stoa.transport.pulse_codec import decode_state, encode_delta, encode_state
from stoa.transport.pulse_state import DTYPES, PulseError, layout_of, state_hash, state_hashes

__all__ = [
    "DTYPES",
    "PulseError",
    "apply_delta",
    "apply_delta_inplace",
    "ShareMismatch",
    "apply_delta_share",
    "apply_deltas_inplace",
    "apply_deltas_share_verified",
    "apply_deltas_verified",
    "decode_state",
    "encode_delta",
    "encode_state",
    "layout_of",
    "state_hash",
    "state_hashes",
]
