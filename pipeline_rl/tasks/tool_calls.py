"""vLLM's tool-call parsers (the ones ``vllm serve --tool-call-parser NAME`` uses), read for
the tool calls of an episode's model turns (:class:`~pipeline_rl.tasks.tool_env.FunctionToolEnv`)
and of the agent endpoint's chat answers. This module is the one place that touches
vLLM's tool parsers (``vllm.tool_parsers``, and the chat request type their
``extract_tool_calls`` takes): no public API parses a finished text outside the server.
vLLM is imported only when a parser is made, so the tasks stay importable without it.

A parser that finds no call where the text holds its call marker (Hermes' ``<tool_call>``,
Llama's ``<|python_tag|>``) reports the turn as *malformed* (vLLM logs such a failure with
a traceback; here it is the environment's to answer, so that logger is quietened to
CRITICAL in the rollout worker, and the failure is counted as a tool error).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline_rl.tasks.base import TaskError


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One tool call: its id, the tool's name, its arguments as JSON text (as the model wrote them)."""

    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedTurn:
    """A model turn read for tool calls: the ``calls`` found, the text before them
    (``content``), and ``malformed`` when the turn holds a call marker but no call parses."""

    calls: tuple[ParsedCall, ...]
    content: str | None
    malformed: bool


class ToolCallParser:
    """vLLM's tool-call parser ``name`` for ``tokenizer`` and ``tools`` (JSON schemas, as a chat
    request's ``tools``). Not thread-safe: one per environment."""

    def __init__(self, name: str, tokenizer: Any, tools: Sequence[dict[str, Any]]) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        try:
            cls = ToolParserManager.get_tool_parser(name)
        except KeyError:
            raise TaskError(f"tool parser {name!r} is not one of vLLM's "
                            f"({', '.join(sorted(ToolParserManager.list_registered()))})") from None
        logging.getLogger(cls.__module__).setLevel(logging.CRITICAL)
        self._request = ChatCompletionRequest(model="episode", messages=[{"role": "user", "content": ""}],
                                              tools=list(tools) or None)
        self._parser = cls(tokenizer, list(self._request.tools or []) or None)
        marker = getattr(self._parser, "tool_call_start_token", None) or getattr(self._parser, "bot_token", None)
        self._marker = marker if isinstance(marker, str) and marker else None

    def parse(self, text: str) -> ParsedTurn:
        info = self._parser.extract_tool_calls(text, self._request)
        calls = tuple(ParsedCall(c.id, c.function.name, c.function.arguments) for c in info.tool_calls)
        malformed = not calls and self._marker is not None and self._marker in text
        return ParsedTurn(calls, info.content, malformed)
