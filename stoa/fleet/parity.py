"""Start-up parity: the learner, the int8 scorer and the rollout engine run one model alike.

The trainer's float learner, its int8 scorer (torch or the engine) and every worker's rollout
engine build the model from the same ``config.json``, each through its own framework. A field
one of them reads differently (RoPE's base is the one seen in practice) leaves every stack
running, each on a different model: the audit then calibrates on the gap and the sampling check
bans honest workers. Before the trainer publishes anything, :func:`check_trainer` scores a few
probe episodes on every stack and refuses the start, in one line naming what differs, when

* the engine built a field differently from the run's normalized config
  (:mod:`stoa.models.hfconfig`), or
* the engine or int8 scorer differ from the float learner by more than :data:`INT8_BOUND`
  (the int8 rounding of a correctly read model stays far below it), or
* the engine and the torch int8 scorer, which run the same int8 weights, differ by more than
  :data:`SAME_WEIGHTS_BOUND`.

A worker runs :func:`join_check` on its engine against the signed config at join (its mlx-lm
may not be the trainer's). :func:`check_floor` holds the audit's calibrated floor to the same
bound: a floor above it means the stacks disagree, not that int8 is that coarse.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stoa.fleet.worker.section import RolloutConfig
from stoa.types import Episode, Segment

__all__ = ["INT8_BOUND", "SAME_WEIGHTS_BOUND", "Parity", "ParityError", "check", "check_floor", "check_trainer", "gap",
           "join_check", "probe_episodes"]

log = logging.getLogger("stoa.trainer")

INT8_BOUND = 0.15
"""Most mean |log p_float - log p_int8| (nat, per probe episode) between the float learner and an
int8 stack. int8 / group-64 rounding of a correctly read model stays well below it (SmolLM2-135M:
0.044 on the probes); the same model with RoPE's base misread (1e4 for 1e5) gives 0.24."""

SAME_WEIGHTS_BOUND = 0.05
"""Most mean |difference| (nat, per probe episode) between two stacks scoring the same int8 weights."""

_PROBES = (
    ("What is the capital of France?", "The capital of France is Paris. It lies on the Seine, in the north of "
                                       "the country, and has been its capital for most of its history."),
    ("Add 17 and 25.", "17 + 25 = 42. The answer is 42."),
    ("Write a short note about rivers.", " ".join(
        ["Rivers carry water from the hills to the sea, cut valleys into rock, and feed the towns along "
         "their banks."] * 6)),
)


class ParityError(RuntimeError):
    """The stacks of a run do not run the same model (the message is one line naming what differs)."""


@dataclass(frozen=True)
class Parity:
    """What :func:`check` measured (nat; per probe episode: mean |difference| over model tokens,
    the largest over probes; ``max_token``: the largest difference at one token)."""

    int8_vs_float: float
    """The engine against the float learner."""
    scorer_vs_float: float | None
    """The torch int8 scorer against the float learner (None: the run scores on the engine)."""
    engine_vs_scorer: float | None
    """The engine against the torch int8 scorer."""
    max_token: float

    def metrics(self) -> dict[str, float]:
        out = {"parity/int8_vs_float": self.int8_vs_float, "parity/max_token": self.max_token}
        if self.scorer_vs_float is not None:
            out["parity/scorer_vs_float"] = self.scorer_vs_float
        if self.engine_vs_scorer is not None:
            out["parity/engine_vs_scorer"] = self.engine_vs_scorer
        return out


def probe_episodes(codec: Any, vocab_size: int) -> list[Episode]:
    """A few chat episodes of fixed text (a prompt, then one model turn), tokenized by ``codec``
    (an engine's :class:`stoa.backends.engine.TextCodec`); ids outside the vocabulary are dropped."""
    out = []
    for i, (prompt, answer) in enumerate(_PROBES):
        p = np.array([t for t in codec.prompt_tokens(prompt) if 0 <= t < vocab_size], np.int32)
        a = np.array([t for t in codec.encode(answer) if 0 <= t < vocab_size], np.int32)
        if len(p) and len(a):
            out.append(Episode(prompt_tokens=p, segments=[Segment("model", a, np.zeros(len(a), np.float32))],
                               reward=0.0, group_id=f"parity-{i}"))
    if not out:
        raise ParityError("the tokenizer encodes none of the probe texts")
    return out


