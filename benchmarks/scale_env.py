"""The synthetic search task with a shaping bonus, so a random-weight model gets a learning signal.

A model of real shape with random weights never answers correctly, so every group would have
zero reward variance and no optimizer step would change the weights. The bonus (0.5 for a turn
with any text) varies because such a model mostly samples padding ids past the tokenizer's
vocabulary, which decode to nothing. It is deterministic in the action, so the trainer's replay
still reproduces every reward; it exists only to exercise the trainer's step and PULSE at real
size (benchmarks/scale.py).
"""

import stoa.envs
from stoa.envs.synthetic import SyntheticSearchEnv


class ScaleSearchEnv(SyntheticSearchEnv):
    def step(self, action: str):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward + (0.5 if action.strip() else 0.0), terminated, truncated, info


stoa.envs.register("bench/ScaleSearch-v0", entry_point=ScaleSearchEnv)
