"""Add a new task to Stoa: arithmetic with a calculator tool, registered, checked and trained.

The model may call ``<calc> 37 * 41 </calc>`` (the environment appends ``<result> 1517 </result>``)
and ends with ``<answer> 1522 </answer>``; reward 1 for the right number. Registering is one call,
after which ``stoa.envs.make("example/Arithmetic-v0")`` finds it. The optional hooks at the end of
the class (metric types, demonstrations, tokenizer texts, sibling tasks) are what ``stoa train``
needs to build a tiny model for the task, warm-start it and log its metrics; the runtime knows
nothing else about it.

Run: ``python examples/custom_env.py`` (checks the env), then
``stoa train examples/arithmetic_tiny.toml`` (trains it; the config's ``env.module`` names this file).
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
    metric_types = {"correct": bool, "used_calc": bool, "num_calls": int, "num_turns": int}
    success_metric = "correct"
    headline_metrics = ("used_calc",)
    demo_styles = ("oracle", "guess")

    def __init__(self, split: str = "train", max_turns: int = 3, size: int = 500, seed: int = 0) -> None:
        rng = np.random.default_rng([seed, {"train": 0, "test": 1}[split]])
        self.items = [tuple(int(x) for x in row) for row in rng.integers(10, 100, size=(size, 3))]
        self.split, self.max_turns, self.seed, self._done = split, max_turns, seed, True

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
        return {"correct": correct, "used_calc": self._calls > 0, "num_calls": self._calls, "num_turns": self._turns}

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

    # -- optional hooks for `stoa train` (see stoa.envs.base) --------------------------------------
    def demonstration_turns(self, index: int, style: str, rng: np.random.Generator) -> list[str] | None:
        if style == "guess":  # answer at once, roughly right: what RL should improve on
            a, b, c = self.items[index]
            return [f"<answer> {round(a * b + c, -2) + int(rng.integers(-50, 50))} </answer>"]
        return super().demonstration_turns(index, style, rng)

    def tokenizer_texts(self):
        for i, (a, b, c) in enumerate(self.items):
            prompt, _ = self.reset(options={"index": i})
            yield prompt + f"<calc> {a} * {b} + {c} </calc>\n<result> {a * b + c} </result>\n<answer> {a * b + c} </answer>"
        yield "\nUse <calc> expression </calc> or <answer> number </answer>.\n<result> error </result>"

    def practice_kwargs(self, k: int) -> dict:
        return {"seed": self.seed + 1000 + k}  # other numbers, same protocol


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
