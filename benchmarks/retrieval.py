"""BM25 retrieval: index build time, memory and per-query latency, bm25s vs rank-bm25.

The corpus is synthetic abstract-like text (seeded): a 50k-word Zipfian vocabulary, ~150 words per
document. Queries are 4 words drawn from random documents (so every query matches something).
Each (backend, size) runs in a fresh process with one thread, so resident-memory deltas are
clean: ``build MiB`` is the RSS growth while building (the documents themselves excluded),
``peak MiB`` the building process's high-water mark (generated corpus included), ``serve MiB`` the RSS growth of a process that loads the index and answers the queries.

bm25s builds with ``out=`` (documents stream to the index folder) and is reloaded memory-mapped in a fresh process (the deployment mode); its
latency and serve memory are measured there. rank-bm25 lives in memory only.

    python benchmarks/retrieval.py --quick          # 20k documents, < 1 min
    python benchmarks/retrieval.py                  # 100k documents
    python benchmarks/retrieval.py --with-1m        # + 1M documents (bm25s; minutes, several GB)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def corpus(n: int, words: int, seed: int):
    from stoa.envs.retrieval import Document

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, size=int(k))) for k in rng.integers(3, 11, size=50_000)]
    p = 1.0 / np.arange(1, len(vocab) + 1) ** 1.07
    p /= p.sum()
    lens = np.clip(rng.normal(words, words / 4, size=n).astype(int), 20, 4 * words)
    ids = rng.choice(len(vocab), size=int(lens.sum()), p=p)
    docs, s = [], 0
    for i, ln in enumerate(lens):
        toks = ids[s : s + ln].tolist()
        s += ln
        docs.append(Document(str(i), " ".join(vocab[t] for t in toks[:6]), " ".join(vocab[t] for t in toks[6:])))
    return docs


def queries(docs, q: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed + 1)
    out = []
    for i in rng.integers(len(docs), size=q):
        words = docs[int(i)].text.split()
        out.append(" ".join(rng.choice(words, size=min(4, len(words)), replace=False)))
    return out


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def latency(r, qs: list[str], k: int) -> tuple[float, float]:
    r.search(qs[:2], k)  # warm caches and lazy imports
    times = []
    for q in qs:
        t = time.perf_counter()
        r.search([q], k)
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3), float(np.mean(times) * 1e3)


def child(mode: str, n: int, words: int, nq: int, k: int, seed: int, folder: str) -> dict:
    from stoa.envs.retrieval import BM25SRetriever, RankBM25Retriever, load_retriever

    if mode == "bm25s_serve":  # a fresh process that only loads the saved index and answers queries
        qs = json.loads((Path(folder) / "queries.json").read_text())
        gc.collect()
        base = rss_mib()
        t = time.perf_counter()
        r = load_retriever(Path(folder) / "idx")
        load_ms = (time.perf_counter() - t) * 1e3
        p50, mean = latency(r, qs, k)
        return {"load_ms": load_ms, "p50_ms": p50, "mean_ms": mean, "serve_mib": rss_mib() - base,
                "serve_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    docs = corpus(n, words, seed)
    qs = queries(docs, nq, seed)
    gc.collect()
    base = rss_mib()
    t = time.perf_counter()
    if mode == "bm25s_build":  # the way large corpora are indexed: documents stream to disk
        r = BM25SRetriever.build(docs, out=Path(folder) / "idx")
    else:
        r = RankBM25Retriever.build(docs)
    build_s = time.perf_counter() - t
    gc.collect()
    out = {"backend": "bm25s" if mode == "bm25s_build" else "rank_bm25", "docs": n, "queries": nq,
           "build_s": build_s, "build_mib": rss_mib() - base}
    if mode == "bm25s_build":
        (Path(folder) / "queries.json").write_text(json.dumps(qs))
        out["disk_mib"] = sum(f.stat().st_size for f in (Path(folder) / "idx").iterdir()) / 2**20
    else:
        out["p50_ms"], out["mean_ms"] = latency(r, qs, k)
        out["serve_mib"] = out["build_mib"]
    out["build_peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def run_child(mode: str, n: int, args: argparse.Namespace, nq: int, folder: str = "-") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--child", mode, str(n), str(args.words), str(nq), str(args.k), str(args.seed), folder]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{mode} at {n} docs failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20k documents only (< 1 min)")
    ap.add_argument("--with-1m", action="store_true", help="also 1M documents (bm25s only; minutes, several GB)")
    ap.add_argument("--ref-1m", action="store_true", help="with --with-1m, run rank-bm25 at 1M too (very slow, ~10+ GB)")
    ap.add_argument("--words", type=int, default=150, help="mean words per document")
    ap.add_argument("--queries", type=int, default=200, help="queries timed for bm25s")
    ap.add_argument("--ref-queries", type=int, default=20, help="queries timed for rank-bm25")
    ap.add_argument("--k", type=int, default=3, help="top-k")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        m, n, w, q, k, s, folder = args.child
        print(json.dumps(child(m, int(n), int(w), int(q), int(k), int(s), folder)))
        return

    sizes = [20_000] if args.quick else [100_000] + ([1_000_000] if args.with_1m else [])
    nq, nref = (100, 10) if args.quick else (args.queries, args.ref_queries)
    rows = []
    for n in sizes:
        ref = run_child("rank_bm25", n, args, nref) if n < 1_000_000 or args.ref_1m else None
        with tempfile.TemporaryDirectory() as tmp:
            fast = run_child("bm25s_build", n, args, nq, tmp)
            fast.update(run_child("bm25s_serve", n, args, nq, tmp))
        if ref:
            fast["speedup_query"] = ref["mean_ms"] / fast["mean_ms"]
            fast["speedup_build"] = ref["build_s"] / fast["build_s"]
            fast["memory_ratio"] = ref["serve_mib"] / max(fast["serve_mib"], 1e-9)
            rows.append(ref)
        rows.append(fast)

    hdr = (f"{'backend':<10}{'docs':>10}{'build s':>9}{'build MiB':>11}{'peak MiB':>10}{'serve MiB':>11}{'disk MiB':>10}"
           f"{'load ms':>9}{'ms/query p50':>14}{'mean':>8}{'query x':>9}{'build x':>9}{'mem x':>7}")
    print(f"BM25 top-{args.k}, ~{args.words} words/doc, 1 thread; 'x' = rank-bm25 / bm25s in the same run")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        def f(key, fmt):
            return format(r[key], fmt) if key in r else "-"
        print(f"{r['backend']:<10}{r['docs']:>10,}{f('build_s', '.1f'):>9}{f('build_mib', '.0f'):>11}"
              f"{f('build_peak_mib', '.0f'):>10}{f('serve_mib', '.0f'):>11}{f('disk_mib', '.0f'):>10}{f('load_ms', '.0f'):>9}"
              f"{f('p50_ms', '.2f'):>14}{f('mean_ms', '.2f'):>8}{f('speedup_query', '.0f'):>9}"
              f"{f('speedup_build', '.1f'):>9}{f('memory_ratio', '.1f'):>7}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"benchmark": "retrieval", "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
