"""Warm start: supervised steps on scripted demonstrations, so RL starts from a realistic policy.

A base model that has never seen the search protocol would need millions of RL samples before it
emitted a well-formed turn. The warm start teaches the *format* and the *reading skill* (copy the
answer out of retrieved text) while leaving the *decision to search* mostly unlearned: only
``search_fraction`` of the demonstrations search; the rest answer at once with a plausible but
random name. RL then has to discover that searching pays, which is the behaviour the demo measures.

Demonstrations are played through the real environment (its observations are the retrieved
documents) and built at token level exactly as the rollout engine builds episodes: the prompt
through the chat template, each turn's text encoded on its own, each observation encoded on its
own. Their behaviour log-probs are 0 (they are not samples of any policy; SFT ignores them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from stoa.types import Episode, Segment

__all__ = ["Demonstrations", "answer_after_search_probability", "answer_only"]


class Demonstrations:
    """Scripted demonstration episodes for a search environment (``oracle_turns`` + random answers).

    Args:
        make_env: factory of the environment (its ``unwrapped`` must implement ``oracle_turns``).
        tokenizer: the model's Hugging Face tokenizer (``apply_chat_template``, ``encode``).
        distractors: names a non-searching demonstration answers with (drawn uniformly).
        env_id: stamped on the episodes.
    """

    def __init__(self, make_env: Callable[[], Any], tokenizer: Any, distractors: Sequence[str], env_id: str = ""):
        self.env = make_env()
        self.tok = tokenizer
        self.distractors = list(distractors)
        self.env_id = env_id
        if not self.distractors:
            raise ValueError("need at least one distractor answer")
        if self.env.unwrapped.oracle_turns(0) is None:
            raise ValueError(f"{type(self.env.unwrapped).__name__} has no oracle_turns(); cannot script demonstrations")

    def __len__(self) -> int:
        return len(self.env.unwrapped)

    def episode(self, index: int, search: bool, rng: np.random.Generator) -> Episode:
        """One demonstration of dataset item ``index``: search-then-answer, or a direct random answer."""
        prompt, info = self.env.reset(options={"index": int(index)})
        turns = self.env.unwrapped.oracle_turns(int(index))
        if not search:  # the oracle's answer turn with the gold answer swapped for a random name
            guess = self.distractors[int(rng.integers(len(self.distractors)))]
            turns = [turns[-1].replace(info["gold_answers"][0], guess)]
        prompt_ids = self.tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
        segments, reward, metrics = [], 0.0, {}
        for text in turns:
            ids = self.tok.encode(text, add_special_tokens=False)
            segments.append(Segment("model", np.asarray(ids), np.zeros(len(ids), np.float32)))
            obs, r, terminated, truncated, step_info = self.env.step(text)
            reward += r
            metrics = step_info.get("metrics", metrics)
            if terminated or truncated:
                break
            if obs:
                segments.append(Segment("env", np.asarray(self.tok.encode(obs, add_special_tokens=False))))
        return Episode(np.asarray(prompt_ids), segments, reward, dict(metrics), env_id=self.env_id,
                       group_id=f"demo-{info['question_id']}", worker_id="warmstart")

    def batch(self, size: int, search_fraction: float, rng: np.random.Generator) -> list[Episode]:
        idx = rng.integers(len(self), size=size)
        searches = rng.random(size) < search_fraction
        return [self.episode(int(i), bool(s), rng) for i, s in zip(idx, searches)]


def answer_only(episode: Episode) -> Episode:
    """The same transcript with every segment but the last model turn turned into context (no loss)."""
    *context, last = episode.segments
    tokens = np.concatenate([s.tokens for s in context]) if context else np.zeros(0, np.int32)
    segments = ([Segment("env", tokens)] if len(tokens) else []) + [last]
    return Episode(episode.prompt_tokens, segments, episode.reward, dict(episode.metrics), env_id=episode.env_id,
                   group_id=episode.group_id, worker_id=episode.worker_id)


def answer_after_search_probability(logprobs: Sequence[np.ndarray], episodes: Sequence[Episode]) -> float:
    """Mean probability of producing the demonstrated final turn (the answer) after the search.

    ``logprobs`` are the learner's per-token log-probs of search demonstrations (aligned with
    ``episode.tokens()``); the final model segment is the answer turn, so ``exp`` of its summed
    log-probs is the chance of sampling exactly that answer at temperature 1.
    """
    probs = []
    for lp, ep in zip(logprobs, episodes):
        n = len(ep.segments[-1].tokens)
        probs.append(float(np.exp(lp[-n:].astype(np.float64).sum())))
    return float(np.mean(probs)) if probs else 0.0
