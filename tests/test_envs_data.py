"""Data for the search environments: the offline ``datasets`` path with PaperSearchQA's schema,
the synthetic corpus and its learnability properties, caching, and the example task."""

import json
import re
import runpy
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import stoa.envs
from stoa.envs import check_env
from stoa.envs.data import load_questions, resolve_files
from stoa.envs.papersearch import SEARCH_R1_TEMPLATE, PaperSearchQAEnv
from stoa.envs.retrieval import BM25SRetriever
from stoa.envs.synthetic import (
    RELATIONS, SHORT_TEMPLATE, SyntheticConfig, SyntheticSearchEnv, generate, tokenizer_texts,
)

ROOT = Path(__file__).resolve().parents[1]

QA_ROWS = {
    "train": [
        {"question": "Which gene is mutated in cystic fibrosis?", "answer": "CFTR",
         "golden_answers": ["CFTR", "cystic fibrosis transmembrane conductance regulator"], "cat": "genetic",
         "cat_num": 1, "pmid": "111", "paper_title": "CFTR", "question_original": "q", "is_paraphrased": False},
        {"question": "Which kinase is inhibited by imatinib?", "answer": "BCR-ABL", "golden_answers": ["BCR-ABL", "ABL1"],
         "cat": "drug", "cat_num": 2, "pmid": "222", "paper_title": "Imatinib", "question_original": "q",
         "is_paraphrased": True},
    ],
    "test": [
        {"question": "Which protein aggregates in Parkinson disease?", "answer": "alpha-synuclein",
         "golden_answers": ["alpha-synuclein", "SNCA"], "cat": "protein", "cat_num": 3, "pmid": "333",
         "paper_title": "Synuclein", "question_original": "q", "is_paraphrased": False},
    ],
}
CORPUS = [
    {"id": 0, "contents": '"CFTR mutations"\nCystic fibrosis is caused by mutations in the CFTR gene.'},
    {"id": 1, "contents": "TITLE: Imatinib in CML. ABSTRACT: Imatinib inhibits the BCR-ABL tyrosine kinase."},
    {"id": 2, "contents": '"Synuclein"\nAlpha-synuclein aggregates form Lewy bodies in Parkinson disease.'},
    {"id": 3, "contents": "An untitled abstract about ribosomes."},
]


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.fixture
def local_data(tmp_path):
    """PaperSearchQA questions in the hub's parquet layout and a Search-R1 style corpus."""
    qa = tmp_path / "PaperSearchQA"
    (qa / "data").mkdir(parents=True)
    for split, rows in QA_ROWS.items():
        pq.write_table(pa.Table.from_pylist(rows), qa / "data" / f"{split}-00000-of-00001.parquet")
    corpus = tmp_path / "pubmed.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    return qa, corpus


def test_papersearchqa_from_local_files_without_network(local_data, no_network):
    qa, corpus = local_data
    env = stoa.envs.make("stoa/PaperSearchQA-v0", split="train", questions=str(qa), corpus=str(corpus))
    assert len(env.unwrapped) == 2
    prompt, info = env.reset(options={"index": 1})
    assert prompt == SEARCH_R1_TEMPLATE.format(question="Which kinase is inhibited by imatinib?")
    assert info == {"question_id": "train-1", "gold_answers": ["BCR-ABL", "ABL1"], "index": 1}
    obs = env.step("<search> imatinib kinase </search>")[0]
    assert obs.startswith("\n\n<information>Doc 1(Title: Imatinib in CML) Imatinib inhibits the BCR-ABL")
    _, reward, term, _, step_info = env.step("<answer> abl1 </answer>")  # a listed synonym
    assert reward == 1.0 and term and step_info["metrics"]["searched"]
    test_env = stoa.envs.make("stoa/PaperSearchQA-v0", split="test", questions=str(qa), corpus=str(corpus))
    test_env.reset(options={"index": 0})
    obs = test_env.step("<search> Parkinson aggregates </search>")[0]
    assert "Doc 1(Title: Synuclein) Alpha-synuclein aggregates" in obs
    check_env(test_env)


