"""The replay buffer's global admission budget: how many new groups rollout workers may start.

Invariant (docs/design.md section 2, AReaL's rule): a grant is made only while
``used <= (staleness + version + 1) * groups_per_step`` after it, where ``used`` counts every
group that was granted and not lost, minus evicted ones (evicted and lost groups, and groups
dropped for zero reward variance, give their slot back, so eviction cannot starve the run)
and ``version`` is the newest trainer version the buffer has seen (from ``get_batch`` or
``set_version``; monotone). If groups arrive in grant order, the i-th useful group is
trained at version ``i // groups_per_step``, so a group started with weights
``>= Admission.min_version`` passes. Every grant carries the last version it can be trained
at (its deadline, ``min_version + staleness``), which the hand-out's straggler wait reads.
A request from a worker or process declared lost grants nothing.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

from pipeline_rl.buffer.buffer_lock import BufferLock
from pipeline_rl.buffer.grants import Grants
from pipeline_rl.buffer.types import Admission, AdmissionStats, ProcessId, _Counters
from pipeline_rl.calls import in_daemon_thread


class AdmissionBudget:
    """Grants under the budget, their refunds, and the trainer version the budget follows.
    Shares the buffer's lock and counters (``groups_in``, ``evicted``)."""

    def __init__(self, lock: BufferLock, counters: _Counters, grants: Grants, *, staleness: int,
                 groups_per_step: int, start_version: int) -> None:
        """``start_version``: the trainer's version when the buffer starts (non-zero when
        resuming, so the budget does not open ``start_version * groups_per_step`` slots at once)."""
        self._lock = lock
        self._c = counters
        self._grants = grants
        self.staleness = staleness
        self.groups_per_step = groups_per_step
        self.version = start_version
        self._used_base = start_version * groups_per_step  # groups "trained" before we started

    def acquire(self, worker_id: int, max_groups: int, timeout_s: float = 0.0,
                requester: ProcessId | None = None) -> Admission:
        """Grant up to ``max_groups`` new groups to ``worker_id`` under the global budget; waits up to
        ``timeout_s`` for a non-zero grant (default: answer now). ``requester``: the asking process."""
        if max_groups < 0:
            raise ValueError(f"max_groups must be >= 0, got {max_groups}")
        deadline = time.monotonic() + timeout_s
        with self._lock.lock:
            # A request held here when its worker is declared lost, or sent by a process declared
            # lost, grants nothing: no one would use the grants, and they would hold budget forever.
            life = self._grants.lives.get(worker_id, 0)
            alive = requester is None or self._grants.asked_by(worker_id, requester)

            def lost() -> bool:
                return not alive or self._grants.lives.get(worker_id, 0) != life

            self._lock.wait(lambda: self.room_locked() > 0 or max_groups == 0 or lost(), deadline)
            granted = 0 if lost() else max(0, min(max_groups, self.room_locked()))
            used_after = self.used_locked() + granted
            # The last granted group is trained at version >= step_of_last; it must
            # then have lag <= staleness.
            step_of_last = max(self.version, (used_after - 1) // self.groups_per_step)
            min_version = max(0, step_of_last - self.staleness)
            if granted:
                self._grants.grant(worker_id, granted, min_version + self.staleness)
            return Admission(granted, self.version, min_version)

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
        with self._lock.lock:
            refund = self._grants.release(worker_id, count)
            self._lock.changed.notify_all()
            return refund

    def worker_lost(self, worker_id: int) -> int:
        """A worker died: refund its grants not yet delivered (granted - received)
        so the global budget cannot deadlock, and count them as lost. Groups of
        that worker still in flight and arriving later are accepted as
        ``unadmitted``. Returns the refund."""
        with self._lock.lock:
            refund = self._grants.lose(worker_id)
            self._lock.changed.notify_all()
            return refund

    def set_version(self, version: int) -> None:
        """Tell the budget the trainer reached ``version`` (monotone: older is ignored)."""
        with self._lock.lock:
            self.observe_locked(version)

    def observe_locked(self, version: int) -> None:
        """:meth:`set_version` for a caller holding the lock."""
        if version < 0:
            raise ValueError(f"trainer version must be >= 0, got {version}")
        if version > self.version:
            self.version = version
            self._lock.changed.notify_all()

    def used_locked(self) -> int:
        evicted = sum(self._c.evicted.values())
        return self._used_base + self._c.groups_in - evicted + self._grants.owed()

    def limit_locked(self) -> int:
        return (self.staleness + self.version + 1) * self.groups_per_step

    def room_locked(self) -> int:
        return self.limit_locked() - self.used_locked()

    def stats_locked(self) -> AdmissionStats:
        """The budget's snapshot, for a caller holding the lock."""
        return AdmissionStats(
            version=self.version, limit=self.limit_locked(), used=self.used_locked(),
            granted=self._grants.granted, outstanding=self._grants.owed(),
            lost=self._grants.lost, unadmitted=self._grants.unadmitted)
