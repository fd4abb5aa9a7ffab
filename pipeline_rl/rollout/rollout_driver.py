"""The one driver of rollouts: a group's copies (and an evaluation's samples) run through the
task's :class:`~pipeline_rl.rollout.rollout_shape.Rollout`, their finished episodes handed on.

Everything here runs on the worker's engine loop (the one thread touching the engine), except
:meth:`RolloutDriver.post`'s callers. The driver steps each episode's coroutine by hand
(``send``): a :class:`~pipeline_rl.rollout.rollout_shape.Generate` it yields is added to the
engine and the coroutine is resumed with the finished sequence when :meth:`collect` is handed
it; an :class:`~pipeline_rl.rollout.rollout_shape.OffLoop` parks it until its ``resume`` is
called (any thread) and the loop's next :meth:`pump`. A group's first requests, when they
are the same prompt under the same sampling (single-turn copies), go in as one
``add_copies`` (the prompt prepared once).

A finished episode is counted (an episode's turn metrics), then it is an evaluation's answer
(``answered``) or one of its group's ``n``: each is handed to the scorer as it ends (a
per-completion reward starts on it at once), and the ``n``-th hands the group over to be
scored and sent. A group is in :attr:`RolloutDriver.pending` from its start until then.

Invariants: an episode's coroutine is in exactly one of ``_awaiting`` (by the request id it
waits for) and ``_parked`` (by its wait's token) between two loop passes, or finished; the
driver is the only code that starts a group's copies (``tests/test_rollout_shape.py``).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from pipeline_rl.rollout.engines.engine import FinishedSequence, GenerationEngine, SamplingConfig
from pipeline_rl.rollout.request_key import RequestKey
from pipeline_rl.rollout.rollout_shape import FinishedEpisode, Generate, OffLoop, Rollout, SideRequests
from pipeline_rl.rollout.scoring import PendingGroup, Scorer
from pipeline_rl.rollout.worker_stats import Counters
from pipeline_rl.tasks.base import Prompt

#: An episode in flight: its rollout's coroutine.
Running = Coroutine[Any, Any, FinishedEpisode]


class RolloutDriver:
    """Runs ``rollout``'s episodes on ``engine`` (module docstring); ``n`` copies per group.
    ``scorer`` takes the groups, ``counters`` (under ``lock``) the episodes' turn metrics,
    ``answered(key, text, versions, reward)`` an evaluation's answers; ``wake`` wakes the
    loop when an off-loop wait is resumed; ``side``: the rollout's own requests (an agent's
    endpoint), pumped each pass and handed their finished answers."""

    def __init__(self, rollout: Rollout, engine: GenerationEngine, n: int, scorer: Scorer, counters: Counters,
                 lock: threading.Lock, wake: Callable[[], None],
                 answered: Callable[[RequestKey, str, np.ndarray, float | None], None],
                 side: SideRequests | None = None) -> None:
        self.rollout, self._engine, self.n, self._scorer = rollout, engine, n, scorer
        self._c, self._clock, self._wake, self._answered, self._side = counters, lock, wake, answered, side
        self.pending: dict[int, PendingGroup] = {}
        self._awaiting: dict[str, Running] = {}   # by the request id the episode waits for
        self._parked: dict[int, Running] = {}     # by the token of its off-loop wait
        self._tokens = itertools.count()
        self._posts: deque[tuple[int, Any]] = deque()
        self._plock = threading.Lock()

    @property
    def waiting(self) -> int:
        """Episodes waiting off the engine (an environment's call, an agent thinking)."""
        parked = len(self._parked)
        return parked if self._side is None else max(0, parked - self._side.in_engine)

    # -- starts --------------------------------------------------------------------------------
    def start_group(self, group_id: int, prompt: Prompt, prompt_ids: tuple[int, ...], sampling: SamplingConfig) -> None:
        """Start a group's ``n`` copies (``RequestKey(group_id, i)``); the group is pending
        until its ``n`` episodes are handed to the scorer."""
        self.pending[group_id] = PendingGroup(group_id, prompt, prompt_ids)
        first: list[tuple[Running, Any]] = []
        for i in range(self.n):
            running = self.rollout(RequestKey(group_id, i), prompt, prompt_ids, sampling)
            try:
                first.append((running, running.send(None)))
            except StopIteration as done:
                self._finished(done.value)
        copies = [(r, c) for r, c in first if type(c) is Generate and _copy(c, prompt_ids, sampling)]
        if copies and len(copies) == len(first):   # the group's copies: the prompt prepared once
            for running, command in copies:
                self._awaiting[command.request_id] = running
            self._engine.add_copies([c.request_id for _, c in copies], prompt_ids, sampling)
            return
        for running, command in first:
            self._dispatch(running, command)

    def start_one(self, key: RequestKey, prompt: Prompt, prompt_ids: tuple[int, ...], sampling: SamplingConfig) -> None:
        """Start one episode on its own (an evaluation's sample)."""
        self._resume(self.rollout(key, prompt, prompt_ids, sampling), None)

    # -- the loop's pass ---------------------------------------------------------------------
    def collect(self, seq: FinishedSequence, key: RequestKey) -> None:
        """A finished sequence (``key``: its request's): the episode awaiting it goes on, or
        the rollout's side requests take it (an agent's answer)."""
        if self._side is not None and key.answer is not None:
            self._side.collect(seq, key)
            return
        self._resume(self._awaiting.pop(seq.request_id), seq)

    def pump(self) -> None:
        """The side requests' pass, then every parked episode whose wait was resumed goes on."""
        if self._side is not None:
            self._side.pump()
        if not self._posts:
            return
        with self._plock:
            posts = list(self._posts)
            self._posts.clear()
        for token, value in posts:
            running = self._parked.pop(token, None)
            if running is not None:   # else: a second resume of one wait, dropped
                self._resume(running, value)

    def post(self, token: int, value: Any) -> None:
        """Resume the wait ``token`` with ``value`` at the loop's next pass (any thread)."""
        with self._plock:
            self._posts.append((token, value))
        self._wake()

    # -- stepping ------------------------------------------------------------------------------
    def _resume(self, running: Running, value: Any) -> None:
        try:
            command = running.send(value)
        except StopIteration as done:
            self._finished(done.value)
            return
        self._dispatch(running, command)

    def _dispatch(self, running: Running, command: Any) -> None:
        if type(command) is Generate:
            self._awaiting[command.request_id] = running
            self._engine.add(command)
        elif type(command) is OffLoop:
            token = next(self._tokens)
            self._parked[token] = running
            command.begin(lambda value: self.post(token, value))
        else:
            running.close()
            raise TypeError(f"a rollout awaited {type(command).__name__}; it may await only Generate or OffLoop")

    def _finished(self, episode: FinishedEpisode) -> None:
        """A finished episode: counted, into its evaluation or its group (complete: to the scorer)."""
        end = episode.end
        if end is not None:
            with self._clock:
                self._c.episode_ended(end.ended, end.turns, end.env_s, end.tool_calls, end.tool_errors, end.metrics)
        key = episode.key
        if key.prompt is not None:
            self._answered(key, episode.text, episode.model_versions, episode.reward)
            return
        group = self.pending[key.group]
        group.finished[key.index] = episode
        self._scorer.episode_done(group, key.index)
        if len(group.finished) == self.n:
            del self.pending[key.group]
            self._scorer.group_done(group)

    def close(self) -> None:
        """Close the episodes still running (their groups stay in :attr:`pending`) and the rollout."""
        for running in [*self._awaiting.values(), *self._parked.values()]:
            running.close()
        self._awaiting.clear()
        self._parked.clear()
        self.rollout.close()


def _copy(command: Generate, prompt_ids: tuple[int, ...], sampling: SamplingConfig) -> bool:
    """Whether ``command`` generates the group's prompt under the group's sampling, as a copy."""
    return ((command.prompt_ids is prompt_ids or command.prompt_ids == prompt_ids)
            and (command.sampling is sampling or command.sampling == sampling))
