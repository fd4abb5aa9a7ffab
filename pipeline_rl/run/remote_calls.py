"""Remote results as the driver's supervision sees them: four outcomes, no Ray types.

:class:`RayCalls` reads them through Ray; the supervisor's tests give stand-ins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pipeline_rl.calls import first_line


class CallFailed(Exception):
    """A remote call that failed; ``error`` is what it raised (first line: the message)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(first_line(error))
        self.error = error


class ActorDied(CallFailed):
    """The actor's process is gone (Ray may be restarting it)."""


class ActorUnavailable(ActorDied):
    """The actor is being restarted and takes no calls yet."""


class NoAnswer(CallFailed):
    """No answer within the timeout."""


class ActorRaised(CallFailed):
    """An exception inside an actor method."""


@dataclass(frozen=True, slots=True)
class WorkerCall:
    """A call made to rollout worker ``index`` (its position among the run's workers) and
    its remote result ``ref``: what the supervisor reads for a caller (``Supervisor.answers``)."""

    index: int
    ref: Any


@dataclass(frozen=True, slots=True)
class WorkerLost:
    """The supervisor's notice that every call to rollout worker ``index`` not answered yet
    is lost (``why``, one line). ``restarted``: its process stopped and was restarted (its
    counters start again from zero); False: one call failed while its process went on."""

    index: int
    why: str
    restarted: bool = True


class Calls(Protocol):
    """``pending``: the refs still unanswered after ``timeout_s``; ``get`` raises a
    :class:`CallFailed` of one of the kinds above."""

    def pending(self, refs: Sequence[Any], timeout_s: float) -> list[Any]: ...

    def get(self, ref: Any, timeout_s: float | None = None) -> Any: ...


class RayCalls:
    """:class:`Calls` through Ray."""

    def pending(self, refs: Sequence[Any], timeout_s: float) -> list[Any]:
        import ray

        if not refs:
            return []
        _, rest = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        return list(rest)

    def get(self, ref: Any, timeout_s: float | None = None) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise NoAnswer(e) from None
        except ray.exceptions.ActorUnavailableError as e:
            raise ActorUnavailable(e) from None
        except ray.exceptions.RayActorError as e:
            raise ActorDied(e) from None
        except ray.exceptions.RayError as e:
            raise ActorRaised(e) from None
