"""How a checkpoint's writing is seen from every rank and from the driver: whether it moves,
and whether a rank's part of it failed (``training.checkpoint_writer`` writes; this module
only looks). Nothing here needs torch.

A checkpoint is written into ``step_N.partial`` by every rank. In that folder each rank
leaves one marker: ``.written-rank{R}`` (empty) once its files are written, or
``.failed-rank{R}`` (its one-line cause) when its write failed. So any rank, and the driver,
can tell from the folder alone which ranks are done, which failed and why, and whether the
writing still moves.

Invariants:
- progress is a change of the folder's :func:`fingerprint` (files, bytes, newest modification
  time: a file being written grows) or of a writer's count of finished jobs; nothing else;
- :data:`WRITE_STALL_S` without progress while writes are pending is a failure (named by
  :func:`stall_line`); a write of a large state at idle priority, tens of seconds, grows its
  files all along and is never one;
- a failure marker is written aside and renamed, so a reader sees its whole line or none; every
  rank raises the same line for it (:func:`failed_line`): the checkpoint, the rank, the cause.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pipeline_rl.training.checkpoint import CheckpointError

log = logging.getLogger(__name__)

#: How long a checkpoint's writes may go on without progress (module docstring) before that
#: is a failure: far above a write's pauses, far below a run's patience.
WRITE_STALL_S = 30.0
SAMPLE_S = 1.0   # how often progress is sampled (a walk of the checkpoint's files)


class PeerFailed(CheckpointError):
    """Another rank's part of a checkpoint failed or stopped progressing (its line names it)."""


class Progress:
    """Seconds since ``sample()`` last changed (the module docstring's progress), sampled at
    most every ``every_s``; the clock starts at the first sample. Thread-safe."""

    def __init__(self, sample: Callable[[], object], every_s: float = SAMPLE_S) -> None:
        self._sample, self._every_s = sample, every_s
        self._lock = threading.Lock()
        self._seen = sample()
        self._changed = self._sampled = time.monotonic()

    def idle_s(self) -> float:
        with self._lock:
            now = time.monotonic()
            if now - self._sampled >= self._every_s:
                seen, self._sampled = self._sample(), now
                if seen != self._seen:
                    self._seen, self._changed = seen, now
            return now - self._changed

    def restart(self) -> None:
        with self._lock:
            self._changed = time.monotonic()


def fingerprint(folder: Path) -> tuple[int, int, int]:
    """(files, bytes, newest modification time in ns) of everything under ``folder``, zeros
    once it is gone: what changes while a checkpoint is written into it."""
    files = size = newest = 0
    stack = [str(folder)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                    continue
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            files, size, newest = files + 1, size + st.st_size, max(newest, st.st_mtime_ns)
    return files, size, newest


def part_of(where: Path) -> Path:
    """The ``.partial`` folder ``where`` is in (or is); ``where`` itself when none."""
    return next((p for p in (where, *where.parents) if p.name.endswith(".partial")), where)


def written_marker(part: Path, rank: int) -> Path:
    """The empty file rank ``rank`` leaves in ``part`` once its files of it are written."""
    return part / f".written-rank{rank}"


def failed_marker(part: Path, rank: int) -> Path:
    """The file rank ``rank`` leaves in ``part`` when its write of it failed: the one-line cause."""
    return part / f".failed-rank{rank}"


def failed_line(part: Path, rank: int, cause: str) -> str:
    """The one line every rank raises for rank ``rank``'s failed part of ``part``."""
    return f"checkpoint {part.name.removesuffix('.partial')}: rank {rank} failed to write its part: {cause}"


def leave_failure(part: Path, rank: int, cause: str) -> None:
    """Leave rank ``rank``'s failure marker in ``part`` (written aside, then renamed: a reader
    sees all of it or nothing); on a full disk it may be empty, or missing (then the others
    see the stall instead)."""
    marker = failed_marker(part, rank)
    aside = marker.with_name(f"{marker.name}.tmp")
    try:
        try:
            aside.write_text(cause + "\n")
        except OSError:
            aside.touch()   # no room for the line: an empty marker still says it failed
        os.replace(aside, marker)
    except OSError as e:
        log.error("trainer: rank %d could not leave its failure marker in %s: %s", rank, part, e)


def peer_failure(part: Path, world_size: int) -> str | None:
    """The line of the first rank whose failure marker is in ``part`` (:func:`failed_line`), or None."""
    for rank in range(world_size):
        try:
            cause = failed_marker(part, rank).read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            cause = ""
        return failed_line(part, rank, cause or "its cause could not be recorded")
    return None


def stall_line(part: Path, world_size: int, stall_s: float) -> str:
    """One line: ``part``'s writes made no progress for ``stall_s``; the ranks not done."""
    left = [str(r) for r in range(world_size) if not written_marker(part, r).exists()]
    return (f"checkpoint {part.name.removesuffix('.partial')}: no progress writing it for {stall_s:.0f} s "
            f"(rank(s) {', '.join(left) or 'none'} not done)")
