"""A seeded synthetic biomedical corpus that a tiny model can learn to search in minutes.

``generate(SyntheticConfig(seed=0))`` invents ``num_entities`` proteins with pronounceable one-word
names (``Kavorin``), each with ``facts_per_entity`` one-sentence facts relating it to another
invented entity (``Kavorin inhibits the kinase Mertil in hepatocytes.``). Every fact is one
document titled by its protein. Each fact yields a relation question in two phrasings
(``Which kinase does Kavorin inhibit?`` / ``Kavorin inhibits which kinase?``) whose answer is the
one-word object name.

Properties the tests pin down, and why they make search learnable:

- Every name is used once (objects are never reused), so a protein's name occurs only in its
  own documents and BM25's top-``facts_per_entity`` for the query ``"Kavorin"`` is exactly its
  facts; the answer is then a copy from the retrieved text.
- Train and test are split *by fact*: a test answer appears in no training question or answer,
  so test accuracy measures searching, not memorization (the corpus has it; weights do not).
- Answers are drawn from hundreds of names, so guessing without searching scores ~0.

:class:`SyntheticSearchEnv` (``stoa/SyntheticSearch-v0``) is :class:`SearchEnv` over this data with
a short prompt (sequence length is precious on a CPU). Question rows follow PaperSearchQA's schema
plus ``subject`` (the protein, i.e. the query a scripted demonstration should search for).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from stoa.envs import data as _data
from stoa.envs.papersearch import (
    SEARCH_R1_INVALID, SEARCH_R1_TEMPLATE, SearchConfig, SearchEnv, answer_turn, format_information, search_turn,
)
from stoa.envs.retrieval import BM25SRetriever, Document, Hit, RankBM25Retriever

__all__ = [
    "SyntheticConfig", "SyntheticData", "generate", "tokenizer_texts", "SyntheticSearchEnv",
    "SHORT_TEMPLATE", "SHORT_INVALID", "RELATIONS",
]

SHORT_TEMPLATE = "Search with <search> query </search> and answer with <answer> name </answer>.\nQuestion: {question}"
"""Default prompt of the synthetic task (about 25 tokens with a tokenizer trained on this task)."""
SHORT_INVALID = "\nInvalid turn: use <search> query </search> or <answer> name </answer>.\n"
"""Default feedback to an invalid turn in the synthetic task."""

# (relation, fact, question, paraphrase); {P} protein, {X} object, {C} cell type.
RELATIONS = (
    ("kinase", "{P} inhibits the kinase {X} in {C}.", "Which kinase does {P} inhibit?", "{P} inhibits which kinase?"),
    ("receptor", "{P} binds the receptor {X} on {C}.", "Which receptor does {P} bind?", "{P} binds which receptor?"),
    ("gene", "{P} is encoded by the gene {X}.", "Which gene encodes {P}?", "{P} is encoded by which gene?"),
    ("enzyme", "{P} activates the enzyme {X} in {C}.", "Which enzyme does {P} activate?", "{P} activates which enzyme?"),
    ("protease", "{P} is cleaved by the protease {X} in {C}.", "Which protease cleaves {P}?",
     "{P} is cleaved by which protease?"),
    ("transporter", "{P} is carried by the transporter {X} into {C}.", "Which transporter carries {P}?",
     "{P} is carried by which transporter?"),
    ("factor", "{P} is regulated by the transcription factor {X} in {C}.",
     "Which transcription factor regulates {P}?", "{P} is regulated by which transcription factor?"),
    ("chaperone", "{P} is folded by the chaperone {X}.", "Which chaperone folds {P}?", "{P} is folded by which chaperone?"),
)
CELLS = ("hepatocytes", "neurons", "cardiomyocytes", "macrophages", "fibroblasts", "keratinocytes", "adipocytes",
          "astrocytes", "myoblasts", "podocytes")
# Names are onset + coda (1,600 two-part names), then onset + middle + coda when more are needed.
_ONSETS = ("Ka", "Me", "Do", "Ze", "Vi", "Lo", "Ru", "Pa", "Ti", "No", "Be", "Sa", "Fe", "Go", "Hu", "Ja", "Ki",
           "Li", "Mo", "Ne", "Po", "Ra", "Se", "To", "Va", "Xe", "Yo", "Zu", "Bo", "Da", "Fi", "Ga", "Ha", "Jo",
           "Ku", "Lu", "Mi", "Nu", "Pe", "Re")
_CODAS = ("vorin", "rtil", "ltan", "rex", "dila", "mok", "nara", "stin", "fex", "bulin", "gon", "rim", "dor",
          "lix", "pen", "sal", "thor", "kel", "muna", "ros", "vil", "nep", "tar", "lom", "brin", "dex", "fal",
          "gren", "hal", "jin", "kor", "mel", "nix", "pral", "quin", "sor", "tuk", "zan", "voss", "drel")
_MIDDLES = ("la", "ri", "no", "ve", "tu", "mi", "sa", "ko")
# Real words the scheme can spell; a name must not be mistaken for ordinary text.
_AVOID = frozenset({"tomel", "pepen", "ratar", "sator", "dotar", "rotor", "tenor", "gator", "salon", "melon",
                    "pesos", "kokel", "linen", "bogon", "tarot"})
MAX_NAMES = len(_ONSETS) * len(_CODAS) * (1 + len(_MIDDLES))


@dataclass(frozen=True)
class SyntheticConfig:
    """Size and seed of the synthetic corpus."""

    seed: int = 0
    """Seed of every random choice (names, relations, cells, split, phrasings)."""
    num_entities: int = 300
    """Proteins; each has its own documents."""
    facts_per_entity: int = 3
    """Facts (documents) per protein, each with a different relation; at most len(RELATIONS)."""
    num_test_facts: int = 200
    """Facts held out for the test split (one question each)."""
    train_both_phrasings: bool = True
    """Train questions in both phrasings (else one random phrasing per fact, like test)."""

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0")
        if not 1 <= self.facts_per_entity <= len(RELATIONS):
            raise ValueError(f"facts_per_entity={self.facts_per_entity} must lie in [1, {len(RELATIONS)}]")
        if not 1 <= self.num_entities or self.num_entities * (1 + self.facts_per_entity) > MAX_NAMES:
            raise ValueError(f"num_entities={self.num_entities} needs more than the {MAX_NAMES} available names")
        if not 1 <= self.num_test_facts < self.num_entities * self.facts_per_entity:
            raise ValueError(f"num_test_facts={self.num_test_facts} must lie in [1, number of facts)")


@dataclass(frozen=True, eq=False)
class SyntheticData:
    """A generated corpus and its questions (rows in PaperSearchQA's schema plus ``subject``)."""

    config: SyntheticConfig
    docs: tuple[Document, ...]
    """One document per fact, titled by its protein."""
    train: tuple[dict[str, Any], ...]
    test: tuple[dict[str, Any], ...]
    proteins: tuple[str, ...]
    """The subject names, in generation order."""

    def split(self, name: str) -> tuple[dict[str, Any], ...]:
        if name not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {name!r}")
        return self.train if name == "train" else self.test

    def docs_of(self, protein: str) -> list[Document]:
        """The documents about ``protein``."""
        return [d for d in self.docs if d.title == protein]


def entity_names(rng: np.random.Generator, n: int) -> list[str]:
    two = [o + c for o, c in itertools.product(_ONSETS, _CODAS)]
    three = [o + m + c for o, m, c in itertools.product(_ONSETS, _MIDDLES, _CODAS)]
    words = {w for r in RELATIONS for s in r[1:] for w in s.replace(".", " ").replace("?", " ").lower().split()}
    pool = []
    for group in (two, three):
        group = [w for w in group if w.lower() not in _AVOID and w.lower() not in words]
        pool += [group[i] for i in rng.permutation(len(group))]
        if len(pool) >= n:
            break
    return pool[:n]


def generate(config: SyntheticConfig = SyntheticConfig()) -> SyntheticData:
    """Generate the corpus and questions for ``config`` (same config, same output)."""
    rng = np.random.default_rng([config.seed, 0x5EA4C4])
    n, f = config.num_entities, config.facts_per_entity
    names = entity_names(rng, n * (1 + f))
    proteins, objects = names[:n], names[n:]
    docs, facts = [], []
    for p_i, protein in enumerate(proteins):
        for j, r_i in enumerate(rng.choice(len(RELATIONS), size=f, replace=False)):
            obj = objects[p_i * f + j]
            rel = RELATIONS[int(r_i)]
            cell = CELLS[int(rng.integers(len(CELLS)))]
            doc_id = f"syn{config.seed}-{p_i}-{j}"
            docs.append(Document(doc_id, protein, rel[1].format(P=protein, X=obj, C=cell)))
            facts.append((protein, obj, rel, doc_id))
    test_ids = set(rng.choice(len(facts), size=config.num_test_facts, replace=False).tolist())
    train, test = [], []
    for k, (protein, obj, rel, doc_id) in enumerate(facts):
        held_out = k in test_ids
        both = config.train_both_phrasings and not held_out
        for ph in ((0, 1) if both else (int(rng.integers(2)),)):
            (test if held_out else train).append({
                "id": f"syn{config.seed}-{k}-{ph}",
                "question": rel[2 + ph].format(P=protein),
                "answer": obj,
                "golden_answers": [obj],
                "subject": protein,
                "relation": rel[0],
                "cat": "synthetic",
                "cat_num": RELATIONS.index(rel),
                "pmid": doc_id,
                "paper_title": protein,
                "question_original": rel[2].format(P=protein),
                "is_paraphrased": ph == 1,
            })
    return SyntheticData(config, tuple(docs), tuple(train), tuple(test), tuple(proteins))


def tokenizer_texts(data: SyntheticData) -> Iterator[str]:
    """Every string a tokenizer for this task should see: both prompt templates and feedback
    texts, every document, and for every question a full demonstration (prompt, canonical search
    turn, the ``<information>`` block of the subject's documents, canonical answer turn)."""
    yield SEARCH_R1_TEMPLATE.format(question=data.train[0]["question"])
    yield SEARCH_R1_INVALID
    yield SHORT_INVALID
    for d in data.docs:
        yield f"{d.title}\n{d.text}"
    by_subject: dict[str, list[Document]] = {}
    for d in data.docs:
        by_subject.setdefault(d.title, []).append(d)
    for row in data.train + data.test:
        hits = [Hit(d.id, d.title, d.text, 1.0) for d in by_subject[row["subject"]]]
        yield (SHORT_TEMPLATE.format(question=row["question"]) + search_turn(row["subject"])
               + format_information(hits) + answer_turn(row["answer"]))


def corpus_env_parts(name: str, config_cls: type, make_corpus: Any, split: str, config: Any, backend: str,
                     kwargs: dict[str, Any]) -> tuple[Any, tuple, Any, SearchConfig]:
    """What a generated-corpus search env is built from: ``(data, questions, retriever, protocol)``.

    ``kwargs`` holds ``config_cls`` fields (the corpus; not together with ``config``) and
    :class:`SearchConfig` fields (the protocol); the corpus, its questions and its index are cached
    per process under ``name``.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    corpus_fields = {f.name for f in fields(config_cls)}
    overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in corpus_fields}
    if config is not None and overrides:
        raise ValueError(f"give either config= or its fields {sorted(overrides)}, not both")
    config = config or config_cls(**overrides)
    protocol_fields = {f.name for f in fields(SearchConfig)}
    if set(kwargs) - protocol_fields:
        raise TypeError(f"unknown arguments {sorted(set(kwargs) - protocol_fields)}")
    protocol = SearchConfig(**{"prompt_template": SHORT_TEMPLATE, "invalid_feedback": SHORT_INVALID, **kwargs})
    if backend not in ("bm25s", "rank_bm25"):
        raise ValueError(f"backend must be 'bm25s' or 'rank_bm25', got {backend!r}")
    data = _data.cached((name, config), lambda: make_corpus(config))
    questions = _data.cached((f"{name}-questions", config, split), lambda: tuple(
        _data.question_from_row(r, i, split) for i, r in enumerate(data.split(split))))
    cls = BM25SRetriever if backend == "bm25s" else RankBM25Retriever
    retriever = _data.cached((f"{name}-index", config, backend), lambda: cls.build(data.docs))
    return data, questions, retriever, protocol


class SyntheticSearchEnv(SearchEnv):
    """``stoa/SyntheticSearch-v0``: the search protocol over :func:`generate`'s corpus.

    Args:
        split: ``"train"`` or ``"test"``.
        config: the corpus; or give its fields directly (``seed=``, ``num_entities=``, ...;
            ``seed`` is the corpus seed, episodes are seeded by ``reset``).
        backend: ``"bm25s"`` (default) or ``"rank_bm25"``.
        **protocol: :class:`SearchConfig` fields; the defaults here are ``prompt_template=``
            :data:`SHORT_TEMPLATE` and ``invalid_feedback=`` :data:`SHORT_INVALID`.
    """

    def __init__(self, split: str = "train", *, config: SyntheticConfig | None = None, backend: str = "bm25s",
                 **kwargs: Any) -> None:
        data, questions, retriever, protocol = corpus_env_parts("synthetic", SyntheticConfig, generate, split,
                                                                config, backend, kwargs)
        self.data = data
        self._rows = data.split(split)
        super().__init__(questions, retriever, protocol)

    def tokenizer_texts(self) -> Iterator[str]:
        return tokenizer_texts(self.data)

    def practice_kwargs(self, k: int) -> dict[str, Any]:
        """Another corpus seed: other entity names and facts, same templates and protocol."""
        return {"seed": self.data.config.seed + k}

    def oracle_turns(self, index: int) -> list[str]:
        """Search the protein *and* the relation's keyword (``Kavorin kinase``), so BM25 ranks the
        asked-for fact first, then answer with the object's name."""
        row = self._rows[index]
        return [search_turn(f"{row['subject']} {row['relation']}"), answer_turn(row["answer"])]
