"""Read a Megatron learner checkpoint back into whole Hugging Face tensors, offline.

Needs torch and safetensors only (no megatron-core, no process group): a checkpoint written by
``tensor_parallel x pipeline_parallel x data_parallel`` ranks on a GPU box can be exported on a
laptop. The tensors are the model's parameters as the learner computed with them (float32 on
CPU, the compute dtype, bf16 by default, on CUDA), taken from the data-parallel rank 0 files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from stoa.backends.learner import LearnerError, read_checkpoint_meta

from .convert import Arch, ConversionError, megatron_to_hf, renumber

__all__ = ["FORMAT", "RANK_KEYS", "hf_state"]

FORMAT = "stoa.megatron_learner.v1"
RANK_KEYS = ("tp_rank", "pp_rank", "dp_rank")
"""Safetensors metadata of each rank file: that rank's coordinates in the parallel layout."""


def _coords(rank: int, metadata: dict[str, str] | None, tp: int, dp: int) -> tuple[int, int, int]:
    """(tp_rank, pp_rank, dp_rank) of a rank file: its metadata, else megatron's default rank order
    (``tp-cp-ep-dp-pp``: tensor ranks vary fastest, pipeline stages slowest)."""
    if metadata and all(k in metadata for k in RANK_KEYS):
        return tuple(int(metadata[k]) for k in RANK_KEYS)  # type: ignore[return-value]
    return rank % tp, rank // (tp * dp), (rank // tp) % dp


def hf_state(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """HF-named tensors of the whole model in the checkpoint at ``path``, and its ``meta.json``.

    Raises:
        LearnerError: not a Megatron checkpoint, rank files missing, or tensors that do not map.
    """
    meta = read_checkpoint_meta(path, FORMAT)
    try:
        arch = Arch(**meta["arch"])
        lay = meta["layout"]
        tp, pp, dp, world = (int(lay[k]) for k in ("tp", "pp", "dp", "world"))
        fused = lay.get("attention") == "te"
    except (KeyError, TypeError, ValueError, ConversionError) as e:
        raise LearnerError(f"{path}/meta.json: bad arch or layout ({e})") from None
    files = {int(f.name[4:9]): f for f in path.glob("rank?????.safetensors")}
    if sorted(files) != list(range(world)):
        raise LearnerError(f"{path} should hold {world} rank files rank00000..rank{world - 1:05d}.safetensors, "
                           f"found {len(files)}")
    wanted: dict[tuple[int, int], Path] = {}
    for rank, f in files.items():
        with safe_open(str(f), framework="pt") as h:
            t, p, d = _coords(rank, h.metadata(), tp, dp)
        if d == 0:
            wanted[(t, p)] = f
    per_stage = arch.num_layers // pp
    out: dict[str, torch.Tensor] = {}
    for p in range(pp):
        shards = []
        for t in range(tp):
            if (t, p) not in wanted:
                raise LearnerError(f"{path}: no rank file for tensor rank {t} of pipeline stage {p}")
            with safe_open(str(wanted[(t, p)]), framework="pt") as h:
                local = {k[len("model/"):]: h.get_tensor(k) for k in h.keys() if k.startswith("model/")}  # noqa: SIM118
            shards.append(renumber(local, p * per_stage))
        layers = range(p * per_stage, (p + 1) * per_stage)
        try:
            out.update(megatron_to_hf(shards, arch, fused_norms=fused, layers=layers,
                                      embedding=p == 0, head=p == pp - 1))
        except ConversionError as e:
            raise LearnerError(f"{path}: {e}") from None
    return out, meta