def gap(a: Sequence[np.ndarray], b: Sequence[np.ndarray], episodes: Sequence[Episode]) -> tuple[float, float]:
    """(largest per-episode mean |a - b| over model tokens, largest single-token |a - b|)."""
    means, worst = [], 0.0
    for x, y, ep in zip(a, b, episodes):
        m = ep.loss_mask()
        d = np.abs(np.asarray(x, np.float64)[m] - np.asarray(y, np.float64)[m])
        means.append(float(d.mean()) if d.size else 0.0)
        worst = max(worst, float(d.max()) if d.size else 0.0)
    return max(means), worst


def join_check(engine: Any, model_dir: str | Path) -> str | None:
    """Why ``engine`` does not run the model of ``model_dir``'s config, in one line, or None."""
    from stoa.models import hfconfig

    try:
        spec = hfconfig.read(hfconfig.load(model_dir))
    except hfconfig.ModelConfigError as e:
        return str(e)
    wrong = hfconfig.disagreements(spec, engine.built_config)
    return f"the engine built the model differently from the run's config: {'; '.join(wrong)}" if wrong else None


def check(model_dir: str | Path, learner: Any, engine: Any, scorer: Any = None,
          episodes: Sequence[Episode] | None = None) -> Parity:
    """Score probe episodes (default :func:`probe_episodes`) on the float ``learner``, the int8
    ``engine`` and (when given) a torch int8 ``scorer`` holding the same weights as the engine.
    Returns what it measured; raises :class:`ParityError` naming the first disagreement."""
    why = join_check(engine, model_dir)
    if why:
        raise ParityError(why)
    eps = list(episodes) if episodes is not None else probe_episodes(engine.codec, engine.vocab_size)
    fl = learner.logprobs(eps, temperature=None)
    en = engine.score(eps)
    e_f, worst = gap(en, fl, eps)
    s_f = e_s = None
    if scorer is not None:
        sc = scorer.score(eps)
        s_f, w2 = gap(sc, fl, eps)
        e_s, w3 = gap(en, sc, eps)
        worst = max(worst, w2, w3)
    got = Parity(e_f, s_f, e_s, worst)
    if e_s is not None and e_s > SAME_WEIGHTS_BOUND:
        raise ParityError(f"the rollout engine and the torch int8 scorer disagree on the same int8 weights: mean "
                          f"|log p| difference {e_s:.3f} nat on a probe episode (bound {SAME_WEIGHTS_BOUND})")
    for name, v in (("rollout engine", e_f), ("torch int8 scorer", s_f)):
        if v is not None and v > INT8_BOUND:
            raise ParityError(f"the {name} (int8) and the float learner disagree beyond int8 rounding: mean "
                              f"|log p| difference {v:.3f} nat on a probe episode (bound {INT8_BOUND}); "
                              "they do not read the model alike")
    return got


def check_trainer(model_dir: str | Path, learner: Any, rollout: RolloutConfig, scorer: str, device: str,
                  dtype: str = "float32", prompt_format: str = "auto") -> Parity:
    """:func:`check` on the trainer's own stacks: the learner's current weights quantized to
    int8, run by a rollout engine as ``rollout`` (the run's ``[rollout]``) and ``prompt_format``
    (``model.prompt_format``) configure it and, when the run scores with a named int8 scorer
    (``scorer``, a key of :data:`stoa.backends.scorer.SCORERS`; ``"engine"``: the engine alone), by
    that scorer."""
    from stoa.backends.engine import make_engine
    from stoa.transport.quant import quantize_state

    state = quantize_state(learner.iter_weights(dtype))
    engine = make_engine(model_dir, rollout.engine, state=dict(state), version=0, mode=rollout.engine_mode,
                         config=rollout.engine_config(prompt_format), worker_id="parity")
    named = None
    if scorer != "engine":
        from stoa.backends.scorer import make_scorer

        named = make_scorer(scorer, model_dir, device, dtype)
        named.load_state(0, state)
    got = check(model_dir, learner, engine, named)
    log.info("parity: int8 vs float %.4f nat, engine vs torch scorer %s (per probe episode, worst)",
             got.int8_vs_float, "n/a" if got.engine_vs_scorer is None else f"{got.engine_vs_scorer:.4f}")
    return got


def check_floor(floor: float) -> None:
    """Refuse an audit floor above :data:`INT8_BOUND`: the float learner and the int8 policy
    then disagree by more than int8 rounding explains."""
    if not floor <= INT8_BOUND:
        raise ParityError(f"the audit's int8-vs-float floor {floor:.3f} nat is above the {INT8_BOUND} bound: the "
                          "trainer's float and int8 stacks do not run the same model")
