"""The bounded replay buffer: whole groups stored until a trainer rank takes them, stale
ones evicted, stragglers waited for; the public face of the buffer's rooms.

Thread-safe and in-process: the ZeroMQ receiver thread (``server.py``) puts groups, trainer ranks
take batches, rollout workers ask for admission (all three through one Ray actor in a run).
The rooms, all under one lock (``buffer_lock.py``): the store (``version_queue.py``), the
admission budget (``admission.py``, its invariant there), multi-rank steps (``step_slices.py``).
This module does the waiting: backpressure, a trainer rank's wait, the straggler wait.

Invariants (checked by the tests):

* ``fill <= capacity_groups`` always; a full buffer makes ``put`` wait (the
  receiver then stops reading its socket, so ZeroMQ blocks the producers):
  nothing is ever dropped for lack of room.
* A group whose lag (trainer version - oldest token version) exceeds
  ``staleness`` at hand-out is evicted and counted (``evicted["stale"]``); it is
  never handed out. Every accepted group is handed out exactly once, evicted
  once, or still stored: ``groups_in == groups_out + evicted + fill + held``.
* Stragglers (a grant whose ``min_version + staleness`` is the step being
  assembled) are waited for: every grant carries the last version it can be
  trained at (its *deadline*), and the step at a grant's deadline is not
  assembled while that grant is outstanding -- at most ``straggler_wait_s``,
  and never while the buffer is full (the straggler could not be stored).
  Hand-out is then most-urgent-first (lowest oldest token version, arrival
  order among equals), so a straggler that arrives last is still trained at its
  deadline. Without both, groups granted after a long generation overtake it
  and push it one step past its staleness: it would be evicted although its
  worker honoured ``min_version``. So a worker that honours ``min_version`` never
  has a group evicted, unless the straggler wait runs out (counted as
  ``straggler_timeouts``). ``staleness=0`` is exactly synchronous: only
  the ``groups_per_step`` groups of step ``v`` can be in flight while the
  trainer is at ``v``, they can only be granted once it has reached ``v``, must
  be generated with weights ``v`` (``min_version``), and the trainer waits for
  all of them -- nothing can overtake.
* Groups with no signal (``skip_zero_variance``, DAPO's dynamic sampling): a group
  whose rewards are all equal has zero GRPO advantage everywhere; it is dropped on
  arrival, counted (``zero_variance``), never stored or trained, and gives its budget
  slot back as an evicted group does (it is not in ``groups_in``), so every batch is
  made of groups with signal and the run asks for more groups instead of starving.
* Several trainer ranks (``num_ranks=R``) each take their slice of one atomically
  assembled step (``step_slices.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future

from pipeline_rl.buffer.admission import AdmissionBudget
from pipeline_rl.buffer.buffer_lock import BufferLock
from pipeline_rl.buffer.grants import Grants
from pipeline_rl.buffer.step_slices import StepSlices
from pipeline_rl.buffer.types import Admission, BufferStats, ProcessId, _Counters
from pipeline_rl.buffer.version_queue import VersionQueue
from pipeline_rl.samples import Group

# How long a step waits for a straggler at its deadline before it is assembled
# without it (the straggler is then evicted when it arrives). A worker's death
# refunds its grants at once (``worker_lost``), so this bounds only a live but
# slow worker.
STRAGGLER_WAIT_S = 60.0


class ReplayBuffer:
    """Bounded queue of groups with backpressure, staleness eviction and the
    admission budget. See the module docstring for the invariants."""

    def __init__(self, capacity_groups: int, staleness: int, groups_per_step: int, *,
                 num_ranks: int = 1, start_version: int = 0,
                 straggler_wait_s: float = STRAGGLER_WAIT_S, skip_zero_variance: bool = False) -> None:
        """``groups_per_step``: groups the trainer consumes per optimizer step (all
        ranks together); ``start_version``: the trainer's version when the buffer
        starts (non-zero when resuming, so the admission budget does not open
        ``start_version * groups_per_step`` slots at once); ``straggler_wait_s``:
        how long a step waits for a grant due at it; ``skip_zero_variance``: drop groups
        whose rewards are all equal (module docstring)."""
        _check_positive(capacity_groups=capacity_groups, groups_per_step=groups_per_step,
                        num_ranks=num_ranks)
        if staleness < 0 or start_version < 0 or straggler_wait_s < 0:
            raise ValueError(f"staleness ({staleness}), start_version ({start_version}) and "
                             f"straggler_wait_s ({straggler_wait_s}) must be >= 0")
        if groups_per_step % num_ranks:
            raise ValueError(f"groups_per_step={groups_per_step} must divide evenly over num_ranks={num_ranks}")
        if capacity_groups < groups_per_step:
            raise ValueError(f"capacity_groups={capacity_groups} is below groups_per_step="
                             f"{groups_per_step}: a step's batch could never fit")
        self.capacity = capacity_groups
        self.staleness = staleness
        self.groups_per_step = groups_per_step
        self.num_ranks = num_ranks
        self.straggler_wait_s = straggler_wait_s
        self.skip_zero_variance = skip_zero_variance
        self._lock = BufferLock()
        self._queue = VersionQueue()
        self._steps = StepSlices()
        self._wants: list[int] = []  # batch sizes (groups) trainer ranks are waiting for
        self._grants = Grants()
        self._c = _Counters()
        self._admission = AdmissionBudget(self._lock, self._c, self._grants, staleness=staleness,
                                          groups_per_step=groups_per_step, start_version=start_version)

    # ---------------------------------------------------------------- producers
    def put(self, group: Group, timeout_s: float | None = None, *, nbytes: int = 0) -> bool:
        """Store one group, waiting while the buffer is full. Returns False on
        timeout or once the buffer is closed (the group was not stored)."""
        return self.put_many([group], timeout_s, nbytes=nbytes) == 1

    def put_many(self, groups: Sequence[Group], timeout_s: float | None = None, *,
                 nbytes: int = 0) -> int:
        """Store groups in order, waiting for room; returns how many were stored
        (fewer only on timeout or close; a group dropped for zero reward variance counts as
        taken). ``nbytes``: their wire size, for stats."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stored = 0
        with self._lock.lock:
            for group in groups:
                if self.skip_zero_variance and not group.has_signal:
                    self._c.zero_variance += 1
                    self._grants.receive(group.worker_id, group.oldest_version + self.staleness)
                    self._lock.changed.notify_all()  # its budget slot is free again
                    stored += 1
                    continue
                if not self._wait_for_room_locked(deadline):
                    break
                self._queue.append(self._c.groups_in, group)
                self._c.groups_in += 1
                self._grants.receive(group.worker_id, group.oldest_version + self.staleness)
                stored += 1
            if groups:
                self._c.bytes_in += nbytes * stored // len(groups)
            # Only a waiting trainer rank can use new groups (admission and room do
            # not grow with a put); wake it once its batch is complete, not per put.
            if self._wants and len(self._queue) >= min(self._wants):
                self._lock.changed.notify_all()
        return stored

    def wait_for_space(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until at least one group fits (time spent is
        counted as ``full_wait_s``). False when still full, or closed."""
        with self._lock.lock:
            return self._wait_for_room_locked(time.monotonic() + timeout_s)

    def _wait_for_room_locked(self, deadline: float | None) -> bool:
        def count(seconds: float) -> None:
            self._c.full_wait_s += seconds

        return self._lock.wait(lambda: len(self._queue) < self.capacity, deadline, count)

    def free_slots(self) -> int:
        """Groups that fit right now (a racy hint for a single producer thread)."""
        return self.capacity - len(self._queue)

    def reject(self, reason: str, count: int = 1) -> None:
        """Count messages the receiver refused (they never entered the buffer)."""
        with self._lock.lock:
            self._c.rejected[reason] = self._c.rejected.get(reason, 0) + count

    def connection_event(self, connected: bool) -> None:
        """Count a producer connecting (True) or disconnecting (False)."""
        with self._lock.lock:
            if connected:
                self._c.connections += 1
            else:
                self._c.disconnections += 1

    # ---------------------------------------------------------------- admission (admission.py)
    def acquire(self, worker_id: int, max_groups: int, timeout_s: float = 0.0,
                requester: ProcessId | None = None) -> Admission:
        """:meth:`AdmissionBudget.acquire`: up to ``max_groups`` new groups for ``worker_id``."""
        return self._admission.acquire(worker_id, max_groups, timeout_s, requester)

    def request(self, worker_id: int, max_groups: int, timeout_s: float = 0.0) -> "Future[Admission]":
        """:meth:`AdmissionBudget.request`: :meth:`acquire` without blocking the caller."""
        return self._admission.request(worker_id, max_groups, timeout_s)

    def release(self, worker_id: int, count: int) -> int:
        """:meth:`AdmissionBudget.release`: a live worker's unused grants refunded."""
        return self._admission.release(worker_id, count)

    def worker_lost(self, worker_id: int) -> int:
        """:meth:`AdmissionBudget.worker_lost`: a dead worker's undelivered grants refunded."""
        return self._admission.worker_lost(worker_id)

    def set_version(self, version: int) -> None:
        """Tell the buffer the trainer reached ``version`` (monotone: older is ignored)."""
        self._admission.set_version(version)

    # ---------------------------------------------------------------- consumers
    def get_batch(self, num_groups: int, trainer_version: int, timeout_s: float | None = None,
                  *, rank: int = 0) -> list[Group] | None:
        """Hand ``num_groups`` groups (this rank's share of the step) to a trainer
        rank at ``trainer_version``, most urgent first, after evicting stale ones
        and waiting for stragglers due at this version.

        Blocks up to ``timeout_s`` (None: forever, 0: non-blocking) and returns
        None if the batch is not complete by then (nothing is taken) or the
        buffer is closed. With ``num_ranks > 1`` every rank must ask once per
        version with the same ``num_groups``; see ``step_slices.py``."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} outside 0..{self.num_ranks - 1}")
        if num_groups < 1 or num_groups * self.num_ranks > self.capacity:
            raise ValueError(f"num_groups={num_groups} x {self.num_ranks} ranks must be in "
                             f"1..capacity ({self.capacity})")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock.lock:
            self._admission.observe_locked(trainer_version)
            start = time.monotonic()
            try:
                return self._get_locked(num_groups, trainer_version, rank, deadline)
            finally:
                self._c.consumer_wait_s += time.monotonic() - start

    def _get_locked(self, num_groups: int, version: int, rank: int,
                    deadline: float | None) -> list[Group] | None:
        total = num_groups * self.num_ranks
        straggle_until: float | None = None  # set when this step starts waiting for a straggler
        while True:
            if version in self._steps:
                return self._steps.take(version, rank, num_groups)
            if self._lock.closed:
                return None
            if len(self._queue) >= total:
                if self._grants.straggler_due(version) and len(self._queue) < self.capacity:
                    straggle_until = straggle_until or time.monotonic() + self.straggler_wait_s
                    if time.monotonic() < straggle_until:
                        self._wait_straggler_locked(total, version, straggle_until if deadline is None
                                                    else min(deadline, straggle_until))
                        if deadline is not None and time.monotonic() >= deadline:
                            return None
                        continue
                    self._c.straggler_timeouts += 1
                groups = self._assemble_locked(total, version)
                if groups is not None:
                    if self.num_ranks == 1:
                        return groups
                    self._steps.hold(version, groups, self.num_ranks)
                    self._lock.changed.notify_all()
                    continue
            self._wants.append(total)
            try:
                if not self._lock.wait(lambda: len(self._queue) >= total or version in self._steps,
                                       deadline):
                    return None
            finally:
                self._wants.remove(total)

    def _wait_straggler_locked(self, total: int, version: int, until: float) -> None:
        """Wait (at most until ``until``) for the grants due at ``version`` to arrive,
        be refunded, or for the buffer to fill; the time counts as ``straggler_wait_s``."""
        start = time.monotonic()
        self._wants.append(total)
        try:
            self._lock.wait(lambda: (not self._grants.straggler_due(version)
                                     or len(self._queue) >= self.capacity
                                     or version in self._steps), until)
        finally:
            self._wants.remove(total)
            self._c.straggler_wait_s += time.monotonic() - start

    def _assemble_locked(self, total: int, version: int) -> list[Group] | None:
        """Evict the stale groups, then take the ``total`` most urgent fresh ones
        (``VersionQueue.take``). None (nothing taken) if too few remain."""
        stale = self._queue.evict_below(version - self.staleness)  # the oldest version still fresh
        if stale:
            self._c.evicted["stale"] = self._c.evicted.get("stale", 0) + stale
            self._lock.changed.notify_all()  # evictions freed room and budget
        if len(self._queue) < total:
            return None
        groups = self._queue.take(total, version, self._c.lag_histogram)
        self._c.groups_out += total
        self._lock.changed.notify_all()
        return groups

    # ---------------------------------------------------------------- common
    def stats(self) -> BufferStats:
        """A consistent snapshot of every counter (taken under the lock)."""
        with self._lock.lock:
            c = self._c
            return BufferStats(
                groups_in=c.groups_in, groups_out=c.groups_out, evicted=dict(c.evicted),
                rejected=dict(c.rejected), fill=len(self._queue), held=self._steps.held,
                capacity=self.capacity, full_wait_s=c.full_wait_s, consumer_wait_s=c.consumer_wait_s,
                lag_histogram=dict(c.lag_histogram), bytes_in=c.bytes_in,
                straggler_wait_s=c.straggler_wait_s, straggler_timeouts=c.straggler_timeouts,
                zero_variance=c.zero_variance, connections=c.connections, disconnections=c.disconnections,
                admission=self._admission.stats_locked())

    @property
    def version(self) -> int:
        return self._admission.version

    @property
    def closed(self) -> bool:
        return self._lock.closed

    def __len__(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        """Wake every waiter; later puts return False and get_batch returns None."""
        self._lock.close()


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
