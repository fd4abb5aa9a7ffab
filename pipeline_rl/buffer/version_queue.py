"""The replay buffer's store: groups by their oldest token version, each version's in
arrival order, with their arrival numbers.

Invariants: a batch is taken most urgent first (lowest oldest token version, arrival order
among equals) and keeps arrival order; the groups left queued keep theirs; eviction drops
whole versions. Both cost O(batch + versions), not O(fill). Not thread-safe: the buffer
calls it under its lock.
"""

from __future__ import annotations

from collections import deque

from pipeline_rl.samples import Group


class VersionQueue:
    """Stored groups keyed by oldest token version; ``len()`` is how many are stored."""

    def __init__(self) -> None:
        self._by_version: dict[int, deque[tuple[int, Group]]] = {}
        self._fill = 0

    def __len__(self) -> int:
        return self._fill

    def append(self, arrival: int, group: Group) -> None:
        """Store ``group``, the ``arrival``-th the buffer accepted (arrival numbers are unique)."""
        oldest = group.oldest_version
        same = self._by_version.get(oldest)
        if same is None:
            same = self._by_version[oldest] = deque()
        same.append((arrival, group))
        self._fill += 1

    def evict_below(self, lowest: int) -> int:
        """Drop every group whose oldest token version is below ``lowest``; returns how many."""
        queue = self._by_version
        stale = sum(len(queue.pop(v)) for v in [v for v in queue if v < lowest])
        self._fill -= stale
        return stale

    def take(self, total: int, version: int, lag_histogram: dict[int, int]) -> list[Group]:
        """Remove and return the ``total`` most urgent groups (at most ``len(self)``), in arrival
        order, counting each one's lag behind trainer ``version`` in ``lag_histogram``."""
        queue = self._by_version
        taken: list[tuple[int, Group]] = []
        for oldest in sorted(queue):  # most urgent first
            same = queue[oldest]
            count = min(len(same), total - len(taken))
            taken += [same.popleft() for _ in range(count)]
            lag = max(0, version - oldest)
            lag_histogram[lag] = lag_histogram.get(lag, 0) + count
            if not same:
                del queue[oldest]
            if len(taken) == total:
                break
        taken.sort()  # the batch keeps arrival order (arrival numbers are unique)
        self._fill -= len(taken)
        return [group for _, group in taken]
