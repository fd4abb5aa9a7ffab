"""The admission grants of the replay buffer (``admission.py``'s module docstring states
the admission rule, ``replay.py``'s the straggler rule): per worker, the deadlines of its
grants not yet received, and the counts the admission statistics report. Not
thread-safe: the buffer calls it under its lock."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline_rl.buffer.types import ProcessId


class Grants:
    """Outstanding grants per worker, and the granted / lost / unadmitted counts."""

    def __init__(self) -> None:
        # worker -> deadlines of its grants not yet received, ascending (a grant's
        # deadline: the last trainer version its group can be trained at).
        self.outstanding: dict[int, list[int]] = {}
        self.lives: dict[int, int] = {}   # per worker: how many times it was declared lost
        # per worker: the processes that asked for grants since it was last declared lost; then
        # theirs are dead, and a request of theirs that arrives late is refused. A process is
        # its node, pid and start time (ProcessId), so a new process that reuses a dead one's
        # pid, or has its pid on another node, is not kept out.
        self.requesters: dict[int, set[ProcessId]] = {}
        self.dead: set[tuple[int, ProcessId]] = set()
        self.granted = self.lost = self.unadmitted = 0

    def asked_by(self, worker_id: int, requester: ProcessId) -> bool:
        """Note ``requester`` (a process) asking for ``worker_id``; False when that process
        was declared lost (its request must grant nothing: no one would use the grants)."""
        if (worker_id, requester) in self.dead:
            return False
        self.requesters.setdefault(worker_id, set()).add(requester)
        return True

    def receive(self, worker_id: int, latest: int) -> None:
        """A group of ``worker_id`` arrived that can meet deadlines up to ``latest``."""
        owed = self.outstanding.get(worker_id)
        if owed:
            owed.pop(grant_of(owed, latest))
        else:
            self.unadmitted += 1  # sent without a grant (or after worker_lost): still counted as used

    def grant(self, worker_id: int, count: int, deadline: int) -> None:
        owed = self.outstanding.setdefault(worker_id, [])
        owed.extend([deadline] * count)
        owed.sort()
        self.granted += count

    def release(self, worker_id: int, count: int) -> int:
        owed = self.outstanding.get(worker_id, [])
        refund = min(max(count, 0), len(owed))
        # A worker starts its grants in order, so the ones it gives back are its newest.
        del owed[len(owed) - refund:]
        return refund

    def lose(self, worker_id: int) -> int:
        self.dead |= {(worker_id, r) for r in self.requesters.pop(worker_id, set())}
        refund = len(self.outstanding.pop(worker_id, []))
        self.lost += refund
        self.lives[worker_id] = self.lives.get(worker_id, 0) + 1
        return refund

    def owed(self) -> int:
        return sum(len(owed) for owed in self.outstanding.values())

    def straggler_due(self, version: int) -> bool:
        """A grant not yet received must be trained at ``version`` at the latest."""
        return any(owed and owed[0] <= version for owed in self.outstanding.values())


def grant_of(deadlines: list[int], latest: int) -> int:
    """Index of the grant an arriving group fills, in a worker's ascending grant
    deadlines, given the latest deadline the group can meet (``oldest version +
    staleness``): the last grant with a deadline <= ``latest`` (a group started
    with weights ``v`` can fill any grant whose ``min_version <= v``; taking the
    latest such grant keeps the earlier, more urgent ones waited for). A group
    older than every grant fills the first."""
    return max(0, bisect.bisect_right(deadlines, latest) - 1)
