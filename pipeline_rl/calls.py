"""Two helpers every process uses around calls to its peers.

- :func:`in_daemon_thread` runs a call that may block on a peer (a worker, the
  buffer) where it can never keep the process alive.
- :func:`first_line` is the one-line form of an error, as every failure message shows it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
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
