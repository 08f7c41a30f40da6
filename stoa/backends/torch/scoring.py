"""Teacher-forced scoring and sampling checks from a torch model's hidden states, shared by the
int8 scorer (:mod:`stoa.backends.torch.int8`) and the rollout engine (:mod:`stoa.backends.torch.engine`).

Both take ``hidden(x) -> [rows, width, hidden]`` (the model up to its output head, over right-padded
token rows ``x``, int64 on the device) and ``head(h) -> logits``; the alignment is
``RolloutEngine.score``'s (entry 0 is 0.0, entry ``t`` is ``log p(tokens[t] | tokens[:t])``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from stoa.backends.packing import padded_tokens
from stoa.backends.sampling import Draws, margin_plan
from stoa.types import Episode

__all__ = ["draws_batch", "score_batch"]

Hidden = Callable[[torch.Tensor], torch.Tensor]
Head = Callable[[torch.Tensor], torch.Tensor]


def score_batch(eps: Sequence[Episode], temperature: float | None, vocab: int, device: torch.device,
                hidden: Hidden, head: Head, error: type[Exception]) -> list[np.ndarray]:
    """One float32 array ``[len(episode)]`` per episode (``temperature`` None: each episode's own)."""
    toks, x = padded_tokens(eps, vocab, np.int64, error)
    width = x.shape[1]
    xs = torch.from_numpy(x).to(device)
    inv_t = torch.tensor([1.0 / (temperature or ep.temperature) for ep in eps], dtype=torch.float32,
                         device=device)[:, None, None]
    # Right padding under a causal mask leaves every real position's logits unchanged.
    h = hidden(xs)
    # Bound the float32 logits held at once (~128 MB); each chunk re-reads the head matrix.
    chunk = max(1, (1 << 25) // (len(eps) * vocab))
    parts = []
    for a in range(0, width - 1, chunk):
        b = min(width - 1, a + chunk)
        z = head(h[:, a:b]).to(torch.float32) * inv_t
        logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
        parts.append(torch.gather(logp, -1, xs[:, a + 1:b + 1, None])[..., 0])
    lp = torch.cat(parts, dim=1).cpu().numpy() if parts else np.zeros((len(eps), 0), np.float32)
    return [np.concatenate([[0.0], lp[r, :len(t) - 1]]).astype(np.float32) for r, t in enumerate(toks)]


def draws_batch(eps: Sequence[Episode], seeds: Sequence[int], top_k: int, drift: float, vocab: int,
                device: torch.device, hidden: Hidden, head: Head, error: type[Exception]) -> list[Draws]:
    """``RolloutEngine.check_draws`` of one batch: margins and log-probs from one forward pass."""
    _, x = padded_tokens(eps, vocab, np.int64, error)
    plan = margin_plan(eps, seeds, x)
    margins, logprobs = np.empty(plan.at.size, np.float64), np.empty(plan.at.size, np.float64)
    if margins.size:
        h = hidden(torch.from_numpy(plan.x).to(device))
        rows, cols = torch.from_numpy(plan.src).to(device), torch.from_numpy(plan.at - 1).to(device)
        step = max(1, (1 << 22) // vocab)  # bound the float logits held at once
        for a in range(0, margins.size, step):
            logits = head(h[rows[a:a + step], cols[a:a + step]]).to(torch.float32)
            b = a + logits.shape[0]
            margins[a:b], logprobs[a:b] = plan.margins(a, logits.cpu().numpy(), top_k, drift)
    return plan.draws(margins, logprobs)
