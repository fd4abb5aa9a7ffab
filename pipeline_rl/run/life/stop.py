"""Stopping a life's actors: wound down in bounded phases at the run's end, killed at once
when the life ends in a failure a restart heals (its successor must not wait on them). What
goes on into the next life (``run/life/carry.py``) is left out by the caller.

Invariants: every phase is bounded by ``_SHUTDOWN_WAIT_S`` (a failed run must still end
within seconds); nothing here raises (a step that fails is logged at debug and skipped).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline_rl.actors.handles import BufferHandle, TrainerHandle
    from pipeline_rl.run.life.slots import WorkerSlot

log = logging.getLogger("pipeline_rl.run.life.stop")

_SHUTDOWN_WAIT_S = 5.0  # per shutdown phase: a failed run must still end within seconds


def stop_actors(buffer: BufferHandle | None, trainers: Sequence[TrainerHandle], workers: Sequence[WorkerSlot],
                graceful: bool = True) -> None:
    """Stop every actor, each phase bounded by ``_SHUTDOWN_WAIT_S``: workers stop generating,
    trainers close their publishers, the buffer closes; then all are killed. Not ``graceful``
    (a life of the run that is about to restart), all are killed at once: a worker blocked
    sending to a dead buffer, or to a full one that a dead trainer no longer drains, would
    hold its phase for the whole bound."""
    import ray

    if not ray.is_initialized():
        return
    if not graceful:
        _kill_all(buffer, trainers, workers)
        return
    for w in workers:
        _quiet(lambda: w.handle.stop.remote())
    runs = [w.run_ref for w in workers if w.run_ref is not None]
    if runs:
        _quiet(lambda: ray.wait(runs, num_returns=len(runs), timeout=_SHUTDOWN_WAIT_S))
    closing = [t.close.remote() for t in trainers]
    if closing:
        _quiet(lambda: ray.wait(closing, num_returns=len(closing), timeout=_SHUTDOWN_WAIT_S))
    if buffer is not None:
        _quiet(lambda: ray.get(buffer.close.remote(), timeout=_SHUTDOWN_WAIT_S))
    _kill_all(buffer, trainers, workers)


def _kill_all(buffer: BufferHandle | None, trainers: Sequence[TrainerHandle], workers: Sequence[WorkerSlot]) -> None:
    handles: list[Any] = [w.handle for w in workers] + [w.standby for w in workers] + list(trainers) + [buffer]
    for handle in handles:
        kill(handle)


def kill(handle: Any) -> None:
    """Kill an actor (None: nothing), never raising."""
    import ray

    if handle is not None:
        _quiet(lambda: ray.kill(handle))


def _quiet(fn: Callable[[], object]) -> None:
    """Best-effort shutdown step: log, never raise."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - shutdown must go on
        log.debug("shutdown step failed: %s", e)
