"""Document retrieval behind one small interface.

A :class:`Retriever` answers a batch of text queries with, per query, at most ``k`` :class:`Hit`
objects (document id, title, text, score), best first. Implementations:

- :class:`BM25SRetriever` (default): BM25 with ``bm25s`` (Lucene variant); built once, saved to a
  folder, loaded memory-mapped, so many processes on one machine share the page cache.
- :class:`RankBM25Retriever`: ``rank-bm25``'s Okapi BM25, kept as a reference (about 90x slower
  per query, in memory only).
- :class:`HTTPRetriever`: a client of the Search-R1 retriever API (``POST /retrieve``), served by
  ``stoa retriever serve`` (:mod:`stoa.envs.server`) or by Search-R1's own server.

Both BM25 backends share :func:`bm25_tokenize` (pinned: lower-case, ``\\w+`` words, a short stop
list, no stemming), so their scores differ only by their IDF variants. Documents with score 0
(no query term in common) are never returned, so a query may get fewer than ``k`` hits.
"""

from __future__ import annotations

import json
import math
import mmap
import re
import time
import urllib.error
import urllib.request
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from stoa.errors import ExpectedFailure

__all__ = [
    "Document", "Hit", "Retriever", "RetrieverError", "BM25SRetriever", "RankBM25Retriever",
    "HTTPRetriever", "bm25_tokenize", "load_retriever", "document_from_contents", "TOKENIZER_VERSION",
]

TOKENIZER_VERSION = "stoa-bm25-tok-v1"
"""Name of :func:`bm25_tokenize`'s rules, recorded in every saved index."""

INDEX_FORMAT = "stoa-bm25s-index"
INDEX_VERSION = 1
MANIFEST = "stoa_index.json"

_WORD = re.compile(r"\w+", re.UNICODE)
# Function words only: domain words ("protein", "cell") stay, since BM25's IDF already damps them.
_STOP = frozenset(
    "a an and are as at be been but by can do does did for from had has have how in into is it its "
    "of on or that the their them there these they this those to was were what when where which who "
    "whom whose why will with".split()
)


@dataclass(frozen=True)
class Document:
    """One corpus entry."""

    id: str
    """Stable identifier (e.g. a PMID)."""
    title: str
    """Title, shown as ``Doc i(Title: <title>)``; may be empty."""
    text: str
    """Body text (an abstract, a fact)."""


@dataclass(frozen=True)
class Hit:
    """One retrieved document and its score (higher is better; comparable within one query)."""

    id: str
    title: str
    text: str
    score: float


@runtime_checkable
class Retriever(Protocol):
    """Anything that answers a batch of queries with ranked documents."""

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        """Return, for each query in order, at most ``k`` hits sorted by decreasing score.

        An empty query, or one sharing no term with the corpus, gets ``[]``. Raises
        :class:`RetrieverError` when the backend fails (e.g. the server is unreachable).
        """
        ...


class RetrieverError(ExpectedFailure, RuntimeError):
    """A retriever could not answer, or its index/server gave malformed data."""


def bm25_tokenize(text: str) -> list[str]:
    """Lower-cased word tokens of ``text`` minus stop words (the rule named :data:`TOKENIZER_VERSION`)."""
    return [w for w in _WORD.findall(text.lower()) if w not in _STOP]


def _index_text(doc: Document) -> str:
    return f"{doc.title}\n{doc.text}" if doc.title else doc.text


def _check_k(k: int) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    return k


def _top_k(scores: np.ndarray, k: int) -> list[tuple[int, float]]:
    """Indices of the ``k`` best positive scores; ties broken by lower index (deterministic)."""
    k = min(k, len(scores))
    if k == 0:
        return []
    cand = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
    cand = cand[np.lexsort((cand, -scores[cand]))]
    return [(int(i), float(scores[i])) for i in cand if scores[i] > 0]


# ---------------------------------------------------------------------------------------------
# Document stores: a list in memory, or a JSONL file + offsets, memory-mapped
# ---------------------------------------------------------------------------------------------


