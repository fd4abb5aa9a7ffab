"""Plug-in rewards for tests/test_tasks.py and tests/test_rewards.py (``--task.reward reward_plugin:NAME``)."""

from __future__ import annotations

import asyncio

from pipeline_rl.tasks.base import Prompt

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


# --- for tests/test_rewards.py ----------------------------------------------------------------

async def async_half(prompt: str, completion: str, meta: Prompt) -> float:
    """An ``async def`` reward that waits 0.2 s (a remote judge) and scores 0.5."""
    await asyncio.sleep(0.2)
    return 0.5


def picky(prompt: str, completion: str, meta: Prompt) -> object:
    """Fails in every way a reward can, by completion: "raise" raises, "text" returns a
    string, "nan" a NaN; anything else scores 1."""
    if completion == "raise":
        raise ValueError("no digits here")
    return {"text": "0.5", "nan": float("nan")}.get(completion, 1)


async def flaky_async(prompt: str, completion: str, meta: Prompt) -> float:
    """An ``async def`` reward that raises on every third prompt, else scores whether the
    answer appears in the completion (a real run's reward, with failures)."""
    await asyncio.sleep(0.002)
    if meta.prompt_id % 3 == 0:
        raise ValueError("judge unavailable")
    return float(meta.answer in completion)


# --- the reward forms of TRL and verl, as written for those trainers (tests/test_reward_forms.py) ---

def exact(prompts, completions, answer, **kwargs):  # type: ignore[no-untyped-def]
    """TRL's form: a batch in, one float per completion out, the data's columns as keywords."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):  # type: ignore[no-untyped-def]
    """verl's form: one completion, its reference answer as ``ground_truth``."""
    return 1.0 if solution_str.strip() == ground_truth else 0.0


def verl_dict(data_source, solution_str, ground_truth, extra_info=None):  # type: ignore[no-untyped-def]
    """verl's form with a dict result (its ``score`` counts)."""
    return {"score": 0.75, "acc": 1.0, "source": data_source, "index": extra_info["index"]}


def trl_needs_solution(prompts, completions, solution, **kwargs):  # type: ignore[no-untyped-def]
    """TRL's form asking for a column ``solution``."""
    return [float(c == s) for c, s in zip(completions, solution)]


def trl_ids(prompts, completions, completion_ids, **kwargs):  # type: ignore[no-untyped-def]
    """TRL's form asking for the token ids: the number of ids."""
    return [float(len(ids)) for ids in completion_ids]


def trl_some_none(prompts, completions, **kwargs):  # type: ignore[no-untyped-def]
    """TRL's form scoring only completions that start with "y" (None: no score)."""
    return [1.0 if c.startswith("y") else None for c in completions]


async def trl_async(prompts, completions, **kwargs):  # type: ignore[no-untyped-def]
    """TRL's form, ``async def``: the completion's length / 10."""
    await asyncio.sleep(0.01)
    return [len(c) / 10 for c in completions]


def no_form(a, b):  # type: ignore[no-untyped-def]
    """Matches none of the forms."""
    return 0.0


def trl_needs_level(prompts, completions, level, **kwargs):  # type: ignore[no-untyped-def]
    """TRL's form asking for a column ``level`` (the test data has none)."""
    return [0.0 for _ in completions]
