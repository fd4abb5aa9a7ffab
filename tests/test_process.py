"""Actor process helpers: the C-heap trimmer the rollout worker calls between engine steps."""

from __future__ import annotations

from pipeline_rl.actors.process import HeapTrimmer


def test_heap_trimmer_trims_at_most_once_per_interval() -> None:
    calls: list[int] = []
    trimmer = HeapTrimmer(every_s=3600.0)
    trimmer._trim = lambda pad: calls.append(pad) or 1   # record instead of trimming
    for _ in range(5):
        trimmer.maybe_trim()
    assert calls == [0] and trimmer.trims == 1 and trimmer.trim_s >= 0.0


def test_heap_trimmer_releases_freed_memory_on_glibc() -> None:
    """On glibc a real trim runs and returns; elsewhere the trimmer is a no-op."""
    trimmer = HeapTrimmer(every_s=0.0)
    blocks = [bytearray(4096 + i % 7) for i in range(20_000)]
    del blocks[::2]
    trimmer.maybe_trim()
    trimmer.maybe_trim()
    assert trimmer.trims in (0, 2)


def test_heap_trimmer_without_malloc_trim_is_a_no_op() -> None:
    trimmer = HeapTrimmer(every_s=0.0)
    trimmer._trim = None
    trimmer.maybe_trim()
    assert trimmer.trims == 0
