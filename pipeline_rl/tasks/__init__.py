"""Verifiable tasks: deterministic prompt pools with programmatic rewards.

Built-in (CPU default): ``addition`` and ``sort`` (:mod:`pipeline_rl.tasks.builtin`).
User data: ``dataset``, a JSONL file scored by math answer matching
(:mod:`pipeline_rl.tasks.dataset`, :mod:`pipeline_rl.tasks.math_reward`).
Importing this package imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline_rl.tasks.base import Prompt, RewardFn, Task, TaskError
from pipeline_rl.tasks.builtin import AdditionTask, SortTask
from pipeline_rl.tasks.dataset import DatasetTask, Encoder, load_dataset_task

if TYPE_CHECKING:
    from pipeline_rl.config import TaskConfig

__all__ = ["AdditionTask", "DatasetTask", "Prompt", "RewardFn", "SortTask", "Task", "TaskError",
           "build_task", "longest_prompt"]


def longest_prompt(cfg: "TaskConfig") -> str | None:
    """The longest prompt text a built-in task can produce (None for a dataset)."""
    nines = "9" * cfg.digits
    if cfg.name == "addition":
        return f"{nines}+{nines}="
    if cfg.name == "sort":
        return f"sort {nines}="
    return None


def build_task(cfg: "TaskConfig", *, seed: int = 0, tokenizer: Encoder | None = None,
               max_prompt_tokens: int | None = None) -> Task:
    """The task a config names.

    With ``tokenizer`` and ``max_prompt_tokens`` (the driver passes
    ``rollout.max_model_len - rollout.max_new_tokens``), every prompt is checked
    to fit before anything starts: a dataset row that does not is a
    :class:`TaskError` naming ``FILE:LINE``.
    """
    if cfg.name == "dataset":
        if cfg.dataset is None:
            raise TaskError("task.dataset: give a JSONL file for task.name=dataset")
        return load_dataset_task(cfg.dataset, seed=seed, tokenizer=tokenizer,
                                 max_prompt_tokens=max_prompt_tokens)
    task: Task = (AdditionTask if cfg.name == "addition" else SortTask)(cfg.digits, cfg.num_prompts, seed)
    longest = longest_prompt(cfg)
    if tokenizer is not None and max_prompt_tokens is not None and longest is not None:
        n = len(tokenizer.encode(longest))
        if n > max_prompt_tokens:
            raise TaskError(f"task.digits: {cfg.name} prompts take up to {n} tokens, more than the "
                            f"{max_prompt_tokens} the model's context leaves for them")
    return task
