"""The one lock and condition every part of the replay buffer shares, and its waits.

Invariant: every change a waiter can use is made under :attr:`BufferLock.lock` and followed
by ``changed.notify_all()``; a wait ends when its ``ready()`` holds, at its deadline, or once
the buffer is closed (then it reports False, so nothing is stored or handed out after close).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class BufferLock:
    """The buffer's lock, its condition (notified on any change a waiter can use) and its
    closed flag. Callers of :meth:`wait` hold :attr:`lock`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.closed = False

    def wait(self, ready: Callable[[], bool], deadline: float | None,
             waited: Callable[[float], None] | None = None) -> bool:
        """Wait on the condition until ``ready()`` or the deadline (None: none); False on
        timeout or close. When it had to wait, ``waited`` (if given) gets the seconds spent."""
        if ready() and not self.closed:
            return True
        start = time.monotonic()
        try:
            while not self.closed and not ready():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self.changed.wait(remaining)
            return not self.closed
        finally:
            if waited is not None:
                waited(time.monotonic() - start)

    def close(self) -> None:
        """Mark the buffer closed and wake every waiter."""
        with self.lock:
            self.closed = True
            self.changed.notify_all()
