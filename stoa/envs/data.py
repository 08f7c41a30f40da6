"""Questions and corpora for the search tasks, read with ``datasets``, and a per-process cache.

A *source* is either a Hugging Face hub dataset name (``"jmhb/PaperSearchQA"``) or a local path:

- a file (``.parquet``, ``.jsonl``, ``.json``, optionally ``.gz``): used as is, for any split;
- a folder: for split ``s``, the first match of ``s-*.parquet``, ``s.parquet``, ``s.jsonl``,
  ``s.json``, ``s-*.jsonl`` in the folder or its ``data/`` subfolder (the hub's layout);
- a path containing ``{split}`` (e.g. ``"qa/{split}.jsonl"``), formatted with the split; glob
  patterns are allowed.

Local files are read with ``datasets.load_dataset("parquet"|"json", data_files=...)`` into a
throwaway Arrow cache (streamed instead above 512 MiB); this makes no network access and leaves
nothing behind. Hub corpora are streamed; hub questions are downloaded once into the HF cache. Question rows follow PaperSearchQA's schema
(``question``, ``answer``, ``golden_answers``, ...); corpus rows are either Search-R1 style
(``id``, ``contents``) or ``id``/``pmid``, ``title``, ``text``/``abstract``/``abstractText``.
"""

from __future__ import annotations

import glob
import tempfile
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from stoa.envs.retrieval import Document, document_from_contents

__all__ = [
    "Question", "load_questions", "iter_corpus", "question_from_row", "document_from_row",
    "resolve_files", "source_key", "cached", "clear_cache", "PAPERSEARCHQA", "PUBMED_CORPUS", "PUBMED_CORPUS_FILES",
]

PAPERSEARCHQA = "jmhb/PaperSearchQA"
"""Hub name of the benchmark's questions (54,907 train / 5,000 test)."""
PUBMED_CORPUS = "jmhb/pubmed_bioasq_2022"
"""Hub name of the BioASQ 2022 PubMed corpus (16M+ abstracts, tens of GB)."""
PUBMED_CORPUS_FILES = "data/corpus/pubmed.jsonl"
"""The retrieval-ready file of :data:`PUBMED_CORPUS` (Search-R1 ``id``/``contents`` rows)."""

_PATTERNS = ("{s}-*.parquet", "{s}.parquet", "{s}.jsonl", "{s}.json", "{s}-*.jsonl", "{s}.jsonl.gz")
_STREAM_BYTES = 512 << 20  # local sources above this are streamed instead of converted to Arrow
_ID_KEYS = ("id", "pmid", "PMID", "_id", "docid", "doc_id")
_TEXT_KEYS = ("text", "abstract", "abstractText")


@dataclass(frozen=True)
class Question:
    """One question of a search task."""

    id: str
    """Stable id: the row's ``id`` if it has one, else ``"<split>-<row index>"``."""
    question: str
    """The question text."""
    golden_answers: tuple[str, ...]
    """Accepted answers (the ``answer`` first, then synonyms); never empty."""
    subject: str = ""
    """Entity to search for, when the data knows it (the synthetic task); else empty."""


def _format_of(path: str) -> str:
    p = path.lower().removesuffix(".gz")
    if p.endswith(".parquet"):
        return "parquet"
    if p.endswith((".jsonl", ".json")):
        return "json"
    raise ValueError(f"{path}: unsupported file type (use .parquet, .jsonl or .json)")


def resolve_files(source: str, split: str | None) -> list[str] | None:
    """Local files for ``source`` and ``split``, or ``None`` if ``source`` names a hub dataset."""
    if "{split}" in source:
        if split is None:
            raise ValueError(f"{source!r} has a {{split}} placeholder but no split was given")
        source = source.format(split=split)
    if any(c in source for c in "*?["):
        found = sorted(glob.glob(source))
        if not found:
            raise FileNotFoundError(f"no file matches {source!r}")
        return found
    p = Path(source).expanduser()
    if p.is_file():
        return [str(p)]
    if p.is_dir():
        if split is None:
            found = sorted(str(f) for f in p.rglob("*") if f.is_file() and f.name.endswith(
                (".parquet", ".jsonl", ".json", ".jsonl.gz")))
            if found:
                return found
            raise FileNotFoundError(f"{p} holds no .parquet/.jsonl/.json files")
        for d in (p, p / "data"):
            for pat in _PATTERNS:
                found = sorted(glob.glob(str(d / pat.format(s=split))))
                if found:
                    return found
        raise FileNotFoundError(f"{p}: no file for split {split!r} (looked for {', '.join(_PATTERNS)} in it and data/)")
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise FileNotFoundError(f"{source!r} is neither an existing path nor a hub dataset name (owner/name)")
    return None


