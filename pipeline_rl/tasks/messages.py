"""Chat messages, as environments answer with them and tasks may start from them.

A :class:`Message` is what a chat template renders: ``role`` (``system``, ``user``,
``assistant``, ``tool``), ``content``, and for a tool's result the id of the call it
answers (``tool_call_id``) and the tool's ``name``. ``as_dict`` is the form
``tokenizer.apply_chat_template`` and vLLM's chat API take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message (see the module docstring)."""

    role: str
    content: str
    tool_call_id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def tool_result(call_id: str, name: str, content: str) -> Message:
    """A tool's result answering the call ``call_id`` to ``name``."""
    return Message("tool", content, tool_call_id=call_id, name=name)
