"""Supervision helpers of the driver: name the actor behind a failure, and notice
when the run stops making progress.

- :func:`describe_failure` turns whatever a Ray call raised (an exception inside an
  actor method, possibly raised through another actor's call, or an actor process
  that died) into one line naming the actor's role and the innermost cause.
- :class:`Watchdog` bounds the time between two completed steps by
  ``max(floor_s, factor x median step time)`` (the floor alone before the first
  step); the driver asks :meth:`Watchdog.overdue` while it waits and, when it
  answers, reports who waits for what and ends the run.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from pipeline_rl.calls import first_line

_RAY_CALL = re.compile(r"ray::(\w+\.\w+)")

#: Ray actor class name -> the role named in messages.
ROLES = {"BufferActor": "replay buffer", "TrainerActor": "trainer", "RolloutActor": "rollout worker"}


def _innermost(e: BaseException) -> tuple[str | None, BaseException]:
    """(the innermost Ray task's function name, the innermost cause) of ``e``."""
    where: str | None = None
    cause: BaseException = e
    for _ in range(16):  # RayTaskError chains: actor call inside actor call
        # A remote error's text names every ``ray::Class.method`` it went through, the
        # innermost last (its ``function_name`` keeps only the outermost).
        calls = _RAY_CALL.findall(f"{cause}\n{getattr(cause, 'traceback_str', '') or ''}")
        if calls:
            where = calls[-1]
        inner = cause.__dict__.get("cause")
        if not isinstance(inner, BaseException) or inner is cause:
            break
        cause = inner
    return where, cause


def role_of(function_name: str | None) -> str | None:
    """The role of the actor class in a Ray function name (``TrainerActor.train_step``)."""
    if not function_name:
        return None
    for cls, role in ROLES.items():
        if cls in function_name:
            return role
    return None


def cause_of(e: BaseException) -> str:
    """The innermost cause of ``e`` in one line (see :func:`first_line`)."""
    return first_line(_innermost(e)[1])


def describe_failure(e: BaseException, default_role: str) -> str:
    """One line: the role whose call failed (``default_role`` when the error does not
    say) and the innermost cause."""
    where, cause = _innermost(e)
    role = role_of(where) or default_role
    return f"{role} failed: {first_line(cause)}"


@dataclass(slots=True)
class Watchdog:
    """Progress bound between completed steps (see the module docstring).

    Invariant: :meth:`overdue` answers only after ``bound_s()`` seconds without a
    completed step, and the bound never falls below ``floor_s``."""

    floor_s: float
    factor: float = 20.0
    _last: float = field(default_factory=time.monotonic)
    _times: deque[float] = field(default_factory=lambda: deque(maxlen=50))

    def step_done(self, step_s: float) -> None:
        self._times.append(step_s)
        self._last = time.monotonic()

    def touch(self) -> None:
        """Restart the clock without a step (after a checkpoint, which is not a stall)."""
        self._last = time.monotonic()

    def bound_s(self) -> float:
        if not self._times:
            return self.floor_s
        return max(self.floor_s, self.factor * statistics.median(self._times))

    def waited_s(self) -> float:
        return time.monotonic() - self._last

    def overdue(self) -> bool:
        return self.floor_s > 0 and self.waited_s() > self.bound_s()
