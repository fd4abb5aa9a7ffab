"""Rewards and sends of a rollout worker's finished groups (``pipeline_rl.rollout.worker``),
in its thread pool, off the engine's critical path.

A reward function that raises (or returns a non-finite value) is logged with the
prompt id and scores 0; it stops the worker only if it has failed on its
first ``REWARD_FAILURES_FATAL`` calls without a single success.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pipeline_rl.rollout.engine import FinishedSequence
from pipeline_rl.rollout.ports import SenderLike
from pipeline_rl.rollout.worker_stats import Counters
from pipeline_rl.samples import I32, Completion, Group
from pipeline_rl.tasks.base import Prompt, RewardFn

log = logging.getLogger(__name__)

#: A reward function that failed this many times without ever succeeding ends the run.
REWARD_FAILURES_FATAL = 32


class RewardFailed(RuntimeError):
    """The task's reward function fails on every call (it never returned a score)."""


@dataclass(slots=True)
class PendingGroup:
    """A group in flight: its prompt and the sequences finished so far (by index)."""

    group_id: int
    prompt: Prompt
    prompt_ids: tuple[int, ...]
    done: dict[int, FinishedSequence] = field(default_factory=dict)


class Scorer:
    """Scores a finished group's completions with ``reward_fn`` and sends the group (pool
    threads), counting into the worker's counters under its lock; ``fail`` stops the worker."""

    def __init__(self, worker_id: int, n: int, reward_fn: RewardFn, sender: SenderLike,
                 counters: Counters, lock: threading.Lock, fail: Callable[[BaseException], None]) -> None:
        self.worker_id, self.n, self._reward_fn, self._sender = worker_id, n, reward_fn, sender
        self._c, self._lock, self._fail = counters, lock, fail

    def score_and_send(self, pending: PendingGroup) -> None:
        completions = tuple(
            Completion(token_ids=s.token_ids, logprobs=s.logprobs, versions=s.versions,
                       reward=self.reward(pending.prompt, s.text), finish_reason=s.finish_reason)
            for s in (pending.done[i] for i in range(self.n)))
        group = Group(group_id=pending.group_id, prompt_id=pending.prompt.prompt_id,
                      worker_id=self.worker_id,
                      prompt_ids=_i32(pending.prompt_ids), completions=completions)
        self._sender.send(group)
        with self._lock:
            self._c.groups_sent += 1

    def reward(self, prompt: Prompt, completion: str) -> float:
        try:
            value = float(self._reward_fn(prompt.text, completion, prompt))
            if not math.isfinite(value):
                raise ValueError(f"non-finite reward {value}")
            with self._lock:
                self._c.reward_ok += 1
            return value
        except Exception as e:  # a user's reward function must never kill the worker...
            with self._lock:
                self._c.reward_errors += 1
                hopeless = not self._c.reward_ok and self._c.reward_errors >= REWARD_FAILURES_FATAL
            log.warning("worker %d: reward function failed on prompt %d (scored 0): %s: %s",
                        self.worker_id, prompt.prompt_id, type(e).__name__, e)
            if hopeless:  # ...unless it has never once worked: then nothing can be learned
                self._fail(RewardFailed(f"the reward function failed on all of its first "
                                        f"{REWARD_FAILURES_FATAL} calls; last: {type(e).__name__}: "
                                        f"{str(e).splitlines()[0] if str(e) else ''}"))
            return 0.0


def _i32(ids: tuple[int, ...]) -> I32:
    return np.asarray(ids, dtype=np.int32)