class _MmapDocs:
    """Read-only ``docs.jsonl`` + ``docs.offsets.npy``; a document is parsed only when fetched."""

    def __init__(self, folder: Path) -> None:
        jsonl, offs = folder / "docs.jsonl", folder / "docs.offsets.npy"
        self._offsets = np.load(offs, mmap_mode="r", allow_pickle=False)
        if self._offsets.ndim != 1 or self._offsets.dtype != np.int64 or len(self._offsets) < 1:
            raise RetrieverError(f"{offs}: expected a 1-D int64 array")
        size = jsonl.stat().st_size
        if int(self._offsets[0]) != 0 or int(self._offsets[-1]) != size or np.any(np.diff(self._offsets) <= 0):
            raise RetrieverError(f"{offs} does not match {jsonl} ({size} bytes): the index is corrupt")
        with open(jsonl, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        self._where = jsonl

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> Document:
        line = self._mm[int(self._offsets[i]) : int(self._offsets[i + 1])]
        try:
            d = json.loads(line)
        except ValueError:
            raise RetrieverError(f"{self._where}: document {i} is not valid JSON") from None
        if not isinstance(d, dict) or not all(isinstance(d.get(f), str) for f in ("id", "title", "text")):
            raise RetrieverError(f"{self._where}: document {i} lacks string fields id/title/text")
        return Document(d["id"], d["title"], d["text"])


def _doc_line(d: Document) -> bytes:
    return json.dumps({"id": d.id, "title": d.title, "text": d.text}, ensure_ascii=False).encode() + b"\n"


def _write_docs(folder: Path, docs: Sequence[Document]) -> None:
    offsets = np.zeros(len(docs) + 1, np.int64)
    with open(folder / "docs.jsonl", "wb") as f:
        for i, d in enumerate(docs):
            line = _doc_line(d)
            f.write(line)
            offsets[i + 1] = offsets[i] + len(line)
    np.save(folder / "docs.offsets.npy", offsets, allow_pickle=False)


def _new_folder(path: str | Path) -> Path:
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise FileExistsError(f"{folder} is not empty; choose a new folder for the index")
    return folder


def _save_model(model: Any, folder: Path, num_docs: int) -> None:
    """The bm25s arrays (no pickle), then the manifest, which marks the index complete."""
    model.save(str(folder), show_progress=False)
    manifest = {
        "format": INDEX_FORMAT, "version": INDEX_VERSION, "backend": "bm25s", "num_docs": num_docs,
        "tokenizer": TOKENIZER_VERSION, "k1": model.k1, "b": model.b, "method": model.method,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _as_documents(docs: Iterable[Document]) -> list[Document]:
    out = list(docs)
    for i, d in enumerate(out):
        if not isinstance(d, Document):
            raise TypeError(f"document {i} is a {type(d).__name__}, not a stoa.envs.retrieval.Document")
    if not out:
        raise ValueError("cannot index an empty corpus")
    return out


# ---------------------------------------------------------------------------------------------
# bm25s
# ---------------------------------------------------------------------------------------------


def _bm25s():
    import logging

    import bm25s

    logging.getLogger("bm25s").setLevel(logging.WARNING)  # it sets itself to DEBUG on import
    return bm25s


class BM25SRetriever:
    """BM25 (Lucene variant) on ``bm25s``: build, :meth:`save`, :meth:`load` memory-mapped."""

    def __init__(self, model: Any, docs: Sequence[Document] | _MmapDocs) -> None:
        self._model = model
        self._docs = docs
        self._vocab: dict[str, int] = model.vocab_dict

    @classmethod
    def build(cls, docs: Iterable[Document], *, k1: float = 1.5, b: float = 0.75,
              out: str | Path | None = None) -> BM25SRetriever:
        """Index ``docs`` (title and text are both searched).

        With ``out`` (a new, empty folder) the documents stream to disk while being tokenized and
        are never held in memory; the index is saved there and returned memory-mapped. That is
        the way to index a corpus larger than RAM allows as Python objects.
        """
        bm25s = _bm25s()

        folder = _new_folder(out) if out is not None else None
        kept: list[Document] = []
        vocab: dict[str, int] = {}
        # int32 arrays of token ids: 4 bytes a token, where lists of str cost ~60 (1M abstracts: 0.6 vs 9 GB).
        ids: list[array] = []
        offsets = [0]
        sink = open(folder / "docs.jsonl", "wb") if folder else None
        try:
            for i, d in enumerate(docs):
                if not isinstance(d, Document):
                    raise TypeError(f"document {i} is a {type(d).__name__}, not a stoa.envs.retrieval.Document")
                ids.append(array("i", [vocab.setdefault(t, len(vocab)) for t in bm25_tokenize(_index_text(d))]))
                if sink is not None:
                    line = _doc_line(d)
                    sink.write(line)
                    offsets.append(offsets[-1] + len(line))
                else:
                    kept.append(d)
        finally:
            if sink is not None:
                sink.close()
        if not ids:
            raise ValueError("cannot index an empty corpus")
        if not vocab:
            raise ValueError("the corpus has no indexable words")
        model = bm25s.BM25(k1=k1, b=b, method="lucene")
        model.index((ids, vocab), create_empty_token=False, show_progress=False)
        if folder is None:
            return cls(model, kept)
        np.save(folder / "docs.offsets.npy", np.asarray(offsets, np.int64), allow_pickle=False)
        del ids
        _save_model(model, folder, len(offsets) - 1)
        return cls.load(folder)

    def __len__(self) -> int:
        return len(self._docs)

    def document(self, i: int) -> Document:
        """The ``i``-th indexed document."""
        return self._docs[i]

    def save(self, path: str | Path) -> Path:
        """Write the index to the folder ``path`` (created; must be empty). The manifest goes last."""
        folder = _new_folder(path)
        _write_docs(folder, [self._docs[i] for i in range(len(self._docs))])
        _save_model(self._model, folder, len(self._docs))
        return folder

    @classmethod
    def load(cls, path: str | Path, *, mmap: bool = True) -> BM25SRetriever:
        """Open an index written by :meth:`save`; with ``mmap`` the arrays and documents stay on disk."""
        bm25s = _bm25s()

        folder = Path(path)
        manifest = _read_manifest(folder)
        model = bm25s.BM25.load(str(folder), mmap=mmap, load_corpus=False, allow_pickle=False, show_progress=False)
        docs = _MmapDocs(folder)
        s = model.scores
        if s["num_docs"] != manifest["num_docs"] or len(docs) != manifest["num_docs"]:
            raise RetrieverError(
                f"{folder}: manifest says {manifest['num_docs']} documents, index has {s['num_docs']}, "
                f"document store has {len(docs)}"
            )
        if len(s["indptr"]) != len(model.vocab_dict) + 1 or not len(s["data"]) == len(s["indices"]) == int(s["indptr"][-1]):
            raise RetrieverError(f"{folder}: inconsistent bm25s arrays (vocabulary vs indptr/data sizes)")
        return cls(model, docs)

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        _check_k(k)
        out = []
        for q in queries:
            ids = [self._vocab[t] for t in bm25_tokenize(q) if t in self._vocab]
            if not ids:
                out.append([])
                continue
            scores = self._model.get_scores_from_ids(ids)
            out.append([_hit(self._docs[i], s) for i, s in _top_k(scores, k)])
        return out


def _hit(d: Document, score: float) -> Hit:
    return Hit(d.id, d.title, d.text, score)


def _read_manifest(folder: Path) -> dict[str, Any]:
    f = folder / MANIFEST
    if not f.exists():
        raise RetrieverError(f"{folder} has no {MANIFEST}: not a stoa index, or its build did not finish")
    try:
        m = json.loads(f.read_text())
    except ValueError:
        raise RetrieverError(f"{f} is not valid JSON") from None
    if not isinstance(m, dict) or m.get("format") != INDEX_FORMAT:
        raise RetrieverError(f"{f}: format is not {INDEX_FORMAT!r}")
    if m.get("version") != INDEX_VERSION:
        raise RetrieverError(f"{f}: index version {m.get('version')!r}, this reader supports {INDEX_VERSION}")
    if m.get("tokenizer") != TOKENIZER_VERSION:
        raise RetrieverError(f"{f}: built with tokenizer {m.get('tokenizer')!r}, this code uses {TOKENIZER_VERSION!r}")
    if not isinstance(m.get("num_docs"), int) or m["num_docs"] < 1:
        raise RetrieverError(f"{f}: num_docs must be a positive int")
    return m


def load_retriever(path: str | Path) -> BM25SRetriever:
    """Open a saved index folder (see :meth:`BM25SRetriever.save`)."""
    return BM25SRetriever.load(path, mmap=True)


# ---------------------------------------------------------------------------------------------
# rank-bm25 (reference)
# ---------------------------------------------------------------------------------------------


class RankBM25Retriever:
    """``rank_bm25.BM25Okapi`` over the same tokens; in memory only, for reference and benchmarks."""

    def __init__(self, model: Any, docs: list[Document]) -> None:
        self._model, self._docs = model, docs

    @classmethod
    def build(cls, docs: Iterable[Document], *, k1: float = 1.5, b: float = 0.75) -> RankBM25Retriever:
        from rank_bm25 import BM25Okapi

        docs = _as_documents(docs)
        return cls(BM25Okapi([bm25_tokenize(_index_text(d)) for d in docs], k1=k1, b=b), docs)

    def __len__(self) -> int:
        return len(self._docs)

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        _check_k(k)
        out = []
        for q in queries:
            toks = bm25_tokenize(q)
            if not toks:
                out.append([])
                continue
            scores = np.asarray(self._model.get_scores(toks), dtype=np.float64)
            out.append([_hit(self._docs[i], s) for i, s in _top_k(scores, k)])
        return out


# ---------------------------------------------------------------------------------------------
# Search-R1 HTTP client
# ---------------------------------------------------------------------------------------------


def document_from_contents(contents: str, doc_id: str = "") -> Document:
    """Split a Search-R1 ``contents`` string into title and text.

    Accepts the wiki style (``"Title"\\ntext``), PaperSearchRL's ``TITLE: t. ABSTRACT: a`` and
    plain text (empty title).
    """
    # Same split as re.match(r"TITLE:\s*(.*?)\.?\s+ABSTRACT:\s*(.*)\Z", contents, re.S), found with
    # str.find in linear time (that regex backtracks cubically over long runs of spaces).
    if contents.startswith("TITLE:"):
        k = len(contents) - len(contents[6:].lstrip())  # the title starts after leading spaces
        j = contents.find("ABSTRACT:", k + 1)
        while j != -1 and not contents[j - 1].isspace():
            j = contents.find("ABSTRACT:", j + 1)
        if j != -1:
            title = contents[k:j].rstrip()
            return Document(doc_id, (title[:-1] if title.endswith(".") else title).strip(), contents[j + 9 :].strip())
        if k > 6 and contents.startswith("ABSTRACT:", k):
            return Document(doc_id, "", contents[k + 9 :].strip())
    if "\n" in contents:
        title, text = contents.split("\n", 1)
        title = title.strip()
        if len(title) >= 2 and title[0] == title[-1] == '"':
            title = title[1:-1]
        return Document(doc_id, title, text.strip())
    return Document(doc_id, "", contents.strip())


class HTTPRetriever:
    """Client of a Search-R1 retriever server: ``POST {url}/retrieve`` with ``queries``, ``topk``,
    ``return_scores=true``. Every response is validated; failures raise :class:`RetrieverError`.

    What a server can make it do is bounded: at most ``max_response_bytes`` are read per request
    (``max_batch`` queries), within ``timeout`` seconds for the whole answer (a server trickling
    bytes is cut off), and parsing is linear in those bytes.
    """

    def __init__(self, url: str, *, timeout: float = 30.0, retries: int = 2,
                 max_response_bytes: int = 16 << 20, max_batch: int = 256) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"retriever url must start with http:// or https://, got {url!r}")
        if not (timeout > 0 and max_response_bytes >= 1 and max_batch >= 1 and retries >= 0):
            raise ValueError("timeout, max_response_bytes and max_batch must be positive, retries >= 0")
        url = url.rstrip("/")
        self.url = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout, self.retries = timeout, retries
        self.max_response_bytes, self.max_batch = max_response_bytes, max_batch

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        _check_k(k)
        queries = list(queries)
        if not all(isinstance(q, str) for q in queries):
            raise TypeError("queries must be strings")
        out: list[list[Hit]] = []
        for s in range(0, len(queries), self.max_batch):
            out += self._post(queries[s : s + self.max_batch], k)
        return out

    def _post(self, queries: list[str], k: int) -> list[list[Hit]]:
        body = json.dumps({"queries": queries, "topk": k, "return_scores": True}).encode()
        req = urllib.request.Request(self.url, data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        for attempt in range(self.retries + 1):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as r:
                    if (r.length or 0) > self.max_response_bytes:  # declared too big: do not read it
                        raise RetrieverError(f"retriever response of {r.length} bytes is over "
                                             f"{self.max_response_bytes}")
                    raw = _read_bounded(r, self.max_response_bytes + 1, time.monotonic() + self.timeout)
                break
            except urllib.error.HTTPError as e:  # the server answered: only "busy" is worth a retry
                detail = e.read(2000).decode("utf-8", "replace")
                if e.code == 503 and attempt < self.retries:
                    time.sleep(0.2 * 2**attempt)
                    continue
                raise RetrieverError(f"retriever {self.url} answered HTTP {e.code}: {detail}") from None
            except (urllib.error.URLError, OSError) as e:
                if attempt == self.retries:
                    raise RetrieverError(f"retriever {self.url} unreachable: {e}") from None
                time.sleep(0.2 * 2**attempt)
        if len(raw) > self.max_response_bytes:
            raise RetrieverError(f"retriever response over {self.max_response_bytes} bytes")
        return _parse_response(raw, len(queries), k, self.url)


def _read_bounded(r: Any, limit: int, deadline: float) -> bytes:
    """At most ``limit`` bytes of a response body, all before ``deadline`` (monotonic seconds)."""
    chunks, got = [], 0
    while got < limit:
        if time.monotonic() > deadline:
            raise TimeoutError("the response took longer than the timeout")
        chunk = r.read1(min(1 << 16, limit - got)) if hasattr(r, "read1") else r.read(min(1 << 16, limit - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _finite(x: int | float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float range
        return False


def _parse_response(raw: bytes, n: int, k: int, where: str) -> list[list[Hit]]:
    def bad(msg: str) -> RetrieverError:
        return RetrieverError(f"malformed response from {where}: {msg}")

    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad("nested too deeply") from None
    except ValueError:
        raise bad("not JSON") from None
    result = body.get("result") if isinstance(body, dict) else None
    if not isinstance(result, list) or len(result) != n:
        raise bad(f"expected {{'result': [...]}} with {n} entries")
    out = []
    for qi, items in enumerate(result):
        if not isinstance(items, list) or len(items) > k:
            raise bad(f"result[{qi}] must be a list of at most {k} items")
        hits = []
        for j, item in enumerate(items):
            where_j = f"result[{qi}][{j}]"
            if not isinstance(item, dict):
                raise bad(f"{where_j} is not an object")
            doc, score = (item.get("document"), item.get("score")) if "document" in item else (item, None)
            if not isinstance(doc, dict):
                raise bad(f"{where_j}.document is not an object")
            if score is None:
                score = 0.0
            if isinstance(score, bool) or not isinstance(score, (int, float)) or not _finite(score):
                raise bad(f"{where_j}.score must be a finite number")
            did = doc.get("id", "")
            if not isinstance(did, (str, int)) or isinstance(did, bool):
                raise bad(f"{where_j}.id must be a string or int")
            if isinstance(doc.get("title"), str) and isinstance(doc.get("text"), str):
                d = Document(str(did), doc["title"], doc["text"])
            elif isinstance(doc.get("contents"), str):
                d = document_from_contents(doc["contents"], str(did))
            else:
                raise bad(f"{where_j} has neither 'contents' nor 'title'/'text' strings")
            hits.append(Hit(d.id, d.title, d.text, float(score)))
        out.append(hits)
    return out
