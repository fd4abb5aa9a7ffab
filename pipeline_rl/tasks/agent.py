"""Agents as tasks: ``--task.agent MODULE:FUNCTION`` names ``agent(client, sample) -> reward``.

- ``client``: an ``openai.AsyncOpenAI`` for an ``async def`` agent, an ``openai.OpenAI`` for a
  plain one, already pointed at the rollout worker's endpoint with the run's key
  (``rollout/agents/endpoint.py``); the ``model`` an agent names in its requests is not read.
- ``sample``: the data row (:class:`~pipeline_rl.tasks.base.Prompt`: ``question``,
  ``answer``, ``messages``, ``columns``, ``prompt_id``).
- the reward: a float, or a dict with ``"reward"`` (a float) and other numbers (metrics).

The worker calls it ``--rollout.n`` times per prompt (a GRPO group), each call bounded by
``--task.env_timeout_s`` (``rollout/agents/runner.py``). The function may carry ``tool_parser``,
the name of vLLM's tool-call parser for the model's calls (``vllm serve --tool-call-parser``;
default :data:`DEFAULT_TOOL_PARSER`).

The spec is resolved in the driver before any process starts (a misnamed one is a one-line
:class:`TaskError` naming ``task.agent``, exit status 2), and again in each rollout worker's
agents' process (``rollout/agents/agent_host.py``), which runs it; the worker itself never imports it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline_rl.tasks.base import TaskError

#: vLLM's tool-call parser an agent's model is read with unless the function names another
#: (``agent.tool_parser = "llama3_json"``): Hermes ``<tool_call>`` JSON, as Qwen2.5 writes it.
DEFAULT_TOOL_PARSER = "hermes"


@dataclass(frozen=True, slots=True)
class AgentSpec:
    """A resolved agent: the function, its name (``MODULE:FUNCTION``), whether it is
    ``async def``, and the tool parser its model's calls are read with."""

    fn: Callable[..., Any]
    name: str
    is_async: bool
    tool_parser: str


def resolve_agent(spec: str) -> AgentSpec:
    """What ``--task.agent MODULE:FUNCTION`` names; a one-line :class:`TaskError` naming
    ``task.agent`` when it names no function of two arguments."""
    from pipeline_rl.tasks.plugin import REWARD_SPEC, import_attribute

    if not REWARD_SPEC.match(spec):
        raise TaskError(f"task.agent: expected MODULE:FUNCTION (e.g. my_agents:solve), got {spec!r}")
    fn = import_attribute(spec, "task.agent")
    if not callable(fn) or isinstance(fn, type):
        raise TaskError(f"task.agent: {spec} is a {type(fn).__name__}, not a function agent(client, sample)")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise TaskError(f"task.agent: {spec} does not take (client, sample)") from None
    except ValueError:   # no signature to read (a builtin): trust it
        pass
    parser = getattr(fn, "tool_parser", DEFAULT_TOOL_PARSER)
    if not isinstance(parser, str):
        raise TaskError(f"task.agent: {spec}.tool_parser must be a parser's name, not a {type(parser).__name__}")
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
    return AgentSpec(fn, spec, is_async, parser)


def agent_reward(value: object) -> tuple[float, dict[str, float]]:
    """An agent's answer as ``(reward, metrics)``; ValueError (one line) for anything that
    is not a finite number or a dict with a finite ``"reward"`` and numeric metrics."""
    metrics: dict[str, float] = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"returned a dict without 'reward' (keys: {', '.join(map(str, value))})")
        for k, v in value.items():
            if k != "reward" and isinstance(v, (int, float)) and not isinstance(v, bool):
                metrics[str(k)] = float(v)
        value = value["reward"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"returned {value!r} ({type(value).__name__}), not a finite reward")
    return float(value), metrics
