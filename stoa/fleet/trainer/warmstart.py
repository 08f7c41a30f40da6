"""Warm start: supervised steps on scripted demonstrations, so RL starts from a realistic policy.

A base model that has never seen a task's protocol would need millions of RL samples before it
emitted a well-formed turn. The warm start teaches the *format* and the task's general *skill*
from the environment's own scripted demonstrations (``TextEnv.demonstration_turns`` in named
styles), while leaving what RL should discover mostly unlearned: for the search tasks, practice
in sibling tasks teaches reading retrieved text, and this task's habit mixes a few searching
(``"oracle"``) demonstrations with many that answer at once (``"guess"``), so RL has to discover
that searching pays. Nothing here knows a task: styles, siblings and answers come from the env.

Demonstrations are played through the real environment (its observations are the environment's
own) and built at token level exactly as the rollout engine builds episodes: the prompt in the
run's prompt format (``model.prompt_format``, :func:`stoa.backends.prompting.prompt_tokens`), each
turn's text encoded on its own, each observation encoded on its own. Their
behaviour log-probs are 0 (they are not samples of any policy; SFT ignores them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stoa.backends import prompting
from stoa.fleet.config import RunConfig
from stoa.types import Episode, Segment

__all__ = ["Demonstrations", "answer_only", "final_turn_probability", "opening_probability", "warm_start"]

log = logging.getLogger("stoa.trainer")


class Demonstrations:
    """Scripted demonstration episodes of one environment instance.

    Args:
        make_env: factory of the environment (a :class:`stoa.envs.TextEnv`, possibly wrapped).
        tokenizer: the model's Hugging Face tokenizer (``apply_chat_template``, ``encode``).
        env_id: stamped on the episodes.
        prompt_format: ``model.prompt_format`` (``"auto"``, ``"chat"`` or ``"plain"``).

    Raises:
        ValueError: the environment scripts no ``"oracle"`` demonstration of its first item and
            has no other style.
    """

    def __init__(self, make_env: Callable[[], Any], tokenizer: Any, env_id: str = "", prompt_format: str = "auto"):
        self.env = make_env()
        self.tok = tokenizer
        self.env_id = env_id
        self.prompt_format = prompting.resolve(prompt_format, tokenizer)
        u = self.env.unwrapped
        self.styles = tuple(u.demo_styles)
        if not self.styles:
            raise ValueError(f"{type(u).__name__} lists no demonstration styles; cannot script demonstrations")

    def __len__(self) -> int:
        return len(self.env.unwrapped)

    def episode(self, index: int, style: str, rng: np.random.Generator) -> Episode | None:
        """One demonstration of item ``index`` in ``style``, or None if the env has none for it."""
        turns = self.env.unwrapped.demonstration_turns(int(index), style, rng)
        if not turns:
            return None
        prompt, info = self.env.reset(options={"index": int(index)})
        prompt_ids = prompting.prompt_tokens(self.tok, prompt, self.prompt_format)
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
                segments.append(Segment("env", np.asarray(self.tok.encode(obs, add_special_tokens=False,
                                                                          split_special_tokens=True))))
        return Episode(np.asarray(prompt_ids), segments, reward, dict(metrics), env_id=self.env_id,
                       group_id=f"demo-{info['question_id']}", worker_id="warmstart")

    def sample(self, style: str, rng: np.random.Generator, tries: int = 32) -> Episode:
        """A demonstration of a random item in ``style`` (items without one are redrawn)."""
        for _ in range(tries):
            ep = self.episode(int(rng.integers(len(self))), style, rng)
            if ep is not None:
                return ep
        raise ValueError(f"{type(self.env.unwrapped).__name__} scripted no {style!r} demonstration in {tries} draws")

    def batch(self, size: int, mix: Mapping[str, float], rng: np.random.Generator,
              exact: bool = False) -> list[Episode]:
        """``size`` demonstrations of random items whose styles are drawn with the weights of ``mix``
        (an item without a demonstration in its style is replaced by a fresh draw). ``exact``: each
        style's count is its share of ``size``, rounded (largest remainders, ties at random), so
        the batch itself has the mix's composition."""
        names = list(mix)
        weights = np.array([mix[n] for n in names], dtype=float)
        if exact:
            want = weights / weights.sum() * size
            counts = np.floor(want).astype(int)
            order = np.lexsort((rng.random(len(names)), -(want - counts)))
            counts[order[: size - counts.sum()]] += 1
            styles = [n for n, c in zip(names, counts) for _ in range(c)]
            idx = rng.integers(len(self), size=size)
        else:
            cum = np.cumsum(weights)
            idx, u = rng.integers(len(self), size=size), rng.random(size) * cum[-1]
            styles = [names[min(int(np.searchsorted(cum, x, side="right")), len(names) - 1)] for x in u]
        return [self.episode(int(i), st, rng) or self.sample(st, rng) for i, st in zip(idx, styles)]


