"""A task at a small pretrained model's level: add two numbers, answer in tags.

The prompt asks ``What is 47 + 38?`` and the model ends its one turn with ``<answer> 85 </answer>``.
Reward 1 for the right sum, ``format_reward`` (default 0.1) for a well-formed integer answer that
is wrong, 0 otherwise, so a policy that has learned the format but not the sum still gets a signal
within its group. ``examples/smollm2_addition.toml`` trains SmolLM2-135M-Instruct on it.

The optional hooks give ``stoa train`` what its warm start needs: ``"oracle"`` demonstrations (the
right sum) and ``"near"`` ones (a sum off by a few units, the kind of slip RL should remove), and
sibling tasks (other numbers) for practice.

Run: ``python examples/addition_env.py`` (checks the env).
"""

import re

import numpy as np

import stoa.envs
from stoa.envs import TextEnv

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


class AdditionEnv(TextEnv):
    """``a + b`` with ``a, b`` drawn from ``[lo, hi]``; one turn, answered in ``<answer>`` tags."""

    stop_strings = ("</answer>",)
    metric_types = {"correct": bool, "formatted": bool}
    success_metric = "correct"
    headline_metrics = ("formatted",)
    demo_styles = ("oracle", "near")

    def __init__(self, split: str = "train", lo: int = 10, hi: int = 99, size: int = 2000, seed: int = 0,
                 format_reward: float = 0.1) -> None:
        if not (0 <= lo <= hi and size >= 1 and 0.0 <= format_reward < 1.0):
            raise ValueError("need 0 <= lo <= hi, size >= 1 and 0 <= format_reward < 1")
        rng = np.random.default_rng([seed, {"train": 0, "test": 1}[split]])
        self.items = [(int(a), int(b)) for a, b in rng.integers(lo, hi + 1, size=(size, 2))]
        self.split, self.seed, self.format_reward, self._done = split, seed, format_reward, True

    def __len__(self) -> int:
        return len(self.items)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        i = self._select_index(options)
        a, b = self.items[i]
        self._gold, self._done = a + b, False
        prompt = f"What is {a} + {b}? Reply with <answer> number </answer>."
        return prompt, {"question_id": f"{self.split}-{i}", "gold_answers": [str(self._gold)], "index": i}

    def step(self, action):
        if not isinstance(action, str):
            raise TypeError("an action is the text of one model turn")
        if self._done:
            raise RuntimeError("the episode has ended; call reset()")
        self._done = True
        m = _ANSWER.search(action)
        text = m.group(1).strip() if m else ""
        formatted = bool(re.fullmatch(r"-?\d+", text))
        correct = formatted and int(text) == self._gold
        reward = 1.0 if correct else self.format_reward if formatted else 0.0
        return "", reward, True, False, {"metrics": {"correct": correct, "formatted": formatted}}

    def oracle_turns(self, index: int) -> list[str]:
        a, b = self.items[index]
        return [f"<answer> {a + b} </answer>"]

    # -- optional hooks for `stoa train` (see stoa.envs.base) --------------------------------------
    def demonstration_turns(self, index: int, style: str, rng: np.random.Generator) -> list[str] | None:
        if style == "near":  # the right format, a sum off by 1-10
            a, b = self.items[index]
            off = int(rng.integers(1, 11)) * (1 if rng.random() < 0.5 else -1)
            return [f"<answer> {a + b + off} </answer>"]
        return super().demonstration_turns(index, style, rng)

    def practice_kwargs(self, k: int) -> dict:
        return {"seed": self.seed + 1000 + k}  # other numbers, same protocol


stoa.envs.register("example/Addition-v0", entry_point=AdditionEnv)

if __name__ == "__main__":
    stoa.envs.check_env("example/Addition-v0", split="test")
    env = stoa.envs.make("example/Addition-v0", split="test")
    prompt, info = env.reset(seed=0)
    (turn,) = env.unwrapped.oracle_turns(info["index"])
    _, reward, *_, step_info = env.step(turn)
    print(f"{prompt}\n{turn}\nreward {reward}, metrics {step_info['metrics']}\ncheck_env passed")
