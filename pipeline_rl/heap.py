"""The C heap handed back to the OS between a rollout worker's engine steps (:class:`HeapTrimmer`).
Standard library only: any role may use it."""

from __future__ import annotations


class HeapTrimmer:
    """Hands the C heap's free pages back to the OS, at most once every ``every_s`` seconds.

    Why: glibc's allocator keeps freed memory inside its arenas. A rollout worker frees
    and allocates buffers of ever-changing sizes (batches of sequences of varying
    lengths, oneDNN scratch for each new shape, weights arriving every step), so holes
    accumulate and its resident memory creeps up step after step although nothing
    leaks; ``malloc_trim(0)`` releases the free pages inside the arenas too
    (``benchmarks/soak.py`` measures the slope with and without). A no-op where the C
    library has no ``malloc_trim`` (not glibc).
    """

    def __init__(self, every_s: float = 10.0) -> None:
        import ctypes
        import ctypes.util

        self.every_s = every_s
        self.trims = 0
        self.trim_s = 0.0
        self._next = 0.0
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            self._trim = getattr(libc, "malloc_trim", None)
        except OSError:
            self._trim = None

    def maybe_trim(self) -> None:
        """Trim if ``every_s`` has passed since the last trim (cheap to call often)."""
        import time

        now = time.monotonic()
        if self._trim is None or now < self._next:
            return
        self._trim(0)
        done = time.monotonic()
        self.trims += 1
        self.trim_s += done - now
        self._next = done + self.every_s
