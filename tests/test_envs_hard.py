"""stoa/SyntheticSearchHard-v0: determinism, the split, paraphrases, distractors, two hops, the oracle,
the demonstration styles and the extra metrics, on a real BM25 index."""

import numpy as np
import pytest

import stoa.envs
from stoa.envs.papersearch import normalize_answer
from stoa.envs.retrieval import bm25_tokenize
from stoa.envs.synthetic_hard import (
    PARAPHRASES,
    HardConfig,
    SyntheticSearchHardEnv,
    generate_hard,
)

SMALL = {"num_families": 40, "num_test": 30, "seed": 3}


@pytest.fixture(scope="module")
def env():
    return SyntheticSearchHardEnv("train", **SMALL)


@pytest.fixture(scope="module")
def test_env():
    return SyntheticSearchHardEnv("test", **SMALL)


def play(env, i, turns):
    env.reset(seed=0, options={"index": i})
    steps = []
    for t in turns:
        steps.append(env.step(t))
        if steps[-1][2] or steps[-1][3]:
            break
    return steps


def test_generation_is_deterministic_and_seeded():
    a, b = generate_hard(HardConfig(**SMALL)), generate_hard(HardConfig(**SMALL))
    assert a.docs == b.docs and a.train == b.train and a.test == b.test
    c = generate_hard(HardConfig(**{**SMALL, "seed": 4}))
    assert {d.text for d in c.docs}.isdisjoint({d.text for d in a.docs})


def test_split_by_chain_and_names_used_once():
    d = generate_hard(HardConfig(**SMALL))
    assert len(d.test) == 30 and len(d.train) == 40 * 2 * 3 - 30
    train_names = {r["answer"] for r in d.train} | {r["bridge"] for r in d.train if r["bridge"]}
    test_names = {r["answer"] for r in d.test} | {r["bridge"] for r in d.test if r["bridge"]}
    assert train_names.isdisjoint(test_names)
    for row in d.train + d.test:  # an answer occurs in exactly one document: its own fact
        holding = [doc.id for doc in d.docs if row["answer"] in doc.text.split(" ")
                   or row["answer"] + "." in doc.text.split(" ")]
        assert holding == row["docs"][-1:]


def test_hops_and_paraphrases_are_mixed_as_configured():
    d = generate_hard(HardConfig(seed=0))
    rows = d.train + d.test
    two = np.mean([r["hops"] == 2 for r in rows])
    para = np.mean([r["is_paraphrased"] for r in rows])
    assert 0.2 < two < 0.4 and 0.4 < para < 0.6
    one = generate_hard(HardConfig(**{**SMALL, "two_hop_frac": 0.0, "paraphrase_frac": 0.0}))
    assert {r["hops"] for r in one.train} == {1} and not any(r["is_paraphrased"] for r in one.train)


def test_paraphrased_questions_avoid_the_documents_words(env):
    """A paraphrased one-hop question shares only the entity's name with its document."""
    docs = {doc.id: doc for doc in env.data.docs}
    rows = [r for r in env.data.train if r["is_paraphrased"] and r["hops"] == 1]
    assert rows
    for r in rows:
        doc = docs[r["docs"][0]]
        shared = set(bm25_tokenize(r["question"])) & set(bm25_tokenize(doc.text))
        assert shared == set(bm25_tokenize(r["subject"])), (r["question"], doc.text)
    assert all("{P}" in q and "{P}" in lit and "{P}" in para for q, lit, para in PARAPHRASES.values())


def test_oracle_queries_rank_the_right_document_first(env, test_env):
    for e in (env, test_env):
        pairs = [(q, doc) for r in e._rows for q, doc in zip(r["queries"], r["docs"])]
        top1 = [e.retriever.search([q], 3)[0][0].id == doc for q, doc in pairs]
        assert np.mean(top1) >= 0.95


