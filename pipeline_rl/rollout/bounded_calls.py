"""Calls to user code that can never stall a rollout worker: the one concurrency-with-timeout
helper the reward scorer (``rollout/scoring.py``) and the environment calls
(``rollout/episodes.py``) share.

:class:`BoundedCalls` runs at most ``concurrency`` calls at once, each bounded by
``timeout_s``, on an event loop it is given (``await calls.run(fn, *args)`` there):

- a coroutine function runs on that loop; past its timeout it is cancelled;
- a plain function runs on the helper's own threads (``on_pool``) or, when told not to,
  on the loop itself (a pure, fast built-in reward);
- a call past its timeout frees its slot at once and for good: a thread cannot be killed,
  so the thread still running it is *abandoned* (it ends when the call returns, and then
  exits) and a replacement thread is started in its place. The pool therefore always has
  ``concurrency`` threads free for the calls holding a slot, however many calls hang.
  Abandoned threads still running are counted (:attr:`BoundedCalls.abandoned`); past
  :data:`ABANDONED_MAX` of them a new call fails at once with one line saying so, instead
  of growing the process without bound.

Invariants: a slot is held from the start of a call until it returns, raises or times out,
never longer; every call ends in one :class:`Outcome` (never an exception, except the
cancellation of the awaiting task itself).
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

#: Abandoned threads (calls still running past their timeout) a helper keeps at most; past
#: it a new call fails at once (a hung dependency, not a slow one: the run says so).
ABANDONED_MAX = 4096


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one call ended: ``value`` when it returned, else ``error`` (what it raised, or a
    ``TimeoutError`` when ``timed_out``); ``seconds`` from its start (its slot taken) to its end."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True, eq=False)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: "Future[Any]"
    abandoned: bool = False


class _Threads:
    """``size`` daemon threads taking jobs from one queue; :meth:`abandon` gives up on a
    running job: a new thread replaces the one running it, which exits once the job returns."""

    def __init__(self, size: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._name, self._made, self._live = name, 0, 0
        self.abandoned = 0   # threads running an abandoned job now
        for _ in range(size):
            self._spawn()

    def _spawn(self) -> None:
        self._made += 1
        self._live += 1
        threading.Thread(target=self._work, name=f"{self._name}-{self._made}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> _Job:
        job = _Job(fn, args, Future())
        self._jobs.put(job)
        return job

    def abandon(self, job: _Job) -> None:
        """Give up on ``job``: not started, it never will; running, its thread is replaced."""
        if job.future.cancel():
            return
        with self._lock:
            if job.future.done() or job.abandoned:
                return
            job.abandoned = True
            self.abandoned += 1
            self._spawn()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                break
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.future.set_result(job.fn(*job.args))
            except BaseException as e:  # noqa: BLE001 -- handed to the waiter
                job.future.set_exception(e)
            with self._lock:
                if job.abandoned:        # a replacement took this thread's place
                    self.abandoned -= 1
                    self._live -= 1
                    return
        with self._lock:
            self._live -= 1

    def close(self) -> None:
        """Stop the threads once their job returns (an abandoned one ends with its call)."""
        with self._lock:
            live = self._live - self.abandoned
        for _ in range(live):
            self._jobs.put(None)


class BoundedCalls:
    """See the module docstring. ``what`` names the timeout flag in the timeout's message;
    ``started``/``ended(seconds)`` are told when a call takes and frees its slot (the
    scorer counts busy time with them). Use :meth:`run` on one event loop only."""

    def __init__(self, concurrency: int, timeout_s: float, name: str, what: str,
                 started: Callable[[], None] | None = None,
                 ended: Callable[[float], None] | None = None) -> None:
        self.concurrency, self.timeout_s, self._what = concurrency, timeout_s, what
        self._threads = _Threads(concurrency, name)
        self._slots: asyncio.Semaphore | None = None   # made on the loop that runs the calls
        self._started, self._ended = started, ended

    @property
    def abandoned(self) -> int:
        """Threads still running a call that timed out."""
        return self._threads.abandoned

    async def run(self, fn: Callable[..., Any], *args: Any, on_pool: bool | None = None) -> Outcome:
        """``fn(*args)`` within a slot and the timeout (``on_pool``: run a plain function on the
        threads; None: yes unless ``fn`` is a coroutine function). An awaitable it returns is
        awaited within the same timeout."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrency)
        if on_pool is None:
            on_pool = not _is_async(fn)
        async with self._slots:
            if on_pool and self._threads.abandoned >= ABANDONED_MAX:
                return Outcome(error=RuntimeError(f"{ABANDONED_MAX} calls still running past their timeout "
                                                  f"({self._what}); new calls refused"))
            if self._started is not None:
                self._started()
            start = time.perf_counter()
            try:
                return await self._outcome(fn, args, on_pool, start)
            finally:   # also when the awaiting task is cancelled (the worker closing)
                if self._ended is not None:
                    self._ended(time.perf_counter() - start)

    async def _outcome(self, fn: Callable[..., Any], args: tuple[Any, ...], on_pool: bool, start: float) -> Outcome:
        job: _Job | None = None
        try:
            if on_pool:
                job = self._threads.submit(fn, args)
                running = asyncio.wrap_future(job.future)
                done, _ = await asyncio.wait({running}, timeout=self.timeout_s)
                if not done:
                    running.add_done_callback(_retrieved)   # it may still fail, unobserved
                    raise asyncio.TimeoutError
                value = running.result()
            else:
                value = fn(*args)
            if inspect.isawaitable(value):
                left = self.timeout_s - (time.perf_counter() - start)
                value = await asyncio.wait_for(value, max(left, 0.0))
        except asyncio.TimeoutError:
            if job is not None:
                self._threads.abandon(job)
            return Outcome(error=TimeoutError(f"no answer within {self.timeout_s:g} s ({self._what})"),
                           timed_out=True, seconds=time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001 -- user code's failure is the caller's to report
            return Outcome(error=e, seconds=time.perf_counter() - start)
        return Outcome(value=value, seconds=time.perf_counter() - start)

    def close(self) -> None:
        """Release the threads (a call still running is left to end on its own)."""
        self._threads.close()


def _retrieved(fut: "asyncio.Future[Any]") -> None:
    if not fut.cancelled():
        fut.exception()


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
