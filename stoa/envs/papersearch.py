"""PaperSearchQA: answer biomedical questions by searching a corpus, with the Search-R1 protocol.

Protocol (arXiv 2601.18207, built on Search-R1). Each model turn is parsed for its *action*:

- ``<search> query </search>``: the environment appends
  ``"\\n\\n<information>Doc 1(Title: t1) text1\\nDoc 2(Title: t2) text2\\n...</information>\\n\\n"``
  with the top-``topk`` documents (``No documents found.`` when nothing matches). Reward 0.
- ``<answer> x </answer>``: the episode terminates; reward 1.0 if ``x`` matches a gold answer
  after :func:`normalize_answer` (exact match, EM), else 0.0.

Free text around the action (e.g. ``<think> ... </think>``) is allowed and ignored. The rollout
engine ends a turn at ``</search>`` or ``</answer>`` (:attr:`SearchEnv.stop_strings`).

Malformed turns. A turn is *invalid* when it has no action tag, an opening tag without its
closing tag (unclosed), a closing tag without an opening one, mismatched or out-of-order tags,
both a search and an answer, two actions, nested tags (a protocol tag inside the action), an
empty query or an empty answer. An invalid turn gets the configured feedback text
(``invalid_feedback``, Search-R1's "My previous action is invalid..." by default) as observation,
reward 0, and counts toward ``max_turns``; ``step``'s ``info["invalid_reason"]`` says why. A query
longer than ``max_query_chars`` is cut to that length and searched (``info["query_truncated"]``).
After ``max_turns`` turns without an answer the episode ends with ``truncated=True``, observation
``""`` and reward 0 (a search on the last allowed turn is not executed). Stepping after the end
raises ``RuntimeError``.

Tag forgery. Text the environment did not write (documents, titles, questions) cannot carry
protocol tags or chat-control tokens: :func:`neutralize` turns the ``<`` of ``<search>``,
``</information>``, ``<answer>``, ``<think>`` (any case, any spacing) and of ``<|...|>`` into
``&lt;``.

Metrics (``info["metrics"]`` on every step; final on the last): ``searched`` (bool),
``num_searches``, ``format_ok`` (every turn valid and the episode ended with an answer), ``em``,
``cover_em`` (a normalized gold answer is a substring of the normalized prediction), ``answer``
(the raw answer, at most 256 characters; ``""`` if none), ``num_turns``, ``invalid_turns``.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from stoa.envs import data as _data
from stoa.envs.base import TextEnv
from stoa.envs.data import Question
from stoa.envs.retrieval import BM25SRetriever, Hit, HTTPRetriever, RankBM25Retriever, Retriever, load_retriever

__all__ = [
    "SearchConfig", "SearchEnv", "PaperSearchQAEnv", "SEARCH_R1_TEMPLATE", "SEARCH_R1_INVALID",
    "normalize_answer", "exact_match", "cover_exact_match", "neutralize", "parse_turn", "Turn",
    "format_information", "search_turn", "answer_turn", "make_retriever",
]

SEARCH_R1_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
    "get new information. After reasoning, if you find you lack some knowledge, you can call a search engine "
    "by <search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)
"""Search-R1's instruction prompt (verbatim, as the benchmark's baselines used it)."""

SEARCH_R1_INVALID = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and "
    "</answer>. Let me try again.\n"
)
"""Search-R1's feedback to an invalid turn."""

NO_DOCUMENTS = "No documents found."
MAX_ANSWER_METRIC = 256