def _rows(source: str, split: str | None, hub_files: str | None = None) -> Iterator[Mapping[str, Any]]:
    import datasets

    files = resolve_files(source, split)
    if files is None:
        if split is None:  # a hub corpus: tens of GB, so stream it rather than convert it to Arrow
            yield from datasets.load_dataset(source, data_files=hub_files, split="train", streaming=True)
        else:  # hub questions: downloaded and cached once, reusable offline
            yield from datasets.load_dataset(source, split=split)
        return
    fmts = {_format_of(f) for f in files}
    if len(fmts) != 1:
        raise ValueError(f"{source}: mixed file types {sorted(fmts)}")
    fmt = fmts.pop()
    if sum(Path(f).stat().st_size for f in files) > _STREAM_BYTES:
        yield from datasets.load_dataset(fmt, data_files=files, split="train", streaming=True)
        return
    # Small local files: a throwaway Arrow cache. (Streaming would import torch, whenever it is
    # installed, to share an epoch counter with DataLoader workers: seconds and ~300 MB per process.)
    with tempfile.TemporaryDirectory(prefix="stoa-data-") as tmp:
        yield from datasets.load_dataset(fmt, data_files=files, split="train", cache_dir=tmp)


def _str_list(v: Any) -> list[str] | None:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    try:
        items = list(v)
    except TypeError:
        return None
    return items if all(isinstance(x, str) for x in items) else None


def question_from_row(row: Mapping[str, Any], index: int, split: str) -> Question:
    """Validate one PaperSearchQA-schema row (``question``, ``answer``/``golden_answers``)."""
    where = f"{split} row {index}"
    q = row.get("question")
    if not isinstance(q, str) or not q.strip():
        raise ValueError(f"{where}: 'question' must be a non-empty string")
    golds = _str_list(row.get("golden_answers"))
    if golds is None:
        raise ValueError(f"{where}: 'golden_answers' must be a list of strings")
    ans = row.get("answer")
    if ans is not None and not isinstance(ans, str):
        raise ValueError(f"{where}: 'answer' must be a string")
    if ans and ans not in golds:
        golds.insert(0, ans)
    golds = [g for g in dict.fromkeys(golds) if g.strip()]
    if not golds:
        raise ValueError(f"{where}: no answer (need 'answer' or 'golden_answers')")
    rid = row.get("id")
    qid = str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) and str(rid) else f"{split}-{index}"
    subject = row.get("subject") or ""
    if not isinstance(subject, str):
        raise ValueError(f"{where}: 'subject' must be a string")
    return Question(qid, q.strip(), tuple(golds), subject)


def load_questions(source: str, split: str, *, limit: int | None = None) -> tuple[Question, ...]:
    """All questions of ``split`` (the first ``limit`` if given) from a hub name or local path."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    out = []
    for i, row in enumerate(_rows(source, split)):
        if limit is not None and i >= limit:
            break
        out.append(question_from_row(row, i, split))
    if not out:
        raise ValueError(f"{source} ({split}) has no questions")
    return tuple(out)


def document_from_row(row: Mapping[str, Any], index: int) -> Document:
    """A corpus row as a :class:`Document` (Search-R1 ``contents`` or ``title`` + text)."""
    did = next((row[k] for k in _ID_KEYS if row.get(k) is not None), index)
    if isinstance(did, bool) or not isinstance(did, (str, int)):
        raise ValueError(f"corpus row {index}: id must be a string or int")
    title = row.get("title")
    text = next((row[k] for k in _TEXT_KEYS if isinstance(row.get(k), str)), None)
    if text is None and isinstance(row.get("contents"), str):
        if isinstance(title, str):
            text = row["contents"]
        else:
            d = document_from_contents(row["contents"], str(did))
            return d
    if text is None:
        raise ValueError(f"corpus row {index}: needs 'contents' or a text field ({', '.join(_TEXT_KEYS)})")
    if title is not None and not isinstance(title, str):
        raise ValueError(f"corpus row {index}: 'title' must be a string")
    return Document(str(did), (title or "").strip(), text.strip())


def iter_corpus(source: str, *, files: str | None = None, limit: int | None = None) -> Iterator[Document]:
    """Stream documents from a local path or a hub dataset (``files`` selects the hub file(s);
    :data:`PUBMED_CORPUS` defaults to :data:`PUBMED_CORPUS_FILES`)."""
    if files is None and source == PUBMED_CORPUS:
        files = PUBMED_CORPUS_FILES
    for i, row in enumerate(_rows(source, None, files)):
        if limit is not None and i >= limit:
            return
        yield document_from_row(row, i)


# ---------------------------------------------------------------------------------------------
# Per-process cache: a rollout engine builds ~128 environments that share one dataset/index.
# ---------------------------------------------------------------------------------------------

T = TypeVar("T")
_CACHE: dict[Hashable, Any] = {}
_LOCK = threading.RLock()


def source_key(source: str, split: str | None = None) -> Hashable:
    """A cache key for a source that changes when its local files change."""
    try:
        files = resolve_files(source, split)
    except FileNotFoundError:
        files = None
    if not files:
        return (source, split)
    stats = tuple((f, (st := Path(f).stat()).st_size, st.st_mtime_ns) for f in files)
    return (source, split, stats)


def cached(key: Hashable, factory: Callable[[], T]) -> T:
    """``factory()`` once per process for each ``key``."""
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = factory()
        return _CACHE[key]


def clear_cache() -> None:
    """Drop every cached dataset and retriever (tests; long-lived processes switching data)."""
    with _LOCK:
        _CACHE.clear()
