"""``stoa/SyntheticSearchHard-v0``: a synthetic search task on which RL must learn more than to search.

The v0 task (:mod:`stoa.envs.synthetic`) is solved by one search for the question's protein and a
copy of the only object name in the top document: once a policy searches, reading is trivial, so
RL there mostly learns *when* to search. This task keeps the corpus style and the Search-R1
protocol and adds three things a policy must get right after it decides to search:

- **Paraphrased questions.** A question is phrased with synonyms of the document's words
  (``Which phosphotransferase is blocked by Kavorin alpha?`` for the fact ``Kavorin alpha
  inhibits the kinase Mertil in hepatocytes.``), with probability ``paraphrase_frac``. Searching
  the question's words finds the protein's documents but does not single out the asked-for fact;
  searching the document's word (``Kavorin alpha kinase``) does.
- **Distractors about similarly named entities.** Proteins come in families of ``isoforms``
  (``Kavorin alpha``, ``Kavorin beta``) that have facts of the *same relations* with different
  objects. A query ranks the sibling's fact of the same relation right behind the asked-for one,
  so the ``<information>`` block holds a wrong answer that looks right; the answer must be read
  from the document about the exact entity.
- **Two-hop questions** (``two_hop_frac`` of facts): the fact's object has a fact of its own
  (``Mertil is encoded by the gene Dolex.``) and the question asks for it through the first
  (``Which gene encodes the kinase that Kavorin alpha inhibits?``). It needs two searches:
  entity -> attribute (``Mertil``) -> second fact (``Dolex``).

Properties the tests pin down: generation is deterministic in the config; every name is used
once (an object or bridge name occurs only in its own documents); the train/test split is by
fact chain (no test answer, and no bridge of a test chain, is a train answer); the oracle's
queries rank the right document first on most items; a two-hop item's answer is in no document
that its first query retrieves.

Metrics (``info["metrics"]``; the Search-R1 ones of :class:`~stoa.envs.papersearch.SearchEnv`
plus): ``hops`` (1 or 2, the item's), ``answer_retrieved`` (some search of the episode returned
a document holding the gold answer), ``em_given_search`` (``em`` if the episode searched, else
``None``: its mean is pass@1 after search, reported apart from the search rate ``searched``).

Demonstration styles: ``oracle`` (every hop searched with the document's words, then the gold
answer), ``guess`` (answer at once with another item's answer), ``naive`` (search the question's
own words once, answer with the object of the top document: the lazy reader that paraphrases,
distractors and second hops defeat).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from stoa.envs.papersearch import (
    SEARCH_R1_INVALID,
    SEARCH_R1_TEMPLATE,
    SearchEnv,
    answer_turn,
    format_information,
    normalize_answer,
    search_turn,
)
from stoa.envs.retrieval import Document
from stoa.envs.synthetic import (
    CELLS,
    MAX_NAMES,
    RELATIONS,
    SHORT_INVALID,
    SHORT_TEMPLATE,
    corpus_env_parts,
    entity_names,
)

__all__ = ["ISOFORMS", "PARAPHRASES", "HardConfig", "HardData", "SyntheticSearchHardEnv", "generate_hard"]

ISOFORMS = ("alpha", "beta", "gamma")
"""Second words of the members of a protein family (the similarly named entities)."""

# relation -> (paraphrased question about {P}, noun phrase for the object: literal, paraphrased).
# Paraphrases avoid the fact's relation noun and verb, so only a reader who maps the synonyms
# (or searches the document's word) finds the asked-for fact among the protein's documents.
PARAPHRASES = {
    "kinase": ("Which phosphotransferase is blocked by {P}?", "the kinase that {P} inhibits",
               "the phosphotransferase blocked by {P}"),
    "receptor": ("Which docking site does {P} attach to?", "the receptor that {P} binds",
                 "the docking site {P} attaches to"),
    "gene": ("Which locus codes for {P}?", "the gene that encodes {P}", "the locus coding for {P}"),
    "enzyme": ("Which catalyst is switched on by {P}?", "the enzyme that {P} activates",
               "the catalyst switched on by {P}"),
    "protease": ("Which peptidase cuts {P}?", "the protease that cleaves {P}", "the peptidase cutting {P}"),
    "transporter": ("Which carrier moves {P}?", "the transporter that carries {P}", "the carrier moving {P}"),
    "factor": ("Which transcriptional regulator controls {P}?", "the transcription factor that regulates {P}",
               "the transcriptional regulator controlling {P}"),
    "chaperone": ("Which folding helper shapes {P}?", "the chaperone that folds {P}", "the folding helper shaping {P}"),
}
_REL = {r[0]: r for r in RELATIONS}


@dataclass(frozen=True)
class HardConfig:
    """Size, difficulty and seed of the hard corpus."""

    seed: int = 0
    """Seed of every random choice (names, relations, cells, bridges, phrasings, split)."""
    num_families: int = 150
    """Protein families; each has ``isoforms`` similarly named members."""
    isoforms: int = 2
    """Members per family (1 = no distractors; at most 3)."""
    facts_per_entity: int = 3
    """Facts per protein; the members of a family share their relations."""
    two_hop_frac: float = 0.3
    """Fraction of facts whose object has a fact of its own, asked for through the first (two-hop)."""
    paraphrase_frac: float = 0.5
    """Probability that a question is phrased with synonyms instead of the document's words."""
    num_test: int = 200
    """Fact chains (one question each) held out for the test split."""

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0")
        if not 1 <= self.isoforms <= len(ISOFORMS):
            raise ValueError(f"isoforms={self.isoforms} must lie in [1, {len(ISOFORMS)}]")
        if not 1 <= self.facts_per_entity <= len(RELATIONS):
            raise ValueError(f"facts_per_entity={self.facts_per_entity} must lie in [1, {len(RELATIONS)}]")
        if not 0 <= self.two_hop_frac <= 1 or not 0 <= self.paraphrase_frac <= 1:
            raise ValueError("two_hop_frac and paraphrase_frac must lie in [0, 1]")
        n_facts = self.num_families * self.isoforms * self.facts_per_entity
        if self.num_families < 1 or n_facts * 2 + self.num_families > MAX_NAMES:
            raise ValueError(f"num_families={self.num_families} needs more names than the generator has")
        if not 1 <= self.num_test < n_facts:
            raise ValueError(f"num_test={self.num_test} must lie in [1, number of facts {n_facts})")