# -- answers -----------------------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD/Search-R1 normalization: lowercase, drop ASCII punctuation, drop the articles
    a/an/the, collapse whitespace."""
    return " ".join(_ARTICLES.sub(" ", s.lower().translate(_PUNCT)).split())


def exact_match(prediction: str, golds: Sequence[str]) -> bool:
    """Whether the normalized prediction equals some normalized gold answer."""
    p = normalize_answer(prediction)
    return any(p == normalize_answer(g) for g in golds)


def cover_exact_match(prediction: str, golds: Sequence[str]) -> bool:
    """Whether some non-empty normalized gold answer is a substring of the normalized prediction."""
    p = normalize_answer(prediction)
    return any((g := normalize_answer(gold)) and g in p for gold in golds)


# -- text from outside the protocol ----------------------------------------------------------------

# "\s*/?\s*" would backtrack quadratically over a long run of spaces after "<"; this form is linear.
_FORGEABLE = re.compile(r"<(?=\s*(?:/\s*)?(?:search|answer|information|think)\s*>|\|)", re.IGNORECASE)


def neutralize(text: str) -> str:
    """Make ``text`` unable to open or close a protocol tag or a chat-control token."""
    return _FORGEABLE.sub("&lt;", text)


def format_information(hits: Sequence[Hit], max_doc_chars: int | None = None) -> str:
    """The observation for a search: Search-R1's ``<information>`` block with ``Doc i(Title: ...)``."""
    lines = []
    for i, h in enumerate(hits, 1):
        text = h.text if max_doc_chars is None or len(h.text) <= max_doc_chars else h.text[:max_doc_chars] + " ..."
        lines.append(f"Doc {i}(Title: {neutralize(h.title)}) {neutralize(text)}")
    body = "\n".join(lines) if lines else NO_DOCUMENTS
    return f"\n\n<information>{body}</information>\n\n"


def search_turn(query: str) -> str:
    """A well-formed search turn in the canonical spacing (``<search> q </search>``)."""
    return f"<search> {query} </search>"


def answer_turn(answer: str) -> str:
    """A well-formed answer turn in the canonical spacing (``<answer> a </answer>``)."""
    return f"<answer> {answer} </answer>"


# -- parsing a turn ------------------------------------------------------------------------------

_ACTION_TAG = re.compile(r"<(/?)(search|answer)>")
_ANY_TAG = re.compile(r"</?(?:search|answer|information)>")


@dataclass(frozen=True)
class Turn:
    """A parsed model turn."""

    kind: str
    """``"search"``, ``"answer"`` or ``"invalid"``."""
    content: str = ""
    """The stripped query or answer."""
    reason: str = ""
    """Why the turn is invalid (empty otherwise)."""


def parse_turn(text: str) -> Turn:
    """Classify one turn (see the module docstring for the rules)."""
    found = list(_ACTION_TAG.finditer(text))
    tags = [(m.group(1) == "/", m.group(2)) for m in found]
    if not tags:
        return Turn("invalid", reason="no <search> or <answer> tag")
    if len(tags) == 1:
        closing, name = tags[0]
        return Turn("invalid", reason=f"closing </{name}> without <{name}>" if closing else f"unclosed <{name}>")
    if len(tags) > 2:
        depth = 0
        for closing, _ in tags:
            depth += -1 if closing else 1
            if depth >= 2:
                return Turn("invalid", reason="nested tags")
        names = {n for _, n in tags}
        return Turn("invalid", reason="both <search> and <answer>" if len(names) == 2 else "more than one action")
    (c0, n0), (c1, n1) = tags
    if c0 or not c1:
        return Turn("invalid", reason="nested tags" if not c0 and not c1 else "tags out of order")
    if n0 != n1:
        return Turn("invalid", reason=f"<{n0}> closed by </{n1}>")
    content = text[found[0].end() : found[1].start()]
    if _ANY_TAG.search(content):
        return Turn("invalid", reason="nested tags")
    content = content.strip()
    if not content:
        return Turn("invalid", reason=f"empty {'query' if n0 == 'search' else 'answer'}")
    return Turn(n0, content)


