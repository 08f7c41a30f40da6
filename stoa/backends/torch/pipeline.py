"""Pipeline-parallel rollouts on the torch engine: a model cut into stages of contiguous layers.

A :class:`Stage` holds layers ``[a, b)`` of the model (:class:`~stoa.backends.torch.decoder.Decoder`
with ``part=(a, b)``), only their tensors of the int8 weight state, and the keys and values of
those layers. The first stage also holds the embeddings and takes token ids; the last holds the
final norm and the head (for a tied head, the embeddings again) and turns hidden states into
logits. Every other stage takes and returns the residual stream ``[n, m, hidden]``.

A :class:`Pipeline` chains stages that together cover every layer once and plays cohorts with
the torch engine's own loop (:class:`stoa.backends.torch.rollout.Cohort`): the same continuous
batching, the same episode bookkeeping, the same seeded sampling rule on the same float32
weights of record. Each stage computes exactly the layers the single engine would, on the same
rows, so a pipeline's episodes are token for token the single engine's and its log-probs agree to
float rounding (tested on random and real models). Everything here runs in one process; the
activation channel between machines is measured in ``benchmarks/pipeline.py`` and described in
``docs/pipeline.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stoa.backends.engine import EngineConfig, EngineError, RolloutRequest, SamplingConfig
from stoa.backends.engine_base import EngineBase
from stoa.backends.sampling import HostSampler
from stoa.backends.torch import decoder as D
from stoa.backends.torch.engine import ENGINE_DTYPES, check_state, exact_matmuls, state_layout, draw, rebuild
from stoa.backends.torch.engine import DIGITS, KERNEL_MODES, built_fields, resolve_device, resolve_mode
from stoa.types import Episode

__all__ = ["Pipeline", "Stage", "StageMemory", "make", "read_share", "split_layers", "stage_names"]


def split_layers(layers: int, stages: int) -> list[tuple[int, int]]:
    """``stages`` contiguous layer ranges covering ``0 .. layers`` with sizes differing by at most
    one (the earlier stages take the extra layers: the last also holds the head)."""
    if not 1 <= stages <= layers:
        raise EngineError(f"cannot cut {layers} layers into {stages} stages")
    q, r = divmod(layers, stages)
    bounds = [0]
    for i in range(stages):
        bounds.append(bounds[-1] + q + (i < r))
    return list(zip(bounds[:-1], bounds[1:]))


def stage_names(names: Sequence[str], part: tuple[int, int], layers: int, tied: bool) -> list[str]:
    """The entries of a weight state (``names``: every name of the whole model's state) that a
    stage of layers ``part`` needs: its layers' tensors, plus the embeddings for the first stage,
    plus the final norm and head (the embeddings when ``tied``) for the last. Sorted. These are
    the tensors of the stage's shares (:func:`stoa.transport.shares.stage_shares`), which the
    signed manifest hashes one by one."""
    from stoa.transport import shares

    return shares.stage_names(names, part, layers, tied)


@dataclass(frozen=True)
class StageMemory:
    """What one stage holds, in bytes."""

    state: int
    """Its share of the int8 weight state (codes, scales, biases, unquantized tensors)."""
    weights: int
    """The float weights it computes with (the weights of record in the compute dtype)."""
    kv_per_token: int
    """Keys and values of one cached position of one row, over its layers."""

    def total(self, slots: int, positions: int) -> int:
        """State, weights and a full KV cache of ``slots`` rows of ``positions`` positions."""
        return self.state + self.weights + self.kv_per_token * slots * positions


class Stage:
    """Layers ``part = (a, b)`` of the model in ``hf_dir`` on the int8 weights in ``state`` (a whole
    state or any mapping holding at least this stage's entries, :func:`stage_names`; copied).
    ``mode`` and ``device`` are the torch engine's."""

    def __init__(self, hf_dir: str | Path, part: tuple[int, int], state: Mapping[str, np.ndarray],
                 mode: str = "auto", device: str = "cpu") -> None:
        from transformers import AutoConfig

        from stoa.backends.torch import families

        self.device = resolve_device(device)
        self.mode = resolve_mode(mode, self.device)
        spec = families.read_spec(Path(hf_dir), "torch", EngineError)
        cfg = AutoConfig.from_pretrained(hf_dir)
        try:
            self.decoder = D.Decoder(spec, cfg, self.device, ENGINE_DTYPES[self.mode],
                                     attention_bias=bool(getattr(cfg, "attention_bias", False)),
                                     mlp_bias=bool(getattr(cfg, "mlp_bias", False)), part=part,
                                     quantized=self.mode in KERNEL_MODES, digits=DIGITS.get(self.mode, 0))
        except ValueError as e:
            raise EngineError(str(e)) from None
        self.part, self.first, self.last = self.decoder.part, self.decoder.first, self.decoder.last
        self.layout = state_layout(self.decoder)
        share = {k: state[k] for k in self.layout if k in state}
        check_state(share, self.layout, None)
        self.state = {k: np.array(v, copy=True, order="C") for k, v in share.items()}
        rebuild(self.decoder, self.layout, self.state, list(self.layout))
        self.cache: D.KVCache | None = None
        self.version: int | None = None
        """The chain version :meth:`sync` last brought the share to (None before the first)."""

    @property
    def names(self) -> list[str]:
        """The state entries this stage holds, sorted."""
        return sorted(self.layout)

    def memory(self) -> StageMemory:
        seen, weights = set(), 0
        for t in self.decoder.views.values():
            if t.is_meta:  # an int8 matrix computed on the share's own codes
                continue
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                weights += st.nbytes()
        s = self.decoder.spec
        kv = 2 * len(self.decoder.layers) * s.num_key_value_heads * s.head_dim * torch.empty((), dtype=self.decoder.dtype).element_size()
        return StageMemory(sum(a.nbytes for a in self.state.values()), weights, kv)

    def kv(self, slots: int, limit: int | None = None) -> D.KVCache:
        """This stage's KV cache with ``slots`` rows (kept while the row count holds), never
        grown past ``limit`` positions (:class:`~stoa.backends.torch.decoder.KVCache`)."""
        c = self.cache
        if c is None or c.shape[0] != slots:
            s = self.decoder.spec
            c = self.cache = D.KVCache(len(self.decoder.layers), slots, s.num_key_value_heads, s.head_dim,
                                       self.decoder.dtype, self.device, limit=limit)
        return c

    def forward(self, x: torch.Tensor, start: torch.Tensor, longest: int, rows: torch.Tensor | None = None
                ) -> torch.Tensor:
        """:meth:`Decoder.forward` of this stage's layers on its own cache (grown to ``longest``)."""
        assert self.cache is not None, "kv(slots) first"
        self.cache.ensure(longest)
        return self.decoder.forward(x, start, longest, self.cache, rows)


    def apply_delta(self, blob: bytes, layout: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
                    expect_hash: str | None = None) -> list[str]:
        """Apply a whole-state PULSE delta to this stage's share only
        (:func:`stoa.transport.pulse.apply_delta_share`; ``layout``: the whole state's, e.g. from
        :func:`read_share`; ``expect_hash``: the share's hash after, when the publisher signs one);
        the names that changed here."""
        from stoa.transport import pulse

        changed = pulse.apply_delta_share(self.state, layout, blob, expect_hash)
        if changed:
            rebuild(self.decoder, self.layout, self.state, changed)
        return changed


    def sync(self, subscriber: Any, version: int | None = None) -> Any:
        """Bring this stage's share to the head (or ``version``) of the signed chain
        ``subscriber`` follows (a :class:`stoa.transport.chain.ShareSubscriber` for this stage's
        layers): verified deltas are written into the share, or a verified anchor share replaces
        it, and only the changed layers are rebuilt. Returns the ``SyncResult``; raises what
        ``sync`` raises (the share is then untouched)."""
        if (subscriber.part, subscriber.layers) != (self.part, self.decoder.spec.num_hidden_layers):
            raise EngineError(f"the subscriber follows layers {subscriber.part} of {subscriber.layers}; "
                              f"this stage holds {self.part}")
        have = None if self.version is None else (self.version, self.state)
        r = subscriber.sync(have, apply_inplace=True, version=version)
        if r.state is not self.state:
            check_state(r.state, self.layout, None)
            self.state = r.state
        if r.changed_names:
            rebuild(self.decoder, self.layout, self.state, r.changed_names)
        self.version = r.version
        return r


def read_share(read: Callable[[int, int], bytes], size: int, part: tuple[int, int], layers: int, tied: bool
               ) -> tuple[dict[str, np.ndarray], dict[str, tuple[np.dtype, tuple[int, ...]]], int]:
    """A stage's share of an anchor (a safetensors file of ``size`` bytes) read by byte ranges:
    ``read(start, end)`` returns bytes ``[start, end)`` (a ranged GET, a file seek). Reads the
    header, then each run of adjacent wanted tensors in one range. Returns the share (writeable
    arrays), the whole state's layout (name -> (dtype, shape)) and the bytes read. Nothing is
    verified here: :class:`stoa.transport.subscriber.ShareSubscriber` follows the signed chain
    and checks every byte against the manifest's per-share hashes."""
    from stoa.transport import shares

    head, idx = shares.read_header(read, size)
    try:
        share, got = shares.read_spans(read, idx, stage_names(list(idx), part, layers, tied))
    except ValueError as e:
        raise EngineError(str(e)) from None
    return share, {n: (v[0], v[1]) for n, v in idx.items()}, got + len(head)


class _ChainCache:
    """The stages' caches seen as one (what :class:`~stoa.backends.torch.rollout.Cohort` moves rows in)."""

    def __init__(self, stages: Sequence[Stage], slots: int) -> None:
        self.parts = [st.kv(slots) for st in stages]
        self.shape = self.parts[0].shape

    def ensure(self, length: int) -> None:
        for c in self.parts:
            c.ensure(length)

    def copy_rows(self, src: int, dst: list[int], length: int) -> None:
        for c in self.parts:
            c.copy_rows(src, dst, length)

    def move(self, src: int, dst: int, length: int) -> None:
        for c in self.parts:
            c.move(src, dst, length)


class Pipeline(EngineBase):
    """Stages that cover the model's layers in order, played as one rollout engine in this process.

    ``rollout`` follows :meth:`stoa.backends.engine.RolloutEngine.rollout` (episodes, seeds,
    stats); weights are the stages' own (:meth:`Stage.apply_delta` updates one stage's share).
    ``version`` is stamped on every episode; ``mode`` is the first stage's. The other members
    every engine has are :class:`~stoa.backends.engine_base.EngineBase`'s."""

    def __init__(self, hf_dir: str | Path, stages: Sequence[Stage], version: int = 0,
                 config: EngineConfig = EngineConfig(), worker_id: str = "") -> None:
        from transformers import AutoConfig, AutoTokenizer

        from stoa.backends.text import TokenizerText, config_eos_ids

        if not stages:
            raise EngineError("a pipeline needs at least one stage")
        spec = stages[0].decoder.spec
        at = 0
        for st in stages:
            if st.part[0] != at:
                raise EngineError(f"stage {st.part} does not start where the previous ended ({at})")
            at = st.part[1]
        if at != spec.num_hidden_layers:
            raise EngineError(f"the stages end at layer {at}; the model has {spec.num_hidden_layers}")
        path = Path(hf_dir)
        self.stages = list(stages)
        self.device = stages[-1].device
        tok = AutoTokenizer.from_pretrained(path)
        text = TokenizerText(tok, config_eos_ids(path), spec.vocab_size, str(path), config.prompt_format)
        super().__init__(path, config, version, worker_id, mode=stages[0].mode, vocab_size=spec.vocab_size,
                         tokenizer=tok, codec=text.codec, built=built_fields(spec, AutoConfig.from_pretrained(path)))
        self._host_sampler = HostSampler()
        self._cache: _ChainCache | None = None

    @property
    def state(self) -> dict[str, np.ndarray]:
        """The whole state, gathered from the stages (the arrays are the stages' own)."""
        out: dict[str, np.ndarray] = {}
        for st in self.stages:
            out.update(st.state)
        return out

    def kv_cache(self, slots: int) -> _ChainCache:
        if self._cache is None or self._cache.shape[0] != slots:
            self._cache = _ChainCache(self.stages, slots)
        return self._cache

    def _through(self, x: torch.Tensor, start: torch.Tensor, longest: int, rows: torch.Tensor | None) -> torch.Tensor:
        for st in self.stages:
            x = st.forward(x.to(st.device), start.to(st.device), longest,
                           None if rows is None else rows.to(st.device))
        return x

    def feed(self, ids: torch.Tensor, start: torch.Tensor, longest: int, cache: _ChainCache, rows: torch.Tensor) -> None:
        self._through(ids, start, longest, rows)

    def next_tokens(self, ids: torch.Tensor, start: torch.Tensor, longest: int, cache: _ChainCache, seeds: np.ndarray,
                    s: SamplingConfig) -> tuple[np.ndarray, np.ndarray]:
        hidden = self._through(ids, start, longest, None)
        return draw(self.stages[-1].decoder.logits(hidden[:, 0]), seeds, s, self.config.sampler, self._host_sampler)

    def rollout(self, make_env: Callable[[], Any], requests: Sequence[RolloutRequest],
                sampling: SamplingConfig = SamplingConfig()) -> list[Episode]:
        from stoa.backends.torch.rollout import Cohort

        cohort = Cohort(self, make_env, requests, sampling, [])
        try:
            with exact_matmuls(self.device), torch.no_grad():
                return cohort.run()
        finally:
            self._stats = cohort.stats


def make(hf_dir: str | Path, stages: int | Sequence[tuple[int, int]], *, state: Mapping[str, np.ndarray] | None = None,
         version: int = 0, mode: str = "auto", config: EngineConfig = EngineConfig(), worker_id: str = "",
         device: str = "cpu") -> Pipeline:
    """A :class:`Pipeline` of ``stages`` (a count, cut by :func:`split_layers`, or the layer ranges)
    on ``state`` (None: the folder's float weights quantized to int8, as the torch engine does)."""
    from stoa.backends.torch import families
    from stoa.backends.torch.engine import pretrained_state

    path = Path(hf_dir)
    spec = families.read_spec(path, "torch", EngineError)
    parts = split_layers(spec.num_hidden_layers, stages) if isinstance(stages, int) else list(stages)
    if state is None:
        state = pretrained_state(path)
    return Pipeline(path, [Stage(path, p, state, mode, device) for p in parts], version, config, worker_id)
