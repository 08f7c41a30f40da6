"""Each model parameter's float32 master slice and Adam state in Megatron's distributed optimizer.

Megatron's own accessor (``DistributedOptimizer._get_main_param_and_optimizer_states``) finds a
parameter's master by its position in its optimizer group, and that position is counted over the
group's parameters in buffer order while the group's master list holds the float32 parameters
first and the masters of bf16/fp16 parameters after them. In a group that mixes the two (a bf16
model whose norms stay float32, as the local layer spec builds them) it returns another
parameter's master. Here a master is found by identity instead: a bf16/fp16 parameter carries its
own (``param.main_param``); a float32 parameter is its own master, the optimizer holding a view of
this rank's slice of it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from stoa.backends.learner import LearnerError

__all__ = ["master_state", "owned", "set_master_state"]


def _key(t: torch.Tensor) -> tuple[int, int, int]:
    return t.untyped_storage().data_ptr(), t.storage_offset(), t.numel()


def owned(opt: Any, params: Mapping[str, torch.nn.Parameter]) -> Iterator[tuple[str, torch.nn.Parameter, range]]:
    """``(name, param, range)`` for each parameter ``opt`` (one of a chain) holds a slice of on
    this rank; ``range`` is the slice of the flattened parameter."""
    groups = getattr(opt, "model_param_group_index_map", {})
    for name, p in params.items():
        if p in groups:
            r = opt._get_model_param_range_map(p)["param"]
            yield name, p, range(r.start, r.end)


def _master(opt: Any, p: torch.nn.Parameter, r: range) -> torch.Tensor:
    main = getattr(p, "main_param", None)
    if main is None:  # a float32 parameter: the optimizer trains a view of its slice
        views = {_key(q): q for g in opt.optimizer.param_groups for q in g["params"]}
        main = views.get((p.untyped_storage().data_ptr(), p.storage_offset() + r.start, len(r)))
    if main is None or main.numel() != len(r) or main.dtype != torch.float32:
        raise LearnerError(f"the distributed optimizer holds no float32 master of {len(r)} values for a "
                           f"{tuple(p.shape)} {p.dtype} parameter")
    return main


def master_state(opt: Any, p: torch.nn.Parameter, r: range) -> dict[str, torch.Tensor]:
    """``{"param": master slice, **Adam state}`` of parameter ``p`` (slice ``r``), live tensors."""
    main = _master(opt, p, r)
    return {"param": main, **opt.optimizer.state.get(main, {})}


def set_master_state(opt: Any, p: torch.nn.Parameter, r: range, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (the fields of :func:`master_state`) into ``p``'s master and Adam state."""
    main = _master(opt, p, r)
    state = opt.optimizer.state.setdefault(main, {})
    for field, v in tensors.items():
        dst = main if field == "param" else state.get(field)
        if dst is None:
            state[field] = v.clone()
        else:
            dst.detach().copy_(v.view_as(dst))
