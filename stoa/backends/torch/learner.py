"""The torch learner: ``transformers`` causal LMs, packed micro-batches, AdamW (contract:
:mod:`stoa.backends.learner`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from stoa.algos import Objective
from stoa.backends.learner import (
    Counters, LearnerConfig, LearnerError, check_episodes, checkpoint_extra, durable_rename, fsync_file, lr_at,
    read_checkpoint_meta,
)
from stoa.backends.packing import MicroBatch, build_micro_batches
from stoa.backends.torch import attention, families
from stoa.backends.torch.int8 import resolve_device
from stoa.backends.torch.objective import ObjectiveBatch
from stoa.backends.torch.weights import host_arrays
from stoa.types import Episode

CHECKPOINT_FORMAT = "stoa.torch_learner.v1"
_OPTIMIZER_FIELDS = ("lr", "betas", "eps", "weight_decay", "grad_clip", "schedule",
                     "warmup_steps", "total_steps", "min_lr_ratio")
MicroLoss = Callable[[MicroBatch, torch.Tensor], torch.Tensor]


def make(hf_dir: Path, config: LearnerConfig, **options: Any) -> TorchLearner:
    """Backend entry point used by :func:`stoa.backends.learner.make_learner`."""
    if options:
        raise LearnerError(f"the torch learner takes no backend options, got {sorted(options)}")
    return TorchLearner(hf_dir, config)


def _libc_trim() -> Callable[[], None]:
    """glibc's ``malloc_trim(0)``, or a no-op elsewhere. A CPU step frees gigabytes of
    activations; glibc keeps much of that in its heap, so a trainer's resident memory would ratchet
    up to its worst step plus whatever the next phase (scoring, evaluation) allocates on top."""
    import ctypes
    import ctypes.util

    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: None if trim(0) else None


_trim_host_heap = _libc_trim()


def _device(config: LearnerConfig) -> torch.device:
    return torch.device(resolve_device(config.device, LearnerError))


class TorchLearner(Counters):
    """A Hugging Face causal LM with float32 master weights, trained one packed batch per step."""

    def __init__(self, hf_dir: str | Path, config: LearnerConfig = LearnerConfig()) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        self.hf_dir = Path(hf_dir)
        spec = families.read_spec(self.hf_dir, "torch", LearnerError)
        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        self.device = _device(config)
        self._compute_dtype = {"auto": torch.bfloat16 if self.device.type == "cuda" else torch.float32,
                               "float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]
        torch.manual_seed(config.seed)
        attn = families.attn_implementation(spec, packed=config.packing)
        bar = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a per-load progress bar is noise in trainer logs
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                self.hf_dir, dtype=torch.float32, attn_implementation=attn
            ).to(self.device)
        finally:
            if bar:
                hf_logging.enable_progress_bar()
        self.model.config.use_cache = False
        wrong = families.prepare(self.model, spec)
        if wrong:
            raise LearnerError(f"{self.hf_dir}: transformers built the model differently from its config "
                               f"({'; '.join(wrong)})")
        if config.gradient_checkpointing:
            kw = {"use_reentrant": False}
            if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.x name
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        self._body = self.model.get_decoder()
        self._head = families.head(self.model, spec)
        self._params = dict(self.model.named_parameters())
        self._step = 0
        self._version = 0
        self._optimizer = self._make_optimizer()

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    # -- optimizer -----------------------------------------------------------------------------
    def _make_optimizer(self) -> torch.optim.AdamW:
        c = self.config
        decay = [p for p in self._params.values() if p.ndim >= 2]
        rest = [p for p in self._params.values() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": c.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr_at(c, 0), betas=tuple(c.betas), eps=c.eps)

    def reset_optimizer(self, config: LearnerConfig | None = None, keep_state: bool = False) -> None:
        if config is not None:
            keep = {f: getattr(self.config, f) for f in ("device", "dtype", "packing", "gradient_checkpointing")}
            if any(getattr(config, f) != v for f, v in keep.items()):
                raise LearnerError(f"reset_optimizer cannot change {sorted(keep)}; build a new learner")
            if config.threads and config.threads != self.config.threads:
                torch.set_num_threads(config.threads)
            self.config = config
        if keep_state:
            return
        self._step = 0
        self._optimizer = self._make_optimizer()

    # -- inputs --------------------------------------------------------------------------------
    def _check(self, episodes: Sequence[Episode], *, train: bool) -> list[np.ndarray]:
        return check_episodes(episodes, self.vocab_size, train=train)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self._compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self._compute_dtype)

    def _hidden(self, mb: MicroBatch) -> torch.Tensor:
        """Final hidden states ``[rows * row_len, hidden]`` of one micro-batch."""
        dev = self.device
        kwargs: dict[str, Any] = {
            "input_ids": torch.from_numpy(mb.input_ids).to(dev),
            "position_ids": torch.from_numpy(mb.position_ids).to(dev),
        }
        if mb.varlen is not None:
            kwargs["stoa_varlen"] = attention.VarlenTensors.from_layout(mb.varlen, dev)
        else:
            kwargs["attention_mask"] = torch.from_numpy(mb.attention_mask).to(dev)
        with self._autocast():
            h = self._body(**kwargs).last_hidden_state
        return h.reshape(-1, h.shape[-1])

    def _token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, inv_temp: torch.Tensor) -> torch.Tensor:
        """``log_softmax(head(hidden) * inv_temp)[target]`` per row, over vocab chunks in float32.

        Rows are processed ``logits_chunk_elements // vocab`` at a time; with grad, each chunk is
        checkpointed so only its hidden states are kept and logits are recomputed in backward.
        """
        chunk = max(1, self.config.logits_chunk_elements // self.vocab_size)

        def piece(h: torch.Tensor, t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            with self._autocast():
                logits = self._head(h)
            logits = logits.float() * s[:, None]
            return logits.gather(1, t[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)

        if hidden.shape[0] <= chunk:
            return piece(hidden, targets, inv_temp)
        outs = []
        for i in range(0, hidden.shape[0], chunk):
            args = (hidden[i : i + chunk], targets[i : i + chunk], inv_temp[i : i + chunk])
            if torch.is_grad_enabled():
                outs.append(torch.utils.checkpoint.checkpoint(piece, *args, use_reentrant=False))
            else:
                outs.append(piece(*args))
        return torch.cat(outs)

    def _scored(self, mb: MicroBatch, hidden: torch.Tensor, select: Sequence[np.ndarray],
                temps: Sequence[float]) -> torch.Tensor:
        """Log-probs at the flat positions of ``mb`` where ``select[episode]`` is True.

        Returns ``[P]`` log-probs in placement order, then position order. Position ``p`` is
        predicted from hidden ``p - 1``; callers never select an episode's first token, so that
        hidden state always belongs to the same episode.
        """
        row_len = mb.input_ids.shape[1]
        pos, temp = [], []
        for i, r, s, n in mb.placements:
            where = np.flatnonzero(select[i]) + r * row_len + s
            pos.append(where)
            temp.append(np.full(len(where), 1.0 / temps[i], np.float32))
        flat = np.concatenate(pos)
        dev = self.device
        idx = torch.from_numpy(flat).to(dev)
        targets = torch.from_numpy(mb.input_ids.reshape(-1)[flat]).to(dev)
        return self._token_logprobs(hidden.index_select(0, idx - 1), targets,
                                    torch.from_numpy(np.concatenate(temp)).to(dev))

    # -- scoring -------------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, episodes: Sequence[Episode], temperature: float | None = 1.0, *,
                 model_only: bool = False) -> list[np.ndarray]:
        if temperature is not None and not (math.isfinite(temperature) and temperature > 0):
            raise LearnerError(f"temperature {temperature!r} must be finite and > 0")
        tokens = self._check(episodes, train=False)
        temps = [temperature or ep.temperature for ep in episodes]
        select = [np.arange(len(t)) > 0 for t in tokens]
        if model_only:  # the head and the log-softmax run at model tokens only
            select = [s & ep.loss_mask() for s, ep in zip(select, episodes)]
        out = [np.zeros(len(t), np.float32) for t in tokens]
        self.model.eval()
        for mb in build_micro_batches(tokens, self.config.micro_batch_tokens, self.config.packing):
            lp = self._scored(mb, self._hidden(mb), select, temps).cpu().numpy()
            k = 0
            for i, _r, _s, _n in mb.placements:
                where = np.flatnonzero(select[i])
                out[i][where] = lp[k : k + where.size]
                k += where.size
        return out

    # -- training ------------------------------------------------------------------------------
    def _rl_loss(self, episodes: Sequence[Episode], advantages: np.ndarray,
                 objective: Objective | None) -> tuple[MicroLoss, Callable[[], dict[str, float]]]:
        """Per-micro-batch objective (full-batch normalizer) and the full-batch metrics after it."""
        batch = ObjectiveBatch(episodes, advantages, objective)
        masks, temps = batch.masks, [ep.temperature for ep in episodes]

        def micro_loss(mb: MicroBatch, hidden: torch.Tensor) -> torch.Tensor:
            lp = self._scored(mb, hidden, masks, temps)  # counted tokens only, in placement order
            ids = [p[0] for p in mb.placements]
            index = np.full((len(ids), max(p[3] for p in mb.placements)), lp.shape[0], dtype=np.int64)
            k = 0
            for j, i in enumerate(ids):
                where = np.flatnonzero(masks[i])
                index[j, where] = np.arange(k, k + len(where))
                k += len(where)
            return batch.loss(ids, lp, index)

        return micro_loss, batch.metrics

    def _sft_loss(self, episodes: Sequence[Episode]) -> tuple[MicroLoss, Callable[[], dict[str, float]]]:
        masks = [ep.loss_mask() for ep in episodes]
        ones = [1.0] * len(episodes)
        n_loss = float(sum(int(m.sum()) for m in masks))
        total = [0.0]

        def micro_loss(mb: MicroBatch, hidden: torch.Tensor) -> torch.Tensor:
            loss = -self._scored(mb, hidden, masks, ones).sum() / n_loss
            total[0] += float(loss.detach())
            return loss

        return micro_loss, lambda: {"loss": total[0]}

    def _backward(self, tokens: list[np.ndarray], micro_loss: MicroLoss) -> list[MicroBatch]:
        self.model.train()
        self._optimizer.zero_grad(set_to_none=True)
        mbs = build_micro_batches(tokens, self.config.micro_batch_tokens, self.config.packing)
        for mb in mbs:
            micro_loss(mb, self._hidden(mb)).backward()
        return mbs

    def _step_with(self, episodes: Sequence[Episode], tokens: list[np.ndarray],
                   losses: tuple[MicroLoss, Callable[[], dict[str, float]]]) -> dict[str, float]:
        t0 = time.perf_counter()
        micro_loss, finish = losses
        mbs = self._backward(tokens, micro_loss)
        clip = self.config.grad_clip or math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self._params.values(), clip))
        if not math.isfinite(grad_norm):
            self._optimizer.zero_grad(set_to_none=True)
            raise LearnerError(f"non-finite gradient norm ({grad_norm}); step skipped, weights unchanged")
        lr = lr_at(self.config, self._step)
        for g in self._optimizer.param_groups:
            g["lr"] = lr
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._step += 1
        self._version += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        else:
            _trim_host_heap()
        seconds = time.perf_counter() - t0
        n_tok = sum(mb.num_tokens for mb in mbs)
        return {
            **finish(),
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": float(n_tok),
            "loss_tokens": float(sum(ep.num_model_tokens for ep in episodes)),
            "micro_batches": float(len(mbs)),
            "pad_fraction": 1.0 - n_tok / sum(mb.num_slots for mb in mbs),
            "seconds": seconds,
            "tokens_per_s": n_tok / seconds,
        }

    def train_step(self, episodes: Sequence[Episode], advantages: np.ndarray,
                   objective: Objective | None = None) -> dict[str, float]:
        tokens = self._check(episodes, train=True)
        return self._step_with(episodes, tokens, self._rl_loss(episodes, advantages, objective))

    def sft_step(self, episodes: Sequence[Episode]) -> dict[str, float]:
        tokens = self._check(episodes, train=True)
        return self._step_with(episodes, tokens, self._sft_loss(episodes))

    def gradients(self, episodes: Sequence[Episode], advantages: np.ndarray | None = None,
                  objective: Objective | None = None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """The loss metrics and unclipped gradients (by parameter name) ``train_step`` (or, with
        ``advantages=None``, ``sft_step``) would use; no weight or counter changes. For tests and
        backend parity checks."""
        tokens = self._check(episodes, train=True)
        losses = (self._sft_loss(episodes) if advantages is None
                  else self._rl_loss(episodes, advantages, objective))
        self._backward(tokens, losses[0])
        grads = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                 for n, p in self._params.items()}
        self._optimizer.zero_grad(set_to_none=True)
        return losses[1](), grads

    # -- weights and checkpoints ---------------------------------------------------------------
    def _hf_state(self) -> dict[str, torch.Tensor]:
        """Tensors by HF name, tied duplicates dropped (first name wins, as in the HF folder)."""
        seen, out = set(), {}
        for name, t in self.model.state_dict().items():
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            out[name] = t
        return out

    def export_weights(self, dtype: Literal["float32", "bfloat16"] = "float32") -> dict[str, np.ndarray]:
        return dict(self.iter_weights(dtype))

    def iter_weights(self, dtype: Literal["float32", "bfloat16"] = "float32") -> Iterator[tuple[str, np.ndarray]]:
        if dtype not in ("float32", "bfloat16"):
            raise LearnerError(f"dtype must be float32 or bfloat16, got {dtype!r}")
        return host_arrays(self._hf_state(), dtype)

    def load_weights(self, state: Mapping[str, np.ndarray]) -> None:
        """Set the weights from ``{hf_name: float32 array}`` (every tensor :meth:`export_weights`
        gives, same shapes); the optimizer's state and counters are kept (an outer step,
        :mod:`stoa.fleet.outer`)."""
        hf = self._hf_state()
        if set(state) != set(hf) or any(tuple(np.shape(state[n])) != tuple(t.shape) for n, t in hf.items()):
            raise LearnerError("load_weights: the names or shapes differ from the model's")
        with torch.no_grad():
            for n, t in hf.items():
                t.copy_(torch.from_numpy(np.ascontiguousarray(state[n], np.float32)).to(t.device, t.dtype))

    def save_checkpoint(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        path = Path(path)
        if path.exists():
            raise LearnerError(f"checkpoint path {path} already exists")
        extra_json = checkpoint_extra(extra)
        names = {id(p): n for n, p in self._params.items()}
        opt: dict[str, torch.Tensor] = {}
        for p, state in self._optimizer.state.items():
            for k, v in state.items():
                opt[f"{names[id(p)]}/{k}"] = v.detach().cpu().contiguous()
        rng = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                rng[f"torch_cuda_{i}"] = s
        meta = {
            "format": CHECKPOINT_FORMAT,
            "backend": "torch",
            "model_type": self.model.config.model_type,
            "step": self._step,
            "version": self._version,
            "config": dataclasses.asdict(self.config),
            "params": {n: list(p.shape) for n, p in self._params.items()},
            "extra": extra_json,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        try:
            weights = {n: p.detach().cpu().contiguous() for n, p in self._params.items()}
            save_file(weights, str(tmp / "weights.safetensors"))
            save_file(opt, str(tmp / "optimizer.safetensors"))
            save_file(rng, str(tmp / "rng.safetensors"))
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
            for f in tmp.iterdir():
                fsync_file(f)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        durable_rename(tmp, path)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        path = Path(path)
        files = ("meta.json", "weights.safetensors", "optimizer.safetensors", "rng.safetensors")
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise LearnerError(f"{path} is not a complete checkpoint (missing {missing})")
        meta = read_checkpoint_meta(path, CHECKPOINT_FORMAT)
        shapes = {n: list(p.shape) for n, p in self._params.items()}
        if meta.get("params") != shapes:
            raise LearnerError(f"{path} holds another model (parameter names or shapes differ)")
        step, version = meta.get("step"), meta.get("version")
        if not all(isinstance(v, int) and v >= 0 for v in (step, version)):
            raise LearnerError(f"{path}: bad step/version {step!r}/{version!r}")
        saved = meta.get("config", {})
        try:
            opt_fields = {f: saved[f] for f in _OPTIMIZER_FIELDS}
            opt_fields["betas"] = tuple(opt_fields["betas"])
            config = dataclasses.replace(self.config, **opt_fields)
        except (KeyError, TypeError, ValueError) as e:
            raise LearnerError(f"{path}: bad optimizer config in meta.json: {e}") from None
        weights = load_file(str(path / "weights.safetensors"))
        opt = load_file(str(path / "optimizer.safetensors"))
        rng = load_file(str(path / "rng.safetensors"))
        if set(weights) != set(self._params) or any(list(weights[n].shape) != shapes[n] for n in weights):
            raise LearnerError(f"{path}/weights.safetensors does not match the model")
        with torch.no_grad():
            for n, p in self._params.items():
                p.copy_(weights[n])
        self.config = config
        self._optimizer = self._make_optimizer()
        state: dict[int, dict[str, torch.Tensor]] = {}
        index = {id(p): i for i, p in enumerate(p for g in self._optimizer.param_groups for p in g["params"])}
        for key, v in opt.items():
            name, _, field = key.rpartition("/")
            if name not in self._params:
                raise LearnerError(f"{path}/optimizer.safetensors: unknown parameter {name!r}")
            if field != "step" and list(v.shape) != shapes[name]:
                raise LearnerError(f"{path}/optimizer.safetensors: {key} has shape {list(v.shape)}")
            state.setdefault(index[id(self._params[name])], {})[field] = v
        sd = self._optimizer.state_dict()
        sd["state"] = state
        self._optimizer.load_state_dict(sd)
        torch.set_rng_state(rng["torch_cpu"])
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all([rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
                                         or torch.cuda.get_rng_state_all())
        self._step, self._version = step, version
        return meta.get("extra") or {}