# -- the environment -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SearchConfig:
    """The protocol settings of a search environment."""

    max_turns: int = 4
    """Model turns per episode; the episode is truncated after this many without an answer."""
    topk: int = 3
    """Documents returned per search."""
    prompt_template: str = SEARCH_R1_TEMPLATE
    """User message; ``{question}`` is replaced by the question."""
    invalid_feedback: str = SEARCH_R1_INVALID
    """Observation after an invalid turn."""
    max_query_chars: int = 512
    """Longer queries are cut to this many characters before searching."""
    max_doc_chars: int = 4000
    """Longer document texts are cut (with " ...") in observations; bounds the context."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_turns <= 64:
            raise ValueError(f"max_turns={self.max_turns} must lie in [1, 64]")
        if not 1 <= self.topk <= 50:
            raise ValueError(f"topk={self.topk} must lie in [1, 50]")
        if self.prompt_template.count("{question}") != 1:
            raise ValueError("prompt_template must contain '{question}' exactly once")
        try:
            self.prompt_template.format(question="q")
        except (IndexError, KeyError, ValueError) as e:
            raise ValueError(f"prompt_template has stray braces ({e}); write literal braces as '{{{{' and '}}}}'") from None
        if not 1 <= self.max_query_chars <= 100_000 or not 1 <= self.max_doc_chars <= 1_000_000:
            raise ValueError("max_query_chars must lie in [1, 1e5] and max_doc_chars in [1, 1e6]")


def _split_config(kwargs: dict[str, Any]) -> SearchConfig:
    names = {f.name for f in fields(SearchConfig)}
    return SearchConfig(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})


class SearchEnv(TextEnv):
    """The Search-R1 protocol over a list of questions and a :class:`Retriever`.

    ``PaperSearchQAEnv`` and ``SyntheticSearchEnv`` are this environment with their own data. Step
    ``info`` holds ``metrics`` and ``action`` (``"search"``, ``"answer"``, ``"invalid"``,
    ``"limit"``), plus ``query`` and ``query_truncated`` for searches and ``invalid_reason``.
    """

    stop_strings = ("</search>", "</answer>")
    metric_types = {"searched": bool, "num_searches": int, "format_ok": bool, "em": bool, "cover_em": bool,
                    "answer": str, "num_turns": int, "invalid_turns": int}
    success_metric = "em"
    headline_metrics = ("searched",)
    demo_styles = ("oracle", "guess")
    """``oracle``: search the subject, then answer with the gold answer. ``guess``: answer at once
    with a name drawn uniformly from the questions' answers (plausible, almost always wrong)."""
    _guesses: list[str] | None = None

    def __init__(self, questions: Sequence[Question], retriever: Retriever, config: SearchConfig = SearchConfig()) -> None:
        if not questions:
            raise ValueError("a search environment needs at least one question")
        self.questions = questions
        self.retriever = retriever
        self.config = config
        self._q: Question | None = None
        self._index = self._turns = self._searches = self._invalid = 0
        self._answer, self._em, self._cover = "", False, False
        self._done, self._started = True, False

    def __len__(self) -> int:
        return len(self.questions)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        i = self._select_index(options)
        q = self.questions[i]
        self._q, self._index = q, i
        self._turns = self._searches = self._invalid = 0
        self._answer, self._em, self._cover = "", False, False
        self._done, self._started = False, True
        prompt = self.config.prompt_template.format(question=neutralize(q.question))
        return prompt, {"question_id": q.id, "gold_answers": list(q.golden_answers), "index": i}

    def metrics(self) -> dict[str, bool | int | float | str]:
        """The current episode's metrics (see the module docstring)."""
        answered = bool(self._answer)
        return {
            "searched": self._searches > 0, "num_searches": self._searches,
            "format_ok": answered and self._invalid == 0, "em": self._em, "cover_em": self._cover,
            "answer": self._answer[:MAX_ANSWER_METRIC], "num_turns": self._turns, "invalid_turns": self._invalid,
        }

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not isinstance(action, str):
            raise TypeError(f"an action is the text of one model turn (str), got {type(action).__name__}")
        if self._done:
            raise RuntimeError("the episode has ended (or never started): call reset() before step()"
                               if self._started else "call reset() before step()")
        assert self._q is not None
        cfg = self.config
        self._turns += 1
        turn = parse_turn(action)
        info: dict[str, Any] = {"action": turn.kind}
        if turn.kind == "answer":
            self._answer = turn.content
            self._em = exact_match(turn.content, self._q.golden_answers)
            self._cover = cover_exact_match(turn.content, self._q.golden_answers)
            self._done = True
            info["metrics"] = self.metrics()
            return "", float(self._em), True, False, info
        if self._turns >= cfg.max_turns:
            self._done = True
            info["action"] = "limit" if turn.kind == "search" else "invalid"
            if turn.kind == "invalid":
                self._invalid += 1
                info["invalid_reason"] = turn.reason
            info["metrics"] = self.metrics()
            return "", 0.0, False, True, info
        if turn.kind == "invalid":
            self._invalid += 1
            info["invalid_reason"] = turn.reason
            info["metrics"] = self.metrics()
            return cfg.invalid_feedback, 0.0, False, False, info
        query = turn.content[: cfg.max_query_chars]
        info["query"], info["query_truncated"] = query, len(turn.content) > cfg.max_query_chars
        hits = self.retriever.search([query], cfg.topk)[0]
        self._searches += 1
        info["metrics"] = self.metrics()
        return format_information(hits[: cfg.topk], cfg.max_doc_chars), 0.0, False, False, info

    def oracle_turns(self, index: int) -> list[str]:
        q = self.questions[index]
        return [search_turn(q.subject or q.question), answer_turn(q.golden_answers[0])]

    def demonstration_turns(self, index: int, style: str, rng: np.random.Generator) -> list[str] | None:
        if style == "guess":
            if self._guesses is None:
                self._guesses = sorted({q.golden_answers[0] for q in self.questions})
            return [answer_turn(self._guesses[int(rng.integers(len(self._guesses)))])]
        return super().demonstration_turns(index, style, rng)


