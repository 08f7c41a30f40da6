"""The trainer's config sections: ``[model]``, ``[trainer]``, ``[eval]``, ``[warmstart]``, ``[pulse]``.

Leaves: each is a frozen dataclass that checks its own bounds (:func:`stoa.fleet.sections.check`)
and imports nothing that runs. :mod:`stoa.fleet.config` assembles them with the other rooms'
sections; the code that reads them is beside this file (:mod:`.trainer`, :mod:`.warmstart`,
:mod:`.publishing`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from stoa.fleet.sections import check
from stoa.models.tiny import TinyConfig

__all__ = ["EvalConfig", "ModelConfig", "PulseConfig", "TrainerConfig", "WarmstartConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """Which weights the run starts from (``[model]``; :func:`stoa.fleet.trainer.trainer.prepare_model` reads it)."""

    path: str = ""
    """A local Hugging Face folder (config.json + safetensors + tokenizer). Empty: build a tiny model
    whose tokenizer is trained on the task's ``tokenizer_texts()``."""
    tiny: TinyConfig = TinyConfig()
    """Shape of the tiny model (used when ``path`` is empty); its ``seed`` is the run's seed."""
    prompt_format: Literal["auto", "chat", "plain"] = "auto"
    """How the task's prompt reaches the model (:mod:`stoa.backends.prompting`): ``chat`` (the
    tokenizer's chat template), ``plain`` (the prompt text continued, for base models), ``auto``
    (chat when the tokenizer has a template). The engine, the warm start and replay all use it."""


