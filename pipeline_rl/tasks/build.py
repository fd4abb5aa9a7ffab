"""The task a config names, as the rollout workers must see it (:func:`build_task`): the
built-in or dataset task, its chat template, its plug-in reward, every prompt checked to fit.
Imports no torch, ``datasets`` or transformers (the model's tokenizer: :mod:`pipeline_rl.tasks.tokenizer`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pipeline_rl.tasks.base import RewardFn, Split, Task, TaskError
from pipeline_rl.tasks.builtin import AdditionTask, CountdownTask, SortTask
from pipeline_rl.tasks.word_problems import WordProblemsTask, longest_problem
from pipeline_rl.tasks.calc import CalcTask
from pipeline_rl.tasks.chat import ConfiguredTask, Renderer, chat_renderer, has_chat_template
from pipeline_rl.tasks.dataset import DatasetTask, Encoder, load_dataset_task, prompt_tokens
from pipeline_rl.tasks.plugin import resolve_reward
from pipeline_rl.tasks.reward_forms import PluginReward
from pipeline_rl.tasks.reward_mix import Reward, WeightedReward
from pipeline_rl.tasks.tokenizer import task_tokenizer

if TYPE_CHECKING:
    from pipeline_rl.tasks.task_config import TaskConfig


class HeldOut(Protocol):
    """What :func:`build_task` reads of ``--eval.*`` (``pipeline_rl.config.EvalConfig``)."""

    @property
    def every(self) -> int: ...

    @property
    def dataset(self) -> str | None: ...


def longest_prompt(cfg: "TaskConfig") -> str | None:
    """The longest prompt text a built-in task can produce (None for a dataset)."""
    nines = "9" * cfg.digits
    if cfg.name == "addition":
        return f"{nines}+{nines}="
    if cfg.name == "sort":
        return f"sort {nines}="
    if cfg.name == "countdown":
        return f"countdown {nines}="
    if cfg.name == "calc":
        return f"calc {nines}*{nines}="
    if cfg.name == "word_problems":
        return longest_problem()
    return None


def task_renderer(cfg: "TaskConfig", tokenizer: object | None) -> Renderer | None:
    """The chat-template renderer the config asks for, or None (prompts verbatim).

    With ``chat_template=auto``, a tokenizer with a chat template gives one; a
    ``system_prompt`` with no template to put it in is a :class:`TaskError`
    (``chat_template=none`` with a system prompt is refused by the config).
    """
    if cfg.chat_template == "auto" and has_chat_template(tokenizer):
        return chat_renderer(tokenizer, cfg.system_prompt)
    if cfg.system_prompt and cfg.chat_template == "auto" and tokenizer is not None:
        raise TaskError("task.system_prompt: the model's tokenizer has no chat template to put it in")
    return None


def _check_builtin_fits(cfg: "TaskConfig", tokenizer: Encoder, max_prompt_tokens: int,
                        render: Renderer | None) -> None:
    longest = longest_prompt(cfg)
    if longest is None:
        return
    n = prompt_tokens(tokenizer, longest if render is None else render(longest), render is not None)
    if n > max_prompt_tokens:
        raise TaskError(f"task.digits: {cfg.name} prompts take up to {n} tokens, more than the "
                        f"{max_prompt_tokens} the model's context leaves for them")


def build_task(cfg: "TaskConfig", *, seed: int = 0, tokenizer: Encoder | None = None,
               max_prompt_tokens: int | None = None, split: Split = "train",
               evaluation: "HeldOut | None" = None, reward_fn: "Reward | RewardFn | None" = None) -> Task:
    """The task a config names, as the rollout workers must see it.

    - ``split``: ``train`` prompts, or the held-out ``eval`` ones. Built-in tasks always
      keep the two apart (5% of prompt texts are held out). A dataset is split only
      when ``evaluation`` is on (``every > 0``) without ``evaluation.dataset``;
      ``split="eval"`` with ``evaluation.dataset`` reads that file whole.

    - ``task.reward`` is resolved first (a bad spec, or a remote reward that fails its
      start-up probe, is a one-line :class:`TaskError` naming the flag) and replaces the
      task's reward (``task.reward(...)`` calls it; :func:`plugin_reward` returns it);
      ``reward_fn``: that reward already resolved (another split's :func:`plugin_reward`),
      so a process resolves, and probes, it once.
    - With a ``tokenizer`` that has a chat template and ``chat_template=auto``,
      ``prompt(i).text`` is the rendered prompt (see :mod:`pipeline_rl.tasks.chat`);
      the template is tried on prompt 0 here, so a failing one is an error now.
      Without a tokenizer, prompts are verbatim: pass the model's tokenizer
      wherever prompts are fed to the model.
    - With ``tokenizer`` and ``max_prompt_tokens`` (the driver passes
      ``rollout.max_model_len - rollout.max_new_tokens``), every prompt, rendered,
      is checked to fit before anything starts: a dataset row that does not is a
      :class:`TaskError` naming ``FILE:LINE`` (``FILE[i]`` for non-JSONL data).

    The task is returned unwrapped when neither a template nor a plug-in reward applies.
    """
    if reward_fn is None and cfg.reward is not None:
        source = cfg.name if cfg.dataset is None else Path(cfg.dataset).stem
        reward_fn = resolve_reward(cfg.reward, cfg.reward_timeout_s, cfg.reward_form, source)
    keep = isinstance(reward_fn, (PluginReward, WeightedReward)) and reward_fn.wants_columns
    render = task_renderer(cfg, tokenizer)
    check = tokenizer is not None and max_prompt_tokens is not None
    base: Task
    if cfg.name == "dataset":
        if cfg.dataset is None:
            raise TaskError("task.dataset: give a data file for task.name=dataset")
        eval_file = evaluation.dataset if evaluation is not None and split == "eval" else None
        split_rows = eval_file is None and (split == "eval" or (
            evaluation is not None and evaluation.every > 0 and evaluation.dataset is None))
        base = load_dataset_task(eval_file or cfg.dataset, seed=seed, prompt_field=cfg.prompt_field,
                                 answer_field=cfg.answer_field, tokenizer=tokenizer if check else None,
                                 max_prompt_tokens=max_prompt_tokens, render=render,
                                 split=split if split_rows else None, keep_columns=keep)
    else:
        builtin = AdditionTask if cfg.name == "addition" else SortTask if cfg.name == "sort" else (
            CalcTask if cfg.name == "calc" else CountdownTask)
        base = (WordProblemsTask(cfg.max_level, cfg.num_prompts, seed, split) if cfg.name == "word_problems"
                else builtin(cfg.digits, cfg.num_prompts, seed, split))
        if tokenizer is not None and max_prompt_tokens is not None:
            _check_builtin_fits(cfg, tokenizer, max_prompt_tokens, render)
    if isinstance(reward_fn, (PluginReward, WeightedReward)):
        names = base.column_names if isinstance(base, DatasetTask) else frozenset({"prompt", "answer"})
        reward_fn.check_columns(names, str(base.path) if isinstance(base, DatasetTask) else f"the {cfg.name} task")
    if render is None and reward_fn is None:
        return base
    task = ConfiguredTask(base, render, reward_fn)
    task.prompt(0)
    return task


def build_task_for_model(cfg: "TaskConfig", model_dir: str, *, seed: int = 0,
                         max_prompt_tokens: int | None = None, split: Split = "train",
                         evaluation: "HeldOut | None" = None,
                         tokenizer: Encoder | None = None, reward_fn: "Reward | RewardFn | None" = None) -> Task:
    """:func:`build_task` with the tokenizer of the model in ``model_dir`` (see
    :func:`task_tokenizer`; pass ``tokenizer`` to reuse one already loaded), so prompts
    get its chat template."""
    tok = tokenizer if tokenizer is not None else task_tokenizer(cfg, model_dir, max_prompt_tokens=max_prompt_tokens)
    return build_task(cfg, seed=seed, tokenizer=tok, max_prompt_tokens=max_prompt_tokens if tok is not None else None,
                      split=split, evaluation=evaluation, reward_fn=reward_fn)
