"""Episodes of a chat model: an environment's reply messages as the chat template's own
continuation of the conversation, appended as token ids.

For a tokenizer with a chat template, the tokens a reply adds are exactly those the template
writes after the model's turn: the end of the assistant message (when the model did not
write it itself), the reply messages (a tool's result with its call id, a user's answer),
and the generation prompt of the next assistant turn. :class:`ChatTurns` finds them by
rendering a fixed two-message conversation ``[user U, assistant A]`` with and without the
reply and keeping what the reply added after ``A`` (the template's rendering of a message
does not depend on the messages after it: checked once here, a one-line error when it
does not hold). Only that continuation is encoded; the model's tokens are never decoded
and encoded again, so the episode's ids equal the template's rendering of the whole
conversation (``tests/test_chat_turns.py``, a ChatML/Qwen2 and a Llama-3 template).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline_rl.tasks.base import TaskError
from pipeline_rl.tasks.chat import ChatTokenizer
from pipeline_rl.tasks.messages import Message

#: The fixed conversation a reply is rendered after (its texts appear nowhere else).
_USER, _MODEL = "\u2063u\u2063", "\u2063a\u2063"


class ChatTurns:
    """Token ids of a conversation's parts through ``tokenizer``'s chat template (``tools``:
    JSON schemas handed to the template, as ``vllm serve`` hands a request's tools).
    Invariant: ``prompt_ids(m) + turn_1 + reply_ids(r_1, turn_1[-1]) + ...`` is the
    template's rendering of the whole conversation whenever each model turn is the encoding
    of its text."""

    def __init__(self, tokenizer: ChatTokenizer, tools: Sequence[dict[str, Any]] | None = None) -> None:
        self._tok, self._tools = tokenizer, list(tools) if tools else None
        base = [{"role": "user", "content": _USER}]
        head = self._render(base, generation=True)
        self._after_model = head + _MODEL
        whole = self._render(base + [{"role": "assistant", "content": _MODEL}], generation=False)
        if not whole.startswith(self._after_model):
            raise TaskError("task.chat_template: the chat template renders an assistant turn other than "
                            "after its generation prompt; its episodes cannot be rendered turn by turn")

    def _render(self, messages: list[dict[str, Any]], *, generation: bool) -> str:
        try:
            text = self._tok.apply_chat_template(messages, tools=self._tools, tokenize=False,
                                                 add_generation_prompt=generation)
        except Exception as e:  # a Jinja error in the model's template: one line
            first = (str(e).strip().splitlines() or [""])[0]
            raise TaskError(f"task.chat_template: the chat template failed on an episode's messages "
                            f"({type(e).__name__}: {first})") from None
        if not isinstance(text, str):
            raise TaskError(f"task.chat_template: the chat template returned {type(text).__name__}, not text")
        return text

    def _encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))   # type: ignore[attr-defined]

    def prompt_text(self, messages: Sequence[Message]) -> str:
        """A conversation's start (system, user, ... messages) with the generation prompt."""
        return self._render([m.as_dict() for m in messages], generation=True)

    def conversation_text(self, messages: Sequence[dict[str, Any]]) -> str:
        """A conversation of message dicts (as a chat request holds them) with the generation prompt."""
        return self._render(list(messages), generation=True)

    def reply_ids(self, messages: Sequence[Message], last_model_id: int | None) -> list[int]:
        """The ids the template adds after a model turn ending with ``last_model_id`` when
        ``messages`` answer it, up to and with the next generation prompt. A model turn that
        ended with the template's own end-of-turn token (``<|im_end|>``, ``<|eot_id|>``) keeps
        it: the continuation then starts after it."""
        return self.continuation_ids([m.as_dict() for m in messages], last_model_id)

    def continuation_ids(self, messages: Sequence[dict[str, Any]], last_model_id: int | None) -> list[int]:
        """:meth:`reply_ids` for message dicts (as a chat request holds them)."""
        base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _MODEL}]
        full = self._render(base + list(messages), generation=True)
        if not full.startswith(self._after_model):
            raise TaskError("task.chat_template: the chat template renders earlier messages differently "
                            "once a reply follows them; its episodes cannot be rendered turn by turn")
        ids = self._encode(full[len(self._after_model):])
        if ids and last_model_id is not None and ids[0] == last_model_id:
            ids = ids[1:]
        return ids
