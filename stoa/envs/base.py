"""The text-environment contract: what a rollout engine may assume about every Stoa task.

A :class:`TextEnv` is a ``gymnasium.Env[str, str]`` for multi-turn text tasks in which the model
writes turns and the environment appends text between them, all inside one assistant message.

Episode life cycle (what the rollout engine does)::

    prompt, info = env.reset(seed=s, options={"index": i})
    context = prompt_tokens(prompt)   # the chat template, or the plain text for a base model
                                       # (model.prompt_format, stoa.backends.prompting)
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

Replay (:attr:`TextEnv.replayable`): when the observations, rewards and metrics depend only on
the item (``options["index"]``) and the turns, not on the reset seed, the clock or anything
outside the process, the trainer checks every episode a worker uploads by replaying its model
turns through its own copy of the environment (``stoa.fleet.trust.replay``): a forged reward, metric
or observation is caught exactly. ``check_env`` plays episodes twice with different seeds to
hold an env that says it is replayable to it. Declare ``replayable = False`` for a task that
samples with ``np_random`` after ``reset`` or calls a service whose answers change; its
episodes are then checked only statistically (``docs/trust.md``).

Indeterminate outcomes (:attr:`TextEnv.indeterminate_metrics`): a replayable task whose scoring
can fail for reasons of the machine rather than the text (a scorer killed at its time limit under
load) names the metric values that say so, e.g. ``{"score_error": ("timeout", "crashed")}``. When
the worker's claim or the trainer's replay of an episode carries one of them, the episode cannot be
verified either way: it is *unverifiable*, neither trained on nor counted against the worker (its
group is dropped; the trust report counts it per worker). Such a value must come with the turn
that ends the episode, or with an observation the task derives from it: replay compares a
claim only once the tokens match.

Optional hooks (what the runtime may ask of a task; each has a safe default here)
---------------------------------------------------------------------------------
The trainer and workers know no task: whatever task knowledge they use comes through these.

- :attr:`metric_types`: the type of every key the environment puts in ``info["metrics"]``. The
  trainer checks workers' episodes against it (a worker is a stranger: a ``None`` or a string
  where a number belongs is refused, not trained on) and logs the mean of every numeric or bool
  metric as ``rollout/<key>`` and ``eval/<key>``.
- :attr:`success_metric`: the bool metric that says an episode solved the task (evaluation's
  pass@1 and pass@k); ``None`` means ``reward > 0``.
- :attr:`headline_metrics`: metrics shown beside pass@1 in the live view, plots and summary.
- :meth:`tokenizer_texts`: texts a new tokenizer for the task is trained on, so that ``stoa
  train`` can build a tiny model for the task from scratch (``model.path = ""``).
- :meth:`demonstration_turns` and :attr:`demo_styles`: scripted turns for the supervised warm
  start, in named styles (``"oracle"`` solves the item; a task may add others, e.g. a style that
  answers without using its tool, so RL has something to improve).
- :meth:`practice_kwargs`: keyword overrides that make a *sibling* task (same protocol, none of
  this instance's items), for warm-start practice that teaches the protocol without the answers.

``stoa.envs.check_env`` verifies all of the above for any registered environment.
"""

from __future__ import annotations

import math
import string
from collections.abc import Iterable
from typing import Any, ClassVar

import gymnasium
import numpy as np
from gymnasium import spaces

from stoa.types import MetricValue

__all__ = ["TextEnv", "TextSpace", "MetricValue", "metric_problem"]

MAX_TEXT = 1 << 20
"""Default length bound (characters) of observation and action spaces."""


def metric_problem(metrics: dict[str, Any], metric_types: dict[str, type | tuple[type, ...]]) -> str | None:
    """Why ``metrics`` break ``metric_types`` (a missing declared key is allowed), or ``None``.

    ``bool`` is not an ``int`` here and ``float`` admits ``int`` (not ``bool``); numbers must be finite.
    """
    for key, want in metric_types.items():
        if key not in metrics:
            continue
        v = metrics[key]
        kinds = want if isinstance(want, tuple) else (want,)
        ok = any(type(v) is k or (k is float and type(v) is int) for k in kinds)
        if not ok:
            names = "/".join(k.__name__ for k in kinds)
            return f"metric {key!r} is {type(v).__name__} {str(v)[:40]!r}, expected {names}"
        if type(v) in (int, float) and not math.isfinite(v):
            return f"metric {key!r} is not finite"
    return None


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
    metric_types: ClassVar[dict[str, type | tuple[type, ...]]] = {}
    """Type of each ``info["metrics"]`` key (``bool``, ``int``, ``float``, ``str``, a tuple of them;
    ``float`` admits ints; include ``type(None)`` for a key that may be ``None``). Keys not listed
    are kept but neither checked nor logged."""
    success_metric: ClassVar[str | None] = None
    """The bool metric that means "solved" (pass@1 / pass@k); ``None``: ``reward > 0``."""
    headline_metrics: ClassVar[tuple[str, ...]] = ()
    """Metrics shown next to pass@1 in the live view, the plots and the run summary."""
    replayable: ClassVar[bool] = True
    """Whether an episode is a function of its item index and its turns alone (see "Replay" in
    the module docstring); the trainer replays uploaded episodes of a replayable task."""
    indeterminate_metrics: ClassVar[dict[str, tuple[Any, ...]]] = {}
    """Metric key -> the values that mean its outcome depended on the machine, not on the text
    (a scorer's timeout); an episode whose claim or replay holds one is unverifiable, neither
    trained on nor struck (see "Indeterminate outcomes" in the module docstring)."""
    demo_styles: ClassVar[tuple[str, ...]] = ("oracle",)
    """Styles :meth:`demonstration_turns` knows; ``"oracle"`` is :meth:`oracle_turns`."""
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

    def demonstration_turns(self, index: int, style: str, rng: np.random.Generator) -> list[str] | None:
        """Scripted turns for item ``index`` in ``style`` (one of :attr:`demo_styles`), or ``None``
        if the item has none. They are played through :meth:`step` like model turns, so their
        observations and reward are the environment's own. ``rng`` draws any random choice.

        Raises:
            ValueError: ``style`` is not in :attr:`demo_styles`.
        """
        if style not in self.demo_styles:
            raise ValueError(f"{type(self).__name__} has no demonstration style {style!r}; styles: {self.demo_styles}")
        return self.oracle_turns(index) if style == "oracle" else None

    def tokenizer_texts(self) -> Iterable[str] | None:
        """Texts a tokenizer for this task should be trained on (prompts, tool outputs, ideal turns),
        or ``None`` if the task cannot supply them (then a run must name a pretrained model)."""
        return None

    def practice_kwargs(self, k: int) -> dict[str, Any] | None:
        """Overrides of this environment's constructor kwargs that make sibling task ``k`` (``k >= 1``):
        same protocol and styles, none of this instance's items or answers. ``None``: no siblings."""
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
