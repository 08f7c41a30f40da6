"""The text-environment contract: what a rollout engine may assume about every Stoa task.

A :class:`TextEnv` is a ``gymnasium.Env[str, str]`` for multi-turn text tasks in which the model
writes turns and the environment appends text between them, all inside one assistant message.

Episode life cycle (what the rollout engine does)::

    prompt, info = env.reset(seed=s, options={"index": i})
    context = chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    while True:
        turn = model.generate(context, stop=env.unwrapped.stop_strings)   # one model turn
        obs, reward, terminated, truncated, info = env.step(turn)
        if terminated or truncated:
            break                          # obs == ""; info["metrics"] -> Episode.metrics
        context += turn + obs              # the model continues in the same assistant turn

Tokens: the engine keeps the model's own sampled tokens for each turn and tokenizes *only* the
appended ``obs`` (never re-tokenizing the transcript), so ``obs`` is exactly the new text. It
should tokenize ``obs`` without parsing special tokens; environments also neutralize chat-control
strings (``<|...|>``) in any text they did not write themselves.

Rewards: ``step`` returns the reward earned by that turn; an episode's return is the sum of the
step rewards (for the search tasks, all of it arrives on the answering turn).

Ending an episode:

- ``terminated=True``: the task reached a natural end (e.g. the model answered). The reward is
  final.
- ``truncated=True``: a limit ended the episode (e.g. ``max_turns`` turns without an answer).
- If the model ends a turn with EOS (or hits the engine's token budget) without producing a stop
  string, the engine still calls ``step(turn_text)`` once (so an answer closed just before EOS
  counts). If that step neither terminates nor truncates, the engine discards ``obs`` and records
  the episode as *truncated*, with the rewards returned so far and that step's
  ``info["metrics"]``. Every step's ``info["metrics"]`` holds the metrics of the episode so far,
  which makes this possible; on the final step they are final.
- Calling ``step`` after the episode ended, or before the first ``reset``, raises
  ``RuntimeError``; a non-``str`` action raises ``TypeError``. A malformed *string* never raises:
  each environment documents what such a turn does (usually: feedback text, no reward, and the
  turn counts toward the limit).

Determinism: with the same ``reset(seed=..., options=...)`` and the same turns, an environment
returns the same observations, rewards and infos (retrieval included, for a fixed index).

``stoa.envs.check_env`` verifies all of the above for any registered environment.
"""

from __future__ import annotations

import string
from typing import Any, ClassVar

import gymnasium
import numpy as np
from gymnasium import spaces

from stoa.types import MetricValue

__all__ = ["TextEnv", "TextSpace", "MetricValue"]

MAX_TEXT = 1 << 20
"""Default length bound (characters) of observation and action spaces."""


class TextSpace(spaces.Text):
    """Any Python ``str`` of at most ``max_length`` characters.

    ``gymnasium.spaces.Text`` only admits characters from a fixed charset; model output and
    documents can hold any Unicode, so membership here checks type and length only. Samples are
    printable ASCII of at most ``SAMPLE_LENGTH`` characters unless a length is asked for (random
    turns for checkers; uniform lengths up to 1M characters would only make them slow).
    """

    SAMPLE_LENGTH = 512

    def __init__(self, max_length: int = MAX_TEXT, *, seed: int | None = None) -> None:
        super().__init__(max_length, min_length=0, charset=string.printable, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        if mask is None and probability is None:
            length = int(self.np_random.integers(0, min(self.max_length, self.SAMPLE_LENGTH) + 1))
            return super().sample(mask=(length, None))
        return super().sample(mask=mask, probability=probability)

    def __repr__(self) -> str:
        return f"TextSpace(max_length={self.max_length})"


class TextEnv(gymnasium.Env[str, str]):
    """Base class of Stoa's multi-turn text environments (see the module docstring for the loop).

    Subclasses implement :meth:`reset`, :meth:`step` and :meth:`__len__`, and set
    :attr:`stop_strings`. They may implement :meth:`oracle_turns` so that ``check_env`` can
    verify that full reward is reachable.

    Attributes:
        stop_strings: strings that end a model turn, e.g. ``("</search>", "</answer>")``. The
            engine stops generation right after the first one (it is part of the turn text).
            Empty means a turn ends only at EOS.
        observation_space: :class:`TextSpace`; observations are prompts and appended text.
        action_space: :class:`TextSpace`; an action is the decoded text of one model turn.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}
    stop_strings: tuple[str, ...] = ()
    observation_space = TextSpace()
    action_space = TextSpace()

    def __len__(self) -> int:
        """Number of dataset items; ``reset(options={"index": i})`` accepts ``0 <= i < len(env)``."""
        raise NotImplementedError

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode and return ``(prompt, info)``.

        Args:
            seed: seeds ``self.np_random`` (gymnasium semantics: only when given).
            options: ``{"index": i}`` selects dataset item ``i`` (the G samples of one group reset
                with the same index). Without it, an item is drawn with ``self.np_random``.

        Returns:
            prompt: the *user message* text; the engine applies the model's chat template to
                ``[{"role": "user", "content": prompt}]``.
            info: at least ``question_id`` (str, stable across processes), ``gold_answers``
                (list[str]; may be empty for tasks without reference answers) and ``index``
                (int, the item used).

        Raises:
            ValueError: ``options["index"]`` is not an int in ``[0, len(self))``.

        Subclasses call ``super().reset(seed=seed)`` first (it seeds ``np_random``, as in gymnasium).
        """
        super().reset(seed=seed, options=options)  # type: ignore[return]

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Apply one model turn.

        Args:
            action: the decoded text of one model turn, including the stop string that ended it.

        Returns:
            observation: the text to append to the context, ``""`` when the episode ended.
            reward: the reward this turn earned (finite float).
            terminated: the episode reached its natural end.
            truncated: a limit (turns) ended the episode.
            info: ``info["metrics"]``, a flat dict of bool/int/float/str/None describing the episode
                so far (final on the last step, copied into ``Episode.metrics``), plus any
                per-turn details the environment documents.

        Raises:
            RuntimeError: the episode already ended, or ``reset`` was never called.
            TypeError: ``action`` is not a ``str``.
        """
        raise NotImplementedError

    def oracle_turns(self, index: int) -> list[str] | None:
        """Turns that solve item ``index`` with the maximum reward, or ``None`` if unknown."""
        return None

    # -- helpers for subclasses ----------------------------------------------------------------
    def _select_index(self, options: dict[str, Any] | None) -> int:
        """The item for this reset: ``options["index"]`` if given, else drawn with ``np_random``."""
        n = len(self)
        if options and "index" in options:
            i = options["index"]
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                raise ValueError(f"options['index'] must be an int, got {type(i).__name__}")
            i = int(i)
            if not 0 <= i < n:
                raise ValueError(f"options['index']={i} is outside [0, {n})")
            return i
        return int(self.np_random.integers(n))