def _check_one_source(corpus: str | None, index: str | None, retriever_url: str | None) -> None:
    given = [n for n, v in (("corpus", corpus), ("index", index), ("retriever_url", retriever_url)) if v]
    if len(given) != 1:
        raise ValueError(
            "give exactly one retrieval source: index=<folder from `stoa retriever build`>, "
            "retriever_url=<http://host:port of `stoa retriever serve`>, or corpus=<hub name or local file> "
            f"(built in memory; fine for small corpora). Got: {given or 'none'}"
        )


def make_retriever(*, corpus: str | None = None, index: str | None = None, retriever_url: str | None = None,
                   backend: str = "bm25s", corpus_limit: int | None = None) -> Retriever:
    """The retriever for exactly one source: a saved index folder, a server URL, or a corpus
    (hub name or local path) indexed in this process. Cached per process."""
    _check_one_source(corpus, index, retriever_url)
    if retriever_url:
        return HTTPRetriever(retriever_url)
    if index:
        return _data.cached(("index", _data.source_key(index)), lambda: load_retriever(index))
    if backend not in ("bm25s", "rank_bm25"):
        raise ValueError(f"backend must be 'bm25s' or 'rank_bm25', got {backend!r}")
    assert corpus is not None
    cls = BM25SRetriever if backend == "bm25s" else RankBM25Retriever
    key = ("corpus", backend, corpus_limit, _data.source_key(corpus))
    return _data.cached(key, lambda: cls.build(_data.iter_corpus(corpus, limit=corpus_limit)))


class PaperSearchQAEnv(SearchEnv):
    """``stoa/PaperSearchQA-v0``: PaperSearchQA questions over a PubMed corpus.

    Args:
        split: ``"train"`` or ``"test"``.
        questions: hub name (default ``jmhb/PaperSearchQA``) or local path (see :mod:`stoa.envs.data`).
        corpus / index / retriever_url: the retrieval source; exactly one (see :func:`make_retriever`).
            The full corpus has 16M abstracts: build an index once with ``stoa retriever build`` and
            share it with ``index=`` or ``stoa retriever serve``.
        retriever: a ready :class:`Retriever` object instead of the three above.
        backend: ``"bm25s"`` (default) or ``"rank_bm25"`` when indexing ``corpus`` here.
        limit / corpus_limit: read only the first questions / documents.
        **protocol: :class:`SearchConfig` fields (``max_turns=4``, ``topk=3``, ``prompt_template``
            = Search-R1's, ``invalid_feedback``, ``max_query_chars``, ``max_doc_chars``).
    """

    def __init__(self, split: str = "train", *, questions: str = _data.PAPERSEARCHQA, corpus: str | None = None,
                 index: str | None = None, retriever_url: str | None = None, retriever: Retriever | None = None,
                 backend: str = "bm25s", limit: int | None = None, corpus_limit: int | None = None,
                 **protocol: Any) -> None:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        config = _split_config(protocol)
        if protocol:
            raise TypeError(f"unknown arguments {sorted(protocol)}")
        if retriever is not None and (corpus or index or retriever_url):
            raise ValueError("give either retriever= or one of corpus=/index=/retriever_url=, not both")
        if retriever is None:
            _check_one_source(corpus, index, retriever_url)  # before any download
        qs = _data.cached(("questions", limit, _data.source_key(questions, split)),
                          lambda: _data.load_questions(questions, split, limit=limit))
        if retriever is None:
            retriever = make_retriever(corpus=corpus, index=index, retriever_url=retriever_url,
                                       backend=backend, corpus_limit=corpus_limit)
        super().__init__(qs, retriever, config)