def test_reading_local_data_does_not_import_torch(local_data):
    qa, corpus = local_data
    code = (f"import sys; from stoa.envs.papersearch import PaperSearchQAEnv; "
            f"e = PaperSearchQAEnv(questions={str(qa)!r}, corpus={str(corpus)!r}); "
            f"assert len(e) == 2 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_jsonl_questions_with_split_placeholder_and_parquet_corpus(tmp_path, no_network):
    for split, rows in QA_ROWS.items():
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist([
        {"pmid": "111", "title": "CFTR", "abstract": "CFTR is a chloride channel."},
        {"pmid": "222", "title": "Imatinib", "abstract": "Imatinib targets BCR-ABL."},
    ]), tmp_path / "corpus.parquet")
    env = PaperSearchQAEnv("test", questions=str(tmp_path / "{split}.jsonl"), corpus=str(tmp_path / "corpus.parquet"),
                           max_turns=2, topk=1)
    env.reset(options={"index": 0})
    env.step("<search> chloride channel </search>")
    assert env.retriever.search(["chloride"], 3)[0][0].id == "111"
    assert load_questions(str(tmp_path / "{split}.jsonl"), "train")[0].golden_answers[0] == "CFTR"


def test_saved_index_source_matches_in_memory_corpus(local_data, tmp_path, no_network):
    qa, corpus = local_data
    a = PaperSearchQAEnv(questions=str(qa), corpus=str(corpus))
    a.retriever.save(tmp_path / "index")
    b = PaperSearchQAEnv(questions=str(qa), index=str(tmp_path / "index"))
    for env in (a, b):
        env.reset(options={"index": 0})
    assert a.step("<search> cystic fibrosis gene </search>") == b.step("<search> cystic fibrosis gene </search>")


def test_data_errors_are_clear(tmp_path, local_data):
    qa, corpus = local_data
    with pytest.raises(FileNotFoundError, match="no file for split 'validation'"):
        resolve_files(str(qa), "validation")
    with pytest.raises(ValueError, match="exactly one retrieval source"):
        PaperSearchQAEnv(questions=str(qa))
    with pytest.raises(ValueError, match="exactly one retrieval source"):
        PaperSearchQAEnv(questions=str(qa), corpus=str(corpus), retriever_url="http://127.0.0.1:1")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"answer": "x"}) + "\n")
    with pytest.raises(ValueError, match="row 0: 'question'"):
        load_questions(str(bad), "train")
    with pytest.raises(FileNotFoundError):
        resolve_files(str(tmp_path / "missing" / "file.parquet"), "train")
    with pytest.raises(TypeError, match="unknown arguments"):
        PaperSearchQAEnv(questions=str(qa), corpus=str(corpus), top_k=3)
    with pytest.raises(ValueError, match="split"):
        PaperSearchQAEnv("dev", questions=str(qa), corpus=str(corpus))


def test_environments_share_data_and_index_per_process(local_data):
    qa, corpus = local_data
    envs = [PaperSearchQAEnv(questions=str(qa), corpus=str(corpus)) for _ in range(16)]
    assert all(e.retriever is envs[0].retriever and e.questions is envs[0].questions for e in envs)
    syn = [stoa.envs.make("stoa/SyntheticSearch-v0").unwrapped for _ in range(16)]
    assert all(e.retriever is syn[0].retriever and e.questions is syn[0].questions for e in syn)
    other = stoa.envs.make("stoa/SyntheticSearch-v0", seed=1).unwrapped
    assert other.retriever is not syn[0].retriever


# -- the synthetic corpus ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data():
    return generate(SyntheticConfig(seed=0))


def test_synthetic_generation_is_seeded(data):
    again = generate(SyntheticConfig(seed=0))
    assert (again.docs, again.train, again.test) == (data.docs, data.train, data.test)
    other = generate(SyntheticConfig(seed=1))
    assert other.docs != data.docs and other.proteins != data.proteins


def test_synthetic_sizes_and_schema(data):
    assert len(data.docs) == 900 and len(data.proteins) == 300
    assert len(data.train) == 2 * 700 and len(data.test) == 200
    keys = {"id", "question", "answer", "golden_answers", "subject", "cat", "cat_num", "pmid", "paper_title",
            "question_original", "is_paraphrased", "relation"}
    for row in data.train + data.test:
        assert set(row) == keys and row["golden_answers"] == [row["answer"]]
        assert row["subject"] in row["question"] and row["question"].endswith("?")
    assert len({r["id"] for r in data.train + data.test}) == 1600
    assert Counter(r["is_paraphrased"] for r in data.test).most_common()[-1][1] > 50  # both phrasings in test