@dataclass(frozen=True, eq=False)
class HardData:
    """A generated hard corpus: documents, question rows (PaperSearchQA schema plus the chain)."""

    config: HardConfig
    docs: tuple[Document, ...]
    train: tuple[dict[str, Any], ...]
    test: tuple[dict[str, Any], ...]
    objects: dict[str, str]
    """Document id -> the object name the document states (what a naive reader would copy)."""

    def split(self, name: str) -> tuple[dict[str, Any], ...]:
        if name not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {name!r}")
        return self.train if name == "train" else self.test


def _question(rel: str, subject: str, paraphrase: bool) -> str:
    return PARAPHRASES[rel][0].format(P=subject) if paraphrase else _REL[rel][2].format(P=subject)


def _noun_phrase(rel: str, subject: str, paraphrase: bool) -> str:
    return PARAPHRASES[rel][2 if paraphrase else 1].format(P=subject)


def generate_hard(config: HardConfig = HardConfig()) -> HardData:
    """Generate the corpus and questions for ``config`` (same config, same output)."""
    rng = np.random.default_rng([config.seed, 0x4A2D])
    c = config
    n_entities = c.num_families * c.isoforms
    n_facts = n_entities * c.facts_per_entity
    names = entity_names(rng, c.num_families + 2 * n_facts)
    bases, objects, seconds = names[: c.num_families], names[c.num_families: c.num_families + n_facts], names[
        c.num_families + n_facts:]
    docs: list[Document] = []
    doc_object: dict[str, str] = {}
    chains: list[dict[str, Any]] = []

    def add_doc(doc_id: str, title: str, rel: tuple[str, ...], subject: str, obj: str) -> None:
        cell = CELLS[int(rng.integers(len(CELLS)))]
        docs.append(Document(doc_id, title, rel[1].format(P=subject, X=obj, C=cell)))
        doc_object[doc_id] = obj

    k = 0
    for f_i, base in enumerate(bases):
        rels = [RELATIONS[int(r)] for r in rng.choice(len(RELATIONS), size=c.facts_per_entity, replace=False)]
        for iso in range(c.isoforms):
            entity = f"{base} {ISOFORMS[iso]}" if c.isoforms > 1 else base
            for rel in rels:
                obj = objects[k]
                doc_id = f"hard{c.seed}-{k}"
                add_doc(doc_id, entity, rel, entity, obj)
                chain = {"k": k, "entity": entity, "rel": rel[0], "object": obj, "doc": doc_id, "hops": 1}
                if rng.random() < c.two_hop_frac:
                    rel2 = RELATIONS[int(rng.integers(len(RELATIONS)))]
                    second_id = f"hard{c.seed}-{k}-2"
                    add_doc(second_id, obj, rel2, obj, seconds[k])
                    chain.update(hops=2, rel2=rel2[0], answer=seconds[k], doc2=second_id)
                chains.append(chain)
                k += 1
    test_ids = set(rng.choice(len(chains), size=c.num_test, replace=False).tolist())
    train, test = [], []
    for ch in chains:
        para = bool(rng.random() < c.paraphrase_frac)
        if ch["hops"] == 1:
            question, answer = _question(ch["rel"], ch["entity"], para), ch["object"]
            queries = [f"{ch['entity']} {ch['rel']}"]
        else:
            question = _question(ch["rel2"], _noun_phrase(ch["rel"], ch["entity"], para), para)
            answer = ch["answer"]
            queries = [f"{ch['entity']} {ch['rel']}", f"{ch['object']} {ch['rel2']}"]
        (test if ch["k"] in test_ids else train).append({
            "id": f"hard{c.seed}-{ch['k']}",
            "question": question,
            "answer": answer,
            "golden_answers": [answer],
            "subject": ch["entity"],
            "relation": ch["rel"],
            "hops": ch["hops"],
            "bridge": ch["object"] if ch["hops"] == 2 else "",
            "queries": queries,
            "docs": [ch["doc"]] + ([ch["doc2"]] if ch["hops"] == 2 else []),
            "cat": "synthetic-hard",
            "cat_num": ch["hops"],
            "pmid": ch.get("doc2", ch["doc"]),
            "paper_title": ch["entity"],
            "question_original": _question(ch["rel"], ch["entity"], False),
            "is_paraphrased": para,
        })
    return HardData(c, tuple(docs), tuple(train), tuple(test), doc_object)


