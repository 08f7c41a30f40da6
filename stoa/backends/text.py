"""An engine's text side over a Hugging Face tokenizer, framework-free: the
:class:`~stoa.backends.engine.TextCodec` every backend gives (same prompts, same observation
tokens, same turn text, same EOS set), so a replay on one stack rebuilds episodes of another."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stoa.backends import prompting
from stoa.backends.engine import EngineError, TextCodec

__all__ = ["TokenizerText", "config_eos_ids"]


def config_eos_ids(hf_dir: str | Path) -> list[int]:
    """``eos_token_id`` of the folder's ``config.json`` (an int or a list), as a list."""
    try:
        eos = json.loads((Path(hf_dir) / "config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return []
    return [int(eos)] if isinstance(eos, int) else [int(t) for t in eos or []]


class TokenizerText:
    """Args:
        tokenizer: the model's Hugging Face tokenizer (``encode``, ``decode``, ``batch_decode``,
            ``apply_chat_template``).
        eos_ids: tokens that end an episode (the config's; the tokenizer's own EOS is added).
        vocab_size: rows of the model's embedding (a stop-token candidate set never exceeds it).
        where: the model folder, for messages.
        prompt_format: ``model.prompt_format`` (:mod:`stoa.backends.prompting`), resolved here once.

    Raises:
        EngineError: a prompt format the tokenizer cannot use (``chat`` without a template).
    """

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int], vocab_size: int, where: str,
                 prompt_format: str = "auto") -> None:
        self._hf, self._vocab, self._where = tokenizer, int(vocab_size), where
        try:
            self.prompt_format = prompting.resolve(prompt_format, tokenizer, where)
        except prompting.PromptFormatError as e:
            raise EngineError(str(e)) from None
        own = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = frozenset(int(t) for t in eos_ids) | (frozenset([int(own)]) if own is not None else frozenset())
        self._stop_cache: dict[tuple[str, ...], frozenset[int]] = {}
        self._pieces: list[str] | None = None

    @property
    def codec(self) -> TextCodec:
        return TextCodec(self.prompt_tokens, self.encode, self.decode, self.eos_ids, self.stop_candidates,
                         self.prompt_format)

    def encode(self, text: str) -> list[int]:
        """Observation tokens: no BOS/EOS added, special-token strings not parsed as control tokens."""
        return list(self._hf.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, tokens: Sequence[int]) -> str:
        return self._hf.decode(list(tokens), skip_special_tokens=False)

    def prompt_tokens(self, prompt: str) -> list[int]:
        return prompting.prompt_tokens(self._hf, prompt, self.prompt_format)

    def stop_candidates(self, stops: tuple[str, ...]) -> frozenset[int]:
        """Tokens whose text holds the last character of a stop string: only after one of them can
        a stop string complete, so only then is the turn decoded and searched."""
        if stops not in self._stop_cache:
            if any(not s[-1].isascii() for s in stops):  # a multi-byte char may span tokens
                ids = frozenset(range(self._vocab))
            else:
                if self._pieces is None:
                    self._pieces = self._hf.batch_decode([[i] for i in range(len(self._hf))],
                                                         skip_special_tokens=False)
                last = {s[-1] for s in stops}
                ids = frozenset(i for i, p in enumerate(self._pieces) if any(c in p for c in last))
            self._stop_cache[stops] = ids
        return self._stop_cache[stops]