@dataclass(frozen=True)
class TrainerConfig:
    """How the trainer turns episodes into optimizer steps (``[trainer]``)."""

    steps: int = 100
    """Optimizer steps of RL (each publishes one weight version)."""
    groups_per_step: int = 16
    """Prompt groups per optimizer step."""
    max_lag: int = 3
    """Staleness gate: episodes more than this many versions behind are dropped (and counted)."""
    advantage: Literal["grpo", "drgrpo", "rloo"] = "drgrpo"
    """Group advantage estimator (``stoa.algos.advantages``)."""
    skip_zero_variance_groups: bool = True
    """Leave out groups whose rewards are all equal (they carry no signal)."""
    average_over: Literal["step", "signal"] = "step"
    """What the loss's mean runs over when zero-variance groups are left out. ``step``: every
    token (or sequence, per the objective's aggregation) the step took, the left-out groups counted
    with advantage 0, as a full-batch mean counts them; a step in which few groups carry signal
    then moves the policy less. ``signal``: only the groups with signal, so a step with one such
    group moves the policy as far as a step with all of them (noisy with small steps)."""
    checkpoint_every: int = 25
    """Save a full training checkpoint every this many steps (and at the end)."""
    threads: int = 0
    """torch CPU threads (0: leave torch's default)."""
    poll_seconds: float = 0.2
    """How often the trainer lists new rollouts while waiting."""
    silent_after_s: float = 30.0
    """A worker whose heartbeat is older than this is *silent* (event ``worker_silent``, metric
    ``fleet/workers_silent``). A working worker beats at least every few seconds; a sleeping
    laptop or a dead link goes quiet. Only shown: nothing is dropped or struck for silence."""
    warn_flat_steps: int = 3
    """Warn (log and event ``no_learning_signal``) when this many steps in a row had no group whose
    rewards differ: every advantage was then 0 and the weights did not move (0 = never warn)."""
    mismatch_every: int = 0
    """Every this many steps, split the behaviour/trainer mismatch into its int8 and staleness parts
    (``stoa.fleet.trainer.mismatch``: one extra int8 prefill and one float scoring pass); 0 = never."""
    int8_scorer: Literal["auto", "engine", "torch"] = "auto"
    """What re-scores episodes under a version's int8 weights (spot-checks, sampling checks, the
    mismatch split): ``engine`` (the rollout engine, on the host), ``torch`` (the int8 state
    dequantized into a torch model on the learner's device), ``auto`` (torch when the learner
    runs on CUDA, else the engine). Evaluation always runs on the engine."""

    def __post_init__(self) -> None:
        check(self.steps >= 0 and self.groups_per_step >= 1, "trainer.steps >= 0 and groups_per_step >= 1")
        check(self.mismatch_every >= 0, "trainer.mismatch_every must be >= 0")
        check(self.warn_flat_steps >= 0, "trainer.warn_flat_steps must be >= 0")
        check(self.max_lag >= 0, "trainer.max_lag must be >= 0")
        check(self.silent_after_s > 0, "trainer.silent_after_s must be > 0")
        check(self.average_over in ("step", "signal"), "trainer.average_over must be 'step' or 'signal'")
        check(self.checkpoint_every >= 1 and self.threads >= 0, "trainer.checkpoint_every >= 1, threads >= 0")


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation with the int8 policy the workers run (``[eval]``)."""

    every: int = 25
    """Evaluate every this many versions (and at the first and last)."""
    num_questions: int = 200
    """Held-out questions per evaluation."""
    samples: int = 4
    """Samples per question (pass@1 is their mean; pass@k uses all of them)."""

    def __post_init__(self) -> None:
        check(self.every >= 1 and self.num_questions >= 1 and self.samples >= 1, "eval.every/num_questions/samples >= 1")


@dataclass(frozen=True)
class WarmstartConfig:
    """Supervised steps on the task's scripted demonstrations, so RL starts from a realistic policy
    (``[warmstart]``).

    Two phases, both built from the environment's hooks (``demonstration_turns``, ``practice_kwargs``).
    *Practice* (``practice_steps``): ``practice_style`` demonstrations in sibling tasks (so no item
    of this run's task is seen); for the search tasks they search and answer from the retrieved
    text, teaching the protocol and how to read (a base model's general skill). *Habit*
    (``steps``): demonstrations of this run's task in the styles of ``mix`` (weights), plus
    ``practice_answer_only`` practice demonstrations per batch trained on their last turn only
    (earlier turns are context), so the skill is kept without teaching the rest. For the demo:
    ``mix = {oracle = 0.22, guess = 0.78}``: RL starts from a policy that rarely searches.
    """

    practice_steps: int = 0
    """Supervised steps of practice in sibling tasks (0 = none)."""
    practice_worlds: int = 16
    """Sibling tasks (``env.practice_kwargs(1..N)``) the practice draws from."""
    practice_style: str = "oracle"
    """Demonstration style of the practice (and of the held-out check)."""
    steps: int = 0
    """Supervised steps in this run's task with the ``mix`` of styles (0 = none)."""
    mix: dict[str, float] = field(default_factory=lambda: {"oracle": 1.0})
    """Demonstration style -> weight, for the habit steps (styles the env lists in ``demo_styles``)."""
    practice_answer_only: int = 0
    """Practice demonstrations added to each habit batch with only their last turn trained."""
    batch_size: int = 64
    """Demonstrations per step."""
    lr: float = 2e-3
    """Learning rate of the warm start (AdamW, its own optimizer state)."""
    check_every: int = 0
    """Report p(last turn) of held-out practice-style demonstrations every this many steps (0 = at the end)."""
    habit_band: tuple[float, float] | None = None
    """``[lo, hi]``: where the habit must leave the policy's propensity to open an episode as
    ``practice_style`` does (for the search tasks: to search first), measured exactly from the
    learner's probabilities on held-out prompts after the habit steps. Up to ``band_steps`` more
    habit steps, each batch exactly at the band's middle share, at ``band_lr_scale`` of the
    rate, bring it inside. The habit's end
    point otherwise varies from seed to seed (a short phase at full learning rate), and a policy
    that never opens that way gives RL nothing to reinforce. None: no calibration."""
    band_steps: int = 8
    """At most this many extra habit steps to reach ``habit_band``."""
    band_lr_scale: float = 0.25
    """The extra steps' learning rate as a share of ``lr`` (the habit's optimizer state kept): at the
    habit's own rate a single batch moved SmolLM2-135M's propensity from 10% to 43%."""
    threads: int = 0
    """torch CPU threads during the warm start (workers are idle then); 0 = the trainer's setting."""

    def __post_init__(self) -> None:
        check(self.steps >= 0 and self.batch_size >= 1, "warmstart.steps >= 0 and batch_size >= 1")
        check(self.practice_steps >= 0 and self.practice_worlds >= 1 and self.threads >= 0
               and self.practice_answer_only >= 0,
               "warmstart.practice_steps >= 0, practice_worlds >= 1, threads >= 0, practice_answer_only >= 0")
        check(bool(self.mix) and all(isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and math.isfinite(v) and v >= 0 for k, v in self.mix.items())
               and sum(self.mix.values()) > 0, "warmstart.mix must map style names to weights >= 0 (sum > 0)")
        check(math.isfinite(self.lr) and self.lr > 0 and self.check_every >= 0, "warmstart.lr > 0 and check_every >= 0")
        check(self.habit_band is None or (len(self.habit_band) == 2 and 0 <= self.habit_band[0] < self.habit_band[1] <= 1),
              "warmstart.habit_band must be [lo, hi] with 0 <= lo < hi <= 1")
        check(self.band_steps >= 0 and 0 < self.band_lr_scale <= 1,
              "warmstart.band_steps must be >= 0 and band_lr_scale in (0, 1]")


@dataclass(frozen=True)
class PulseConfig:
    """The weight channel the trainer publishes on (``[pulse]``)."""

    anchor_every: int = 50
    """A full anchor every this many versions (deltas in between)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype the trainer exports before int8 quantization (scales/biases travel in it)."""

    def __post_init__(self) -> None:
        check(self.anchor_every >= 1, "pulse.anchor_every must be >= 1")
