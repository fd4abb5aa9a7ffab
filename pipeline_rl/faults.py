"""Fault injection for failure tests: make one actor raise at a chosen point.

``--fault POINT@VERSION`` (``Config.fault``; it reaches every actor with the config)
makes the named point raise :class:`InjectedFault` the first time it is reached at a
policy version >= ``VERSION``. Points:

- ``weight_update``: a rollout worker taking new weights (``RolloutWorker.offer_weights``);
- ``engine_step``: a rollout worker's engine step (``RolloutWorker._step``);
- ``trainer_step``: a trainer rank's step (``RankStep``, run by ``TrainerActor.train_step``);
- ``buffer``: the replay buffer handing out a batch (``BufferActor.get_batch``);
- ``engine_start``: a vLLM engine's start, after vLLM built it (``InprocessEngine``,
  ``AsyncEngine``): what it started must be shut down, never left holding the process;
- ``engine_hang``: a rollout worker stops stepping its engine without an error
  (a hung engine), until it is told to stop: the progress watchdog's case;
- ``checkpoint_write``: a trainer rank SIGKILLs its own process while it writes a
  checkpoint (its files are in ``step_N.partial``, the run state is not): what a machine
  dying mid-save leaves behind. The run ends as on any trainer death; the previous
  checkpoint resumes (``benchmarks.chaos`` uses it to kill a run during a write).
- ``trainer_kill``, ``buffer_kill``: a trainer rank (at the start of a step) or the replay
  buffer (handing out a batch) SIGKILLs its own process: what the run's restart
  (``--run.max_restarts``) heals. A restart runs without the fault, unless its version is
  0 (a failure at every start: what the restart cap is for).

Unset (the normal case) every check is one comparison. Nothing here runs at import.
"""

from __future__ import annotations

import os
import signal

FAULT_POINTS = ("weight_update", "engine_step", "trainer_step", "buffer", "engine_hang", "engine_start",
                "checkpoint_write", "trainer_kill", "buffer_kill")


class InjectedFault(RuntimeError):
    """Raised by :func:`inject` at the point the fault spec names."""


def inject(spec: str | None, point: str, version: int) -> None:
    """Raise :class:`InjectedFault` if ``spec`` (``POINT@VERSION`` or None) names ``point``
    and ``version`` has reached the one it gives."""
    if reached(spec, point, version):
        raise InjectedFault(f"injected fault at {point} (version {version})")


def reached(spec: str | None, point: str, version: int) -> bool:
    """True if ``spec`` names ``point`` and ``version`` has reached its version (for
    faults that are not exceptions, such as ``engine_hang``)."""
    if not spec:
        return False
    name, _, at = spec.partition("@")
    return name == point and version >= int(at or 0)


def kill_here(spec: str | None, point: str, version: int) -> None:
    """SIGKILL this process if ``spec`` names ``point`` and ``version`` has reached its
    version (``checkpoint_write``: no handler, no clean-up, as when a machine dies)."""
    if reached(spec, point, version):
        os.kill(os.getpid(), signal.SIGKILL)


def check_fault_spec(spec: str) -> None:
    """Raise ValueError (one line) unless ``spec`` is ``POINT@VERSION`` with a known point."""
    name, _, at = spec.partition("@")
    if name not in FAULT_POINTS or not at.isdigit():
        raise ValueError(f"expected POINT@VERSION with POINT one of {', '.join(FAULT_POINTS)} (got {spec!r})")
