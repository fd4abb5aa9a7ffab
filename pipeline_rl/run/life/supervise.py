"""Supervision of a run: every failure becomes one line naming the actor's role and the
innermost cause (:func:`describe_failure`, also through a chain of actor calls), a dead
rollout worker is restarted, and a run that stops progressing (the :class:`Watchdog`:
``max(floor_s, factor x median step time)`` between completed steps) says who waits
for what. No Ray here: actors are typed handles, results come through ``Calls``.

A dead rollout worker is handled here and nowhere else: whoever reads answers from the
workers reads them through :meth:`Supervisor.answers`, and learns what a worker's death
cost it from the :class:`~pipeline_rl.run.remote_calls.WorkerLost` notice (``on_lost``)."""

from __future__ import annotations

import logging
import re
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline_rl.calls import first_line
from pipeline_rl.config import Config
from pipeline_rl.run.remote_calls import (
    ActorDied,
    ActorRaised,
    ActorUnavailable,
    CallFailed,
    Calls,
    NoAnswer,
    WorkerCall,
    WorkerLost,
)
from pipeline_rl.run.life.slots import WorkerSlot

__all__ = ["OrchestratorError", "Supervisor", "Watchdog", "WorkerSlot", "cause_of", "describe_failure", "role_of"]

if TYPE_CHECKING:
    from pipeline_rl.actors.handles import BufferHandle, RolloutHandle, TrainerHandle
    from pipeline_rl.reports import RankStepReport
    from pipeline_rl.run.checkpoints import CheckpointPolicy

log = logging.getLogger("pipeline_rl.run.life.supervise")

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
    completed step, and the bound never falls below ``floor_s``. :meth:`extend` restarts
    the clock without a step (groups keep arriving but are all dropped for equal rewards)
    at most ``max_extensions`` times in a row; a completed step resets the count."""

    floor_s: float
    factor: float = 20.0
    max_extensions: int = 4
    extensions: int = 0
    _last: float = field(default_factory=time.monotonic)
    _times: deque[float] = field(default_factory=lambda: deque(maxlen=50))

    def step_done(self, step_s: float) -> None:
        self._times.append(step_s)
        self._last = time.monotonic()
        self.extensions = 0

    def extend(self) -> bool:
        """Restart the clock once more without a step; False when the extensions are used up."""
        if self.extensions >= self.max_extensions:
            return False
        self.extensions += 1
        self._last = time.monotonic()
        return True

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


class OrchestratorError(RuntimeError):
    """The run cannot go on (a trainer died, no batch came in time, start-up failed); the
    message is the one line the user sees. ``cause``: that line without where to resume
    from; ``restartable``: a failure the run's restart heals (``run/life/heal.py``: a process
    that died, a weight update that failed), not one that would only repeat;
    ``repeat_key``: what makes the same failure twice not worth a third try (None: any);
    ``workers_sound``: the rollout workers may go on into the restarted run (not when the
    failure was one of theirs)."""

    def __init__(self, message: str, *, cause: str | None = None, restartable: bool = False,
                 repeat_key: str | None = None, workers_sound: bool = True) -> None:
        super().__init__(message)
        self.cause = cause if cause is not None else message
        self.restartable, self.repeat_key, self.workers_sound = restartable, repeat_key, workers_sound


#: Innermost causes that mean a process died (Ray's names), not an exception in its code.
_DEATHS = frozenset({"ActorDiedError", "ActorUnavailableError", "RayActorError", "WorkerCrashedError",
                     "OutOfMemoryError", "NodeDiedError", "LocalRayletDiedError"})


def died(e: CallFailed) -> bool:
    """Whether a failed call's actor (or one it called) died, rather than raised."""
    name = type(_innermost(e.error)[1]).__name__.removeprefix("RayTaskError(").removesuffix(")")
    return isinstance(e, ActorDied) or name in _DEATHS


_POLL_S = 0.5
_STOP_GRACE_S = 3.0
_RESTART_TIMEOUT_S = 300.0  # a restarted rollout worker must have its engine up by then
_DEATH_SETTLE_S = 5.0       # a worker call failed as dead: its generation loop's call fails by then too


