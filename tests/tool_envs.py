"""A native tool environment for the tests (``--task.env tool_envs:AddTools``): the model
calls ``add`` in the Hermes format; a turn without a call ends the episode, scored 1.0
when it holds the prompt's answer."""

from __future__ import annotations

from pipeline_rl.tasks.base import Prompt
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
