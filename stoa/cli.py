"""The ``stoa`` command line. Heavy imports happen inside each command, never at start-up."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

import stoa
from stoa import _blas

app = typer.Typer(
    name="stoa",
    help="Decentralized RL post-training: int8 MLX rollout workers and a GPU trainer meeting in an object store.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"stoa {stoa.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Stoa command line."""


@app.command("init-tiny")
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
) -> None:
    """Build a small random Qwen2 model with a trained byte-level BPE tokenizer (HF format, offline)."""
    from stoa.models.tiny import TinyConfig, build_tiny

    if text is not None:
        texts = [line for line in text.read_text().splitlines() if line.strip()]
    else:
        from stoa.envs.synthetic import SyntheticConfig, generate, tokenizer_texts

        texts = list(tokenizer_texts(generate(SyntheticConfig(seed=seed))))
    cfg = TinyConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, seed=seed)
    path = build_tiny(out_dir, texts, cfg)
    cfg_json = (path / "config.json").read_text()
    import json

    c = json.loads(cfg_json)
    typer.echo(f"wrote {path} (vocab {c['vocab_size']}, hidden {c['hidden_size']}, layers {c['num_hidden_layers']})")


def main() -> None:
    """Console entry point. Re-executes once with OpenBLAS preloaded where MLX would otherwise use its slow BLAS."""
    if _blas.needs_reexec():
        env = _blas.preload_env()
        os.execve(sys.executable, [sys.executable, "-m", "stoa", *sys.argv[1:]], env)
    app(prog_name="stoa")


if __name__ == "__main__":
    main()