class Supervisor:
    """Watches every actor while the driver waits for a step; any failure is one
    :class:`OrchestratorError` line (actor, cause, checkpoint to resume from): an exception
    inside an actor method, a dead buffer or trainer, a worker process that died more than
    ``run.max_worker_restarts`` times (before that it is restarted), a stalled run. ``on_lost``
    is told (:class:`WorkerLost`) before a worker is restarted, and when a call to a worker
    failed while its process went on."""

    def __init__(self, cfg: Config, calls: Calls, buffer: BufferHandle, trainers: Sequence[TrainerHandle],
                 workers: Sequence[WorkerSlot], stop: threading.Event, checkpoints: CheckpointPolicy,
                 version: Callable[[], int], on_lost: Callable[[WorkerLost], None] = lambda notice: None) -> None:
        self.cfg, self._calls, self._buffer, self._trainers, self._workers = cfg, calls, buffer, trainers, workers
        self._stop, self._checkpoints, self._version, self._on_lost = stop, checkpoints, version, on_lost
        self.watchdog = Watchdog(cfg.watchdog_s)
        self._dropped_base: int | None = None   # zero-variance count past half the watchdog's bound
        self.abandoned_step = False   # a stop left a train step unfinished: no final checkpoint
        self._buffer_watch = buffer.watch.remote()   # answers only when the buffer fails or closes

    def fail(self, message: str, *, restartable: bool = False, repeat_key: str | None = None,
             workers_sound: bool = True) -> OrchestratorError:
        return OrchestratorError(self._checkpoints.resume_hint(message), cause=message, restartable=restartable,
                                 repeat_key=repeat_key, workers_sound=workers_sound)

    def await_step(self, refs: Sequence[Any]) -> list[RankStepReport] | None:
        """The step's reports (every rank's); None when a stop request abandoned the step.
        Checks the buffer, the workers and the watchdog every ``_POLL_S`` while it waits."""
        pending = list(refs)
        while pending:
            if self._stop.is_set():
                # Let a step already under way finish (a checkpoint taken meanwhile would hold
                # its weights under the previous version's name); give up on one still waiting.
                if self._calls.pending(pending, _STOP_GRACE_S):
                    self.abandoned_step = True
                    return None
                break
            pending = self._calls.pending(pending, _POLL_S)
            self.check()
            if pending and self._stalled_now():
                raise self.fail(self.stalled())
        try:
            reports = [self._calls.get(r) for r in refs]
        except (ActorDied, ActorRaised) as e:
            raise self.trainer_failure(e) from None
        done = [r for r in reports if r is not None]
        if len(done) < len(reports):
            raise self.fail(f"no batch within --trainer.batch_timeout_s={self.cfg.trainer.batch_timeout_s} "
                            f"at version {self._version()}")
        if len({r.result.version for r in done}) != 1:   # ranks step together through their collectives
            raise OrchestratorError(f"trainer ranks disagree on the version after a step: "
                                    f"{sorted({r.result.version for r in done})}")
        return done

    def check(self) -> None:
        """End the run on a failed buffer or worker; restart a worker whose process died."""
        self.check_buffer()
        self.supervise_workers()

    def trainer_failure(self, e: CallFailed) -> OrchestratorError:
        """The line for a failed trainer call: a dead buffer is named as such (a trainer
        waiting on it fails too), else the innermost failing actor."""
        self.check_buffer(probe=True)
        return self.fail(f"{describe_failure(e.error, 'trainer')} (at version {self._version()})",
                         restartable=died(e))

    def check_buffer(self, *, probe: bool = False) -> None:
        """End the run if the buffer's sentinel answered (its receiver thread crashed, or its
        process died); with ``probe``, also ask it directly."""
        why: str | None = None
        if not self._calls.pending([self._buffer_watch], 0):
            try:
                why = self._calls.get(self._buffer_watch) or "it closed while the run was going on"
            except (ActorDied, ActorRaised) as e:
                why = f"its process died ({e})"
        elif probe:
            try:
                self._calls.get(self._buffer.ping.remote(), timeout_s=2.0)
            except NoAnswer:
                pass
            except (ActorDied, ActorRaised) as e:
                why = f"its process died ({e})"
        if why is not None and not self._stop.is_set():
            raise self.fail(f"replay buffer failed: {why}", restartable=why.startswith("its process died"))

    def _stalled_now(self) -> bool:
        """Whether the watchdog fires now. Past half its bound the buffer's zero-variance
        count is noted; when overdue while groups kept arriving since then but every one had
        equal rewards (``--algorithm.skip_zero_variance`` dropped them), one line says so and
        the run gets another bound, a few times in a row (:meth:`Watchdog.extend`)."""
        wd = self.watchdog
        if not self.cfg.algorithm.skip_zero_variance:
            return wd.overdue()
        if wd.waited_s() <= wd.bound_s() / 2:
            self._dropped_base = None
            return False
        if self._dropped_base is None:
            self._dropped_base = self._dropped_count()
            return False
        if not wd.overdue():
            return False
        now, waited, half = self._dropped_count(), wd.waited_s(), wd.bound_s() / 2
        new = now - self._dropped_base if now >= 0 and self._dropped_base >= 0 else 0
        if new <= 0 or not wd.extend():
            return True
        log.warning("no step for %.0f s; %d groups dropped for equal rewards in the last %.0f s "
                    "(--algorithm.skip_zero_variance: the task may be too hard or too easy for the "
                    "model); still generating (%d/%d)", waited, new, half, wd.extensions, wd.max_extensions)
        return False

    def _dropped_count(self) -> int:
        """The buffer's count of groups dropped for equal rewards (-1 when it does not answer)."""
        try:
            return self._calls.get(self._buffer.stats.remote(), timeout_s=2.0).zero_variance
        except CallFailed:
            return -1

    def stalled(self) -> str:
        """Who waits for what, in one line, when the watchdog fires."""
        parts = [f"no step completed for {self.watchdog.waited_s():.0f} s (watchdog bound "
                 f"{self.watchdog.bound_s():.0f} s, --watchdog-s): the trainer waits for a batch of "
                 f"{self.cfg.groups_per_step} groups at version {self._version()}"]
        try:
            buf = self._calls.get(self._buffer.stats.remote(), timeout_s=2.0)
            adm = buf.admission
            skipped = (f", {buf.zero_variance} dropped for equal rewards (--algorithm.skip_zero_variance)"
                       if buf.zero_variance else "")
            parts.append(f"the buffer holds {buf.fill} groups (capacity {buf.capacity}, "
                         f"{sum(buf.evicted.values())} evicted{skipped}); admission budget {adm.used}/{adm.limit} "
                         f"used at version {adm.version}")
        except CallFailed as e:
            parts.append(f"the buffer does not answer ({e})")
        refs = [w.handle.stats.remote() for w in self._workers]
        late = self._calls.pending(refs, 2.0)
        for i, ref in enumerate(refs):
            if ref in late:
                parts.append(f"rollout worker {i} does not answer")
                continue
            st = self._calls.get(ref)
            parts.append(f"rollout worker {i} holds weights v{st.version}, {st.in_flight_groups} "
                         f"groups in flight, {st.groups_sent} sent, "
                         f"{'generating' if st.in_flight_groups else 'idle: no admission'}")
        return "; ".join(parts)

    def supervise_workers(self) -> None:
        """Restart the generation loop of a worker whose process died (its standby takes
        over, or Ray restarts the process) up to ``run.max_worker_restarts`` times; an
        exception raised inside a worker ends the run."""
        runs = [w.run_ref for w in self._workers]
        running = self._calls.pending(runs, 0)
        for w in self._workers:
            if w.run_ref in running or self._stop.is_set():
                w.poll_standby(self._calls)
                continue
            try:
                self._calls.get(w.run_ref)
                why = "its generation loop returned"
            except ActorDied as e:
                why = f"its process died ({e})"
            except CallFailed as e:
                cause = cause_of(e.error)   # a weight update that failed is tried again once
                raise self.fail(f"rollout worker {w.index} failed: {cause} (at version {self._version()})",
                                restartable=cause.startswith("WeightLoadFailed"),
                                repeat_key=f"{cause} (at version {self._version()})", workers_sound=False) from None
            self._restart(w, why)

    def answers(self, calls: Sequence[WorkerCall]) -> list[Any] | None:
        """The answers to ``calls`` made to rollout workers, every one answered (the caller
        waited). None when one failed because its worker's process died or could not be
        reached: the worker is then handled as any dead one (:meth:`supervise_workers`), and
        ``on_lost`` has been told (:class:`WorkerLost`) before this returns, so the caller
        learns there what it lost. Any other failure is raised as it came (``CallFailed``)."""
        out: list[Any] = []
        for call in calls:
            try:
                out.append(self._calls.get(call.ref))
            except ActorDied as e:
                self._call_lost(self._workers[call.index], e)
                return None
        return out

    def _call_lost(self, w: WorkerSlot, e: ActorDied) -> None:
        """A call to ``w`` failed as dead. Its generation loop's call fails with it when its
        process died (within ``_DEATH_SETTLE_S``), and the worker is restarted as usual; when
        that loop goes on (a passing outage, or the run is stopping), the call alone is lost."""
        restarts = w.restarts
        self._calls.pending([w.run_ref], _DEATH_SETTLE_S)
        self.supervise_workers()
        if w.restarts == restarts:
            self._on_lost(WorkerLost(w.index, f"a call to it failed ({e})", restarted=False))

    def _restart(self, w: WorkerSlot, why: str) -> None:
        """Bring ``w`` back (:meth:`_bring_back`), then start its generation loop."""
        if w.restarts >= self.cfg.run.max_worker_restarts:
            raise self.fail(f"rollout worker {w.index} stopped {w.restarts + 1} times, more than "
                            f"--run.max_worker_restarts={self.cfg.run.max_worker_restarts} allows: {why}")
        lost = self._calls.get(self._buffer.worker_lost.remote(w.index))
        w.restarts += 1
        self._on_lost(WorkerLost(w.index, why))
        log.warning("rollout worker %d stopped (%s): restarting, %d in-flight groups lost", w.index, why, lost)
        t0 = time.monotonic()
        how = self._bring_back(w)
        if how is None:
            return
        log.info("rollout worker %d is back after %.1f s (%s)", w.index, time.monotonic() - t0, how)
        # An admission request the dead process sent that reaches the buffer only now grants
        # nothing: the buffer knows that process (its pid) as lost.
        w.start(self._version(), self.cfg.groups_per_step)

    def _bring_back(self, w: WorkerSlot) -> str | None:
        """Whichever is up first takes the slot, with the newest weights: its standby
        (``run/life/slots.py``), or the process Ray restarts (calls to an actor still restarting
        fail as unavailable). Says which; None on a stop request."""
        deadline = time.monotonic() + _RESTART_TIMEOUT_S
        while not self._stop.is_set():
            if w.poll_standby(self._calls) and self._take_over(w):
                return "its standby took over"
            try:
                self._calls.get(w.handle.ready.remote(), timeout_s=_POLL_S)
                self._calls.get(w.handle.take_over.remote(w.core))   # a restarted process starts unpinned
                break
            except NoAnswer:
                pass
            except ActorUnavailable:
                time.sleep(_POLL_S)
            except CallFailed as e:
                raise self.fail(f"rollout worker {w.index} could not be restarted: {cause_of(e.error)}") from None
            if time.monotonic() > deadline:
                raise self.fail(f"rollout worker {w.index} did not come back within {_RESTART_TIMEOUT_S:.0f} s "
                                f"of its restart")
        else:
            return None
        try:
            self._calls.get(self._trainers[0].offer_latest.remote([w.handle]))
        except (ActorDied, ActorRaised) as e:
            raise self.trainer_failure(e) from None
        return "its process was restarted"

    def _take_over(self, w: WorkerSlot) -> bool:
        """Swap ``w``'s standby in: it takes the slot's core and the trainer's publisher
        the new worker list (a worker new to it gets the newest weights at once). False,
        swapped back, when the standby fails meanwhile."""
        failed = w.standby_take_over(self._calls, _POLL_S * 20)
        if failed is not None:
            log.info("rollout worker %d: its standby failed to take over (%s)", w.index, failed)
            return False
        try:
            self._calls.get(self._trainers[0].set_workers.remote([s.handle for s in self._workers]))
        except (ActorDied, ActorRaised) as e:
            raise self.trainer_failure(e) from None
        return True
