"""DPPO with int8 rollouts and PULSE deltas, in one process: the loop a Stoa fleet runs, written out.

What the algorithm really is
----------------------------
Each iteration samples G answers to each of B prompts with the *int8* policy (the rollout engine
records the behaviour log-prob mu of every sampled token), scores them with the environment
(exact-match reward), turns rewards into group-relative advantages (Dr. GRPO: r - mean of the
group), and takes one optimizer step of the DPPO objective on the float32 trainer policy pi:

    loss = -A * sg(min(pi/mu, C)) * log pi      on kept tokens, averaged over model tokens,

where a token is dropped (no gradient) when the update would push pi further from mu in the
direction its advantage pushes: A > 0 and pi - mu > delta, or A < 0 and pi - mu < -delta (the
binary-TV gate of arXiv 2602.04879). The new float weights are quantized to int8 (group 64, the
codes MLX uses) and shipped to the rollout engine as a PULSE delta. A fleet does the same with
the engine on other machines, the delta travelling through an object store, and weights a few
versions stale; here the engine is updated at once (staleness 0).

    python examples/dppo_loop.py --iterations 30
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np


@dataclass
class Args:
    out: str = "runs/dppo-loop"
    """Folder for the tiny model."""
    seed: int = 0
    """Seed of the model, the prompt stream and sampling."""
    num_entities: int = 300
    """Size of the synthetic corpus (proteins; 3 facts each)."""
    warmstart_steps: int = 600
    """Supervised steps on search demonstrations from other worlds (teaches the format and reading)."""
    warmstart_batch: int = 64
    """Demonstrations per warm-start step."""
    iterations: int = 30
    """RL iterations (one optimizer step and one weight version each)."""
    prompts: int = 8
    """Prompts per iteration (B)."""
    group_size: int = 8
    """Samples per prompt (G)."""
    lr: float = 5e-4
    """RL learning rate."""
    delta: float = 0.2
    """DPPO gate threshold on |pi - mu|."""
    eval_questions: int = 100
    """Held-out questions evaluated before and after RL."""


def parse() -> Args:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in fields(Args):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    return Args(**vars(p.parse_args()))


def main(args: Args) -> dict[str, float]:
    # Heavy imports inside main: `import examples.dppo_loop` stays cheap.
    import stoa.envs
    from stoa.algos import group_advantages, resolve_objective
    from stoa.backends.engine import EngineConfig, RolloutRequest, SamplingConfig
    from stoa.backends.learner import LearnerConfig, make_learner
    from stoa.backends.mlx import MLXEngine
    from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts
    from stoa.fleet.trainer.warmstart import Demonstrations
    from stoa.models.tiny import TinyConfig, build_tiny
    from stoa.transport import pulse
    from stoa.transport.quant import quantize_state

    corpus = dict(num_entities=args.num_entities, facts_per_entity=3, num_test_facts=min(200, args.num_entities))
    make_train = lambda: stoa.envs.make("stoa/SyntheticSearch-v0", split="train", seed=0, **corpus)
    make_test = lambda: stoa.envs.make("stoa/SyntheticSearch-v0", split="test", seed=0, **corpus)

    # 1. A tiny Qwen2 model whose tokenizer knows the task's words.
    model_dir = build_tiny(Path(args.out) / "model", tokenizer_texts(generate(SyntheticConfig(seed=0, **corpus))),
                           TinyConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                      intermediate_size=384, seed=args.seed))
    learner = make_learner("torch", model_dir, LearnerConfig(lr=3e-3, warmup_steps=20, seed=args.seed))

    # 2. Warm start: search-and-answer demonstrations in *other* worlds (corpus seeds 1..8), so
    #    reading is learned without seeing any fact of the world RL and evaluation use.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    worlds = [Demonstrations(lambda s=s: stoa.envs.make("stoa/SyntheticSearch-v0", split="train", seed=s, **corpus), tok)
              for s in range(1, 9)]
    rng = np.random.default_rng(args.seed)
    for step in range(args.warmstart_steps):
        # "oracle": the environment's scripted search-then-answer demonstration of a random item
        batch = [worlds[w].sample("oracle", rng) for w in rng.integers(8, size=args.warmstart_batch)]
        loss = learner.sft_step(batch)["loss"]
        if step % 100 == 0:
            print(f"warm start {step:4d}  loss {loss:.3f}")
    learner.reset_optimizer(LearnerConfig(lr=args.lr, seed=args.seed))
    # The objective, resolved once: DPPO's config and loss function travel as one value.
    objective = resolve_objective("dppo", {"delta_high": args.delta, "delta_low": args.delta})

    # 3. The int8 rollout engine, holding exactly the quantized trainer weights (version 0).
    state = quantize_state(learner.export_weights())
    engine = MLXEngine.from_state(model_dir, state, version=0, config=EngineConfig(max_batch=64))
    sampling = SamplingConfig(temperature=1.0, max_turn_tokens=16, max_episode_tokens=256)

    def evaluate() -> tuple[float, float]:
        n = min(args.eval_questions, len(make_test().unwrapped))
        eps = engine.rollout(make_test, [RolloutRequest(i, f"eval-{i}", 1) for i in range(n)],
                             SamplingConfig(max_turn_tokens=16, max_episode_tokens=256, seed=args.seed))
        return float(np.mean([e.metrics["em"] for e in eps])), float(np.mean([e.metrics["searched"] for e in eps]))

    start = evaluate()
    print(f"before RL: pass@1 {start[0]:.3f}  search rate {start[1]:.3f}")
    n_train = len(make_train().unwrapped)
    for it in range(1, args.iterations + 1):
        t0 = time.time()
        # rollout: B prompts x G samples with the int8 policy; behaviour log-probs recorded per token
        requests = [RolloutRequest(int(i), f"it{it}-p{j}", args.group_size)
                    for j, i in enumerate(rng.integers(n_train, size=args.prompts))]
        episodes = engine.rollout(make_train, requests, sampling)
        # advantages: reward minus the group mean (groups with equal rewards carry no signal)
        rewards = np.array([e.reward for e in episodes], np.float32)
        adv, stats = group_advantages(rewards, [e.group_id for e in episodes], kind="drgrpo")
        keep = ~stats["zero_variance_mask"]
        metrics = {}
        if keep.any():
            # objective: one DPPO step on the float32 trainer policy
            metrics = learner.train_step([e for e, k in zip(episodes, keep) if k], adv[keep], objective)
        # publish: int8 re-quantization (keeping scales where the range did not move), a PULSE delta
        new_state = quantize_state(learner.export_weights(), previous=state)
        blob = pulse.encode_delta(state, new_state)
        engine.apply_delta(it, blob)
        assert engine.state_hash() == pulse.state_hash(new_state)
        state = new_state
        print(f"iter {it:3d}  reward {rewards.mean():.3f}  search {np.mean([e.metrics['searched'] for e in episodes]):.2f}"
              f"  gate masked {metrics.get('gate/masked_frac', 0):.4f}  delta {len(blob) / 1e3:.1f} kB"
              f"  ({time.time() - t0:.1f}s)")
    end = evaluate()
    print(f"after RL:  pass@1 {end[0]:.3f}  search rate {end[1]:.3f}")
    return {"pass@1_start": start[0], "pass@1_end": end[0], "search_rate_start": start[1], "search_rate_end": end[1]}


if __name__ == "__main__":
    main(parse())
