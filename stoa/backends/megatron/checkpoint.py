"""Megatron learner checkpoints: one safetensors file per rank plus ``meta.json``, nothing pickled.

Each rank writes ``rank{global_rank:05d}.safetensors`` with its parameters (``model/<name>``,
Megatron stage-local names, the model's dtype), its optimizer state (CPU: ``opt/<name>/<field>``
of ``torch.optim.AdamW``; CUDA: ``opt<k>/<name>/<field>`` of the distributed optimizer's
float32 master slice and Adam moments for each parameter this data-parallel rank owns) and its
RNG states; the file's metadata names its (tensor, pipeline, data) coordinates, which
:mod:`.export` reads to merge the shards offline. Rank 0 adds ``meta.json`` (model shape,
parallel layout, step, version, config, the caller's ``extra``) and renames the directory into
place, so a crash leaves no ``path`` or a complete one. All ranks must see one filesystem; a
restore needs the same world size and parallel layout (refused with a message naming both
otherwise).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from safetensors.torch import load_file, save_file

from stoa.backends.learner import (
    LearnerConfig,
    LearnerError,
    checkpoint_extra,
    durable_rename,
    fsync_file,
    read_checkpoint_meta,
)

from .export import FORMAT, RANK_KEYS
from .masters import master_state, owned, set_master_state


class Checkpointed(Protocol):
    """What a checkpoint writes and restores of a learner (:class:`.learner.MegatronLearner` is one):
    its parallel coordinates, model, optimizer, counters and config."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    attention: str
    dtype: torch.dtype
    on_cuda: bool
    device: torch.device
    arch: Any
    """The model's shape (a dataclass, compared as a dict)."""
    model: torch.nn.Module
    optimizer: Any
    config: LearnerConfig
    step: int
    version: int

    def chained_optimizers(self) -> list: ...

    def load_local(self, state: Mapping[str, torch.Tensor], where: str) -> None: ...

    def make_optimizer(self) -> Any: ...

    def restore_counters(self, step: int, version: int) -> None: ...

_OPTIMIZER_FIELDS = ("lr", "betas", "eps", "weight_decay", "grad_clip", "schedule",
                     "warmup_steps", "total_steps", "min_lr_ratio")


def layout(ln: Checkpointed) -> dict[str, Any]:
    return {"tp": ln.tp, "pp": ln.pp, "dp": ln.dp, "world": dist.get_world_size(),
            "attention": ln.attention, "dtype": str(ln.dtype), "cuda": ln.on_cuda}


def rank_tensors(ln: Checkpointed) -> dict[str, torch.Tensor]:
    named = dict(ln.model.named_parameters())
    out = {f"model/{n}": p.detach().cpu().contiguous() for n, p in named.items()}
    if ln.on_cuda:
        for k, opt in enumerate(ln.chained_optimizers()):
            for name, p, r in owned(opt, named):
                for field, v in master_state(opt, p, r).items():
                    out[f"opt{k}/{name}/{field}"] = v.detach().cpu().contiguous()
        for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items():
            out[f"rng/tracker/{name}"] = state.cpu()
        out["rng/cuda"] = torch.cuda.get_rng_state(ln.device)
    else:
        names = {p: n for n, p in named.items()}
        for p, state in ln.optimizer.state.items():
            for field, v in state.items():
                out[f"opt/{names[p]}/{field}"] = v.detach().cpu().contiguous()
    out["rng/cpu"] = torch.get_rng_state()
    return out


def save(ln: Checkpointed, path: Path, extra: dict[str, Any] | None) -> None:
    extra_json = checkpoint_extra(extra)
    if path.exists():  # every rank sees the same filesystem, so all raise or none does
        raise LearnerError(f"checkpoint path {path} already exists")
    rank = dist.get_rank()
    tmp = path.parent / f".{path.name}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a crashed save
        tmp.mkdir(parents=True)
    _barrier()
    coords = dict(zip(RANK_KEYS, (str(ln.tp_rank), str(ln.pp_rank), str(ln.dp_rank))))
    save_file(rank_tensors(ln), str(tmp / f"rank{rank:05d}.safetensors"), metadata=coords)
    fsync_file(tmp / f"rank{rank:05d}.safetensors")
    _barrier()
    if rank == 0:
        meta = {"format": FORMAT, "backend": "megatron", "arch": dataclasses.asdict(ln.arch), "layout": layout(ln),
                "step": ln.step, "version": ln.version, "config": dataclasses.asdict(ln.config), "extra": extra_json}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        fsync_file(tmp / "meta.json")
        durable_rename(tmp, path)
    _barrier()


