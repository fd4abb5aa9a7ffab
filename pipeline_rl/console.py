"""The console during long work before the first step: one progress line, nothing else.

:class:`Progress` is a progress bar with its rate and time left (tqdm's), on ONE line:

- on a terminal the line is redrawn in place (at least once a second, so the elapsed
  time moves while a phase without steps runs) and cleared when the work ends;
- elsewhere (a CI log, a pipe, a file) plain lines, one every ``every_s`` seconds and one
  whenever the phase note changes, never carriage returns or bar glyphs.

:func:`quiet_console` sends everything else the process prints meanwhile -- third-party
warnings (DeepSpeed's ``Setting accelerator to CPU``), library progress bars, C-level
prints, this project's own log lines -- to a log file, by pointing file descriptors 1
and 2 there, and hands back a stream on the real console for the progress line.

Invariants: the descriptors are restored and both streams flushed on the way out,
whatever happens inside; nothing here imports torch; a closed :class:`Progress` writes
nothing more (its refresh thread is joined).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

__all__ = ["Phase", "Progress", "quiet_console"]

#: Plain (not a terminal) output: a line at least this often, in seconds.
PLAIN_EVERY_S = 30.0
_PLAIN_FORMAT = "{desc}: {percentage:3.0f}% {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


class Progress:
    """One line of progress for ``total`` units of work (see the module docstring).

    ``total`` may grow (:meth:`set_total`) when the work turns out longer than planned
    (a closed-loop warm start training on past a check); the time left is always to the
    current total. ``tty``: force terminal (True) or plain (False) output; None asks the
    stream."""

    def __init__(self, desc: str, total: int, *, note: str = "", unit: str = "step",
                 stream: TextIO | None = None, tty: bool | None = None, every_s: float = PLAIN_EVERY_S,
                 refresh_s: float = 1.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = tty if tty is not None else _isatty(self.stream)
        self.every_s = every_s
        self._note = note
        self._written = ""
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._began = self._start = time.monotonic()   # the whole work's start; the phase's
        self._last_line = self._start
        self._n, self._total, self._unit, self._desc, self._initial = 0, total, unit, desc, 0
        self._bar = self._new_bar() if self.tty else None
        if self._bar is None:
            self._plain_line()
        self._ticker = threading.Thread(target=self._tick, args=(refresh_s,), name="pipeline_rl-progress",
                                        daemon=True)
        self._ticker.start()

    def update(self, n: int = 1) -> None:
        """``n`` more units done."""
        with self._lock:
            if self._closed.is_set():
                return
            self._n += n
            if self._bar is not None:
                self._bar.update(n)

    def set_total(self, total: int) -> None:
        """The work is now ``total`` units (more or fewer than said before)."""
        with self._lock:
            self._total = total
            if self._bar is not None:
                self._bar.total = total
                self._bar.refresh()

    def phase(self, desc: str, total: int, *, unit: str = "step", n: int = 0, note: str = "") -> "Phase":
        """Count another piece of work on the same line from now on (``n`` of ``total`` done;
        the rate and time left are measured from here); returns the phase it replaces, to go
        back to with :meth:`resume`. A plain output gets a line for where the phase ended and
        one for the new one."""
        with self._lock:
            before = Phase(self._desc, self._total, self._unit, self._n, self._note)
            if self._closed.is_set():
                return before
            if self._bar is None:
                self._plain_line()   # where the phase ended, and when
            self._desc, self._total, self._unit, self._n, self._note = desc, total, unit, n, note
            self._start = time.monotonic()
            self._initial = n   # the rate counts from here
            if self._bar is not None:   # a new bar on the cleared line: no frame mixing the two
                self._bar.close()
                self._bar = self._new_bar()
            else:
                self._plain_line()
            return before

    def resume(self, phase: "Phase", note: str | None = None) -> None:
        """Go back to ``phase`` (as :meth:`phase` returned it), its note replaced by ``note`` if given."""
        self.phase(phase.desc, phase.total, unit=phase.unit, n=phase.n, note=phase.note if note is None else note)

    def note(self, text: str) -> None:
        """Say what runs now (shown after the rate); a plain output gets a line for it."""
        with self._lock:
            if self._closed.is_set() or text == self._note:
                return
            self._note = text
            if self._bar is not None:
                self._bar.set_postfix_str(text)
            else:
                self._plain_line()

    def close(self) -> float:
        """End the line (cleared on a terminal; a last plain line elsewhere); returns the
        seconds since the whole work started. Idempotent."""
        with self._lock:
            if not self._closed.is_set():
                self._closed.set()
                if self._bar is not None:
                    self._bar.close()
                else:
                    self._plain_line()
        if self._ticker is not threading.current_thread():
            self._ticker.join()
        return time.monotonic() - self._began

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def line(self) -> str:
        """The line as plain output writes it now."""
        from tqdm import tqdm

        elapsed = time.monotonic() - self._start
        return tqdm.format_meter(self._n, self._total, elapsed, prefix=self._desc, unit=self._unit,
                                 postfix=self._note or None, bar_format=_PLAIN_FORMAT, initial=self._initial)

    def _new_bar(self) -> Any:
        """A tqdm bar for the current phase (cleared, not left, when closed)."""
        from tqdm import tqdm

        sized = _width(self.stream) > 0   # a terminal that says its width (a bare pty may say 0)
        return tqdm(total=self._total, initial=self._n, desc=self._desc, unit=self._unit, file=self.stream,
                    leave=False, dynamic_ncols=sized, ncols=None if sized else 100, mininterval=0.25,
                    smoothing=0.1, postfix=self._note or None)

    def _plain_line(self) -> None:
        """Write :meth:`line` unless it says what the last one did (caller holds the lock)."""
        self._last_line = time.monotonic()
        text = self.line()
        if text != self._written:
            self._written = text
            self.stream.write(text + "\n")
            self.stream.flush()

    def _tick(self, refresh_s: float) -> None:
        """Keep the elapsed time moving on a terminal; a plain line every ``every_s``."""
        while not self._closed.wait(refresh_s):
            with self._lock:
                if self._closed.is_set():
                    return
                if self._bar is not None:
                    self._bar.refresh()
                elif time.monotonic() - self._last_line >= self.every_s:
                    self._plain_line()


@dataclass(frozen=True)
class Phase:
    """What a :class:`Progress` line counts: ``n`` of ``total`` ``unit``s of ``desc``, and its note."""

    desc: str
    total: int
    unit: str
    n: int
    note: str


def _width(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@contextmanager
def quiet_console(log_path: Path) -> Iterator[TextIO]:
    """Inside: file descriptors 1 and 2 (so ``sys.stdout``, ``sys.stderr``, logging
    handlers on them, and C-level output) append to ``log_path``; yields a line-buffered
    stream on the console's standard error for the one progress line.

    Call only where nothing else should reach the console meanwhile: it is the whole
    process's output (the driver's warm start runs before Ray starts)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    _flush_std()
    try:
        saved_out, saved_err = os.dup(1), os.dup(2)
    except OSError:   # no descriptor 1 or 2 to redirect (a daemon): nothing to keep quiet
        yield sys.stderr
        return
    console = os.fdopen(os.dup(saved_err), "w", buffering=1, encoding="utf-8", errors="replace")
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.dup2(fd, 1)
            os.dup2(fd, 2)
        finally:
            os.close(fd)
        yield console
    finally:
        _flush_std()
        console.close()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass
