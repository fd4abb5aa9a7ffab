"""Chat templates and plug-in rewards layered over any task.

:class:`ConfiguredTask` wraps a task (built-in or dataset) and changes at most
two things: ``prompt(i).text`` becomes the prompt rendered by the tokenizer's
chat template, and ``reward`` becomes a plug-in reward. Prompt ids, pool size,
reference answers and determinism are the wrapped task's.

Rendering (``--task.chat_template auto`` with a tokenizer whose
``chat_template`` is set)::

    tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}?, {"role": "user", "content": prompt}],
        tokenize=False, add_generation_prompt=True)

The rendered text may already hold the model's BOS text, so it is meant to be
encoded without adding special tokens (:attr:`Prompt.templated`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Callable, Protocol, TypeGuard, runtime_checkable

from pipeline_rl.tasks.base import Prompt, RewardFn, Task, TaskError
from pipeline_rl.tasks.reward_mix import Reward

#: Maps a prompt as written to the text fed to the model.
Renderer = Callable[[str], str]


@runtime_checkable
class ChatTokenizer(Protocol):
    """A Hugging Face style tokenizer that may carry a chat template."""

    chat_template: Any

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def has_chat_template(tokenizer: object) -> TypeGuard[ChatTokenizer]:
    """True when ``tokenizer`` has a non-empty ``chat_template``."""
    return isinstance(tokenizer, ChatTokenizer) and bool(tokenizer.chat_template)


def chat_renderer(tokenizer: ChatTokenizer, system_prompt: str | None) -> Renderer:
    """A renderer applying ``tokenizer``'s chat template; a template that fails or does
    not return text raises a one-line :class:`TaskError` naming ``task.chat_template``."""
    def render(prompt: str) -> str:
        messages = [{"role": "user", "content": prompt}]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a Jinja error in the model's template (e.g. no system role)
            first = (str(e).strip().splitlines() or [""])[0]
            raise TaskError(f"task.chat_template: the tokenizer's chat template failed "
                            f"({type(e).__name__}: {first}); use --task.chat_template none"
                            f"{' or drop --task.system_prompt' if system_prompt else ''}") from None
        if not isinstance(text, str):
            raise TaskError(f"task.chat_template: the tokenizer's chat template returned "
                            f"{type(text).__name__}, not text")
        return text

    return render


@dataclass(frozen=True)
class ConfiguredTask:
    """``base`` with its prompts rendered by ``render`` (when set) and its reward replaced
    by ``reward_fn`` (when set). Invariant: ``prompt(i).answer`` and ``prompt(i).question``
    are ``base.prompt(i)``'s answer and text; only ``text`` may differ."""

    base: Task
    render: Renderer | None = None
    reward_fn: "Reward | RewardFn | None" = None

    @property
    def name(self) -> str:
        return self.base.name

    @property
    def num_prompts(self) -> int:
        return self.base.num_prompts

    def prompt(self, prompt_id: int) -> Prompt:
        p = self.base.prompt(prompt_id)
        if self.render is None:
            return p
        return Prompt(p.prompt_id, self.render(p.text), p.answer, raw_prompt=p.text, columns=p.columns)

    def reward(self, prompt: str, completion: str, meta: Prompt) -> float:
        """The plug-in reward when set (it may raise: the rollout worker counts and logs
        that and scores 0; an ``async def`` one is run to its end here), else the base task's.
        A rollout worker calls the plug-in itself (:func:`plugin_reward`), concurrently."""
        if self.reward_fn is None:
            return self.base.reward(prompt, completion, meta)
        value = self.reward_fn(prompt, completion, meta)
        if inspect.isawaitable(value):
            return asyncio.run(_awaited(value))
        return value


async def _awaited(value: Awaitable[float]) -> float:
    return await value


def plugin_reward(task: Task) -> "Reward | RewardFn | None":
    """The plug-in reward (``--task.reward``) that replaced ``task``'s own, or None."""
    return task.reward_fn if isinstance(task, ConfiguredTask) else None
