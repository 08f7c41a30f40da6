"""The Megatron learner's process groups: torch.distributed and megatron's parallel state (made
here when the caller has not), the sum all-reduce the learner's collectives use, and the
tensor-parallel tags its parameters need.
"""

from __future__ import annotations

import math
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from stoa.backends.learner import LearnerError

from .options import MegatronOptions

__all__ = ["all_sum", "init_parallel", "mark_tensor_parallel"]


def free_port() -> int:
    """A free TCP port on the loopback interface (for a world of one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """In-place all-reduce (sum) over ``group`` (default: every rank); a no-op alone."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def init_parallel(opts: MegatronOptions, on_cuda: bool) -> tuple[bool, bool]:
    """Make the process groups ``opts`` asks for where the caller has not: torch.distributed (a
    world of one on a free loopback port unless ``torchrun`` launched this process; NCCL on CUDA,
    gloo otherwise) and megatron's parallel state. Returns whether each was made here
    (``(owns_dist, owns_mpu)``: the learner tears down only those); raises :class:`LearnerError`
    when the world or an existing parallel state does not fit ``opts``."""
    owns_dist = owns_mpu = False
    timeout = timedelta(seconds=opts.timeout_s)
    if not dist.is_initialized():
        backend = "nccl" if on_cuda else "gloo"
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:  # launched by torchrun
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                    timeout=timeout)
        owns_dist = True
    world, model = dist.get_world_size(), opts.tensor_parallel * opts.pipeline_parallel
    if world % model:
        raise LearnerError(f"{world} ranks cannot hold tensor_parallel * pipeline_parallel = {model}-way "
                           "model replicas: the world size must be a multiple of it")
    if mpu.model_parallel_is_initialized():
        have = (mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size())
        if have != (opts.tensor_parallel, opts.pipeline_parallel):
            raise LearnerError(f"megatron is already initialized with (tp, pp) = {have}, "
                               f"not {(opts.tensor_parallel, opts.pipeline_parallel)}")
    else:
        mpu.initialize_model_parallel(tensor_model_parallel_size=opts.tensor_parallel,
                                      pipeline_model_parallel_size=opts.pipeline_parallel,
                                      distributed_timeout_minutes=max(1, math.ceil(opts.timeout_s / 60)))
        owns_mpu = True
    return owns_dist, owns_mpu


def mark_tensor_parallel(model: torch.nn.Module) -> None:
    """Tag sharded parameters as megatron's initializers would (``perform_initialization=False``
    skips them); gradient-norm code (ours, and Megatron's optimizer) counts untagged ones once."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        mode = getattr(module, "parallel_mode", None)  # Transformer Engine's linears say "column" / "row"
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)) or mode == "column":
            dim, names = 0, ("weight", "bias")
        elif isinstance(module, RowParallelLinear) or mode == "row":
            dim, names = 1, ("weight",)  # a row-parallel bias is added after the reduce: replicated
        else:
            continue
        for name in names:
            p = getattr(module, name, None)
            if isinstance(p, torch.nn.Parameter) and not hasattr(p, "tensor_model_parallel"):
                set_tensor_model_parallel_attributes(p, True, dim, 1)
