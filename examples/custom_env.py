"""Add a new task to Stoa: arithmetic with a calculator tool, registered and checked.

The model may call ``<calc> 37 * 41 </calc>`` (the environment appends ``<result> 1517 </result>``)
and ends with ``<answer> 1522 </answer>``; reward 1 for the right number. Registering is one call,
after which ``stoa.envs.make("example/Arithmetic-v0")`` (and the trainer/worker configs) find it.

Run: ``python examples/custom_env.py``
"""

import ast
import operator
import re

import numpy as np

import stoa.envs
from stoa.envs import TextEnv

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expr: str) -> int | None:
    """The value of an integer expression with + - * and parentheses; None for anything else."""
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("unsupported expression")
    if len(expr) > 200:  # bounds parsing time and the size of the result
        return None
    try:
        return ev(ast.parse(expr.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        return None


class ArithmeticEnv(TextEnv):
    """Compute ``a * b + c`` (two-digit numbers) with an optional calculator call per turn."""

    stop_strings = ("</calc>", "</answer>")

    def __init__(self, split: str = "train", max_turns: int = 3, size: int = 500) -> None:
        rng = np.random.default_rng({"train": 0, "test": 1}[split])
        self.items = [tuple(int(x) for x in row) for row in rng.integers(10, 100, size=(size, 3))]
        self.split, self.max_turns, self._done = split, max_turns, True

    def __len__(self) -> int:
        return len(self.items)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        i = self._select_index(options)
        a, b, c = self.items[i]
        self._gold, self._turns, self._calls, self._done = a * b + c, 0, 0, False
        prompt = f"Compute {a} * {b} + {c}. Use <calc> expression </calc> to calculate; reply <answer> number </answer>."
        return prompt, {"question_id": f"{self.split}-{i}", "gold_answers": [str(self._gold)], "index": i}

    def _metrics(self, correct: bool) -> dict:
        return {"correct": correct, "num_calls": self._calls, "num_turns": self._turns}

    def step(self, action):
        if not isinstance(action, str):
            raise TypeError("an action is the text of one model turn")
        if self._done:
            raise RuntimeError("the episode has ended; call reset()")
        self._turns += 1
        answer = re.search(r"<answer>(.*?)</answer>", action, re.S)
        if answer:  # an answer ends the episode, right or wrong
            self._done = True
            correct = answer.group(1).strip() == str(self._gold)
            return "", float(correct), True, False, {"metrics": self._metrics(correct)}
        if self._turns >= self.max_turns:
            self._done = True
            return "", 0.0, False, True, {"metrics": self._metrics(False)}
        calc = re.search(r"<calc>(.*?)</calc>", action, re.S)
        if calc:
            self._calls += 1
            value = calculate(calc.group(1))
            obs = f"\n<result> {'error' if value is None else value} </result>\n"
        else:
            obs = "\nUse <calc> expression </calc> or <answer> number </answer>.\n"
        return obs, 0.0, False, False, {"metrics": self._metrics(False)}

    def oracle_turns(self, index: int) -> list[str]:
        a, b, c = self.items[index]
        return [f"<calc> {a} * {b} + {c} </calc>", f"<answer> {a * b + c} </answer>"]


stoa.envs.register("example/Arithmetic-v0", entry_point=ArithmeticEnv)

if __name__ == "__main__":
    stoa.envs.check_env("example/Arithmetic-v0", split="test")
    env = stoa.envs.make("example/Arithmetic-v0", split="test")
    prompt, info = env.reset(seed=0)
    print(prompt)
    for turn in env.unwrapped.oracle_turns(info["index"]):
        obs, reward, terminated, truncated, step_info = env.step(turn)
        print(turn + obs, end="")
    print(f"\nreward {reward}, metrics {step_info['metrics']}\ncheck_env passed")
