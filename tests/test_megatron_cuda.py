"""The Megatron learner's real path on a GPU: bf16 parameters, the distributed optimizer, Megatron's
DDP and schedules, CUDA checkpoints. Skips without CUDA (CI has none); ``benchmarks/gpu_check.sh``
runs the same checks, and more, on a lent H200. Kept apart from ``tests/test_megatron.py``, whose
module fixture patches megatron for CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stoa.backends.learner import LearnerConfig, make_learner
from stoa.models.tiny import TinyConfig, build_tiny
from stoa.types import Episode, Segment

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (megatron's optimizer and schedules)")

TEXTS = [f"protein P{i} binds receptor R{i % 7} in cell line C{i % 5}" for i in range(200)]


def episodes(n: int, vocab: int, seed: int) -> list[Episode]:
    rng = np.random.default_rng(seed)
    return [Episode(rng.integers(0, vocab, int(rng.integers(3, 20))),
                    [Segment("model", rng.integers(0, vocab, (k := int(rng.integers(2, 30)))),
                             -rng.uniform(0.1, 5, k).astype(np.float32)),
                     Segment("env", rng.integers(0, vocab, int(rng.integers(1, 40)))),
                     Segment("model", rng.integers(0, vocab, 5), np.full(5, -1.0, np.float32))],
                    reward=0.0, temperature=float(rng.choice([0.7, 1.0]))) for _ in range(n)]


def test_cuda_gpu_megatron_bf16_step_checkpoint_and_parity(tmp_path):
    """Close to the float32 CPU torch learner (scores, gradient direction); resumes bit-exactly."""
    folder = build_tiny(tmp_path / "m", TEXTS, TinyConfig(vocab_size=400, hidden_size=64, intermediate_size=128,
                                                          num_layers=2, num_heads=4, num_kv_heads=2))
    cfg = dict(lr=1e-3, micro_batch_tokens=96)
    ref = make_learner("torch", folder, LearnerConfig(**cfg, device="cpu"))
    eps = episodes(16, ref.vocab_size, seed=7)
    adv = np.random.default_rng(2).standard_normal(len(eps))
    gpu = make_learner("megatron", folder, LearnerConfig(**cfg, device="cuda"))
    try:
        for x, y in zip(gpu.logprobs(eps, None), ref.logprobs(eps, None)):
            np.testing.assert_allclose(x, y, atol=0.1)
        _, gg = gpu.gradients(eps, adv)
        _, gc = ref.gradients(eps, adv)
        flat = lambda g: torch.cat([g[k].float().flatten() for k in sorted(g)])  # noqa: E731
        assert torch.nn.functional.cosine_similarity(flat(gg), flat(gc), dim=0) > 0.99
        gpu.train_step(eps, adv)
        gpu.save_checkpoint(tmp_path / "ck", extra={"n": 1})
        expected = gpu.train_step(eps, adv)
        w1 = gpu.export_weights()
        assert gpu.load_checkpoint(tmp_path / "ck") == {"n": 1}
        got = gpu.train_step(eps, adv)
        assert got["loss"] == expected["loss"] and got["grad_norm"] == expected["grad_norm"]
        w2 = gpu.export_weights()
        assert set(w1) == set(w2) and all(np.array_equal(w1[k], w2[k]) for k in w1)
    finally:
        gpu.close()