def test_distractors_about_similarly_named_entities_are_retrieved(env):
    """The first query's top 3 hold a sibling isoform's fact (same family name, same relation)."""
    hits_sibling = []
    for r in env.data.train:
        hits = env.retriever.search([r["queries"][0]], 3)[0]
        family = r["subject"].split()[0]
        hits_sibling.append(any(h.title != r["subject"] and h.title.split()[0] == family
                                and r["relation"] in h.text.lower() for h in hits))
    assert np.mean(hits_sibling) >= 0.9


def test_two_hop_items_need_both_searches(env):
    rows = [(i, r) for i, r in enumerate(env.data.train) if r["hops"] == 2]
    assert rows
    for i, r in rows:
        first = env.retriever.search([r["queries"][0]], 3)[0]
        assert all(normalize_answer(r["answer"]) not in normalize_answer(h.text).split() for h in first)
        oracle = env.oracle_turns(i)
        assert len(oracle) == 3
        steps = play(env, i, oracle)
        assert [s[4]["metrics"]["answer_retrieved"] for s in steps] == [False, True, True]
        assert steps[-1][1] == 1.0 and steps[-1][4]["metrics"]["num_searches"] == 2
        # Answering with what the first search shows (the bridge) is wrong.
        assert play(env, i, oracle[:1] + [f"<answer> {r['bridge']} </answer>"])[-1][1] == 0.0


def test_oracle_solves_every_item_and_the_naive_reader_does_not(test_env):
    rng = np.random.default_rng(0)
    rewards = {"oracle": [], "naive": [], "guess": []}
    for i, row in enumerate(test_env.data.test):
        for style, got in rewards.items():
            steps = play(test_env, i, test_env.demonstration_turns(i, style, rng))
            got.append((sum(s[1] for s in steps), row["hops"], steps[-1][4]["metrics"]))
    assert all(r == 1.0 for r, _, _ in rewards["oracle"])
    naive = np.mean([r for r, _, _ in rewards["naive"]])
    assert 0.1 < naive < 0.8  # searching is not enough: paraphrases and second hops defeat it
    assert all(r == 0.0 for r, hops, _ in rewards["naive"] if hops == 2)
    guess = [m for _, _, m in rewards["guess"]]
    assert all(not m["searched"] and m["em_given_search"] is None for m in guess)
    assert all(m["em_given_search"] is m["em"] for _, _, m in rewards["naive"])


def test_conformance_hooks_and_registry():
    stoa.envs.check_env("stoa/SyntheticSearchHard-v0", **SMALL)
    env = stoa.envs.make("stoa/SyntheticSearchHard-v0", split="test", **SMALL).unwrapped
    assert isinstance(env, SyntheticSearchHardEnv) and len(env) == 30
    assert env.success_metric == "em" and set(env.headline_metrics) <= set(env.metric_types)
    assert {"searched", "em", "hops", "em_given_search", "answer_retrieved"} <= set(env.metric_types)
    assert env.demo_styles == ("oracle", "guess", "naive")
    texts = list(env.tokenizer_texts())
    assert all(isinstance(t, str) for t in texts) and any("phosphotransferase" in t for t in texts)
    assert any("<information>" in t for t in texts)
    sibling = stoa.envs.make("stoa/SyntheticSearchHard-v0", split="train", **{**SMALL, **env.practice_kwargs(1)}).unwrapped
    # Another world: names come from the same pool, but no item (question with its answer) recurs.
    items = {(r["question"], r["answer"]) for r in env.data.train + env.data.test}
    assert {(r["question"], r["answer"]) for r in sibling.data.train}.isdisjoint(items)


@pytest.mark.parametrize("bad", [{"isoforms": 4}, {"two_hop_frac": 1.5}, {"paraphrase_frac": -0.1},
                                 {"num_test": 0}, {"facts_per_entity": 9}, {"seed": -1}])
def test_config_bounds(bad):
    with pytest.raises(ValueError):
        HardConfig(**bad)
