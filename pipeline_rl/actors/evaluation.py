"""Held-out evaluation on a rollout worker's engine: the messages and the bookkeeping.

The driver asks a worker to evaluate a list of held-out prompt ids
(:class:`EvalRequest`); the worker adds, per prompt, one greedy request and ``k``
sampled ones to the engine it generates training samples with -- the same weights,
no extra model copy -- and answers with sums (:class:`EvalResult`) that the driver
adds up over workers. Evaluation requests share the engine's batch with training
requests: nothing pauses; a weight update landing mid-evaluation is applied to
them as to any in-flight sequence, and the result says which versions served
(``version_min`` .. ``version_max``).

Scores: a sample is *solved* when its reward is at least :data:`SOLVED` (the
built-in tasks and the dataset task reward 1.0 for a correct answer, 0.0
otherwise). ``greedy_accuracy``: mean reward of the greedy answers;
``mean_at_k``: mean reward over all ``k`` samples of every prompt; ``pass_at_k``:
share of prompts with at least one solved sample among the ``k``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from pipeline_rl.tasks.base import Prompt

#: Scores one answer: ``(prompt, completion text) -> reward``.
RewardOf = Callable[[Prompt, str], float]
#: Reward at or above which a sample counts as solved (for pass@k).
SOLVED = 1.0 - 1e-6
#: Request ids of evaluation sequences start with this (training ids are ``GROUP:INDEX``).
EVAL_PREFIX = "eval:"


@dataclass(frozen=True, slots=True)
class EvalRequest:
    """Evaluate the eval-split prompts ``prompt_ids``: one greedy sample and ``k`` sampled
    at the rollout temperature each. ``eval_id`` tells concurrent requests apart."""

    eval_id: int
    prompt_ids: tuple[int, ...]
    k: int

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"EvalRequest: k must be >= 1 (got {self.k})")


@dataclass(frozen=True, slots=True)
class EvalResult:
    """Sums over the prompts one worker evaluated (add shares with :meth:`merge`)."""

    num_prompts: int
    k: int
    greedy_reward_sum: float
    sampled_reward_sum: float      # over num_prompts * k samples
    passed: int                    # prompts with at least one solved sample among k
    greedy_tokens: int             # tokens of the greedy answers
    version_min: int
    version_max: int

    @property
    def greedy_accuracy(self) -> float:
        return self.greedy_reward_sum / self.num_prompts if self.num_prompts else 0.0

    @property
    def mean_at_k(self) -> float:
        n = self.num_prompts * self.k
        return self.sampled_reward_sum / n if n else 0.0

    @property
    def pass_at_k(self) -> float:
        return self.passed / self.num_prompts if self.num_prompts else 0.0

    @staticmethod
    def merge(parts: Sequence["EvalResult"]) -> "EvalResult":
        if not parts:
            raise ValueError("EvalResult.merge: nothing to merge")
        if len({p.k for p in parts}) != 1:
            raise ValueError("EvalResult.merge: shares with different k")
        return EvalResult(
            num_prompts=sum(p.num_prompts for p in parts), k=parts[0].k,
            greedy_reward_sum=sum(p.greedy_reward_sum for p in parts),
            sampled_reward_sum=sum(p.sampled_reward_sum for p in parts),
            passed=sum(p.passed for p in parts), greedy_tokens=sum(p.greedy_tokens for p in parts),
            version_min=min(p.version_min for p in parts), version_max=max(p.version_max for p in parts))


def request_id(eval_id: int, prompt_index: int, sample: int) -> str:
    """Engine request id of one evaluation sequence (``sample`` 0 is the greedy one)."""
    return f"{EVAL_PREFIX}{eval_id}:{prompt_index}:{sample}"


def parse_request_id(rid: str) -> tuple[int, int, int]:
    """``(eval_id, prompt_index, sample)`` of an id made by :func:`request_id`."""
    eval_id, prompt_index, sample = rid[len(EVAL_PREFIX):].split(":")
    return int(eval_id), int(prompt_index), int(sample)


@dataclass(slots=True, eq=False)
class PendingEval:
    """An evaluation in flight on one worker: its prompts, the texts and versions that
    came back so far, and the future its caller waits on."""

    request: EvalRequest
    prompts: tuple[Prompt, ...]
    future: Future[EvalResult] = field(default_factory=Future)
    texts: dict[tuple[int, int], str] = field(default_factory=dict)
    greedy_tokens: int = 0
    version_min: int = 2**31 - 1
    version_max: int = -1

    @property
    def expected(self) -> int:
        return len(self.prompts) * (1 + self.request.k)

    def add(self, prompt_index: int, sample: int, text: str, num_tokens: int, versions: np.ndarray) -> bool:
        """Record one finished sequence; True when every sequence is in."""
        self.texts[(prompt_index, sample)] = text
        if sample == 0:
            self.greedy_tokens += num_tokens
        if versions.size:
            self.version_min = min(self.version_min, int(versions.min()))
            self.version_max = max(self.version_max, int(versions.max()))
        return len(self.texts) == self.expected

    def score(self, reward: RewardOf, version_now: int) -> EvalResult:
        """Score every answer with ``reward(prompt, text)`` and sum up."""
        k = self.request.k
        greedy = sampled = 0.0
        passed = 0
        for i, prompt in enumerate(self.prompts):
            greedy += reward(prompt, self.texts[(i, 0)])
            rs = [reward(prompt, self.texts[(i, j)]) for j in range(1, k + 1)]
            sampled += sum(rs)
            passed += int(max(rs) >= SOLVED)
        lo = self.version_min if self.version_max >= 0 else version_now
        hi = self.version_max if self.version_max >= 0 else version_now
        return EvalResult(num_prompts=len(self.prompts), k=k, greedy_reward_sum=greedy,
                          sampled_reward_sum=sampled, passed=passed, greedy_tokens=self.greedy_tokens,
                          version_min=lo, version_max=hi)

