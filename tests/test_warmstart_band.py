"""The warm start's habit band: the propensity to open as the practice style (for the search
tasks: to search first) is measured exactly from the learner's log-probs, and extra habit steps
bring it into ``warmstart.habit_band`` whatever the habit left."""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the warm start trains a torch learner")

from stoa.backends.learner import LearnerConfig, make_learner  # noqa: E402
from stoa.envs import make as make_env  # noqa: E402
from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts  # noqa: E402
from stoa.fleet.config import RunConfig  # noqa: E402
from stoa.fleet.trainer.warmstart import Demonstrations, _toward, opening_probability, warm_start  # noqa: E402
from stoa.models.tiny import TinyConfig, build_tiny  # noqa: E402

WORLD = {"seed": 0, "num_entities": 40, "num_test_facts": 10}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    texts = list(tokenizer_texts(generate(SyntheticConfig(**WORLD))))
    return build_tiny(tmp_path_factory.mktemp("band"), texts, TinyConfig(vocab_size=600, hidden_size=64, num_layers=1,
                                                                        num_heads=2, num_kv_heads=1,
                                                                        intermediate_size=128, seed=0))


def _env(split: str = "train", **over):
    return make_env("stoa/SyntheticSearch-v0", split=split, **{**WORLD, **over})


def test_the_opening_probability_is_the_policys_chance_of_the_styles_first_tokens(model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    learner = make_learner("torch", model, LearnerConfig(device="cpu", seed=0))
    demos = Demonstrations(lambda: _env("test"), tok)
    rng = np.random.default_rng(0)
    p = opening_probability(learner, demos, "oracle", ["guess"], [0, 1, 2], rng)
    want = []
    for i in (0, 1, 2):  # by hand: the prompt, then the first tokens of "<search> ..." up to where "<answer> ..." differs
        search = tok.encode(demos.env.unwrapped.demonstration_turns(i, "oracle", rng)[0], add_special_tokens=False)
        answer = tok.encode(demos.env.unwrapped.demonstration_turns(i, "guess", rng)[0], add_special_tokens=False)
        k = next(j for j, (a, b) in enumerate(zip(search, answer)) if a != b) + 1
        ep = demos.episode(i, "oracle", rng)
        lp = learner.logprobs([ep])[0]
        n = len(ep.prompt_tokens)
        want.append(np.exp(lp[n:n + k].astype(np.float64).sum()))
        assert tok.decode(search[:k]).strip().startswith("<search") or k == 1
    assert p == pytest.approx(float(np.mean(want)), rel=1e-5)
    assert 0 < p < 1


def test_the_band_mix_is_the_bands_middle_and_its_batches_have_it_exactly():
    mix = {"oracle": 0.2, "guess": 0.8}
    assert _toward(mix, "oracle", (0.1, 0.3)) == pytest.approx({"oracle": 0.2, "guess": 0.8})
    assert _toward({"oracle": 1, "guess": 1, "other": 3}, "oracle", (0.1, 0.2)) == pytest.approx(
        {"oracle": 0.15, "guess": 0.85 / 4, "other": 0.85 * 3 / 4})
    from transformers import AutoTokenizer  # noqa: F401 - the demonstrations need no model here

    demos = Demonstrations(lambda: _env(), _WordTokenizer())
    rng = np.random.default_rng(0)
    for size in (16, 7):
        counts = [sum(len(e.segments) > 1 for e in demos.batch(size, {"oracle": 0.175, "guess": 0.825}, rng, exact=True))
                  for _ in range(6)]
        assert set(counts) <= {int(np.floor(0.175 * size)), int(np.ceil(0.175 * size))}  # searching demonstrations


class _WordTokenizer:
    """Enough of a tokenizer for demonstrations: ids of words, no chat template."""

    chat_template = None

    def encode(self, text, add_special_tokens=False, split_special_tokens=False):
        return [hash(w) % 1000 for w in text.split()]


@pytest.mark.parametrize("band_steps", [16, 0])
def test_extra_habit_steps_bring_the_propensity_into_the_band(model, band_steps, caplog):
    """A habit of answer-at-once demonstrations leaves the tiny model almost never opening with a
    search; with a band the warm start adds habit steps until it does as often as the band says,
    and without room for them it warns."""
    from dataclasses import replace

    cfg = RunConfig.from_dict({
        "name": "band", "seed": 0, "env": {"id": "stoa/SyntheticSearch-v0", "kwargs": WORLD},
        "warmstart": {"steps": 2, "batch_size": 16, "lr": 3e-2, "mix": {"oracle": 0.0, "guess": 1.0},
                      "habit_band": [0.05, 0.3], "band_steps": band_steps}})
    learner = make_learner("torch", model, LearnerConfig(device="cpu", seed=0))
    rows: list[dict] = []
    with caplog.at_level(logging.WARNING, logger="stoa.trainer"):
        warm_start(cfg, learner, model, lambda split, **over: _env(split, **over),
                   lambda keep_state=False, **over: learner.reset_optimizer(replace(learner.config, **over), keep_state),
                   lambda **r: rows.append(r))
    measured = [r["warmstart/p_open"] for r in rows if "warmstart/p_open" in r]
    assert measured[0] < 0.05  # the habit alone leaves it below the band
    if band_steps:
        assert 0.05 <= measured[-1] <= 0.3 and 1 < len(measured) <= band_steps + 1
        assert [r["phase"] for r in rows if "warmstart/p_open" in r][1:] == ["band"] * (len(measured) - 1)
        assert "outside warmstart.habit_band" not in caplog.text
    else:
        assert len(measured) == 1 and "outside warmstart.habit_band [0.05, 0.3]" in caplog.text