def test_synthetic_names_are_single_unique_words(data):
    names = list(data.proteins) + sorted({r["answer"] for r in data.train + data.test})
    assert len(names) == len(set(n.lower() for n in names)) == 300 + 900
    assert all(re.fullmatch(r"[A-Z][a-z]{3,9}", n) for n in names)
    words = Counter(w for d in data.docs for w in re.findall(r"\w+", d.text))
    assert all(words[p] == 3 for p in data.proteins)  # a protein's name is only in its own 3 facts


def test_test_answers_never_appear_in_training_questions(data):
    train_text = " ".join(r["question"] + " " + r["answer"] for r in data.train)
    train_words = set(re.findall(r"\w+", train_text))
    for row in data.test:
        assert row["answer"] not in train_words
        assert sum(row["answer"] in d.text for d in data.docs) == 1  # answerable only from its one document


def test_bm25_top3_for_a_protein_is_exactly_its_facts(data):
    r = BM25SRetriever.build(data.docs)
    for protein, hits in zip(data.proteins, r.search(list(data.proteins), 3)):
        assert {h.id for h in hits} == {d.id for d in data.docs_of(protein)}


def test_every_relation_question_is_answered_by_its_subjects_documents(data):
    for row in data.test:
        facts = [d.text for d in data.docs_of(row["subject"])]
        rel = next(r for r in RELATIONS if r[0] == row["relation"])
        fact = next(f for f in facts if row["answer"] in f)
        assert fact == rel[1].format(P=row["subject"], X=row["answer"], C=fact.split()[-1].rstrip("."))


def test_tokenizer_texts_and_entity_token_counts(data):
    from stoa.models.tiny import train_tokenizer

    texts = list(tokenizer_texts(data))
    joined = "\n".join(texts)
    for s in ("<search>", "</information>", "<answer>", "Doc 1(Title: ", SHORT_TEMPLATE.split("{")[0], "<think>"):
        assert s in joined
    assert all(d.text in joined for d in data.docs)
    tok = train_tokenizer(texts, 2048)
    names = list(data.proteins) + [r["answer"] for r in data.test]
    lengths = Counter(len(tok.encode(" " + n).ids) for n in names)  # names follow a space in every episode
    assert sum(v for k, v in lengths.items() if k <= 2) / len(names) >= 0.95
    assert lengths[1] / len(names) >= 0.8


def test_synthetic_config_bounds():
    for bad in ({"seed": -1}, {"facts_per_entity": 0}, {"facts_per_entity": 9}, {"num_entities": 0},
                {"num_test_facts": 900}, {"num_entities": 100_000}):
        with pytest.raises(ValueError):
            SyntheticConfig(**bad)
    small = generate(SyntheticConfig(seed=3, num_entities=20, facts_per_entity=2, num_test_facts=5))
    assert len(small.docs) == 40 and len(small.test) == 5


def test_synthetic_env_arguments():
    env = SyntheticSearchEnv("test", seed=2, num_entities=50, num_test_facts=30, max_turns=3)
    assert len(env) == 30 and env.data.config.seed == 2 and env.config.max_turns == 3
    prompt, info = env.reset(options={"index": 0})
    assert prompt == SHORT_TEMPLATE.format(question=env.questions[0].question)
    long = SyntheticSearchEnv("test", prompt_template=SEARCH_R1_TEMPLATE)
    assert long.reset(options={"index": 0})[0].startswith("Answer the given question.")
    with pytest.raises(ValueError, match="not both"):
        SyntheticSearchEnv(config=SyntheticConfig(), seed=1)
    with pytest.raises(TypeError, match="unknown"):
        SyntheticSearchEnv(num_entitys=5)


def test_oracle_episode_on_synthetic_env():
    env = stoa.envs.make("stoa/SyntheticSearch-v0", split="test")
    _, info = env.reset(options={"index": 7})
    search, answer = env.unwrapped.oracle_turns(7)
    obs = env.step(search)[0]
    assert info["gold_answers"][0] in obs and obs.count("Doc ") == 3
    assert env.step(answer)[1] == 1.0


def test_oracle_query_ranks_the_asked_fact_first():
    env = stoa.envs.make("stoa/SyntheticSearch-v0", split="test").unwrapped
    for i in range(len(env)):
        env.reset(options={"index": i})
        search, answer = env.oracle_turns(i)
        first_doc = env.step(search)[0].split("Doc 2(")[0]
        assert env.questions[i].golden_answers[0] in first_doc, (i, search)


def test_example_custom_env_registers_and_passes_check_env(capsys):
    runpy.run_path(str(ROOT / "examples" / "custom_env.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "check_env passed" in out and "reward 1.0" in out
    check_env("example/Arithmetic-v0", split="train")
