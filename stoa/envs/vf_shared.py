"""What the two verifiers adapters share (:mod:`stoa.envs.vf`, verifiers 0.3's classic
environments; :mod:`stoa.envs.vf_v1`, 0.4's tasksets): the id prefix, the reward error, an event
loop for verifiers' coroutines, and how a prompt's messages become Stoa's prompt text."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

__all__ = ["DISTRIBUTION", "PREFIX", "Loop", "RewardError", "admit", "message_text", "neutralize", "render_prompt"]

PREFIX = "verifiers:"
DISTRIBUTION = "verifiers"


class RewardError(RuntimeError):
    """A verifiers reward function raised or returned a value that is not a finite number."""


class Loop:
    """An event loop of one env's own, for verifiers' coroutines (or, when the caller's thread
    already runs a loop, a short-lived thread's)."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self, coro: Any) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            if self._loop is None or self._loop.is_closed():
                self._loop = asyncio.new_event_loop()
            return self._loop.run_until_complete(coro)
        out: list[Any] = []
        t = threading.Thread(target=lambda: out.append(_outcome(asyncio.run, coro)))
        t.start()
        t.join()
        ok, value = out[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.close()


def message_text(message: Any) -> str:
    content = message.get("content", "") if isinstance(message, dict) else getattr(message, "content", "")
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text", "") if isinstance(p, dict) else str(getattr(p, "text", "")) for p in content)
    return "" if content is None else str(content)


def _role(message: Any) -> str:
    return str(message.get("role", "") if isinstance(message, dict) else getattr(message, "role", ""))


def neutralize(text: str) -> str:
    """Neutralize chat-control strings in text Stoa did not write."""
    return text.replace("<|", "&lt;|")


def render_prompt(messages: Any) -> str:
    """The prompt text of an item's messages (see the module docstring)."""
    if isinstance(messages, str):
        return neutralize(messages)
    parts = []
    for k, m in enumerate(messages):
        role, text = _role(m), message_text(m)
        last = k == len(messages) - 1
        parts.append(text if role == "system" or last else f"{role.capitalize()}: {text}")
    return neutralize("\n\n".join(parts))


def _outcome(fn: Any, *args: Any) -> tuple[bool, Any]:
    try:
        return True, fn(*args)
    except BaseException as e:  # noqa: BLE001 - handed back to the caller's thread
        return False, e


def admit(where: str, unsupported: list[str], unreplayable: list[str], accept_unreplayable: bool) -> tuple[str, ...]:
    """Refuse (``ValueError``, every reason named) an environment with ``unsupported`` parts, or
    with ``unreplayable`` ones unless they are accepted; returns the unreplayable reasons kept."""
    if unsupported:
        raise ValueError(f"{where} is refused: " + "; ".join(unsupported))
    if unreplayable and not accept_unreplayable:
        raise ValueError(f"{where} is refused: " + "; ".join(unreplayable) + ". Set env.kwargs.accept_unreplayable"
                         " = true to train on it anyway (its episodes are then not replayed: docs/environments.md)")
    return tuple(unreplayable)