def load(ln: Checkpointed, path: Path) -> dict[str, Any]:
    rank_file = path / f"rank{dist.get_rank():05d}.safetensors"
    if not (path / "meta.json").is_file():
        raise LearnerError(f"{path} is not a complete Megatron checkpoint (no meta.json)")
    meta = read_checkpoint_meta(path, FORMAT)
    saved, here = meta.get("layout") or {}, layout(ln)
    if isinstance(saved, dict) and any(saved.get(k) != here[k] for k in ("world", "tp", "pp")):
        # Each rank's file holds its own shards and optimizer slice: no resharding on load.
        raise LearnerError(
            f"{path} was written by {saved.get('world')} rank(s) (tensor_parallel={saved.get('tp')}, "
            f"pipeline_parallel={saved.get('pp')}); this job has {here['world']} (tensor_parallel={here['tp']}, "
            f"pipeline_parallel={here['pp']}): resume with the same world size and parallel sizes")
    if not rank_file.is_file():
        raise LearnerError(f"{path} is not a complete Megatron checkpoint for this rank (no {rank_file.name})")
    if meta.get("arch") != dataclasses.asdict(ln.arch):
        raise LearnerError(f"{path} holds another model")
    if meta.get("layout") != layout(ln):
        raise LearnerError(f"{path} was written with layout {meta.get('layout')}, this learner is {layout(ln)}")
    step, version = meta.get("step"), meta.get("version")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (step, version)):
        raise LearnerError(f"{path}: bad step/version {step!r}/{version!r}")
    try:
        fields = {f: meta["config"][f] for f in _OPTIMIZER_FIELDS}
        fields["betas"] = tuple(fields["betas"])
        config = dataclasses.replace(ln.config, **fields)
    except (KeyError, TypeError, ValueError) as e:
        raise LearnerError(f"{path}: bad optimizer config in meta.json: {e}") from None
    saved = load_file(str(rank_file))
    ln.load_local({k[6:]: v for k, v in saved.items() if k.startswith("model/")}, str(rank_file))
    ln.config = config
    ln.optimizer = ln.make_optimizer()
    named = dict(ln.model.named_parameters())
    if ln.on_cuda:
        stepped = any(k.startswith("opt") and k.endswith("/exp_avg") for k in saved)
        for k, opt in enumerate(ln.chained_optimizers()):
            if stepped and len(opt.optimizer.state) == 0:  # allocate Adam moments to copy into
                opt._init_optimizer_states_with_dummy_values()
            for name, p, r in owned(opt, named):
                dst = master_state(opt, p, r)
                try:
                    src = {f: saved[f"opt{k}/{name}/{f}"].to(dst[f].device) for f in dst}
                except KeyError as e:
                    raise LearnerError(f"{rank_file}: missing optimizer tensor {e}") from None
                set_master_state(opt, p, r, src)
        tracker = {k[len("rng/tracker/"):]: v for k, v in saved.items() if k.startswith("rng/tracker/")}
        if tracker:
            tensor_parallel.get_cuda_rng_tracker().set_states(tracker)
        torch.cuda.set_rng_state(saved["rng/cuda"], ln.device)
    else:
        index = {id(p): i for i, p in enumerate(p for g in ln.optimizer.param_groups for p in g["params"])}
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, v in saved.items():
            if key.startswith("opt/"):
                name, _, field = key[4:].rpartition("/")
                if name not in named:
                    raise LearnerError(f"{rank_file}: optimizer state for unknown parameter {name!r}")
                state.setdefault(index[id(named[name])], {})[field] = v
        sd = ln.optimizer.state_dict()
        sd["state"] = state
        ln.optimizer.load_state_dict(sd)
    torch.set_rng_state(saved["rng/cpu"])
    ln.restore_counters(step, version)
    return meta.get("extra") or {}


def _barrier() -> None:
    if dist.get_world_size() > 1:
        dist.barrier()

