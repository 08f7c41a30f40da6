"""The Megatron-core learner (contract: :mod:`stoa.backends.learner`).

A megatron-core ``GPTModel`` built from the HF config (:mod:`.model`), loaded through
:mod:`.convert`, trained with tensor / pipeline / data parallelism:

* CUDA (the real path): one process per GPU under ``torchrun``; parameters in the compute
  dtype (bf16 by default), float32 master weights and Adam moments in Megatron's distributed
  optimizer (sharded over data-parallel ranks), gradients reduced in float32 by Megatron's
  ``DistributedDataParallel``, micro-batches run by Megatron's pipeline schedules.
* CPU (tests and small checks): float32 parameters, ``torch.optim.AdamW``, a plain micro-batch
  loop; tensor and data parallelism over gloo (gradients summed over data-parallel ranks, the
  clipping norm combined over tensor-parallel shards), no pipelining. megatron-core's model
  code calls CUDA-only helpers, so on CPU the *caller* must make them work (see
  ``tests/test_megatron.py``); this module never patches megatron.

Episodes are packed by the planner both learners share (:mod:`stoa.backends.packing`: whole
episodes per row, first-fit decreasing, at most ``micro_batch_tokens`` a row) and fed as THD
packed sequences (``cu_seqlens``: attention and RoPE positions restart at every episode).
Micro-batches are dealt out to the data-parallel ranks; each rank is called with the same full
batch. The objective plumbing (padded masks, per-token advantages, normalizer, metrics) is the
torch learner's too (:class:`stoa.backends.torch.objective.ObjectiveBatch`).

Under several processes, :meth:`MegatronLearner.export_weights` returns the full HF state on
global rank 0 and an empty dict elsewhere, and checkpoints hold one file per rank (restore
needs the same parallel layout).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams

from stoa.algos import Objective
from stoa.backends.learner import Counters, LearnerConfig, LearnerError, check_episodes, lr_at
from stoa.backends.packing import plan_micro_batches
from stoa.backends.torch.objective import ObjectiveBatch
from stoa.backends.torch.weights import host_arrays
from stoa.types import Episode

from . import checkpoint
from . import weights
from .convert import Arch, ConversionError
from .model import build_gpt, resolve_attention, transformer_config
from .ops import vocab_parallel_logprobs
from .options import MegatronOptions
from .parallel import all_sum, init_parallel, mark_tensor_parallel

__all__ = ["MegatronLearner", "MegatronOptions", "make"]


def make(hf_dir: Path, config: LearnerConfig, **options: Any) -> MegatronLearner:
    """Backend entry point used by :func:`stoa.backends.learner.make_learner`."""
    try:
        opts = MegatronOptions(**options)
    except (TypeError, ValueError) as e:
        raise LearnerError(f"bad Megatron learner option: {e}") from None
    return MegatronLearner(hf_dir, config, opts)


# -- micro-batches ------------------------------------------------------------------------------


@dataclass
class _Micro:
    """One forward/backward unit on the device."""

    placements: list[tuple[int, int, int, int]]  # (episode, row, start, length)
    row_len: int
    input_ids: torch.Tensor  # [1, t] packed (THD) or [rows, row_len] padded
    next_ids: torch.Tensor  # [slots] the token each slot predicts (0 where nothing is predicted)
    inv_temp: torch.Tensor  # [slots] float32
    attention_mask: torch.Tensor | None  # [rows, 1, s, s] bool, True = masked (padded layout)
    packed: PackedSeqParams | None
    num_tokens: int
    num_slots: int


def _deal(sizes: Sequence[int], ranks: int) -> list[list[int]]:
    """Assign micro-batches to data-parallel ranks, largest first to the least loaded."""
    load, out = [0] * ranks, [[] for _ in range(ranks)]
    for j in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        out[r].append(j)
        load[r] += sizes[j]
    return [sorted(o) for o in out]


# -- the learner ----------------------------------------------------------------------------------


class MegatronLearner(Counters):
    """A megatron-core GPT trained by one optimizer step per batch (see the module docstring)."""

    def __init__(self, hf_dir: str | Path, config: LearnerConfig = LearnerConfig(),
                 options: MegatronOptions = MegatronOptions()) -> None:
        self.hf_dir = Path(hf_dir)
        try:
            hf_config = json.loads((self.hf_dir / "config.json").read_text())
            self.arch = Arch.from_hf_config(hf_config)
        except FileNotFoundError:
            raise LearnerError(f"{self.hf_dir} is not a Hugging Face model folder (no config.json)") from None
        except (ConversionError, KeyError, TypeError, ValueError) as e:
            raise LearnerError(f"{self.hf_dir}/config.json: {e}") from None
        self.config, self.options = config, options
        if config.threads:
            torch.set_num_threads(config.threads)
        self.on_cuda = (config.device == "auto" and torch.cuda.is_available()) or config.device.startswith("cuda")
        if self.on_cuda and not torch.cuda.is_available():
            raise LearnerError(f"device={config.device!r} but torch sees no CUDA device")
        if self.on_cuda:
            index = int(config.device.split(":")[1]) if ":" in config.device else int(os.environ.get("LOCAL_RANK", 0))
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.dtype = {"auto": torch.bfloat16 if self.on_cuda else torch.float32,
                      "float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]
        if not self.on_cuda and self.dtype != torch.float32:
            raise LearnerError("the Megatron learner on CPU trains in float32 only")
        if not self.on_cuda and options.pipeline_parallel > 1:
            raise LearnerError("pipeline parallelism needs CUDA (megatron's schedules are CUDA-only)")
        try:
            self.arch.check_tp(options.tensor_parallel)
        except ConversionError as e:
            raise LearnerError(str(e)) from None
        self._owns_dist, self._owns_mpu = init_parallel(options, self.on_cuda)
        try:
            self._build(hf_config)
        except BaseException:
            self.close()  # leave no process groups behind on a failed build
            raise

    def _build(self, hf_config: dict[str, Any]) -> None:
        config, options = self.config, self.options
        try:
            torch.cuda.current_device()
        except Exception:  # noqa: BLE001 - torch raises AssertionError/RuntimeError here
            raise LearnerError(
                "megatron-core's model code needs a CUDA device; on a CPU-only machine it runs only "
                "with test shims (see tests/test_megatron.py)") from None
        self.attention = resolve_attention(options.attention, self.device)
        self._packed = config.packing and self.attention != "local"
        self.tp, self.pp = mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size()
        self.tp_rank, self.pp_rank = mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()
        self.dp, self.dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        self.pre, self.post = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
        per_stage = self.arch.num_layers // self.pp
        self.layers = range(self.pp_rank * per_stage, (self.pp_rank + 1) * per_stage)
        """The decoder layers (global numbers) of this rank's pipeline stage."""
        torch.manual_seed(config.seed)
        if self.on_cuda:
            tensor_parallel.model_parallel_cuda_manual_seed(config.seed)
        try:
            self.tf_config = transformer_config(self.arch, tp=self.tp, pp=self.pp, dtype=self.dtype,
                                                cpu_init=not self.on_cuda, recompute=config.gradient_checkpointing)
        except ValueError as e:
            raise LearnerError(str(e)) from None
        self.model = build_gpt(self.arch, self.tf_config, self.attention, pre_process=self.pre, post_process=self.post)
        mark_tensor_parallel(self.model)
        self.model.to(self.device)
        pad = hf_config.get("pad_token_id")
        if self.pre and isinstance(pad, int) and 0 <= pad < self.arch.vocab_size:
            self.model.embedding.word_embeddings.register_forward_hook(partial(_no_grad_at, pad))
        weights.load_hf(self)
        self._step = 0
        self._version = 0
        self._ddp = None
        if self.on_cuda:
            from megatron.core.distributed import (
                DistributedDataParallel,
                DistributedDataParallelConfig,
                finalize_model_grads,
            )

            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True)
            self._ddp = DistributedDataParallel(config=self.tf_config, ddp_config=ddp_config, module=self.model)
            self.tf_config.no_sync_func = self._ddp.no_sync
            self.tf_config.finalize_model_grads_func = finalize_model_grads
        self.optimizer = self.make_optimizer()

    # -- setup ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Tear down the process groups this learner created (none if the caller made them)."""
        if self._owns_mpu:
            mpu.destroy_model_parallel()
            self._owns_mpu = False
        if self._owns_dist and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_dist = False

    def load_local(self, state: Mapping[str, torch.Tensor], where: str) -> None:
        params = dict(self.model.named_parameters())
        if set(state) != set(params):
            raise LearnerError(f"{where}: tensors do not match the model (missing {sorted(set(params) - set(state))[:3]}, "
                               f"unexpected {sorted(set(state) - set(params))[:3]})")
        with torch.no_grad():
            for name, p in params.items():
                if tuple(state[name].shape) != tuple(p.shape):
                    raise LearnerError(f"{where}: {name} has shape {tuple(state[name].shape)}, expected {tuple(p.shape)}")
                p.copy_(state[name])

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    # -- optimizer -----------------------------------------------------------------------------
    def make_optimizer(self):
        c = self.config
        if self.on_cuda:
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            oc = OptimizerConfig(
                optimizer="adam", lr=lr_at(c, 0), min_lr=0.0, weight_decay=c.weight_decay,
                adam_beta1=c.betas[0], adam_beta2=c.betas[1], adam_eps=c.eps, clip_grad=c.grad_clip,
                bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype, use_distributed_optimizer=True)
            return get_megatron_optimizer(oc, [self._ddp])
        params = list(self.model.parameters())
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": c.weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr_at(c, 0), betas=tuple(c.betas), eps=c.eps)

    def reset_optimizer(self, config: LearnerConfig | None = None, keep_state: bool = False) -> None:
        if config is not None:
            keep = ("device", "dtype", "packing", "gradient_checkpointing")
            if any(getattr(config, f) != getattr(self.config, f) for f in keep):
                raise LearnerError(f"reset_optimizer cannot change {list(keep)}; build a new learner")
            self.config = config
        if keep_state:
            return
        self._step = 0
        if self._ddp is not None:
            self._ddp.zero_grad_buffer()
        self.optimizer = self.make_optimizer()

    # -- inputs --------------------------------------------------------------------------------
    def _check(self, episodes: Sequence[Episode], *, train: bool) -> list[np.ndarray]:
        return check_episodes(episodes, self.vocab_size, train=train)

    def _micro(self, rows: list[list[int]], tokens: list[np.ndarray], temps: Sequence[float]) -> _Micro:
        lengths = [len(tokens[i]) for row in rows for i in row]
        row_len = max(sum(len(tokens[i]) for i in row) for row in rows)
        ids = np.zeros((len(rows), row_len), np.int64)
        nxt = np.zeros((len(rows), row_len), np.int64)
        inv = np.ones((len(rows), row_len), np.float32)
        placements = []
        for r, row in enumerate(rows):
            s = 0
            for i in row:
                n = len(tokens[i])
                ids[r, s : s + n] = tokens[i]
                nxt[r, s : s + n - 1] = tokens[i][1:]
                inv[r, s : s + n] = 1.0 / temps[i]
                placements.append((i, r, s, n))
                s += n
        dev = self.device
        mask = packed = None
        if self._packed:
            cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
            if self.attention == "te":
                cu = cu.to(dev)  # Transformer Engine reads cu_seqlens on the GPU; sdpa slices on the host
            packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                     max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
        else:
            real = torch.from_numpy(np.arange(row_len)[None, :] < np.array([len(tokens[r[0]]) for r in rows])[:, None])
            causal = torch.ones(row_len, row_len, dtype=torch.bool).tril()
            mask = ~(causal[None] & real[:, None, :]).unsqueeze(1)  # a query sees earlier real keys only
            mask = mask.to(dev)
        return _Micro(placements, row_len, torch.from_numpy(ids).to(dev), torch.from_numpy(nxt.reshape(-1)).to(dev),
                      torch.from_numpy(inv.reshape(-1)).to(dev), mask, packed, sum(lengths), ids.size)

    def _dummy(self) -> _Micro:
        """A one-token micro-batch with nothing to score (a data-parallel rank with no work)."""
        one = torch.zeros(1, dtype=torch.int64, device=self.device)
        packed = None
        if self._packed:
            cu = torch.tensor([0, 1], dtype=torch.int32, device=self.device if self.attention == "te" else "cpu")
            packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=1, max_seqlen_kv=1)
        mask = None if self._packed else torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        return _Micro([], 1, one[None], one, torch.ones(1, device=self.device), mask, packed, 0, 0)

    def _micro_batches(self, tokens: list[np.ndarray], temps: Sequence[float]) -> tuple[list[_Micro], int, int, int]:
        """This data-parallel rank's micro-batches; the whole batch's token, slot and micro-batch counts."""
        plan = plan_micro_batches([len(t) for t in tokens], self.config.micro_batch_tokens, self._packed)
        sizes = [sum(len(tokens[i]) for row in rows for i in row) for rows in plan]
        slots = sum(len(rows) * max(sum(len(tokens[i]) for i in row) for row in rows) for rows in plan)
        mine = [self._micro(plan[j], tokens, temps) for j in _deal(sizes, self.dp)[self.dp_rank]]
        return mine or [self._dummy()], sum(sizes), slots, len(plan)

    # -- forward -------------------------------------------------------------------------------
    def _slot_logprobs(self, mb: _Micro, logits: torch.Tensor) -> torch.Tensor:
        """float32 ``[slots]``: log-prob of the next token at each slot (the model's last stage)."""
        flat = logits.reshape(-1, logits.shape[-1])
        v_local = flat.shape[-1]
        return vocab_parallel_logprobs(
            flat, mb.next_ids, mb.inv_temp, vocab_start=self.tp_rank * v_local, vocab_size=self.vocab_size,
            group=mpu.get_tensor_model_parallel_group() if self.tp > 1 else None,
            chunk_elements=self.config.logits_chunk_elements)

    def _forward_step(self, loss_of: Callable[[_Micro, torch.Tensor], torch.Tensor], scale: float,
                      data: Iterator[_Micro], model) -> tuple[torch.Tensor, Callable]:
        """Megatron's ``forward_step_func``; the loss function returns ``(loss * scale, {})``."""
        mb = next(data)
        out = model(mb.input_ids, None, mb.attention_mask, packed_seq_params=mb.packed)

        def loss_func(logits: torch.Tensor):
            return loss_of(mb, logits) * scale, {}

        return out, loss_func

    def _run(self, mbs: list[_Micro], loss_of: Callable[[_Micro, torch.Tensor], torch.Tensor], *, train: bool) -> None:
        """Forward (and backward) over this rank's micro-batches; gradients accumulate."""
        if not self.on_cuda:
            for mb in mbs:
                out, loss_func = self._forward_step(loss_of, 1.0, iter([mb]), self.model)
                loss = loss_func(out)[0]
                if train:
                    loss.backward()
            return
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # The schedules divide each loss by the micro-batch count and DDP averages over data-parallel
        # ranks; undo both so gradients are those of the full-batch loss.
        scale = float(len(mbs) * self.dp) if train else 1.0
        get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, loss_of, scale), data_iterator=iter(mbs),
            model=[self._ddp], num_microbatches=len(mbs), seq_length=max(m.input_ids.shape[-1] for m in mbs),
            micro_batch_size=1, forward_only=not train)

    def _scatter(self, lp: torch.Tensor, mb: _Micro, out: dict[int, torch.Tensor]) -> None:
        for i, r, s, n in mb.placements:
            out[i] = lp[r * mb.row_len + s : r * mb.row_len + s + n - 1]

    def _share(self, per_episode: dict[int, torch.Tensor], lengths: Sequence[int]) -> list[np.ndarray]:
        """Every rank gets every episode's ``[n]`` log-probs (entry 0 = 0) from whichever rank scored it."""
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        buf = torch.zeros(int(offsets[-1]), dtype=torch.float32, device=self.device)
        if self.post and self.tp_rank == 0:
            for i, lp in per_episode.items():
                buf[offsets[i] + 1 : offsets[i + 1]] = lp.detach().float()
        host = all_sum(buf).cpu().numpy()
        return [host[offsets[i] : offsets[i + 1]].copy() for i in range(len(lengths))]

    # -- scoring -------------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, episodes: Sequence[Episode], temperature: float | None = 1.0, *,
                 model_only: bool = False) -> list[np.ndarray]:
        if temperature is not None and not (math.isfinite(temperature) and temperature > 0):
            raise LearnerError(f"temperature {temperature!r} must be finite and > 0")
        tokens = self._check(episodes, train=False)
        temps = [temperature or ep.temperature for ep in episodes]
        mbs = self._micro_batches(tokens, temps)[0]
        scored: dict[int, torch.Tensor] = {}

        def loss_of(mb: _Micro, logits: torch.Tensor) -> torch.Tensor:
            self._scatter(self._slot_logprobs(mb, logits), mb, scored)
            return logits.new_zeros(())

        self.model.eval()
        self._run(mbs, loss_of, train=False)
        out = [np.minimum(o, 0.0) for o in self._share(scored, [len(t) for t in tokens])]
        if model_only:  # GPTModel's output layer runs at every position; the contract zeroes the rest
            for o, ep in zip(out, episodes):
                o[~ep.loss_mask()] = 0.0
        return out

    # -- training ------------------------------------------------------------------------------
    def _optimizer_step(self, episodes: Sequence[Episode], tokens: list[np.ndarray], temps: Sequence[float],
                        loss_of: Callable[[_Micro, torch.Tensor], torch.Tensor]) -> dict[str, float]:
        t0 = time.perf_counter()
        mbs, n_tok, slots, n_micro = self._micro_batches(tokens, temps)
        self.model.train()
        lr = lr_at(self.config, self._step)
        self._zero_grad()
        if self.on_cuda:
            self._run(mbs, loss_of, train=True)
            self.optimizer.prepare_grads()
            grad_norm = float(self.optimizer.get_grad_norm())
            if not math.isfinite(grad_norm):
                self._zero_grad()
                raise LearnerError(f"non-finite gradient norm ({grad_norm}); step skipped, weights unchanged")
            for g in self.optimizer.param_groups:
                g["lr"] = lr * g.get("lr_mult", 1.0)
                g["weight_decay"] = self.config.weight_decay * g.get("wd_mult", 1.0)
            ok, _, _ = self.optimizer.step()
            if not ok:
                raise LearnerError("megatron's optimizer skipped the step")
            torch.cuda.synchronize(self.device)
        else:
            self._run(mbs, loss_of, train=True)
            if dist.get_world_size() == 1:
                params = [p for p in self.model.parameters() if p.grad is not None]
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip or math.inf))
            else:
                grad_norm = self._reduce_and_clip_cpu()
            if not math.isfinite(grad_norm):
                self._zero_grad()
                raise LearnerError(f"non-finite gradient norm ({grad_norm}); step skipped, weights unchanged")
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            self.optimizer.step()
            self._zero_grad()
        self._step += 1
        self._version += 1
        seconds = time.perf_counter() - t0
        return {"grad_norm": grad_norm, "lr": lr, "tokens": float(n_tok),
                "loss_tokens": float(sum(ep.num_model_tokens for ep in episodes)),
                "micro_batches": float(n_micro),
                "pad_fraction": 1.0 - n_tok / slots, "seconds": seconds, "tokens_per_s": n_tok / seconds}

    def _reduce_and_clip_cpu(self) -> float:
        """CPU, several ranks: sum gradients over data-parallel ranks and clip them by the global norm.

        Each data-parallel rank ran its share of the micro-batches with the full-batch normalizer,
        so the sum is the full-batch gradient. Tensor-parallel shards hold the gradient of their
        slice (megatron's layers reduce activations' gradients in backward), replicated parameters
        (norms) the same whole gradient on every TP rank: the norm counts shards once each and
        replicated parameters once. Clipping follows ``torch.nn.utils.clip_grad_norm_``."""
        params = list(self.model.parameters())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if self.dp > 1:  # one flat buffer: one collective, the same order on every rank
            flat = all_sum(torch.cat([g.reshape(-1) for g in grads]), mpu.get_data_parallel_group())
            grads = [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)]
        counted = [g for p, g in zip(params, grads) if tensor_parallel.param_is_not_tensor_parallel_duplicate(p)]
        squares = torch.stack([torch.linalg.vector_norm(g).square() for g in counted]).sum() if counted else \
            torch.zeros((), device=self.device)
        norm = all_sum(squares, mpu.get_model_parallel_group()).sqrt()
        coef = torch.clamp((self.config.grad_clip or math.inf) / (norm + 1e-6), max=1.0)
        for p, g in zip(params, grads):
            p.grad = g.mul_(coef)
        return float(norm)

    def _rl_objective(self, episodes: Sequence[Episode], tokens: list[np.ndarray], advantages: np.ndarray,
                      objective: Objective | None) -> tuple[Callable, Callable[[], dict[str, float]]]:
        """The per-micro-batch loss of a policy-gradient objective, and the full-batch metrics after it ran."""
        batch = ObjectiveBatch(episodes, advantages, objective)
        scored: dict[int, torch.Tensor] = {}

        def loss_of(mb: _Micro, logits: torch.Tensor) -> torch.Tensor:
            lp = self._slot_logprobs(mb, logits)
            if not mb.placements:
                return lp.sum() * 0.0
            self._scatter(lp, mb, scored)
            # Slot r*row_len+s+k of an episode at (row r, start s) predicts its token k+1.
            index = np.full((len(mb.placements), max(p[3] for p in mb.placements)), lp.shape[0], dtype=np.int64)
            for j, (_i, r, s, n) in enumerate(mb.placements):
                index[j, 1:n] = r * mb.row_len + s + np.arange(n - 1)
            return batch.loss([p[0] for p in mb.placements], lp, index)

        def finish() -> dict[str, float]:
            # Every rank gets the log-probs of the micro-batches other ranks ran.
            return batch.metrics(self._share(scored, [len(t) for t in tokens]))

        return loss_of, finish

    def _sft_objective(self, episodes: Sequence[Episode]) -> tuple[Callable, Callable[[], dict[str, float]]]:
        """Mean cross-entropy over all model tokens of the batch (prompt and env tokens are context)."""
        masks = [torch.from_numpy(ep.loss_mask()) for ep in episodes]
        n_loss = float(sum(int(m.sum()) for m in masks))
        scored: dict[int, torch.Tensor] = {}

        def loss_of(mb: _Micro, logits: torch.Tensor) -> torch.Tensor:
            lp = self._slot_logprobs(mb, logits)
            if not mb.placements:
                return lp.sum() * 0.0
            self._scatter(lp, mb, scored)
            keep = torch.zeros(lp.shape[0], dtype=torch.bool)
            for i, r, s, n in mb.placements:
                keep[r * mb.row_len + s : r * mb.row_len + s + n - 1] = masks[i][1:]
            return -(lp * keep.to(lp.device)).sum() / n_loss

        def finish() -> dict[str, float]:
            lps = self._share(scored, [len(m) for m in masks])
            return {"loss": -sum(float((lp * m.numpy()).sum()) for lp, m in zip(lps, masks)) / n_loss}

        return loss_of, finish

    def train_step(self, episodes: Sequence[Episode], advantages: np.ndarray,
                   objective: Objective | None = None) -> dict[str, float]:
        tokens = self._check(episodes, train=True)
        loss_of, finish = self._rl_objective(episodes, tokens, advantages, objective)
        out = self._optimizer_step(episodes, tokens, [ep.temperature for ep in episodes], loss_of)
        return {**finish(), **out}

    def sft_step(self, episodes: Sequence[Episode]) -> dict[str, float]:
        tokens = self._check(episodes, train=True)
        loss_of, finish = self._sft_objective(episodes)
        out = self._optimizer_step(episodes, tokens, [1.0] * len(episodes), loss_of)
        return {**finish(), **out}

    def gradients(self, episodes: Sequence[Episode], advantages: np.ndarray | None = None,
                  objective: Objective | None = None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """The loss metrics and unclipped float32 gradients by HF name that ``train_step`` (or, with
        ``advantages=None``, ``sft_step``) would use; no weight or counter changes. For tests and
        backend parity checks; one data-parallel rank only (gradients arrive on global rank 0)."""
        if self.dp > 1:
            raise LearnerError("gradients() needs a single data-parallel rank")
        tokens = self._check(episodes, train=True)
        if advantages is None:
            (loss_of, finish), temps = self._sft_objective(episodes), [1.0] * len(episodes)
        else:
            loss_of, finish = self._rl_objective(episodes, tokens, advantages, objective)
            temps = [ep.temperature for ep in episodes]
        mbs = self._micro_batches(tokens, temps)[0]
        self.model.train()
        self._zero_grad()
        self._run(mbs, loss_of, train=True)
        params = dict(self.model.named_parameters())
        local = {n: (p.main_grad if self.on_cuda else p.grad) for n, p in params.items()}
        local = {n: (g.detach().float() if g is not None else torch.zeros_like(params[n], dtype=torch.float32))
                 for n, g in local.items()}
        grads = weights.gather_hf(self, local)
        self._zero_grad()
        return finish(), {k: v.cpu() for k, v in grads.items()}

    def _zero_grad(self) -> None:
        if self.on_cuda:
            self._ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    # -- weights -------------------------------------------------------------------------------
    def chained_optimizers(self) -> list:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def export_weights(self, dtype: Literal["float32", "bfloat16"] = "float32") -> dict[str, np.ndarray]:
        return dict(self.iter_weights(dtype))

    def iter_weights(self, dtype: Literal["float32", "bfloat16"] = "float32") -> Iterator[tuple[str, np.ndarray]]:
        if dtype not in ("float32", "bfloat16"):
            raise LearnerError(f"dtype must be float32 or bfloat16, got {dtype!r}")
        # The gather is collective: it runs now, on every rank; only the host copies are lazy.
        return host_arrays(weights.gather_hf(self, weights.master(self)), dtype)

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        checkpoint.save(self, Path(path), extra)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        return checkpoint.load(self, Path(path))

    def restore_counters(self, step: int, version: int) -> None:
        """Set :attr:`step` and :attr:`version` to a checkpoint's (``checkpoint.load``)."""
        self._step, self._version = step, version


def _no_grad_at(pad_id: int, module, inputs, output):
    # HF builds its embedding with padding_idx=pad_token_id: that row gets no gradient from the input side.
    at = (inputs[0] == pad_id)[..., None]
    return torch.where(at, output.detach(), output)
