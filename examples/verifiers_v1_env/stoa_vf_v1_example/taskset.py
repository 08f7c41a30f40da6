"""Sums of two numbers: the answer goes in ``<answer>`` tags; reward 1 for the right number."""

from __future__ import annotations

import random
import re
from typing import Literal

import verifiers.v1 as vf

SYSTEM_PROMPT = "Work out the sum. Write the result as <answer>number</answer>."
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class SumData(vf.TaskData):
    answer: str
    """The sum, as digits."""


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        found = ANSWER.findall(trace.last_reply)
        return 1.0 if found and found[-1].strip() == self.data.answer else 0.0

    @vf.metric
    async def formatted(self, trace: vf.Trace) -> float:
        return 1.0 if ANSWER.search(trace.last_reply) else 0.0


class SumConfig(vf.TasksetConfig):
    split: Literal["train", "test"] = "train"
    num_train: int = 200
    num_eval: int = 20
    seed: int = 0
    max_operand: int = 50
    few_shot: bool = False
    """Open each prompt with one worked example (a user and an assistant message)."""


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        cfg = self.config
        n, seed = (cfg.num_train, cfg.seed) if cfg.split == "train" else (cfg.num_eval, cfg.seed + 1)
        rng = random.Random(seed)
        shot = [vf.UserMessage(content="What is 2 + 3?"), vf.AssistantMessage(content="<answer>5</answer>")]
        tasks = []
        for _ in range(n):
            a, b = rng.randint(0, cfg.max_operand), rng.randint(0, cfg.max_operand)
            question = f"What is {a} + {b}?"
            prompt = [*shot, vf.UserMessage(content=question)] if cfg.few_shot else question
            tasks.append(SumTask(SumData(prompt=prompt, system_prompt=SYSTEM_PROMPT, answer=str(a + b)), cfg.task))
        return tasks
