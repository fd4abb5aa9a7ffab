"""Rewards and sends of a rollout worker's finished groups (``pipeline_rl.rollout.worker``),
off the engine's critical path.

Where rewards run: on one asyncio event loop, in a thread of the worker's own
(``rewards-N``); the engine loop only hands over finished groups and evaluations.

- the task's own (built-in) reward: on that loop, once per group (it is pure and fast,
  and never raises: the ``Task`` contract);
- a plug-in reward (:mod:`pipeline_rl.tasks.reward_forms`, called through its
  ``score_batch``): once per completion (our form, verl's) or once per group (TRL's, a
  remote reward, several weighted with one of those); a ``def`` one on a pool of
  ``--task.reward_concurrency`` threads, an ``async def`` one on the loop.

At most ``reward_concurrency`` calls are in flight (``rollout.bounded_calls``, shared with
the environment calls). A call not done after ``--task.reward_timeout_s`` scores 0, is
counted as a timeout and frees its slot at once (an ``async def`` one is cancelled; a
thread cannot be, so it is abandoned and a new thread takes its place). Scored groups
are sent by one sending thread (a full buffer blocks it, never the loop).

Failures -- a call that raises, a value that is not a finite number, a timeout -- score
that completion 0 and are counted (``RewardTally``); so is a ``None`` (no score, TRL's
convention), counted apart (``unscored``), never a failure; the first one is kept as one line
naming the reward, the prompt and the error (``WorkerStats.rewards.first_error``: the
driver prints it). With ``--task.reward_errors fail`` it stops the worker instead; so
does a reward that failed on its first ``REWARD_FAILURES_FATAL`` completions without a
single success.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline_rl.calls import LoopThread, first_line
from pipeline_rl.config import TaskConfig
from pipeline_rl.rollout.eval_feed import PendingEval
from pipeline_rl.rollout.bounded_calls import BoundedCalls
from pipeline_rl.rollout.ports import SenderLike
from pipeline_rl.rollout.rollout_shape import FinishedEpisode, group_samples
from pipeline_rl.rollout.worker_stats import Counters
from pipeline_rl.samples import I32, Group
from pipeline_rl.tasks.base import Prompt, RewardFn, Task
from pipeline_rl.tasks.chat import plugin_reward
from pipeline_rl.tasks.reward_forms import PluginReward, finite_or_none, wrap
from pipeline_rl.tasks.reward_mix import Reward, WeightedReward

log = logging.getLogger(__name__)

#: A reward function that failed this many times without ever succeeding ends the run.
REWARD_FAILURES_FATAL = 32

#: Token ids of completions, in order (None where not at hand: evaluations, episodes).
Ids = Sequence[Iterable[int]] | None
#: One reward call: ``(prompt, completions, their ids) -> one value per completion`` (or an awaitable of it).
Call = Callable[[Prompt, Sequence[str], Ids], list[object] | Awaitable[list[object]]]


class RewardFailed(RuntimeError):
    """The task's reward fails on every call, or failed once under ``--task.reward_errors fail``."""


@dataclass(frozen=True, slots=True)
class RewardSource:
    """What scores completions and how: ``name`` (how messages name it), ``call`` (one
    call), ``per_completion`` (one call per completion, else one per group), ``on_pool``
    (run on the thread pool, else on the event loop)."""

    name: str
    call: Call
    per_completion: bool
    on_pool: bool


def reward_source(cfg: TaskConfig, task: Task, reward_fn: Reward | RewardFn | None = None) -> RewardSource:
    """How a worker scores ``task``: ``reward_fn`` when given (tests, benchmarks), else its
    plug-in (``--task.reward``), else its own reward (see the module docstring)."""
    fn = reward_fn if reward_fn is not None else plugin_reward(task)
    if fn is None:
        own = task.reward
        return RewardSource(f"of the {task.name} task", lambda p, ts, ids: [own(p.text, t, p) for t in ts],
                            False, False)
    name = cfg.reward if reward_fn is None and cfg.reward else getattr(fn, "__qualname__", repr(fn))
    reward = fn if isinstance(fn, (PluginReward, WeightedReward)) else wrap(fn, name)
    return RewardSource(name, reward.score_batch, reward.per_completion, not reward.is_async)


@dataclass(slots=True)
class PendingGroup:
    """A group in flight: its prompt and the episodes finished so far (by index)."""

    group_id: int
    prompt: Prompt
    prompt_ids: tuple[int, ...]
    finished: dict[int, FinishedEpisode] = field(default_factory=dict)
    early: dict[int, Future[list[float]]] = field(default_factory=dict)   # rewards begun per completion


