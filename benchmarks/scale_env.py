"""The synthetic search task with a shaping bonus, so a random-weight model gets a learning signal.

A model of real shape with random weights never answers correctly, so every group would have
zero reward variance and no optimizer step would change the weights. The bonus (0.5 for a turn
whose text has an even number of characters) is deterministic in the action, so the trainer's
replay still reproduces every reward; it exists only to exercise the trainer's step and PULSE
at real size (benchmarks/scale.py).
"""

import stoa.envs
from stoa.envs.synthetic import SyntheticSearchEnv


class ScaleSearchEnv(SyntheticSearchEnv):
    def step(self, action: str):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward + (0.5 if len(action) % 2 == 0 else 0.0), terminated, truncated, info


stoa.envs.register("bench/ScaleSearch-v0", entry_point=ScaleSearchEnv)
