"""A rollout worker's place in the run, as the driver supervises it: the handle generating
now, its generation loop's call, its restarts, and its standby.

Why a standby (``--rollout.standby``): a rollout worker whose process died comes back only
after a cold start of a new process -- Ray reschedules it within a second, but its
constructor imports torch, transformers and vLLM, builds the task and the engine: 13-20 s
of a 2-core machine at load 6, 31 s at load 10 (measured: kill to the next step 12.5-34.5 s,
of which 1-2 s before the new process runs, 1-2 s after it is up; under more load the
start stretches, up to the 120 s the chaos run saw). The standby is that same start done in
advance: a second actor of the same worker, started once start-up is done, unpinned and
with no CPU of Ray's sizing reserved, idle once built. When the worker dies, the standby
takes the slot at once (its core, the newest weights, the loop); the dead worker's handle,
which Ray restarts, becomes the new standby. If the standby is not up yet (a second death
soon after the first), whichever of the two is up first takes the slot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline_rl.run.remote_calls import ActorDied, CallFailed

log = logging.getLogger("pipeline_rl.run.life.slots")

if TYPE_CHECKING:
    from pipeline_rl.actors.handles import RolloutHandle
    from pipeline_rl.resources import CoreSlot
    from pipeline_rl.run.remote_calls import Calls


@dataclass(slots=True)
class WorkerSlot:
    """A rollout worker as the driver supervises it: its handle, its generation loop's
    call in flight, how often its process was restarted, its core slot, and its standby
    (None: none). Invariant: ``handle`` and ``standby`` are two actors of the same worker id;
    only ``handle`` generates."""

    index: int
    handle: RolloutHandle
    run_ref: Any = None
    restarts: int = 0
    core: CoreSlot | None = None
    standby: RolloutHandle | None = None
    standby_up: bool = False
    _standby_ref: Any = None   # its pending ``ready`` (or ``renew``) call
    _renew: Callable[[], Any] | None = None   # makes its ``renew`` call, until one succeeds

    def renew_standby(self, renew: Callable[[], Any]) -> None:
        """Renew the standby for the run's new life (``renew`` makes the call): it is up once
        a renewal answers (:meth:`poll_standby`), not before; one refused because Ray is
        restarting its process is made again (a process that started while the last life
        was ending may have joined that life's buffer)."""
        self._renew = renew
        self.standby_up, self._standby_ref = False, renew()

    def start(self, version: int, groups_per_step: int) -> None:
        """Start (or restart) its generation loop: group ids continue past a resumed run's,
        in a fresh range of 2**28 per restart (ids stay unique; prompts do not repeat)."""
        self.run_ref = self.handle.run.remote((self.restarts << 28) + version * groups_per_step)

    def poll_standby(self, calls: Calls) -> bool:
        """Whether the standby is built and answering, asked without waiting (a standby Ray
        is still restarting fails the call: it is asked again at the next poll)."""
        if self.standby is None or self.standby_up:
            return self.standby_up
        if self._standby_ref is None:
            self._standby_ref = self._renew() if self._renew is not None else self.standby.ready.remote()
        if calls.pending([self._standby_ref], 0):
            return False
        try:
            calls.get(self._standby_ref)
            self.standby_up, self._renew = True, None
        except ActorDied:
            pass   # Ray is restarting its process: asked again at the next poll
        except CallFailed as e:
            if self._renew is not None:   # it could not be renewed: no standby for this life
                log.warning("rollout worker %d: its standby could not be renewed for this life (%s)", self.index, e)
                self.standby, self._renew = None, None
        self._standby_ref = None
        return self.standby_up

    def wait_standby(self, calls: Calls, timeout_s: float) -> bool:
        """Whether the standby is up, waiting up to ``timeout_s`` for its pending call."""
        if self.standby is not None and not self.standby_up and self._standby_ref is not None:
            calls.pending([self._standby_ref], timeout_s)
        return self.poll_standby(calls)

    def standby_take_over(self, calls: Calls, timeout_s: float) -> str | None:
        """The standby takes the slot (:meth:`swap`) and is asked to take over on the slot's
        core (``take_over``), answering within ``timeout_s``. None when it did; else why not
        (one line), swapped back, its standby not up. The one place a standby takes over: the
        supervisor's (a worker died mid-life) and the start of a life's (a carried worker not
        renewed) both come here."""
        self.swap()
        try:
            calls.get(self.handle.take_over.remote(self.core), timeout_s=timeout_s)
            return None
        except CallFailed as e:
            self.swap()
            self.standby_up = False
            return str(e)

    def swap(self) -> None:
        """The standby takes the slot; the old handle (Ray restarts its process) becomes the
        standby, not up until it answers again."""
        assert self.standby is not None, "swap() needs a standby"
        self.handle, self.standby = self.standby, self.handle
        self.standby_up, self._standby_ref, self._renew = False, None, None