class Scorer:
    """Scores finished groups and evaluations and sends the groups (see the module
    docstring), counting into the worker's counters under its lock; ``fail`` stops the
    worker. Any thread may hand work over; :meth:`drain` waits for all of it."""

    def __init__(self, worker_id: int, n: int, cfg: TaskConfig, source: RewardSource, sender: SenderLike,
                 counters: Counters, lock: threading.Lock, fail: Callable[[BaseException], None], *,
                 give_back: Callable[[int], object] | None = None) -> None:
        self.worker_id, self.n, self.source, self._sender = worker_id, n, source, sender
        self._give_back = give_back   # admitted groups returned (a group with nothing to send)
        self._timeout_s = cfg.reward_timeout_s
        self._fail_fast = {"reward": cfg.reward_errors == "fail", "env": cfg.env_errors == "fail"}
        self._c, self._lock, self._fail = counters, lock, fail
        self._calls = BoundedCalls(cfg.reward_concurrency, cfg.reward_timeout_s, f"reward-{worker_id}",
                                   "--task.reward_timeout_s", self._began, self._ended)
        self._sends = ThreadPoolExecutor(1, thread_name_prefix=f"send-{worker_id}")
        self._jobs: set[Future[None]] = set()
        self._loops = LoopThread(f"rewards-{worker_id}")

    # -- handing work over (any thread) ---------------------------------------------------
    def episode_done(self, pending: PendingGroup, index: int) -> None:
        """Episode ``index`` of ``pending`` finished: a per-completion reward starts scoring it
        now (when the episode brought no reward), while its siblings still run (the group
        waits for it when done)."""
        if self.source.per_completion:
            episode = pending.finished[index]
            if episode.reward is None:
                pending.early[index] = self._loops.submit(self._call(pending.prompt, [episode.text]))

    def group_done(self, pending: PendingGroup) -> None:
        """Score ``pending``'s ``n`` finished episodes (those that brought no reward: by the
        task's reward, on the model's text), build the group's samples and send it."""
        self._submit(self._score_and_send(pending))

    def eval_done(self, pending: PendingEval, version: int) -> None:
        """Score every answer of ``pending`` and set its future (``version``: the serving one)."""
        self._submit(self._score_eval(pending, version))

    def drain(self) -> None:
        """Wait until every group handed over is scored and sent (failures went to ``fail``)."""
        while True:
            with self._lock:
                jobs = list(self._jobs)
            if not jobs:
                return
            for job in jobs:
                try:
                    job.result()
                except Exception:  # noqa: BLE001 -- already handed to fail()
                    pass

    def close(self) -> None:
        """Cancel what is still running, stop the loop and release the threads (a reward
        thread still running is left to finish on its own). Safe to call twice."""
        self._loops.close()
        self._calls.close()
        self._sends.shutdown(wait=True, cancel_futures=True)

    def _submit(self, job: Coroutine[Any, Any, None]) -> None:
        fut = self._loops.submit(job)
        with self._lock:
            self._jobs.add(fut)
        fut.add_done_callback(self._job_done)

    def _job_done(self, fut: Future[None]) -> None:
        with self._lock:
            self._jobs.discard(fut)
        err = None if fut.cancelled() else fut.exception()
        if err is not None:
            self._fail(err)

    # -- on the loop ----------------------------------------------------------------------
    async def _score_and_send(self, pending: PendingGroup) -> None:
        episodes = [pending.finished[i] for i in range(self.n)]
        rewards = await self._rewards(pending, episodes)
        built = group_samples(pending.prompt_ids, episodes, rewards)
        if built.split:
            with self._lock:
                self._c.samples_split += built.split
        if not built.completions:   # nothing to send (an agent that made no request): its grant back
            if self._give_back is not None:
                self._give_back(1)
            return
        group = Group(group_id=pending.group_id, prompt_id=pending.prompt.prompt_id, worker_id=self.worker_id,
                      prompt_ids=_i32(built.prompt_ids), completions=built.completions)
        await self._loops.loop.run_in_executor(self._sends, self._sender.send, group)
        with self._lock:
            self._c.groups_sent += 1

    async def _rewards(self, pending: PendingGroup, episodes: list[FinishedEpisode]) -> list[float]:
        """Each episode's reward: its own, the one begun when it ended, or scored now (in one
        call per group when the reward takes groups)."""
        if pending.early:
            parts = await asyncio.gather(*(asyncio.wrap_future(f) for f in pending.early.values()))
            early = {i: part[0] for i, part in zip(pending.early, parts)}
        else:
            early = {}
        todo = [i for i, e in enumerate(episodes) if e.reward is None and i not in early]
        scored: dict[int, float] = {}
        if todo:
            given = [ids for i in todo if (ids := episodes[i].reward_ids) is not None]
            values = await self.score(pending.prompt, [episodes[i].text for i in todo],
                                      given if len(given) == len(todo) else None)
            scored = dict(zip(todo, values))
        return [e.reward if e.reward is not None else early[i] if i in early else scored[i]
                for i, e in enumerate(episodes)]

    async def _score_eval(self, pending: PendingEval, version: int) -> None:
        try:
            todo = [(i, js) for i in range(len(pending.prompts))   # the answers not scored yet (an
                    if (js := pending.unscored(i))]                # episode's may come scored)
            scored = await asyncio.gather(*(self.score(pending.prompts[i], [pending.texts[(i, j)] for j in js])
                                            for i, js in todo))
            for (i, js), rs in zip(todo, scored):
                pending.rewards.update(((i, j), r) for j, r in zip(js, rs))
            result = pending.score(version_now=version)
        except BaseException as e:
            pending.future.set_exception(e)
            raise
        pending.future.set_result(result)

    async def score(self, prompt: Prompt, texts: Sequence[str], ids: Ids = None) -> list[float]:
        """The rewards of ``texts`` (completions of ``prompt``; ``ids``: their token ids),
        failures and no scores 0."""
        if not self.source.per_completion:
            return await self._call(prompt, texts, ids)
        parts = await asyncio.gather(*(self._call(prompt, [t]) for t in texts))
        return [r for part in parts for r in part]

    async def _call(self, prompt: Prompt, texts: Sequence[str], ids: Ids = None) -> list[float]:
        out = await self._calls.run(self.source.call, prompt, texts, ids, on_pool=self.source.on_pool)
        try:
            if out.error is not None:
                raise out.error
            values = list(out.value)
            if len(values) != len(texts):
                raise ValueError(f"{len(values)} scores for {len(texts)} completions")
        except Exception as e:  # a user's reward must never kill the worker (see _failed)
            return self._failed(prompt, len(texts), e, timeout=out.timed_out)
        return [self._checked(prompt, v) for v in values]

    def _checked(self, prompt: Prompt, value: object) -> float:
        """``value`` as a finite float, counted as a success; ``None`` (no score) counted as
        unscored, 0; else a failure scored 0."""
        try:
            number = finite_or_none(value)
        except Exception as e:  # noqa: BLE001 -- a bad value: counted as the reward's failure
            return self._failed(prompt, 1, e)[0]
        with self._lock:
            if number is None:
                self._c.reward_unscored += 1
            else:
                self._c.reward_ok += 1
        return 0.0 if number is None else number

    def _failed(self, prompt: Prompt, count: int, err: BaseException, *, timeout: bool = False) -> list[float]:
        """Count ``count`` completions of ``prompt`` as failed (``err``) and score them 0;
        the first failure is kept as a line; stop the worker if the policy says so."""
        line = (f"reward {self.source.name} failed on prompt {prompt.prompt_id} "
                f"({_short(prompt.question)}): {first_line(err)}")
        self.failure(line, count, timeout=timeout)
        return [0.0] * count

    def failure(self, line: str, count: int = 1, *, timeout: bool = False, env: bool = False) -> None:
        """Count ``count`` completions scored 0 by a failure (``line``: what failed, one line);
        the first is kept for the driver to print; stop the worker if the policy says so:
        ``--task.env_errors`` and an environment that failed on its first ``REWARD_FAILURES_FATAL``
        episodes without one ending well, for an environment's failure (``env``: counted as
        ``env_errors`` / ``env_timeouts``, one per episode), else ``--task.reward_errors`` and a
        reward that never once answered."""
        with self._lock:
            c = self._c
            if env:   # an episode's environment: counted apart from the reward's failures
                c.env_timeouts += count if timeout else 0
                c.env_errors += 0 if timeout else count
            elif timeout:
                c.reward_timeouts += count
            else:
                c.reward_errors += count
            first = c.reward_first_error is None
            if first:
                c.reward_first_error = line
            hopeless = (not c.env_ok and c.env_errors + c.env_timeouts >= REWARD_FAILURES_FATAL if env else
                        not c.reward_ok and c.reward_errors + c.reward_timeouts >= REWARD_FAILURES_FATAL)
        (log.warning if first else log.debug)("worker %d: %s (scored 0)", self.worker_id, line)
        what = "env" if env else "reward"
        if self._fail_fast[what]:
            self._fail(RewardFailed(f"{line} (--task.{what}_errors fail)"))
        elif hopeless:
            whom = "environment" if env else f"reward {self.source.name}"
            units = "episodes" if env else "completions"
            self._fail(RewardFailed(f"the {whom} failed on all of its first {REWARD_FAILURES_FATAL} "
                                    f"{units}; last: {line}"))

    def _began(self) -> None:
        with self._lock:
            if not self._c.reward_in_flight:
                self._c.reward_busy_since = time.perf_counter()
            self._c.reward_in_flight += 1

    def _ended(self, seconds: float) -> None:
        """A call returned, raised or timed out (its slot freed): count its time."""
        now = time.perf_counter()
        with self._lock:
            c = self._c
            c.reward_calls += 1
            c.reward_s += seconds
            c.reward_in_flight -= 1
            if not c.reward_in_flight:
                c.reward_busy_s += now - c.reward_busy_since


def _short(text: str, limit: int = 40) -> str:
    """``text`` quoted on one line, cut to ``limit`` characters."""
    one = " ".join(text.split())
    return repr(one if len(one) <= limit else one[:limit - 3] + "...")


def _i32(ids: tuple[int, ...]) -> I32:
    return np.asarray(ids, dtype=np.int32)
