"""Native tool calls: :class:`FunctionToolEnv` serves plain Python functions to a chat model
that calls them in its own format.

A subclass lists its tools as functions (:attr:`FunctionToolEnv.functions`); each one's JSON
schema comes from its signature and docstring (:func:`function_schema`: the first paragraph
is the description, ``name: text`` lines under ``Args:`` describe the parameters) and goes
to the chat template as the conversation's ``tools`` (the rollout worker renders the
prompt with them). A model turn is read with vLLM's tool-call parser :attr:`parser` (the
``vllm serve --tool-call-parser`` name: ``hermes`` for Qwen2.5/Hermes ``<tool_call>`` JSON,
``llama3_json`` for Llama 3.1; ``tasks/tool_calls.py``). Each call is answered by a
``tool`` message carrying the call's id and the function's result; a malformed call, an
unknown tool, bad arguments or a tool that raises are answered by an error message the
model sees (and counted as tool errors), never an exception. A turn without a call ends
the episode, scored by :meth:`FunctionToolEnv.score`.
"""

from __future__ import annotations

import inspect
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, get_type_hints

from pipeline_rl.tasks.base import Prompt
from pipeline_rl.tasks.env import EnvReply
from pipeline_rl.tasks.messages import Message, tool_result

_JSON_TYPES: dict[Any, str] = {int: "integer", float: "number", str: "string", bool: "boolean",
                               list: "array", dict: "object"}


def function_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI-style tool schema of ``fn`` (``{"type": "function", "function": {...}}``)."""
    doc = inspect.getdoc(fn) or ""
    description = doc.split("\n\n")[0].replace("\n", " ").strip()
    args = dict(re.findall(r"^\s+(\w+)\s*(?:\([^)]*\))?:\s*(.+)$", doc.split("Args:", 1)[1], re.M)) \
        if "Args:" in doc else {}
    hints = get_type_hints(fn)
    properties: dict[str, Any] = {}
    required = []
    for name, param in inspect.signature(fn).parameters.items():
        prop: dict[str, Any] = {"type": _JSON_TYPES.get(getattr(hints.get(name), "__origin__", hints.get(name)),
                                                        "string")}
        if name in args:
            prop["description"] = args[name].strip()
        properties[name] = prop
        if param.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "function", "function": {"name": fn.__name__, "description": description,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


class FunctionToolEnv(ABC):
    """Tool calls in the model's own format (module docstring). Subclasses set
    :attr:`functions` (and :attr:`parser`) and implement :meth:`score`. The rollout worker
    calls :meth:`attach` with its tokenizer before ``reset``."""

    functions: ClassVar[tuple[Callable[..., Any], ...]] = ()
    parser: ClassVar[str] = "hermes"

    def __init__(self) -> None:
        self.prompt: Prompt | None = None
        self._parser: Any = None

    @classmethod
    def tool_schemas(cls) -> list[dict[str, Any]]:
        """The tools' JSON schemas, as the chat template takes them."""
        return [function_schema(f) for f in cls.functions]

    def attach(self, tokenizer: Any) -> None:
        from pipeline_rl.tasks.tool_calls import ToolCallParser

        self._parser = ToolCallParser(self.parser, tokenizer, self.tool_schemas())

    def reset(self, prompt: Prompt) -> None:
        self.prompt = prompt

    def step(self, turn: str) -> EnvReply:
        assert self.prompt is not None and self._parser is not None, "step before attach and reset"
        parsed = self._parser.parse(turn)
        if parsed.malformed:
            return EnvReply(messages=(Message("tool", "error: the tool call could not be parsed (expected "
                                                      "the tool call format given with the tools)"),),
                            tool_calls=1, tool_errors=1)
        if not parsed.calls:
            return EnvReply(reward=self.score(self.prompt, turn), done=True)
        replies, errors = [], 0
        for call in parsed.calls:
            content, ok = self._run(call.name, call.arguments)
            errors += not ok
            replies.append(tool_result(call.call_id, call.name, content))
        return EnvReply(messages=tuple(replies), tool_calls=len(parsed.calls), tool_errors=errors)

    def _run(self, name: str, arguments: str) -> tuple[str, bool]:
        """``name(**arguments)`` as text, or an error text the model sees (and False)."""
        fn = next((f for f in self.functions if f.__name__ == name), None)
        if fn is None:
            return f"error: no tool named {name!r}", False
        try:
            args = json.loads(arguments) if arguments else {}
            if not isinstance(args, dict):
                return "error: the arguments must be a JSON object", False
            return str(fn(**args)), True
        except Exception as e:  # noqa: BLE001 -- the model sees what went wrong, the episode goes on
            return f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", False

    @abstractmethod
    def score(self, prompt: Prompt, turn: str) -> float:
        """The reward of an episode whose last turn (with no tool call) is ``turn``."""
