"""Process set-up shared by every actor process (buffer, rollout worker, trainer rank).

- One thread per process and one process per core (on a 2-core machine a second
  thread per process makes a training step 10-20x slower beside a busy neighbour);
  each rollout worker and trainer rank is pinned to its core when the machine has one
  for each (``pipeline_rl.resources.plan_cores``, :func:`pin_to_core`), and the buffer
  (like the driver) keeps off the rollout workers' cores (:func:`keep_off`).
- vLLM runs its engine core in this process, with a bounded CPU KV cache.
- No garbage collection during start-up; what start-up built is frozen after it
  (:func:`end_of_startup`).
- The console stays quiet: unless ``--log-level debug``, the process's standard
  output and error (file descriptors 1 and 2, so the engine's and libraries'
  prints and warnings too) go to ``OUT_DIR/logs/NAME.log``. Failures still reach
  the driver through Ray and end the run with one line there.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline_rl import runtime_env
from pipeline_rl.config import Config
from pipeline_rl.resources import CoreSlot

log = logging.getLogger(__name__)


def setup_actor_process(cfg: Config, name: str, *, uses_torch: bool = True,
                        core: CoreSlot | None = None, avoid: Sequence[CoreSlot] = ()) -> None:
    """Call first in an actor's constructor (see the module docstring); ``name`` names
    its log file (``rollout-0``, ``trainer-1``, ``buffer``); ``core``: the core slot the
    process takes (:func:`pin_to_core`), None to leave it unpinned; ``avoid``: core slots
    an unpinned process keeps off (:func:`keep_off`)."""
    runtime_env.for_actor()
    gc.disable()   # until end_of_startup(): see there
    if cfg.log_level != "debug":
        redirect_output(Path(cfg.out_dir or ".") / "logs" / f"{name}.log")
    if core is not None:
        pin_to_core(core)
        raise_to_parent_priority()
    elif avoid:
        keep_off(avoid)
    if not uses_torch:
        return
    import torch

    torch.set_num_threads(1)


def raise_to_parent_priority() -> int | None:
    """Run every thread of this process (Linux keeps a niceness per thread; threads started
    later inherit their creator's) at its parent's CPU priority, when it runs below it and the system
    lets it rise (root, or a ``RLIMIT_NICE`` that allows it); returns the niceness it took,
    None when it stayed. Why: Ray starts its worker processes (every actor) at niceness 15,
    below the driver and Ray's own processes, and a pinned actor is the work of a run that
    started its own Ray on this machine (its parent, the raylet, runs at the driver's
    priority). Ray's own setting for it is a test-only system config, so the actor sets its
    own process instead. Measured with that setting: median step 4-8% shorter over 11
    alternated runs of 150 steps (28.2-28.9 ms against 30.1-30.6 ms), start-up unchanged."""
    if not hasattr(os, "getpriority"):
        return None
    try:
        mine, parents = os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, os.getppid())
        if parents >= mine:
            return None
        _set_niceness(parents)
    except OSError as e:   # not allowed to rise: it stays where Ray put it
        log.info("stays at niceness %s (%s)", os.getpriority(os.PRIO_PROCESS, 0), e)
        return None
    return parents


#: The niceness of a process built beside the run (:func:`lower_to_idle_priority`).
IDLE_NICENESS = 19


def lower_to_idle_priority() -> int | None:
    """Run every thread of this process at the lowest CPU priority (niceness 19), for a
    process built beside the run for later (a rollout worker's standby, a process Ray
    restarts while the run keeps standbys, a trainer rank's spare): it then takes only the
    CPU time the run's pinned processes leave, and :func:`raise_to_parent_priority` brings
    it back when it takes its place. Lowered only when it could rise again (root, or a
    ``RLIMIT_NICE`` that allows the parent's niceness): an unprivileged process that
    lowered itself could never rise, and would then work at niceness 19 for good. Returns
    the niceness it had before (:func:`restore_priority` goes back to it), None when it stayed.

    Why: a standby built at the run's priority took its share of both cores from the
    pinned worker and trainer for as long as its vLLM start lasted; the default run took
    1.27x as long with it as without it (measured: docs/failures.md)."""
    if not hasattr(os, "getpriority"):
        return None
    try:
        mine, parents = os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, os.getppid())
        if mine >= IDLE_NICENESS or not _may_rise_to(parents):
            return None
        _set_niceness(IDLE_NICENESS)
    except OSError as e:
        log.info("stays at niceness %s (%s)", os.getpriority(os.PRIO_PROCESS, 0), e)
        return None
    return mine


def restore_priority(before: int | None) -> None:
    """Undo :func:`lower_to_idle_priority` (``before``: what it returned; None: nothing to undo)."""
    if before is None:
        return
    try:
        _set_niceness(before)
    except OSError as e:
        log.info("stays at niceness %s (%s)", os.getpriority(os.PRIO_PROCESS, 0), e)


def _may_rise_to(niceness: int) -> bool:
    """Whether this process may set its niceness back to ``niceness`` once lowered."""
    if os.geteuid() == 0:
        return True
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)   # the ceiling is 20 - soft
    return soft == resource.RLIM_INFINITY or 20 - soft <= niceness


def _set_niceness(niceness: int) -> None:
    """Every thread of this process (threads started later inherit their creator's) at ``niceness``."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):   # the thread ended meanwhile
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)


def end_of_startup() -> None:
    """Call when the actor is built (its imports done, its engine up). Every object alive
    now goes to the permanent generation (``gc.freeze``) and the collector, off since
    :func:`setup_actor_process`, runs again.

    Why: the imports (torch, transformers, vLLM, DeepSpeed) allocate millions of
    long-lived objects, and the collector's full passes over them grow with the heap:
    a rollout worker spent 1.26 s of its start-up -- the run's critical path -- in 11
    full collections (the trainer 0.93 s in 8) that freed a few hundred objects in all.
    Frozen, they are never scanned again, so a later full collection only walks what
    the run itself allocated. The few cycles built during start-up stay allocated."""
    gc.freeze()
    gc.enable()


def plan_cpus() -> list[int]:
    """The CPUs core slots index: those this process may run on, in order (an actor's
    process inherits them from the raylet, which started before the driver kept off any)."""
    return sorted(os.sched_getaffinity(0))


def pin_to_core(slot: CoreSlot) -> int | None:
    """Bind every thread of this process to the ``slot.index``-th of the run's CPUs
    (:func:`plan_cpus`: those it may run on; threads started later inherit it); returns that CPU. Nothing is pinned (None, said in the
    log) when there are fewer CPUs than ``slot.of`` or the platform has no CPU affinity
    (not Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = plan_cpus()
    if len(cpus) < slot.of:
        log.info("not pinned: %d CPUs for %d core slots", len(cpus), slot.of)
        return None
    cpu = cpus[slot.index]
    set_affinity({cpu})
    log.info("pinned to CPU %d (core slot %d of %d)", cpu, slot.index, slot.of)
    return cpu


def keep_off(slots: Sequence[CoreSlot]) -> set[int] | None:
    """Let every thread of this process run on the CPUs it may run on now except the
    cores of ``slots`` (the rollout workers': the buffer and the driver keep off them);
    returns the CPUs it could run on before, None when nothing changed (no slots, fewer
    CPUs than the slots are planned for, no CPU left, or no CPU affinity here)."""
    if not slots or not hasattr(os, "sched_setaffinity"):
        return None
    before = set(os.sched_getaffinity(0))
    cpus = plan_cpus()
    if len(cpus) < slots[0].of:
        return None
    rest = before - {cpus[s.index] for s in slots}
    if not rest:
        return None
    set_affinity(rest)
    log.info("kept off CPU(s) %s (the rollout workers'): on %s", sorted(before - rest), sorted(rest))
    return before


def set_affinity(cpus: set[int]) -> None:
    """Bind every thread of this process (and threads started later) to ``cpus``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:   # the thread ended meanwhile
            pass


def redirect_output(path: Path) -> None:
    """Point file descriptors 1 and 2 (and Python's streams) at ``path`` (appended)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
