"""A multi-rank optimizer step's batch, assembled once and split by rank.

With ``num_ranks=R`` trainer ranks, each calls ``get_batch(n, version, rank=r)`` once per
optimizer step with the same ``version``. The first rank able to do so assembles the whole
step's ``n * R`` groups atomically (under the buffer's lock, after eviction, most urgent
first) and the batch is split by rank: rank ``r`` gets groups ``[r*n, (r+1)*n)``. A rank that
arrives later for the same version takes its slice at once.

Invariants: either every rank of a step gets its groups or none does yet, so ranks cannot
drift apart by a batch; the slices are disjoint and each is taken once. The ranks stay in
step through the trainer's collectives (each optimizer step all-reduces, so no rank asks for
version ``v+1`` before all have finished ``v``). Not thread-safe: the buffer calls it under
its lock.
"""

from __future__ import annotations

from pipeline_rl.samples import Group


class StepSlices:
    """Assembled steps by trainer version, each as its ranks' slices (None once taken), and
    ``held``: the groups assembled but not yet taken."""

    def __init__(self) -> None:
        self._steps: dict[int, list[list[Group] | None]] = {}
        self.held = 0

    def __contains__(self, version: int) -> bool:
        return version in self._steps

    def hold(self, version: int, groups: list[Group], num_ranks: int) -> None:
        """Keep the step at ``version``'s ``groups`` as ``num_ranks`` equal slices, in order."""
        per_rank = len(groups) // num_ranks
        self._steps[version] = [groups[r * per_rank:(r + 1) * per_rank] for r in range(num_ranks)]
        self.held += len(groups)

    def take(self, version: int, rank: int, num_groups: int) -> list[Group]:
        """Rank ``rank``'s slice of the step at ``version`` (held); the step is forgotten once
        every rank took its slice. A second take, or another batch size, is a ValueError."""
        slices = self._steps[version]
        mine = slices[rank]
        if mine is None:
            raise ValueError(f"rank {rank} already took its batch for trainer version {version}")
        if len(mine) != num_groups:
            raise ValueError(f"rank {rank} asked for {num_groups} groups but the step was "
                             f"assembled with {len(mine)} per rank")
        slices[rank] = None
        self.held -= len(mine)
        if all(s is None for s in slices):
            del self._steps[version]
        return mine
