"""Arithmetic, single turn: a verifiers environment written the way any verifiers user writes one.

Stoa trains on it as ``env.id = "verifiers:stoa_vf_example"`` (and on the guessing game in
:mod:`stoa_vf_example.guess` as ``"verifiers:stoa_vf_example.guess"``); nothing here knows Stoa.
"""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = "Work out the sum. Write the result as <answer>number</answer>."


def _items(n: int, seed: int, max_operand: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    return rows


def load_environment(num_train: int = 200, num_eval: int = 20, seed: int = 0, max_operand: int = 50,
                     **kwargs) -> vf.Environment:
    """Sums of two numbers; reward 1 for the right number in ``<answer>`` tags."""
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def correct(completion, answer, parser) -> float:
        got = parser.parse_answer(completion)
        return 1.0 if got is not None and got.strip() == answer else 0.0

    rubric = vf.Rubric(funcs=[correct, parser.get_format_reward_func()], weights=[1.0, 0.0], parser=parser)
    return vf.SingleTurnEnv(dataset=Dataset.from_list(_items(num_train, seed, max_operand)),
                            eval_dataset=Dataset.from_list(_items(num_eval, seed + 1, max_operand)),
                            system_prompt=SYSTEM_PROMPT, parser=parser, rubric=rubric, **kwargs)
