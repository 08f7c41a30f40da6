"""How an episode's prompt becomes tokens: the one rule every engine, the warm start and replay call.

An environment's ``reset`` returns its prompt as text. A run chooses how that text reaches the
model with ``model.prompt_format``:

* ``"chat"``: the tokenizer's chat template applied to ``[{"role": "user", "content": prompt}]``
  with the generation prompt (the assistant header) appended. The model's turns, and the
  observations between them, then all lie inside that one assistant message. For instruct models.
* ``"plain"``: the prompt text itself, continued by the model, as Search-R1 prompts base models
  (its instruction ends with ``Question: ...\\n`` and the model writes on). Tokenized with the
  tokenizer's own special tokens (a BOS where the tokenizer adds one) and with no special token
  parsed out of the text. For base models, which have no chat template.
* ``"auto"``: ``"chat"`` when the tokenizer has a chat template, else ``"plain"``.

Only the prompt differs: turns end where they end today (stop strings, EOS, caps), observations
are encoded on their own in both formats (``stoa.backends.engine``, "Episode layout").

This module imports no framework; it takes a Hugging Face tokenizer (``apply_chat_template``,
``encode``, ``chat_template``), so any engine (MLX, torch) builds prompts by calling
:func:`prompt_tokens` and a replay of its episodes rebuilds the same ids.
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["FORMATS", "PromptFormat", "PromptFormatError", "describe", "has_chat_template", "prompt_tokens",
           "resolve"]

PromptFormat = Literal["auto", "chat", "plain"]
FORMATS: tuple[str, ...] = ("auto", "chat", "plain")


class PromptFormatError(ValueError):
    """A prompt format the model's tokenizer cannot use (``"chat"`` without a chat template), or an unknown one."""


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` (a Hugging Face tokenizer) carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def resolve(fmt: str, tokenizer: Any, where: str = "the model") -> Literal["chat", "plain"]:
    """The concrete format of ``fmt`` for ``tokenizer``: ``"auto"`` picks ``"chat"`` when the
    tokenizer has a chat template, else ``"plain"``.

    Raises:
        PromptFormatError: ``fmt`` is not one of :data:`FORMATS`, or is ``"chat"`` and the
            tokenizer has no chat template (``where`` names the model in the message).
    """
    if fmt not in FORMATS:
        raise PromptFormatError(f"prompt format {fmt!r} is not one of {list(FORMATS)}")
    has = has_chat_template(tokenizer)
    if fmt == "chat" and not has:
        raise PromptFormatError(f"{where} has no chat template, so model.prompt_format = \"chat\" cannot build its "
                                "prompts; use \"plain\" (the prompt text continued, for base models) or \"auto\"")
    if fmt == "auto":
        return "chat" if has else "plain"
    return fmt  # type: ignore[return-value]


def describe(fmt: str, tokenizer: Any) -> str:
    """One line saying which format ``fmt`` resolves to for ``tokenizer`` and why (for ``--check``)."""
    concrete = resolve(fmt, tokenizer)
    why = "the tokenizer has a chat template" if has_chat_template(tokenizer) else "the tokenizer has no chat template"
    shown = f"{fmt} -> {concrete}" if fmt == "auto" else concrete
    return f"prompt format: {shown} ({why})"


def prompt_tokens(tokenizer: Any, prompt: str, fmt: str) -> list[int]:
    """The token ids an episode starts with, for the environment's ``prompt`` text in format ``fmt``
    (see the module docstring). ``tokenizer``: a Hugging Face tokenizer.

    Raises:
        PromptFormatError: as :func:`resolve`.
    """
    tok = tokenizer
    if resolve(fmt, tok) == "chat":
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding from an older transformers
            ids = ids["input_ids"]
    else:
        ids = tok.encode(prompt, add_special_tokens=True, split_special_tokens=True)
    return [int(t) for t in ids]
