"""Tools around a run: ``init-tiny`` (a random model), ``retriever build|serve`` and ``envs list``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

__all__ = ["envs_app", "init_tiny", "retriever_app"]


def init_tiny(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the Hugging Face model into.")],
    text: Annotated[
        Optional[Path], typer.Option(help="Text file (one document per line) to train the tokenizer on.")
    ] = None,
    vocab_size: Annotated[int, typer.Option(help="Target BPE vocabulary size.")] = 2048,
    hidden_size: Annotated[int, typer.Option(help="Model width (multiple of 64).")] = 128,
    num_layers: Annotated[int, typer.Option(help="Transformer blocks.")] = 4,
    num_heads: Annotated[int, typer.Option(help="Attention heads.")] = 4,
    num_kv_heads: Annotated[int, typer.Option(help="Key/value heads.")] = 2,
    intermediate_size: Annotated[int, typer.Option(help="MLP width (multiple of 64).")] = 512,
    seed: Annotated[int, typer.Option(help="Weight-initialisation seed.")] = 0,
    preset: Annotated[
        Optional[str],
        typer.Option(help="Real shape instead of the tiny one: qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-3b, qwen2.5-7b, "
                          "qwen3-0.6b, qwen3-8b, llama-3.2-1b, smollm2-135m, mistral-7b-v0.1, gemma-2-2b, "
                          "gemma-3-1b, or a config.json path. --vocab-size then sets the tokenizer's size; the "
                          "embedding keeps the shape's vocabulary."),
    ] = None,
    dtype: Annotated[str, typer.Option(help="Weights on disk with --preset: float32 or bfloat16.")] = "float32",
) -> None:
    """Build a random model with a trained byte-level BPE tokenizer (HF format, offline): a small
    Qwen2 by default, or a public checkpoint's exact shape with --preset."""
    import json
    import time

    if text is not None:
        texts = [line for line in text.read_text().splitlines() if line.strip()]
    else:
        from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts

        texts = list(tokenizer_texts(generate(SyntheticConfig(seed=seed))))
    t0 = time.perf_counter()
    if preset is not None:
        from stoa.models.presets import build_preset, num_params

        try:
            path = build_preset(out_dir, preset, texts, tokenizer_vocab=vocab_size, dtype=dtype, seed=seed)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
    else:
        from stoa.models.tiny import TinyConfig, build_tiny

        cfg = TinyConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, seed=seed)
        path = build_tiny(out_dir, texts, cfg)
    c = json.loads((path / "config.json").read_text())
    extra = ""
    if preset is not None:
        extra = f", {num_params(c) / 1e9:.3f}B params, {time.perf_counter() - t0:.0f} s"
    typer.echo(f"wrote {path} (vocab {c['vocab_size']}, hidden {c['hidden_size']}, layers {c['num_hidden_layers']}{extra})")


retriever_app = typer.Typer(help="Build and serve BM25 retrieval indexes (Search-R1 API).", no_args_is_help=True)


@retriever_app.command("build")
def retriever_build(
    corpus: Annotated[str, typer.Option(help="Corpus: hub dataset name or local .parquet/.jsonl file or folder.")],
    out: Annotated[Path, typer.Option(help="New (empty) folder to write the index into.")],
    limit: Annotated[Optional[int], typer.Option(help="Index only the first N documents.")] = None,
    files: Annotated[Optional[str], typer.Option(help="Hub file(s) within the dataset, e.g. data/corpus/pubmed.jsonl.")] = None,
) -> None:
    """Index a corpus with bm25s and save it (loaded memory-mapped by --index users)."""
    import time

    from stoa.envs.data import iter_corpus
    from stoa.envs.retrieval import BM25SRetriever

    t0 = time.perf_counter()
    r = BM25SRetriever.build(iter_corpus(corpus, files=files, limit=limit), out=out)
    typer.echo(f"indexed {len(r)} documents into {out} in {time.perf_counter() - t0:.1f} s")


@retriever_app.command("serve")
def retriever_serve(
    index: Annotated[Optional[Path], typer.Option(help="Index folder written by `stoa retriever build`.")] = None,
    corpus: Annotated[Optional[str], typer.Option(help="Or: a corpus to index in memory first.")] = None,
    synthetic_seed: Annotated[Optional[int], typer.Option(help="Or: serve the synthetic corpus of this seed.")] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0 picks a free one).")] = 8000,
    topk: Annotated[int, typer.Option(help="Default topk when a request omits it.")] = 3,
) -> None:
    """Serve POST /retrieve (Search-R1 API) until interrupted."""
    from stoa.envs.server import ServerLimits, serve

    if sum(x is not None for x in (index, corpus, synthetic_seed)) != 1:
        raise typer.BadParameter("give exactly one of --index, --corpus, --synthetic-seed")
    if index is not None:
        from stoa.envs.retrieval import load_retriever

        retriever = load_retriever(index)
    elif corpus is not None:
        from stoa.envs.data import iter_corpus
        from stoa.envs.retrieval import BM25SRetriever

        retriever = BM25SRetriever.build(iter_corpus(corpus))
    else:
        from stoa.envs.retrieval import BM25SRetriever
        from stoa.envs.synthetic import SyntheticConfig, generate

        retriever = BM25SRetriever.build(generate(SyntheticConfig(seed=synthetic_seed)).docs)
    serve(retriever, host, port, ServerLimits(default_topk=topk))


envs_app = typer.Typer(help="Text environments a run can name in env.id.", no_args_is_help=True)


@envs_app.command("list")
def envs_list(
    dataset: Annotated[
        Optional[list[str]], typer.Option(help="Check only these reasoning-gym datasets (repeatable).")
    ] = None,
) -> None:
    """Registered ids, then every reasoning-gym dataset checked through the adapter (check_env and
    its gold answers), passing or refused with the reason."""
    import gymnasium

    import stoa.envs  # noqa: F401 - registers the built-in and installed ids

    ids = sorted(k for k, spec in gymnasium.registry.items()
                 if "/" in k and not str(spec.entry_point).startswith("gymnasium."))
    typer.echo(f"registered ({len(ids)}): " + ", ".join(ids))
    try:
        from stoa.envs import rgym

        names = dataset or rgym.dataset_names()
    except ImportError:
        typer.echo("reasoning_gym:<dataset>: not installed (pip install 'stoa[reasoning-gym]')")
        return
    passing, refused = rgym.survey(names, progress=lambda n: typer.echo(f"checking {rgym.PREFIX}{n}", err=True))
    typer.echo(f"{rgym.PREFIX}<dataset> passing check_env ({len(passing)} of {len(names)}): " + ", ".join(passing))
    typer.echo(f"refused ({len(refused)}):")
    for name, why in refused.items():
        typer.echo(f"  {rgym.PREFIX}{name}: {why}")
