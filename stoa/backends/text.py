"""An engine's text side over a Hugging Face tokenizer, framework-free: the
:class:`~stoa.backends.engine.TextCodec` every backend gives (same prompts, same observation
tokens, same turn text, same EOS set), so a replay on one stack rebuilds episodes of another."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
        tokenizer: the model's Hugging Face tokenizer (``encode``, ``decode``, ``batch_decode``).
        chat: what applies the chat template (the tokenizer itself, or a wrapper of it with the
            same ``apply_chat_template``); its ``has_chat_template`` (or the tokenizer's
            ``chat_template``) says whether there is one.
        eos_ids: tokens that end an episode (the config's; the tokenizer's own EOS is added).
        vocab_size: rows of the model's embedding (a stop-token candidate set never exceeds it).
        where: the model folder, for messages.
    """

    def __init__(self, tokenizer: Any, chat: Any, eos_ids: Sequence[int], vocab_size: int, where: str) -> None:
        self._hf, self._chat, self._vocab, self._where = tokenizer, chat, int(vocab_size), where
        own = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = frozenset(int(t) for t in eos_ids) | (frozenset([int(own)]) if own is not None else frozenset())
        self._stop_cache: dict[tuple[str, ...], frozenset[int]] = {}
        self._pieces: list[str] | None = None

    @property
    def codec(self) -> TextCodec:
        return TextCodec(self.prompt_tokens, self.encode, self.decode, self.eos_ids, self.stop_candidates)

    def encode(self, text: str) -> list[int]:
        """Observation tokens: no BOS/EOS added, special-token strings not parsed as control tokens."""
        return list(self._hf.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, tokens: Sequence[int]) -> str:
        return self._hf.decode(list(tokens), skip_special_tokens=False)

    def prompt_tokens(self, prompt: str) -> list[int]:
        has = getattr(self._chat, "has_chat_template", None)
        if not (has if has is not None else getattr(self._hf, "chat_template", None) is not None):
            raise EngineError(f"{self._where} has no chat template; the engine needs one to build prompts")
        # transformers 5 returns a dict unless told not to; a wrapper (mlx_lm's) says so itself
        extra = {"return_dict": False} if self._chat is self._hf else {}
        ids = self._chat.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=True, **extra)
        return [int(t) for t in ids]

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
