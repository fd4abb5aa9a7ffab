"""Several reward functions with weights, from one flag (TRL's ``reward_funcs`` /
``reward_weights``): ``--task.reward my_rewards:accuracy,my_rewards:format@0.2``.

Each comma-separated part is a reward spec (``MODULE:FUNCTION`` or a remote URL) with an
optional ``@WEIGHT`` (default 1). A completion's reward is the weighted sum of the parts'
scores; a part's ``None`` (no score, TRL's convention) adds nothing, and a completion no
part scored is no score itself (as TRL's ``nansum``). A part that fails fails the
completion's whole reward (counted once, as any reward failure).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pipeline_rl.tasks.base import Prompt, TaskError
from pipeline_rl.tasks.reward_forms import PluginReward, Scores, finite_or_none


@dataclass(frozen=True, slots=True)
class WeightedSpec:
    """One part of ``--task.reward``: a reward spec and its weight."""

    spec: str
    weight: float


def split_specs(spec: str) -> list[WeightedSpec]:
    """The parts of ``spec`` (module docstring); a one-line :class:`TaskError` naming
    ``task.reward`` for an empty part or a weight that is not a finite number."""
    parts: list[WeightedSpec] = []
    for raw in spec.split(","):
        part = raw.strip()
        head, at, tail = part.rpartition("@")
        weight = 1.0
        if at and head:
            try:
                weight = float(tail)
            except ValueError:
                if "://" not in part:   # a URL may hold user@host
                    raise TaskError(f"task.reward: the weight in {part!r} is not a number (write "
                                    f"SPEC@WEIGHT, e.g. my_rewards:format@0.2)") from None
            else:
                if not math.isfinite(weight):
                    raise TaskError(f"task.reward: the weight in {part!r} is not a finite number")
                part = head.strip()
        if not part:
            raise TaskError(f"task.reward: an empty part in {spec!r} (write SPEC[@WEIGHT],SPEC[@WEIGHT])")
        parts.append(WeightedSpec(part, weight))
    return parts


@dataclass(frozen=True)
class WeightedReward:
    """The weighted sum of ``parts`` (module docstring), with :class:`PluginReward`'s
    interface. Always run on the worker's thread pool (``is_async`` False): an
    ``async def`` part is run to its end there. One call per completion when every part
    is per-completion, else a batch."""

    name: str
    parts: tuple[tuple[PluginReward, float], ...]

    @property
    def per_completion(self) -> bool:
        return all(r.per_completion for r, _ in self.parts)

    @property
    def is_async(self) -> bool:
        return False

    @property
    def wants_columns(self) -> bool:
        return any(r.wants_columns for r, _ in self.parts)

    @property
    def wants_ids(self) -> bool:
        return any(r.wants_ids for r, _ in self.parts)

    def check_columns(self, available: frozenset[str], where: str) -> None:
        for r, _ in self.parts:
            r.check_columns(available, where)

    def score_batch(self, meta: Prompt, completions: Sequence[str],
                    completion_ids: Sequence[Iterable[int]] | None = None) -> Scores:
        """One weighted score per completion (``None`` where no part scored it)."""
        totals: list[float | None] = [None] * len(completions)
        for reward, weight in self.parts:
            out = reward.score_batch(meta, completions, completion_ids)
            values = asyncio.run(_awaited(out)) if inspect.isawaitable(out) else out
            if len(values) != len(completions):
                raise ValueError(f"{reward.name}: {len(values)} scores for {len(completions)} completions")
            for i, value in enumerate(values):
                try:
                    number = finite_or_none(value)
                except (TypeError, ValueError) as e:
                    raise type(e)(f"{reward.name} {e}") from None
                if number is not None:
                    totals[i] = (totals[i] or 0.0) + weight * number
        return list(totals)

    def __call__(self, prompt: str, completion: str, meta: Prompt) -> float:
        value = self.score_batch(meta, [completion])[0]
        return 0.0 if value is None else float(value)  # type: ignore[arg-type]


#: A resolved ``--task.reward``: one function, or several with weights.
Reward = PluginReward | WeightedReward


async def _awaited(out: object) -> Scores:
    return list(await out)  # type: ignore[misc]
