"""Token log-probs from vocabulary-parallel logits, without a float32 ``[tokens, vocab]`` copy.

Under tensor parallelism each rank holds logits for its slice of the vocabulary. The log-softmax
needs a max and a sum over the whole vocabulary (two all-reduces per chunk of rows) and the
target's logit from whichever rank owns it (a third). Rows are processed in chunks in float32;
backward recomputes ``softmax`` chunk by chunk from the saved (bf16 or fp32) logits, so the
only per-token state kept is the log-sum-exp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["vocab_parallel_logprobs"]


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, inv_temp, vocab_start, valid, group, chunk):
        n = logits.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        target_logit = torch.empty_like(lse)
        local = targets - vocab_start
        owned = (local >= 0) & (local < valid)
        local = local.clamp(0, max(valid - 1, 0))
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            x = logits[a:b, :valid].float() * inv_temp[a:b, None]
            m = x.max(dim=-1).values if valid else torch.full((b - a,), -torch.inf, device=x.device)
            _all_reduce(m, dist.ReduceOp.MAX, group)
            s = (x - m[:, None]).exp().sum(dim=-1)
            _all_reduce(s, dist.ReduceOp.SUM, group)
            lse[a:b] = m + s.log()
            t = x.gather(1, local[a:b, None])[:, 0] if valid else torch.zeros(b - a, device=x.device)
            target_logit[a:b] = torch.where(owned[a:b], t, 0.0)
        _all_reduce(target_logit, dist.ReduceOp.SUM, group)
        ctx.save_for_backward(logits, local, owned, inv_temp, lse)
        ctx.valid, ctx.chunk = valid, chunk
        return target_logit - lse

    @staticmethod
    def backward(ctx, grad):
        logits, local, owned, inv_temp, lse = ctx.saved_tensors
        valid, chunk = ctx.valid, ctx.chunk
        out = torch.zeros_like(logits)  # padded vocabulary columns get no gradient
        g = grad.float()
        for a in range(0, logits.shape[0], chunk):
            b = min(logits.shape[0], a + chunk)
            x = logits[a:b, :valid].float() * inv_temp[a:b, None]
            d = -(x - lse[a:b, None]).exp() * g[a:b, None]
            rows = torch.arange(b - a, device=d.device)
            d[rows, local[a:b]] += torch.where(owned[a:b], g[a:b], 0.0)
            out[a:b, :valid] = (d * inv_temp[a:b, None]).to(out.dtype)
        return out, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    inv_temp: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group=None,
    chunk_elements: int = 1 << 25,
) -> torch.Tensor:
    """``log_softmax(logits * inv_temp)[targets]`` over the full (sharded) vocabulary.

    Args:
        logits: ``[n, v_local]`` this rank's vocabulary slice (any float dtype).
        targets: int64 ``[n]`` global token ids.
        inv_temp: float32 ``[n]``, ``1 / temperature`` per row.
        vocab_start: global id of this rank's first column.
        vocab_size: the real vocabulary; columns at or beyond it (padding) are excluded.
        group: the tensor-parallel process group (None: no communication).
        chunk_elements: most float32 logits held at once.

    Returns:
        float32 ``[n]``, differentiable with respect to ``logits``.
    """
    v_local = logits.shape[-1]
    valid = v_local if vocab_size is None else max(0, min(v_local, vocab_size - vocab_start))
    chunk = max(1, chunk_elements // max(1, v_local))
    return _VocabParallelLogprobs.apply(logits, targets, inv_temp.float(), vocab_start, valid, group, chunk)