def answer_only(episode: Episode) -> Episode:
    """The same transcript with every segment but the last model turn turned into context (no loss)."""
    *context, last = episode.segments
    tokens = np.concatenate([s.tokens for s in context]) if context else np.zeros(0, np.int32)
    segments = ([Segment("env", tokens)] if len(tokens) else []) + [last]
    return Episode(episode.prompt_tokens, segments, episode.reward, dict(episode.metrics), env_id=episode.env_id,
                   group_id=episode.group_id, worker_id=episode.worker_id)


def final_turn_probability(logprobs: Sequence[np.ndarray], episodes: Sequence[Episode]) -> float:
    """Mean probability of producing each demonstration's final turn given everything before it.

    ``logprobs`` are the learner's per-token log-probs (aligned with ``episode.tokens()``); ``exp``
    of the final model segment's summed log-probs is the chance of sampling exactly that turn at
    temperature 1 (for the search tasks: the answer after the search, the reading skill).
    """
    probs = []
    for lp, ep in zip(logprobs, episodes):
        n = len(ep.segments[-1].tokens)
        probs.append(float(np.exp(lp[-n:].astype(np.float64).sum())))
    return float(np.mean(probs)) if probs else 0.0


def opening_probability(learner: Any, demos: Demonstrations, style: str, others: Sequence[str],
                        indices: Sequence[int], rng: np.random.Generator) -> float:
    """Mean probability, over the prompts of items ``indices``, that the policy opens its first
    turn as ``style``'s demonstration does, up to the first token where it parts from every other
    style's first turn (for the search tasks: ``<search`` rather than ``<answer``). Computed
    exactly from the learner's log-probs at temperature 1; a policy that reaches the same text by
    another tokenization is not counted, so it is a lower bound of the sampled share."""
    episodes = []
    for i in indices:
        turns = {s: demos.env.unwrapped.demonstration_turns(int(i), s, rng) for s in (style, *others)}
        if not turns[style]:
            continue
        ids = demos.tok.encode(turns[style][0], add_special_tokens=False)
        k = 1
        for o in others:
            other = demos.tok.encode(turns[o][0], add_special_tokens=False) if turns[o] else []
            same = next((j for j, (a, b) in enumerate(zip(ids, other)) if a != b), min(len(ids), len(other)))
            k = max(k, same + 1)
        prompt, info = demos.env.reset(options={"index": int(i)})
        prompt_ids = prompting.prompt_tokens(demos.tok, prompt, demos.prompt_format)
        opening = np.asarray(ids[: min(k, len(ids))])
        episodes.append(Episode(np.asarray(prompt_ids), [Segment("model", opening, np.zeros(len(opening), np.float32))],
                                0.0, {}, env_id=demos.env_id, group_id=f"open-{info['question_id']}",
                                worker_id="warmstart"))
    if not episodes:
        raise ValueError(f"no held-out item has a {style!r} demonstration to measure the habit against")
    return final_turn_probability(learner.logprobs(episodes), episodes)


def _toward(mix: Mapping[str, float], style: str, band: Sequence[float]) -> dict[str, float]:
    """The habit's mix with ``style``'s share at the band's middle, the other styles in their ratio:
    supervised steps on it pull the propensity toward that share from either side."""
    share = 0.5 * (band[0] + band[1])
    rest = {k: v for k, v in mix.items() if k != style}
    total = sum(rest.values())
    if not rest or total <= 0:
        return {style: 1.0}
    return {style: share, **{k: (1.0 - share) * v / total for k, v in rest.items()}}


