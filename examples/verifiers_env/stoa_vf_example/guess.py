"""A guessing game, multi-turn: the model guesses a secret number, the environment answers
"Higher." or "Lower." until the guess is right or the turns run out."""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = ("I am thinking of a whole number from 1 to {hi}. Guess it: write one number as "
                 "<guess>number</guess>. I will say whether it is higher or lower.")


class GuessEnv(vf.MultiTurnEnv):
    """The secret is the item's ``answer``; ``state["solved"]`` says whether it was found."""

    stop_strings = ("</guess>",)  # Stoa reads this: a turn ends when a guess is closed

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.guess_parser = vf.XMLParser(["guess"], answer_field="guess")

    async def env_response(self, messages, state, **kwargs):
        guess = self.guess_parser.parse_answer(messages)
        try:
            n = int((guess or "").strip())
        except ValueError:
            return [vf.UserMessage(content="Write one whole number as <guess>number</guess>.")]
        secret = int(state["answer"])
        if n == secret:
            state["solved"] = True
            state["final_env_response"] = [vf.UserMessage(content="Correct!")]
            return state["final_env_response"]
        return [vf.UserMessage(content="Higher." if n < secret else "Lower.")]


def load_environment(num_train: int = 200, num_eval: int = 20, seed: int = 0, hi: int = 20, max_turns: int = 5,
                     **kwargs) -> vf.Environment:
    """Reward 1 for finding the number, less 0.1 for each extra guess."""
    rng = random.Random(seed)
    rows = [{"question": "Your guess?", "answer": str(rng.randint(1, hi))} for _ in range(num_train + num_eval)]

    def found(state) -> float:
        return max(0.0, 1.0 - 0.1 * (len(state["trajectory"]) - 1)) if state.get("solved") else 0.0

    return GuessEnv(dataset=Dataset.from_list(rows[:num_train]), eval_dataset=Dataset.from_list(rows[num_train:]),
                    system_prompt=SYSTEM_PROMPT.format(hi=hi), rubric=vf.Rubric(funcs=[found]),
                    max_turns=max_turns, **kwargs)
