"""A native tool environment for the tests (``--task.env tool_envs:AddTools``): the model
calls ``add`` in the Hermes format; a turn without a call ends the episode, scored 1.0
when it holds the prompt's answer."""

from __future__ import annotations

from pipeline_rl.tasks.base import Prompt
from pipeline_rl.tasks.env import EnvReply
from pipeline_rl.tasks.messages import Message
from pipeline_rl.tasks.tool_env import FunctionToolEnv


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


class AddTools(FunctionToolEnv):
    functions = (add,)
    parser = "hermes"

    def score(self, prompt: Prompt, turn: str) -> float:
        return 1.0 if prompt.answer in turn else 0.0


class AddToolsNudged(AddTools):
    """AddTools that answers a first turn without a call with a user message asking for one
    (so every episode of a random model has at least two turns and a message reply)."""

    def reset(self, prompt: Prompt) -> None:
        super().reset(prompt)
        self.turns = 0

    def step(self, turn: str) -> EnvReply:
        self.turns += 1
        reply = super().step(turn)
        if reply.done and self.turns == 1:
            return EnvReply(messages=(Message("user", "Use the add tool."),))
        return reply