def warm_start(cfg: RunConfig, learner: Any, model_dir: Path, make_env: Callable[..., Any],
               reset_optimizer: Callable[..., None], log_row: Callable[..., Any]) -> None:
    """Practice in sibling tasks, then this task's habit (``[warmstart]``, ``WarmstartConfig``).

    ``make_env(split, **overrides)`` builds the run's environment; ``reset_optimizer(**over)``
    resets the learner's optimizer with the run's learner config changed by ``over``
    (``keep_state=True``: only its rate and schedule); every
    progress row goes to ``log_row(**fields)``."""
    from transformers import AutoTokenizer

    ws, env_cfg = cfg.warmstart, cfg.env
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    fmt = cfg.model.prompt_format
    demos = Demonstrations(lambda: make_env(env_cfg.train_split), tok, env_cfg.id, fmt)
    for style in [ws.practice_style, *ws.mix]:
        if style not in demos.styles:
            raise ValueError(f"warmstart: {env_cfg.id} has no demonstration style {style!r}; it has {demos.styles}")
    held = Demonstrations(lambda: make_env(env_cfg.eval_split), tok, env_cfg.id, fmt)
    rng = np.random.default_rng([cfg.seed, 17])
    check = [e for e in (held.episode(int(i), ws.practice_style, rng) for i in rng.permutation(len(held))[:64]) if e]
    reset_optimizer(lr=ws.lr, schedule="constant", warmup_steps=20, threads=ws.threads or cfg.trainer.threads)
    worlds: list[Demonstrations] = []
    if ws.practice_steps or ws.practice_answer_only:
        for k in range(1, ws.practice_worlds + 1):
            over = demos.env.unwrapped.practice_kwargs(k)
            if over is None:
                raise ValueError(f"warmstart: {env_cfg.id} has no sibling tasks (practice_kwargs); "
                                 "set warmstart.practice_steps = 0 and practice_answer_only = 0")
            worlds.append(Demonstrations(lambda over=over: make_env(env_cfg.train_split, **over), tok, env_cfg.id, fmt))
    band, style = ws.habit_band, ws.practice_style
    if band is not None and (style not in ws.mix or len(ws.mix) < 2):
        raise ValueError(f"warmstart.habit_band calibrates the share of {style!r} (practice_style) in the habit: "
                         f"mix must weigh it against at least one other style, got {dict(ws.mix)}")
    probe = np.random.default_rng([cfg.seed, 29])  # its own stream: without a band the warm start is unchanged
    opening = [int(i) for i in probe.permutation(len(held))[:64]]  # held-out prompts the band is measured on
    t0 = last_report = time.time()
    losses: list[float] = []
    total = ws.practice_steps + ws.steps
    mix, s, extra, p_open = dict(ws.mix), 0, 0, None
    while s < total:
        s += 1
        if s <= ws.practice_steps:
            phase = "practice"
            batch = [worlds[w].sample(ws.practice_style, rng) for w in rng.integers(len(worlds), size=ws.batch_size)]
        else:
            phase = "habit" if s <= ws.practice_steps + ws.steps else "band"
            batch = demos.batch(ws.batch_size, mix, rng, exact=phase == "band")
            batch += [answer_only(worlds[w].sample(ws.practice_style, rng))
                      for w in rng.integers(len(worlds), size=ws.practice_answer_only)] if worlds else []
        losses.append(learner.sft_step(batch)["loss"])
        row = {"step": s, "of": total, "phase": phase, "loss": float(np.mean(losses)), "seconds": time.time() - t0}
        if band is not None and s >= ws.practice_steps + ws.steps and ws.steps:
            p_open = opening_probability(learner, held, style, [o for o in ws.mix if o != style], opening, probe)
            row["warmstart/p_open"] = p_open
            if not band[0] <= p_open <= band[1] and extra < ws.band_steps:
                if not extra:  # smaller steps (same moments): at the habit's rate one batch carries it across
                    reset_optimizer(lr=ws.lr * ws.band_lr_scale, schedule="constant", warmup_steps=0,
                                    threads=ws.threads or cfg.trainer.threads, keep_state=True)
                mix, extra, total = _toward(ws.mix, style, band), extra + 1, total + 1
                row["of"] = total
        if (ws.check_every and s % ws.check_every == 0) or s in (ws.practice_steps, total):
            p = final_turn_probability(learner.logprobs(check), check)
            log_row(**row, **{"warmstart/p_final_turn": p})
            log.info("warm start %d/%d (%s): loss %.3f, p(final turn) of held-out %s demonstrations %.2f%s",
                     s, total, phase, row["loss"], ws.practice_style, p,
                     "" if p_open is None else f", p(opening as {style}) {p_open:.3f}")
            losses, last_report = [], time.time()
        elif time.time() - last_report >= 10 or "warmstart/p_open" in row:  # a heartbeat for non-TTY watchers
            log_row(**row)
            last_report = time.time()
    if band is not None and p_open is not None and not band[0] <= p_open <= band[1]:
        log.warning("warm start: p(opening as %s) %.3f is outside warmstart.habit_band [%g, %g] after %d extra "
                    "habit steps (warmstart.band_steps)", style, p_open, band[0], band[1], extra)