class SyntheticSearchHardEnv(SearchEnv):
    """``stoa/SyntheticSearchHard-v0``: the search protocol over :func:`generate_hard`'s corpus.

    Args:
        split: ``"train"`` or ``"test"``.
        config: the corpus; or give its fields directly (``seed=``, ``num_families=``, ...;
            ``seed`` is the corpus seed, episodes are seeded by ``reset``).
        backend: ``"bm25s"`` (default) or ``"rank_bm25"``.
        **protocol: :class:`SearchConfig` fields; the defaults here are ``prompt_template=``
            :data:`~stoa.envs.synthetic.SHORT_TEMPLATE` and ``invalid_feedback=``
            :data:`~stoa.envs.synthetic.SHORT_INVALID` (``max_turns = 4`` leaves room for two searches).
    """

    metric_types: ClassVar[dict[str, type | tuple[type, ...]]] = {
        **SearchEnv.metric_types, "hops": int, "answer_retrieved": bool, "em_given_search": (bool, type(None))}
    headline_metrics = ("searched", "em_given_search", "answer_retrieved")
    demo_styles = ("oracle", "guess", "naive")
    """``oracle``: search every hop with the document's words, then answer. ``guess``: answer at once
    with another item's answer. ``naive``: search the question verbatim, answer the top document's object."""

    def __init__(self, split: str = "train", *, config: HardConfig | None = None, backend: str = "bm25s",
                 **kwargs: Any) -> None:
        data, questions, retriever, protocol = corpus_env_parts("synthetic-hard", HardConfig, generate_hard, split,
                                                                config, backend, kwargs)
        self.data = data
        self._rows = data.split(split)
        self._retrieved = False
        super().__init__(questions, retriever, protocol)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self._retrieved = False
        return super().reset(seed=seed, options=options)

    def metrics(self) -> dict[str, bool | int | float | str | None]:
        m: dict[str, Any] = dict(super().metrics())
        m["hops"] = int(self._rows[self._index]["hops"])
        m["answer_retrieved"] = self._retrieved
        m["em_given_search"] = m["em"] if m["searched"] else None
        return m

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = super().step(action)
        if info.get("action") == "search" and not self._retrieved:
            words = f" {normalize_answer(obs)} "
            self._retrieved = any(f" {normalize_answer(g)} " in words for g in self.questions[self._index].golden_answers)
            info["metrics"] = self.metrics()
        return obs, reward, terminated, truncated, info

    def oracle_turns(self, index: int) -> list[str]:
        row = self._rows[index]
        return [search_turn(q) for q in row["queries"]] + [answer_turn(row["answer"])]

    def demonstration_turns(self, index: int, style: str, rng: np.random.Generator) -> list[str] | None:
        if style == "naive":
            question = self.questions[index].question
            hits = self.retriever.search([question], self.config.topk)[0]
            answer = self.data.objects.get(hits[0].id, "") if hits else ""
            return [search_turn(question), answer_turn(answer or "unknown")]
        return super().demonstration_turns(index, style, rng)

    def tokenizer_texts(self) -> Iterator[str]:
        """Both prompt templates and feedback texts, every document, and for every question in
        both phrasings an oracle demonstration with the information blocks its searches return."""
        d = self.data
        yield SEARCH_R1_TEMPLATE.format(question=d.train[0]["question"])
        yield SEARCH_R1_INVALID
        yield SHORT_INVALID
        for doc in d.docs:
            yield f"{doc.title}\n{doc.text}"
        topk = self.config.topk
        for row in d.train + d.test:
            text = SHORT_TEMPLATE.format(question=row["question"])
            for q in row["queries"]:
                text += search_turn(q) + format_information(self.retriever.search([q], topk)[0])
            yield text + answer_turn(row["answer"])
            yield row["question_original"]
        for rel, (question, literal, para) in PARAPHRASES.items():
            yield " ".join((question, literal, para, _REL[rel][2], _REL[rel][3])).replace("{P}", "Kavorin alpha")

    def practice_kwargs(self, k: int) -> dict[str, Any]:
        """Another corpus seed: other names and facts, same templates, difficulty and protocol."""
        return {"seed": self.data.config.seed + k}
