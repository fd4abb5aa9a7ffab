"""The task contract: prompts, reference answers and a programmatic reward.

A task is a pool of ``num_prompts`` prompts addressed by ``prompt_id``. The
prompt for an id is a pure function of ``(seed, prompt_id)``: every rollout
worker, on every node, sees the same prompt for the same id, with no state
shared between them. Ids outside ``[0, num_prompts)`` wrap around (an endless
counter walks the pool in epochs). Rewards are floats in ``[0, 1]``.

Multi-turn tasks: a task may also define ``env_factory()``, returning the
:data:`~pipeline_rl.tasks.env.EnvFactory` that makes each of its episodes' environment
(``None``, or no such method: a single-turn task). It is optional, not part of the
:class:`Task` protocol; read it with :func:`pipeline_rl.tasks.env.task_env_factory` (which
looks through wrappers). The rollout worker and the held-out evaluation use it when
``--task.env`` is not given. Built in: ``calc`` (:mod:`pipeline_rl.tasks.calc`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol, runtime_checkable

#: Which prompts a task serves: ``train`` (the default) or the held-out ``eval`` split.
Split = Literal["train", "eval"]

#: Share of distinct prompt texts held out for evaluation, per mille.
HELD_OUT_PER_MILLE = 50


class TaskError(ValueError):
    """Bad task input (a dataset row, a prompt id); the message is one line naming the culprit."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of a task.

    ``prompt_id`` is the id it was asked for. ``text`` is exactly the text fed to
    the model: the task's prompt as written (a built-in task's ``"sort 5193="``,
    a dataset's prompt column), or, when a chat template was applied
    (``--task.chat_template auto`` with a tokenizer that has one), that prompt
    rendered as the user turn (after ``--task.system_prompt``, if any) with the
    generation prompt appended. ``raw_prompt`` is the prompt as written when a
    template was applied, else None (``text`` is then the prompt as written).
    ``answer`` is the reference answer the reward compares against, never
    templated. ``columns``: the dataset row's other columns, kept only for a reward that
    takes them (TRL's and verl's forms, :mod:`pipeline_rl.tasks.reward_forms`), else empty.
    ``messages``: a task that starts from a conversation gives it here
    (``pipeline_rl.tasks.messages.Message``; a chat model's episodes render it, with the
    environment's tools, through the chat template instead of ``text``).
    """

    prompt_id: int
    text: str
    answer: str
    raw_prompt: str | None = None
    columns: Mapping[str, object] = field(default_factory=dict, compare=False)
    messages: tuple[Any, ...] | None = None

    @property
    def templated(self) -> bool:
        """True when ``text`` is chat-template output (it may already hold the BOS
        text, so it should be encoded without adding special tokens)."""
        return self.raw_prompt is not None

    @property
    def question(self) -> str:
        """The prompt as written, before any chat template."""
        return self.text if self.raw_prompt is None else self.raw_prompt


#: Any callable scoring one completion of a prompt, called as ``f(meta.text,
#: completion, meta)``; must return a float in [0, 1]. ``meta.question`` is the
#: prompt before any chat template, ``meta.answer`` the reference answer. A plug-in
#: (``--task.reward``) may be ``async def``; a ``def`` one must be thread-safe (a rollout
#: worker calls it from up to ``--task.reward_concurrency`` threads at once).
RewardFn = Callable[[str, str, Prompt], float]


@runtime_checkable
class BatchReward(Protocol):
    """A reward that scores a group's completions in one call (the remote reward: one
    request per group). ``score_batch(meta, completions)`` returns one value per
    completion, in order; the caller checks each is a finite number."""

    def score_batch(self, meta: Prompt, completions: Sequence[str]) -> list[object]: ...


@runtime_checkable
class Task(Protocol):
    """A verifiable task: deterministic prompts and a programmatic reward.

    Invariants: ``prompt(i)`` is deterministic in ``i`` (for a fixed build seed);
    ``reward(...)`` is in ``[0, 1]``, never raises on any completion text
    (garbage scores 0), and is thread-safe (workers score in a thread pool).
    """

    @property
    def name(self) -> str:
        """Short task name (``addition``, ``sort``, ``dataset``)."""
        ...

    @property
    def num_prompts(self) -> int:
        """Size of the prompt pool (ids wrap around modulo this)."""
        ...

    def prompt(self, prompt_id: int) -> Prompt: ...

    def reward(self, prompt: str, completion: str, meta: Prompt) -> float: ...


def pool_index(prompt_id: int, num_prompts: int) -> int:
    """Map a non-negative prompt id onto the pool (ids wrap around)."""
    if prompt_id < 0:
        raise TaskError(f"prompt_id must be >= 0 (got {prompt_id})")
    return prompt_id % num_prompts


def strip_eos(completion: str, eos: str = "<eos>") -> str:
    """The completion up to (excluding) the first EOS marker, if the text still holds one."""
    cut = completion.find(eos)
    return completion if cut < 0 else completion[:cut]


def is_held_out(question: str) -> bool:
    """Whether a prompt text belongs to the held-out evaluation split.

    A stable hash of the text (the prompt as written, before any chat template), so the
    split is the same in every process and run, and a text that appears twice in a
    dataset is on one side only: training never sees an evaluation prompt."""
    digest = hashlib.blake2b(question.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 1000 < HELD_OUT_PER_MILLE


#: Draws a prompt of a split may take before the task is judged to have too few prompts for it.
MAX_DRAWS = 10_000


def draw_in_split(prompt_id: int, split: str, draw: Callable[[], tuple[str, str]]) -> Prompt | None:
    """Prompt ``prompt_id``: the first ``draw()`` (text, answer) whose text falls in ``split``
    (held out for ``"eval"``, else not; :func:`is_held_out`); None after :data:`MAX_DRAWS` tries."""
    for _ in range(MAX_DRAWS):
        text, answer = draw()
        if is_held_out(text) == (split == "eval"):
            return Prompt(prompt_id, text, answer)
    return None


#: One part of an episode as the warm start shows it: ``(text, by_model)``. A model part
#: is trained on and ends with ``<eos>`` (the end of its turn); an environment part
#: (``by_model`` False) is read, never trained on, exactly as an episode's environment
#: tokens carry a loss mask of 0.
Part = tuple[str, bool]


def task_method(task: object, name: str) -> Callable[..., Any] | None:
    """``task``'s method ``name``, looking through wrappers that hold the task as ``base``
    (:class:`~pipeline_rl.tasks.chat.ConfiguredTask`); None when no layer has it."""
    seen: object | None = task
    while seen is not None:
        method = getattr(seen, name, None)
        if callable(method):
            return method
        seen = getattr(seen, "base", None)
    return None
