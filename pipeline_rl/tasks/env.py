"""Environments for multi-turn episodes: the model takes a turn, the environment answers,
the model goes on, until the environment says the episode is done.

An environment is named like a plug-in reward, ``--task.env MODULE:CLASS`` (a class: one
instance per episode; an instance: shared by every episode, so it must be safe to call
from several at once), and implements :class:`Environment`; either method may be
``async def`` (it then runs on the rollout worker's event loop, beside the engine),
otherwise it runs on the worker's thread pool: a slow environment delays its own episode,
never generation.

Token in, token out: the worker keeps each episode's exact token ids -- the model's
sampled tokens as the engine returned them, and the reply's tokens (``EnvReply.token_ids``,
or ``EnvReply.text`` encoded once, without special tokens) appended after them. Nothing is
ever decoded and re-encoded. ``turn`` (the text the environment reads) is the model's turn
decoded with special tokens kept.

:class:`ToolEnv` is the tool-calling convenience: the model writes a call in a form the
task defines (a regular expression), the environment runs the named tool and answers with
its result; a turn without a call ends the episode and is scored. For a chat model calling
tools in its own format, see :class:`pipeline_rl.tasks.tool_env.FunctionToolEnv` (plain
Python functions, vLLM's tool-call parsers, replies as messages).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from pipeline_rl.tasks.base import Prompt, TaskError, task_method
from pipeline_rl.tasks.messages import Message


@dataclass(frozen=True, slots=True)
class EnvReply:
    """An environment's answer to one model turn. ``text`` (or ``token_ids``, which win
    when given) is appended to the episode as environment tokens; ``done`` ends the
    episode; ``reward`` is the episode's reward (in [0, 1]), read when ``done`` (None:
    the task's reward scores the episode's model text). ``tool_calls`` / ``tool_errors``:
    the tool calls this answer ran, and how many of them failed (the turn metrics count them).
    ``messages`` (``pipeline_rl.tasks.messages.Message``, e.g. tool results with their call
    ids): for a chat model, appended as the chat template's own continuation of the
    conversation (``rollout/chat_turns.py``); without a template, their contents as text.
    Precedence: ``token_ids``, then ``messages``, then ``text``."""

    text: str = ""
    token_ids: tuple[int, ...] | None = None
    messages: tuple[Message, ...] | None = None
    reward: float | None = None
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (see the module docstring)."""

    def reset(self, prompt: Prompt) -> None | Awaitable[None]:
        """A new episode starts from ``prompt``."""

    def step(self, turn: str) -> EnvReply | Awaitable[EnvReply]:
        """The model's turn (decoded, special tokens kept); what the environment answers."""


#: Makes the environment of a new episode (a class, or returns a shared instance).
EnvFactory = Callable[[], Environment]


class ToolEnv(ABC):
    """Tool calls for an episode. Subclasses set :attr:`tools` (name -> ``f(argument) ->
    result``) and :attr:`call` (a pattern whose groups ``name`` and ``arg`` find a call in
    a turn), and implement :meth:`score`. A turn with a call is answered with
    ``reply_format.format(result=...)``; a turn without one ends the episode with
    ``score(prompt, turn)``; a call to an unknown tool is answered with an error text."""

    tools: ClassVar[dict[str, Callable[[str], str]]] = {}
    call: ClassVar[re.Pattern[str]] = re.compile(r"<(?P<name>\w+)>(?P<arg>.*?)</(?P=name)>")
    reply_format: ClassVar[str] = "={result}\n"

    def __init__(self) -> None:
        self.prompt: Prompt | None = None

    def reset(self, prompt: Prompt) -> None:
        self.prompt = prompt

    def step(self, turn: str) -> EnvReply:
        assert self.prompt is not None, "step before reset"
        found = self.call.search(turn)
        if found is None:
            return EnvReply(reward=self.score(self.prompt, turn), done=True)
        tool = self.tools.get(found.group("name"))
        result = tool(found.group("arg")) if tool is not None else f"no tool {found.group('name')!r}"
        return EnvReply(text=self.reply_format.format(result=result), tool_calls=1, tool_errors=int(tool is None))

    @abstractmethod
    def score(self, prompt: Prompt, turn: str) -> float:
        """The reward of an episode whose last turn is ``turn``."""


def resolve_env(spec: str) -> EnvFactory:
    """The environment factory ``--task.env MODULE:CLASS`` names: the class (an instance per
    episode), or a module-level instance shared by every episode. A one-line
    :class:`TaskError` naming ``task.env`` otherwise."""
    from pipeline_rl.tasks.plugin import import_attribute

    obj = import_attribute(spec, "task.env")
    if isinstance(obj, type):
        if not all(callable(getattr(obj, m, None)) for m in ("reset", "step")):
            raise TaskError(f"task.env: {spec} has no reset(prompt) and step(turn) methods")
        return obj  # type: ignore[return-value]
    if not isinstance(obj, Environment):
        raise TaskError(f"task.env: {spec} is a {type(obj).__name__}, not an environment class or instance")
    shared: Environment = obj
    return lambda: shared


def task_env_factory(task: object) -> EnvFactory | None:
    """The environment factory ``task`` supplies for its episodes (its ``env_factory()``),
    or None for a single-turn task (no such method, or it returns None). A wrapper that
    holds the task as ``base`` (:class:`~pipeline_rl.tasks.chat.ConfiguredTask`) is looked
    through. Call it where episodes run (the rollout worker): the factory need not pickle."""
    make = task_method(task, "env_factory")
    factory: EnvFactory | None = make() if make is not None else None
    return factory
