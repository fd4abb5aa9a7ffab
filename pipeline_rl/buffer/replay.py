"""The bounded replay buffer: storage of whole groups in arrival order, staleness
eviction, the global admission budget, and most-urgent-first, multi-rank batch hand-out.

Thread-safe and in-process: the ZeroMQ receiver thread (``server.py``) puts groups, trainer ranks
take batches, rollout workers ask for admission (all three through one Ray actor in a run).

Invariants (checked by the tests):

* ``fill <= capacity_groups`` always; a full buffer makes ``put`` wait (the
  receiver then stops reading its socket, so ZeroMQ blocks the producers):
  nothing is ever dropped for lack of room.
* A group whose lag (trainer version - oldest token version) exceeds
  ``staleness`` at hand-out is evicted and counted (``evicted["stale"]``); it is
  never handed out. Every accepted group is handed out exactly once, evicted
  once, or still stored: ``groups_in == groups_out + evicted + fill + held``.
* Admission (docs/design.md section 2, AReaL's rule): a grant is made only while
  ``used <= (staleness + version + 1) * groups_per_step`` after it, where
  ``used`` counts every group that was granted and not lost, minus evicted ones
  (evicted and lost groups give their slot back, so eviction cannot starve the
  run) and ``version`` is the newest trainer version the buffer has seen (from
  ``get_batch`` or ``set_version``). If groups arrive in grant order, the i-th
  useful group is trained at version ``i // groups_per_step``, so a group
  started with weights ``>= Admission.min_version`` passes.
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

Several trainer ranks (``num_ranks=R``): each rank calls
``get_batch(n, version, rank=r)`` once per optimizer step with the same
``version``. The first rank able to do so assembles the whole step's ``n * R``
groups atomically (under the lock, after eviction, most urgent first) and the
batch is split by rank: rank ``r`` gets groups ``[r*n, (r+1)*n)``. A rank that arrives later
for the same version takes its slice at once. So either every rank of a step
gets its groups or none does yet: ranks cannot drift apart by a batch, and the
slices are disjoint. The ranks themselves stay in step through the trainer's
collectives (each optimizer step all-reduces, so no rank can ask for version
``v+1`` before all have finished ``v``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from pipeline_rl.buffer.grants import Grants
from pipeline_rl.buffer.types import Admission, AdmissionStats, BufferStats, ProcessId, _Counters
from pipeline_rl.samples import Group
from pipeline_rl.calls import in_daemon_thread

# How long a step waits for a straggler at its deadline before it is assembled
# without it (the straggler is then evicted when it arrives). A worker's death
# refunds its grants at once (``worker_lost``), so this bounds only a live but
# slow worker.
STRAGGLER_WAIT_S = 60.0

@dataclass(slots=True)
class _Step:
    """The assembled batch of one multi-rank optimizer step; slice r -> None once taken."""

    slices: list[list[Group] | None]


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
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified on any change a waiter can use
        # The stored groups by oldest token version (the hand-out order), each version's in
        # arrival order, with their arrival numbers: a batch is taken from the lowest versions
        # and eviction drops whole versions -- O(batch + versions), not O(fill).
        self._queue: dict[int, deque[tuple[int, Group]]] = {}
        self._fill = 0      # groups stored (arrival numbers: the buffer's groups_in count)
        self._steps: dict[int, _Step] = {}
        self._wants: list[int] = []  # batch sizes (groups) trainer ranks are waiting for
        self._held = 0
        self._version = start_version
        self._used_base = start_version * groups_per_step  # groups "trained" before we started
        self._grants = Grants()
        self._c = _Counters()
        self._closed = False

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
        with self._lock:
            for group in groups:
                if self.skip_zero_variance and not group.has_signal:
                    self._c.zero_variance += 1
                    self._grants.receive(group.worker_id, group.oldest_version + self.staleness)
                    self._changed.notify_all()  # its budget slot is free again
                    stored += 1
                    continue
                if not self._wait_locked(lambda: self._fill < self.capacity, deadline, "full"):
                    break
                self._append_locked(group)
                stored += 1
            if groups:
                self._c.bytes_in += nbytes * stored // len(groups)
            # Only a waiting trainer rank can use new groups (admission and room do
            # not grow with a put); wake it once its batch is complete, not per put.
            if self._wants and self._fill >= min(self._wants):
                self._changed.notify_all()
        return stored

    def wait_for_space(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until at least one group fits (time spent is
        counted as ``full_wait_s``). False when still full, or closed."""
        with self._lock:
            return self._wait_locked(lambda: self._fill < self.capacity,
                                     time.monotonic() + timeout_s, "full")

    def free_slots(self) -> int:
        """Groups that fit right now (a racy hint for a single producer thread)."""
        return self.capacity - self._fill

    def reject(self, reason: str, count: int = 1) -> None:
        """Count messages the receiver refused (they never entered the buffer)."""
        with self._lock:
            self._c.rejected[reason] = self._c.rejected.get(reason, 0) + count

    def connection_event(self, connected: bool) -> None:
        """Count a producer connecting (True) or disconnecting (False)."""
        with self._lock:
            if connected:
                self._c.connections += 1
            else:
                self._c.disconnections += 1

    def _append_locked(self, group: Group) -> None:
        oldest = group.oldest_version
        same = self._queue.get(oldest)
        if same is None:
            same = self._queue[oldest] = deque()
        same.append((self._c.groups_in, group))
        self._fill += 1
        self._c.groups_in += 1
        self._grants.receive(group.worker_id, oldest + self.staleness)

    # ---------------------------------------------------------------- admission
    def acquire(self, worker_id: int, max_groups: int, timeout_s: float = 0.0,
                requester: ProcessId | None = None) -> Admission:
        """Grant up to ``max_groups`` new groups to ``worker_id`` under the global budget; waits up to
        ``timeout_s`` for a non-zero grant (default: answer now). ``requester``: the asking process."""
        if max_groups < 0:
            raise ValueError(f"max_groups must be >= 0, got {max_groups}")
        deadline = time.monotonic() + timeout_s
        with self._lock:
            # A request held here when its worker is declared lost, or sent by a process declared
            # lost, grants nothing: no one would use the grants, and they would hold budget forever.
            life = self._grants.lives.get(worker_id, 0)
            alive = requester is None or self._grants.asked_by(worker_id, requester)

            def lost() -> bool:
                return not alive or self._grants.lives.get(worker_id, 0) != life

            self._wait_locked(lambda: self._room_locked() > 0 or max_groups == 0 or lost(), deadline, None)
            granted = 0 if lost() else max(0, min(max_groups, self._room_locked()))
            used_after = self._used_locked() + granted
            # The last granted group is trained at version >= step_of_last; it must
            # then have lag <= staleness.
            step_of_last = max(self._version, (used_after - 1) // self.groups_per_step)
            min_version = max(0, step_of_last - self.staleness)
            if granted:
                self._grants.grant(worker_id, granted, min_version + self.staleness)
            return Admission(granted, self._version, min_version)

    def request(self, worker_id: int, max_groups: int, timeout_s: float = 0.0) -> "Future[Admission]":
        """:meth:`acquire` without blocking the caller (a worker in this process): the answer is on the
        future at once when there is room (or ``timeout_s`` is 0), else a helper thread's."""
        now = self.acquire(worker_id, max_groups)
        if now.granted or timeout_s <= 0:
            future: Future[Admission] = Future()
            future.set_result(now)
            return future
        return in_daemon_thread(self.acquire, worker_id, max_groups, timeout_s)

    def release(self, worker_id: int, count: int) -> int:
        """A live worker gives back ``count`` grants it will not use (e.g. it is
        stopping). Returns how many were actually outstanding and refunded."""
        with self._lock:
            refund = self._grants.release(worker_id, count)
            self._changed.notify_all()
            return refund

    def worker_lost(self, worker_id: int) -> int:
        """A worker died: refund its grants not yet delivered (granted - received)
        so the global budget cannot deadlock, and count them as lost. Groups of
        that worker still in flight and arriving later are accepted as
        ``unadmitted``. Returns the refund."""
        with self._lock:
            refund = self._grants.lose(worker_id)
            self._changed.notify_all()
            return refund

    def set_version(self, version: int) -> None:
        """Tell the buffer the trainer reached ``version`` (monotone: older is ignored)."""
        with self._lock:
            self._observe_locked(version)

    def _observe_locked(self, version: int) -> None:
        if version < 0:
            raise ValueError(f"trainer version must be >= 0, got {version}")
        if version > self._version:
            self._version = version
            self._changed.notify_all()

    def _used_locked(self) -> int:
        evicted = sum(self._c.evicted.values())
        return self._used_base + self._c.groups_in - evicted + self._grants.owed()

    def _limit_locked(self) -> int:
        return (self.staleness + self._version + 1) * self.groups_per_step

    def _room_locked(self) -> int:
        return self._limit_locked() - self._used_locked()

    # ---------------------------------------------------------------- consumers
    def get_batch(self, num_groups: int, trainer_version: int, timeout_s: float | None = None,
                  *, rank: int = 0) -> list[Group] | None:
        """Hand ``num_groups`` groups (this rank's share of the step) to a trainer
        rank at ``trainer_version``, most urgent first, after evicting stale ones
        and waiting for stragglers due at this version.

        Blocks up to ``timeout_s`` (None: forever, 0: non-blocking) and returns
        None if the batch is not complete by then (nothing is taken) or the
        buffer is closed. With ``num_ranks > 1`` every rank must ask once per
        version with the same ``num_groups``; see the module docstring."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} outside 0..{self.num_ranks - 1}")
        if num_groups < 1 or num_groups * self.num_ranks > self.capacity:
            raise ValueError(f"num_groups={num_groups} x {self.num_ranks} ranks must be in "
                             f"1..capacity ({self.capacity})")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            self._observe_locked(trainer_version)
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
            step = self._steps.get(version)
            if step is not None:
                return self._take_slice_locked(step, version, rank, num_groups)
            if self._closed:
                return None
            if self._fill >= total:
                if self._grants.straggler_due(version) and self._fill < self.capacity:
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
                    self._steps[version] = _Step([groups[r * num_groups:(r + 1) * num_groups]
                                                  for r in range(self.num_ranks)])
                    self._held += total
                    self._changed.notify_all()
                    continue
            self._wants.append(total)
            try:
                if not self._wait_locked(lambda: self._fill >= total or version in self._steps,
                                         deadline, None):
                    return None
            finally:
                self._wants.remove(total)

    def _wait_straggler_locked(self, total: int, version: int, until: float) -> None:
        """Wait (at most until ``until``) for the grants due at ``version`` to arrive,
        be refunded, or for the buffer to fill; the time counts as ``straggler_wait_s``."""
        start = time.monotonic()
        self._wants.append(total)
        try:
            self._wait_locked(lambda: (not self._grants.straggler_due(version)
                                       or self._fill >= self.capacity
                                       or version in self._steps), until, None)
        finally:
            self._wants.remove(total)
            self._c.straggler_wait_s += time.monotonic() - start

    def _take_slice_locked(self, step: _Step, version: int, rank: int,
                           num_groups: int) -> list[Group]:
        mine = step.slices[rank]
        if mine is None:
            raise ValueError(f"rank {rank} already took its batch for trainer version {version}")
        if len(mine) != num_groups:
            raise ValueError(f"rank {rank} asked for {num_groups} groups but the step was "
                             f"assembled with {len(mine)} per rank")
        step.slices[rank] = None
        self._held -= len(mine)
        if all(s is None for s in step.slices):
            del self._steps[version]
        return mine

    def _assemble_locked(self, total: int, version: int) -> list[Group] | None:
        """Evict the stale groups, then take the ``total`` most urgent fresh ones
        (lowest oldest token version; arrival order among equals). The batch and the
        groups left queued keep arrival order. None (nothing taken) if too few remain."""
        queue, lowest = self._queue, version - self.staleness  # the oldest version still fresh
        stale = sum(len(queue.pop(v)) for v in [v for v in queue if v < lowest])
        if stale:
            self._fill -= stale
            self._c.evicted["stale"] = self._c.evicted.get("stale", 0) + stale
            self._changed.notify_all()  # evictions freed room and budget
        if self._fill < total:
            return None
        taken: list[tuple[int, Group]] = []
        hist = self._c.lag_histogram
        for oldest in sorted(queue):  # most urgent first
            same = queue[oldest]
            count = min(len(same), total - len(taken))
            taken += [same.popleft() for _ in range(count)]
            lag = max(0, version - oldest)
            hist[lag] = hist.get(lag, 0) + count
            if not same:
                del queue[oldest]
            if len(taken) == total:
                break
        taken.sort()  # the batch keeps arrival order (arrival numbers are unique)
        self._fill -= total
        self._c.groups_out += total
        self._changed.notify_all()
        return [group for _, group in taken]

    # ---------------------------------------------------------------- common
    def _wait_locked(self, ready: Callable[[], bool], deadline: float | None, counter: str | None) -> bool:
        """Wait on the condition until ``ready()`` or the deadline; False on
        timeout or close. Time waited is added to ``full_wait_s`` if counter is 'full'."""
        if ready() and not self._closed:
            return True
        start = time.monotonic()
        try:
            while not self._closed and not ready():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._changed.wait(remaining)
            return not self._closed
        finally:
            if counter == "full":
                self._c.full_wait_s += time.monotonic() - start

    def stats(self) -> BufferStats:
        """A consistent snapshot of every counter (taken under the lock)."""
        with self._lock:
            c = self._c
            return BufferStats(
                groups_in=c.groups_in, groups_out=c.groups_out, evicted=dict(c.evicted),
                rejected=dict(c.rejected), fill=self._fill, held=self._held,
                capacity=self.capacity, full_wait_s=c.full_wait_s, consumer_wait_s=c.consumer_wait_s,
                lag_histogram=dict(c.lag_histogram), bytes_in=c.bytes_in,
                straggler_wait_s=c.straggler_wait_s, straggler_timeouts=c.straggler_timeouts,
                zero_variance=c.zero_variance, connections=c.connections, disconnections=c.disconnections,
                admission=AdmissionStats(
                    version=self._version, limit=self._limit_locked(), used=self._used_locked(),
                    granted=self._grants.granted, outstanding=self._grants.owed(),
                    lost=self._grants.lost, unadmitted=self._grants.unadmitted))

    @property
    def version(self) -> int:
        return self._version

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return self._fill

    def close(self) -> None:
        """Wake every waiter; later puts return False and get_batch returns None."""
        with self._lock:
            self._closed = True
            self._changed.notify_all()


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
