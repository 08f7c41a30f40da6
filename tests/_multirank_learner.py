"""Test-only: 3 RL steps of the Megatron learner through rank 0's mirrored learner, on CPU ranks.

``python tests/_multirank_learner.py MODEL_DIR OUT_DIR TP`` in each of the job's processes
(RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment, as torchrun sets them).
Rank 0 writes ``OUT_DIR/weights.safetensors`` (the exported HF weights after the steps) and
``OUT_DIR/metrics.json``; every rank writes its own file of a checkpoint in ``OUT_DIR/ckpt``.
"""

import json
import sys
from pathlib import Path

import _cpu_megatron

_cpu_megatron.apply()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from helpers import random_episodes  # noqa: E402
from stoa.algos import resolve_objective  # noqa: E402
from stoa.backends.learner import LearnerConfig  # noqa: E402
from stoa.fleet.trainer.distributed import Ranks, follow  # noqa: E402

model_dir, out, tp = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
options = {"tensor_parallel": tp, "timeout_s": 120.0}
ranks = Ranks(120.0, cuda=False)
if ranks.rank != 0:
    follow(ranks)
    sys.exit(0)
config = LearnerConfig(lr=1e-3, grad_clip=0.1, micro_batch_tokens=96, threads=1, device="cpu")  # the clip acts
ln = ranks.make_learner("megatron", model_dir, config, **options)
objective = resolve_objective("dppo")
metrics = []
for step in range(3):
    eps = random_episodes(16, ln.vocab_size, seed=100 + step)
    adv = np.random.default_rng(step).standard_normal(len(eps)).astype(np.float32)
    metrics.append(ln.train_step(eps, adv, objective))
ln.save_checkpoint(out / "ckpt", {"steps": 3})
w = ln.export_weights()
streamed = list(ln.iter_weights())  # the other ranks join the gather; rank 0 hands over one tensor at a time
assert [k for k, _ in streamed] == list(w) and all(np.array_equal(v, w[k]) for k, v in streamed)
from safetensors.numpy import save_file  # noqa: E402

save_file(w, str(out / "weights.safetensors"))
(out / "metrics.json").write_text(json.dumps(metrics))
ranks.send("stop")
ranks.close()
