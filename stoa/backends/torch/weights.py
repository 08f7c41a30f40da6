"""Learner weights as host numpy arrays, whole or one tensor at a time (both learners).

A published version needs the learner's weights on the host only long enough to quantize them:
:func:`host_arrays` hands them over one tensor at a time, so the host never holds a float copy
of the whole model (33 GB at 8B in float32) next to the int8 states.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import numpy as np
import torch

__all__ = ["host_array", "host_arrays"]

Dtype = Literal["float32", "bfloat16"]


def host_array(t: torch.Tensor, dtype: Dtype) -> np.ndarray:
    """A host copy of ``t`` the caller owns: float32, or bfloat16 as ``ml_dtypes.bfloat16``
    (round to nearest even)."""
    if dtype == "float32":
        return t.detach().float().cpu().numpy().copy()
    import ml_dtypes

    return t.detach().to(torch.bfloat16).cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()


def host_arrays(tensors: dict[str, torch.Tensor], dtype: Dtype) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, host_array)`` in ``tensors``' order, dropping each entry from ``tensors`` as it is
    handed over (a gathered copy is then freed tensor by tensor)."""
    for name in list(tensors):
        yield name, host_array(tensors.pop(name), dtype)
