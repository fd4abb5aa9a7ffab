"""Plug-in rewards for tests/test_tasks.py (``--task.reward reward_plugin:NAME``)."""

from __future__ import annotations

from pipeline_rl.tasks import Prompt

NOT_CALLABLE = 3


def contains_answer(prompt: str, completion: str, meta: Prompt) -> float:
    """1.0 when the reference answer appears anywhere in the completion, else 0.25
    (a value no built-in reward gives, so tests can tell which reward ran)."""
    return 1.0 if meta.answer in completion else 0.25


def echo_question(prompt: str, completion: str, meta: Prompt) -> float:
    """1.0 when the completion repeats the prompt as written (before any chat template)."""
    return 1.0 if completion == meta.question else 0.0


def two_args(prompt: str, completion: str) -> float:
    return 0.0


class Scorer:
    """A reward reached through a dotted attribute path (``reward_plugin:Scorer.score``)."""

    @staticmethod
    def score(prompt: str, completion: str, meta: Prompt) -> float:
        return 0.5
