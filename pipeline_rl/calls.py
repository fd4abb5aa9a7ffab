"""Helpers every process uses around calls to its peers and to user code.

- :func:`in_daemon_thread` runs a call that may block on a peer (a worker, the
  buffer) where it can never keep the process alive.
- :class:`LoopThread` is an asyncio event loop on a daemon thread of its own, where a
  rollout worker runs its reward and environment calls off its engine loop.
- :func:`first_line` is the one-line form of an error, as every failure message shows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

_T = TypeVar("_T")


def first_line(e: BaseException) -> str:
    """``Type: first line of the message`` (Ray's multi-line texts cut to their first line)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    name = type(e).__name__
    # Ray re-raises remote exceptions as a class named after the cause; keep the plain name.
    name = name.removeprefix("RayTaskError(").removesuffix(")")
    return f"{name}: {text}" if text else name


def in_daemon_thread(fn: Callable[..., _T], *args: Any) -> "Future[_T]":
    """Run ``fn`` on a daemon thread (one a blocked peer can never keep the process
    alive with, unlike an executor's); its result or error lands in the future."""
    future: Future[_T] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            future.set_exception(e)

    threading.Thread(target=run, name=getattr(fn, "__name__", "call"), daemon=True).start()
    return future


class LoopThread:
    """An asyncio event loop running on a daemon thread named ``name``: :meth:`submit`
    hands it a coroutine from any thread; :meth:`close` cancels what still runs on it
    (waiting at most ``CLOSE_WAIT_S`` per phase), stops and closes it. Invariant: once
    closed, it takes nothing more (``submit`` raises ``RuntimeError``)."""

    CLOSE_WAIT_S = 5.0

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Coroutine[Any, Any, _T]) -> "Future[_T]":
        return asyncio.run_coroutine_threadsafe(job, self.loop)

    @property
    def closed(self) -> bool:
        return self.loop.is_closed()

    def close(self) -> None:
        """Safe to call twice (a call still running in an executor thread is left to end
        on its own)."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            with contextlib.suppress(TimeoutError):
                self.submit(_cancel_all()).result(timeout=self.CLOSE_WAIT_S)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=self.CLOSE_WAIT_S)
        if not self._thread.is_alive():
            self.loop.close()


async def _cancel_all() -> None:
    """Cancel every other task of the running loop and wait for them to end."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
