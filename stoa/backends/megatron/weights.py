"""The Megatron learner's weights in Hugging Face terms: an HF folder loaded into this rank's
shard of the model (its pipeline stage's layers, its tensor-parallel slice), and the whole
model gathered back as HF tensors on global rank 0, from the parameters or from the distributed
optimizer's float32 master copy. The tensor layouts themselves are :mod:`.convert`'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from safetensors import safe_open

from stoa.backends.learner import LearnerError

from .convert import ConversionError, hf_shapes, hf_to_megatron, megatron_to_hf, renumber
from .masters import master_state, owned
from .parallel import all_sum

__all__ = ["HFFolder", "gather_hf", "load_hf", "master", "stage_state"]


class Sharded(Protocol):
    """What these functions read of a learner (:class:`.learner.MegatronLearner` is one): its
    model, its place in the parallel layout and its HF folder."""

    hf_dir: Path
    arch: Any
    """The model's shape (:class:`.convert.Arch`)."""
    attention: str
    tp: int
    pp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    pre: bool
    """Whether this rank's stage holds the embeddings (the first stage)."""
    post: bool
    """Whether it holds the output layer (the last stage)."""
    layers: range
    """The decoder layers (global numbers) of this rank's stage."""
    on_cuda: bool
    device: torch.device
    model: torch.nn.Module

    def chained_optimizers(self) -> list: ...

    def load_local(self, state: Mapping[str, torch.Tensor], where: str) -> None: ...


class HFFolder(Mapping):
    """Lazy ``{name: tensor}`` over the ``*.safetensors`` files of an HF folder."""

    def __init__(self, folder: Path) -> None:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise LearnerError(f"{folder} holds no *.safetensors weights (other formats are not read)")
        self._where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    self._where[k] = f

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(str(self._where[name]), framework="pt") as h:
            return h.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def stage_state(ln: Sharded, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's Megatron tensors (stage-local layer numbers) from HF tensors."""
    tied = ln.arch.tie_word_embeddings
    state = hf_to_megatron(hf, ln.arch, tp_rank=ln.tp_rank, tp_size=ln.tp,
                           fused_norms=ln.attention == "te", layers=ln.layers,
                           embedding=ln.pre or (ln.post and tied), head=ln.post)
    if ln.post and tied and not ln.pre:  # the last stage keeps its own copy of a tied head
        state["output_layer.weight"] = state["embedding.word_embeddings.weight"]
    if not ln.pre:
        state.pop("embedding.word_embeddings.weight", None)
    return renumber(state, -ln.layers.start)


def load_hf(ln: Sharded) -> None:
    """Load ``ln.hf_dir``'s weights into this rank's shard of the model."""
    try:
        state = stage_state(ln, HFFolder(ln.hf_dir))
    except (ConversionError, KeyError) as e:
        raise LearnerError(f"{ln.hf_dir}: {e}") from None
    ln.load_local(state, f"{ln.hf_dir}")


def master(ln: Sharded) -> dict[str, torch.Tensor]:
    """This rank's parameters (stage-local Megatron names) in float32, from the master copy."""
    params = dict(ln.model.named_parameters())
    if not ln.on_cuda:
        return {n: p.detach() for n, p in params.items()}
    # The distributed optimizer holds each parameter's float32 master in slices over the
    # data-parallel ranks; every rank writes its slice and a sum assembles the whole.
    out = {}
    dp_group = mpu.get_data_parallel_group()
    full = {name: torch.zeros(p.numel(), dtype=torch.float32, device=ln.device) for name, p in params.items()}
    for opt in ln.chained_optimizers():
        for name, p, r in owned(opt, params):
            full[name][r.start : r.stop] = master_state(opt, p, r)["param"].detach().view(-1)
    for name, p in params.items():
        out[name] = all_sum(full[name], dp_group).view(p.shape)
    return out


def gather_hf(ln: Sharded, local: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors of the whole model on global rank 0 (empty elsewhere)."""
    tp_group = mpu.get_tensor_model_parallel_group()
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(ln.tp)]
    for name in sorted(local):
        t = local[name].contiguous()
        parts = [torch.empty_like(t) for _ in range(ln.tp)]
        if ln.tp > 1:
            dist.all_gather(parts, t, group=tp_group)
        else:
            parts = [t]
        for r in range(ln.tp):
            shards[r][name] = parts[r]
    shards = [renumber(s, ln.layers.start) for s in shards]
    part = megatron_to_hf(shards, ln.arch, fused_norms=ln.attention == "te", layers=ln.layers,
                          embedding=ln.pre, head=ln.post)
    if ln.pp == 1:
        return part if dist.get_rank() == 0 else {}
    if ln.tp_rank != 0 or ln.dp_rank != 0:
        return {}
    # Every stage sends its tensors to stage 0 over the pipeline group, in a fixed order.
    pp_group = mpu.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(pp_group)
    shapes = hf_shapes(ln.arch)
    per_stage = ln.arch.num_layers // ln.pp
    out = dict(part) if ln.pp_rank == 0 else {}
    for stage in range(1, ln.pp):
        names = [k for k in shapes if _stage_of(k, per_stage, ln.pp) == stage]
        for k in names:
            buf = part[k].to(ln.device) if ln.pp_rank == stage else torch.empty(
                shapes[k], dtype=torch.float32, device=ln.device)
            dist.broadcast(buf, src=ranks[stage], group=pp_group)
            if ln.pp_rank == 0:
                out[k] = buf.cpu()
    return out if dist.get_rank() == 0 else {}


def _stage_of(hf_name: str, per_stage: int, pp: int) -> int:
    if hf_name.startswith("model.layers."):
        return int(hf_name.split(".")[2]) // per_stage
    return 0 if hf_name == "model.embed_tokens.weight" else pp - 1
