"""Held-out evaluation, the worker's half: what a rollout worker does with a request.

Asked for held-out prompt ids (:class:`EvalRequest`), a worker adds per
prompt one greedy request and ``k`` sampled ones to the engine it generates training
samples with (same weights, same batch: nothing pauses; an update landing mid-evaluation
applies as to any sequence) and answers with sums (:class:`EvalResult`) naming the
versions that served (``version_min`` .. ``version_max``). A sample is *solved* when its
reward is at least :data:`SOLVED`; ``greedy_accuracy``: mean reward of the greedy answers;
``mean_at_k``: over all ``k`` samples; ``pass_at_k``: share of prompts with a solved sample.
An evaluation is a side-stream (:class:`EvalFeed`): at most :data:`STREAM_SHARE` of the
engine's sequences at a time, so training generation keeps the rest and the trainer keeps
stepping. The starting evaluation is not a stream (``EvalRequest.stream`` False): it takes
the engine at once, and the worker holds every weight update until it is answered, so it
is of the starting weights alone while training goes on (:attr:`EvalFeed.pinned`).

When the driver asks: :mod:`pipeline_rl.run.evaluations`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipeline_rl.tasks.base import Prompt

if TYPE_CHECKING:
    import numpy as np


#: Reward at or above which a sample counts as solved (for pass@k).
SOLVED = 1.0 - 1e-6
#: Scores one answer: ``(prompt, completion text) -> reward``.
RewardOf = Callable[[Prompt, str], float]
#: Share of a worker's engine sequences (``--rollout.max_num_seqs``) a side-stream
#: evaluation holds at most at a time; training generation keeps the rest.
STREAM_SHARE = 0.25


@dataclass(frozen=True, slots=True)
class EvalRequest:
    """Evaluate the eval-split prompts ``prompt_ids``: one greedy sample and ``k`` sampled
    at the rollout temperature each. ``eval_id`` tells concurrent requests apart;
    ``stream``: a side-stream (:class:`EvalFeed`), else every sequence at once."""

    eval_id: int
    prompt_ids: tuple[int, ...]
    k: int
    stream: bool = True

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


@dataclass(slots=True, eq=False)
class PendingEval:
    """An evaluation in flight on one worker: its prompts, the texts and versions that
    came back so far, and the future its caller waits on."""

    request: EvalRequest
    prompts: tuple[Prompt, ...]
    future: Future[EvalResult] = field(default_factory=Future)
    encoded: dict[int, tuple[int, ...]] = field(default_factory=dict)    # prompt index -> its token ids
    texts: dict[tuple[int, int], str] = field(default_factory=dict)
    rewards: dict[tuple[int, int], float] = field(default_factory=dict)   # (prompt index, sample) -> reward
    greedy_tokens: int = 0
    version_min: int = 2**31 - 1
    version_max: int = -1

    @property
    def expected(self) -> int:
        return len(self.prompts) * (1 + self.request.k)

    def add(self, prompt_index: int, sample: int, text: str, num_tokens: int, versions: np.ndarray,
            reward: float | None = None) -> bool:
        """Record one finished answer (``reward``: when it came scored, as an episode's may);
        True when every answer is in."""
        self.texts[(prompt_index, sample)] = text
        if reward is not None:
            self.rewards[(prompt_index, sample)] = reward
        if sample == 0:
            self.greedy_tokens += num_tokens
        if versions.size:
            self.version_min = min(self.version_min, int(versions.min()))
            self.version_max = max(self.version_max, int(versions.max()))
        return len(self.texts) == self.expected

    def unscored(self, prompt_index: int) -> list[int]:
        """The samples of prompt ``prompt_index`` without a reward yet (0: the greedy one)."""
        return [j for j in range(1 + self.request.k) if (prompt_index, j) not in self.rewards]

    def score(self, reward: RewardOf | None = None, *, version_now: int) -> EvalResult:
        """Sum up: each answer's reward from :attr:`rewards` (it came scored, or the worker
        scored it), else ``reward(prompt, text)`` (None: every answer must be in :attr:`rewards`)."""
        k = self.request.k
        greedy = sampled = 0.0
        passed = 0
        def of(i: int, j: int) -> float:
            known = self.rewards.get((i, j))
            if known is None and reward is not None:
                return reward(self.prompts[i], self.texts[(i, j)])
            return self.rewards[(i, j)]

        for i in range(len(self.prompts)):
            greedy += of(i, 0)
            rs = [of(i, j) for j in range(1, k + 1)]
            sampled += sum(rs)
            passed += int(max(rs) >= SOLVED)
        lo = self.version_min if self.version_max >= 0 else version_now
        hi = self.version_max if self.version_max >= 0 else version_now
        return EvalResult(num_prompts=len(self.prompts), k=k, greedy_reward_sum=greedy,
                          sampled_reward_sum=sampled, passed=passed, greedy_tokens=self.greedy_tokens,
                          version_min=lo, version_max=hi)


class EvalFeed:
    """A worker's evaluations on their way into its engine. :meth:`ask` from any thread;
    the rest from the worker's loop. :meth:`due` yields the sequences to add now,
    ``(pending, prompt index, sample)``, sample 0 the greedy one: all of a request that
    is not a stream, otherwise as many as keep the streams' unanswered sequences at
    ``slots`` at most (queued evaluations go in order). :attr:`pinned` holds while an
    evaluation that is not a stream is asked for and not answered: the worker applies no
    weight update then, so such an evaluation is of one version."""

    def __init__(self, slots: int) -> None:
        self.slots = max(1, slots)
        self._lock = threading.Lock()
        self._asked: deque[PendingEval] = deque()
        self._started: dict[int, PendingEval] = {}
        self._next: deque[tuple[PendingEval, int, int]] = deque()   # sequences of started evaluations, not added
        self._streaming = 0   # stream sequences added, not answered
        self._pinned = 0      # evaluations that are not streams, asked and not answered

    @property
    def pinned(self) -> bool:
        """The weights must stay as they are (see the class docstring)."""
        with self._lock:
            return self._pinned > 0

    def ask(self, pending: PendingEval) -> None:
        with self._lock:
            self._asked.append(pending)
            self._pinned += not pending.request.stream

    def due(self) -> Iterator[tuple[PendingEval, int, int]]:
        while True:
            if self._next:
                pending, i, j = self._next[0]
                if pending.request.stream and self._streaming >= self.slots:
                    return
                self._next.popleft()
                self._streaming += pending.request.stream
                yield pending, i, j
                continue
            with self._lock:
                if not self._asked:
                    return
                pending = self._asked.popleft()
            self._started[pending.request.eval_id] = pending
            k = pending.request.k
            self._next.extend((pending, i, j) for i in range(len(pending.prompts)) for j in range(k + 1))

    def answered(self, eval_id: int, prompt_index: int, sample: int, text: str, num_tokens: int,
                 versions: np.ndarray, reward: float | None = None) -> PendingEval | None:
        """Record one answer (:meth:`PendingEval.add`); the evaluation once all are in."""
        pending = self._started[eval_id]
        self._streaming -= pending.request.stream
        if not pending.add(prompt_index, sample, text, num_tokens, versions, reward):
            return None
        del self._started[eval_id]
        with self._lock:
            self._pinned -= not pending.request.stream
        return pending

    def close(self) -> list[PendingEval]:
        """Forget every evaluation asked for and not answered; returns them."""
        with self._lock:
            waiting = list(self._asked) + list(self._started.values())
            self._asked.clear()
            self._pinned = 0
        self._started.clear()
        self._next.clear()
        self._streaming = 0
        return waiting
