"""The chaos benchmark's kills of one actor (``benchmarks.chaos``): which process to kill,
and what each kill cost, read from the run's records once it ended.

- a rollout worker: the busiest ``ray::RolloutActor`` process (its standby idles); the run
  goes on, the standby or Ray's restart takes its place;
- a trainer rank or the replay buffer: ``trainer0`` or ``buffer`` (``benchmarks.soak``'s
  names); the run restarts itself in the same process from its newest checkpoint
  (``--run.max_restarts``), which ``resumes.jsonl`` marks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.soak import actor_pids


@dataclass(slots=True)
class ActorKill:
    """A trainer rank or the buffer killed after ``step`` (``kind``: trainer, buffer, or
    ``trainer (in a save)`` for the ``checkpoint_write`` fault). Filled in afterwards: the
    checkpoint step the run restarted from, the steps lost (``step - resumed_at``), the
    time from the kill to the first step after the restart (``back_s``) and to being back
    at the killed step (``time_lost_s``)."""

    kind: str
    step: int
    at: float
    buffer_fill: int
    resumed_at: int | None = None
    steps_lost: int | None = None
    back_s: float | None = None
    time_lost_s: float | None = None


def busiest_worker() -> int | None:
    """The pid of the rollout worker that is generating: of the ``RolloutActor`` processes
    built (Ray titles one still in its constructor ``ray::RolloutActor.__init__``), the one
    that used the most CPU over 0.3 s (a standby idles once built)."""
    import psutil

    procs = []
    for name, pid in actor_pids().items():
        if name.startswith("rollout"):
            try:
                p = psutil.Process(pid)
                if (p.cmdline() or [""])[0].endswith("__init__"):
                    continue
                procs.append((p, p.cpu_times().user + p.cpu_times().system))
            except psutil.NoSuchProcess:
                continue
    time.sleep(0.3)
    busy = []
    for p, before in procs:
        try:
            busy.append((p.cpu_times().user + p.cpu_times().system - before, p.pid))
        except psutil.NoSuchProcess:
            continue
    return max(busy)[1] if busy else None


def actor_pid(kind: str) -> int | None:
    """The pid of the trainer's rank 0 (``trainer``) or of the buffer (``buffer``)."""
    return actor_pids().get("trainer0" if kind == "trainer" else "buffer")


def resolve(kills: list[ActorKill], marks: list[Any], rows: list[tuple[int, Any]],
            taken: set[int]) -> list[ActorKill]:
    """Fill in each kill from the resume marks (``run_folder.ResumeMark``) and the rows
    seen ((segment, ``chaos.Row``)): the first mark after the kill not ``taken`` (by a
    whole-run kill's resume) is its restart. A mark no kill claims is the restart after the
    ``checkpoint_write`` fault (returned as a new kill, dated by its last step before)."""
    left = [(i, m) for i, m in enumerate(marks) if i not in taken]
    for k in sorted(kills, key=lambda k: k.at):
        found = next(((i, m) for i, m in left if m.unix_time_s > k.at), None)
        if found is None:
            continue
        left.remove(found)
        _fill(k, found[1], rows)
    extra = []
    for _, m in left:
        before = [r for _, r in rows if r.at < m.unix_time_s]
        if before:
            k = ActorKill("trainer (in a save)", before[-1].step, before[-1].at, before[-1].buffer_fill)
            _fill(k, m, rows)
            extra.append(k)
    return extra


def _fill(k: ActorKill, mark: Any, rows: list[tuple[int, Any]]) -> None:
    k.resumed_at, k.steps_lost = mark.resumed_at, k.step - mark.resumed_at
    after = [r for _, r in rows if r.at > mark.unix_time_s]
    killed = [r for _, r in rows if r.at <= k.at and r.step == k.step]
    again = next((r for r in after if r.step >= k.step), None)
    k.back_s = after[0].at - k.at if after else None
    k.time_lost_s = again.at - killed[-1].at if again is not None and killed else None


def marks_of(folder: Path) -> list[Any]:
    from pipeline_rl.run.life.run_folder import read_resumes

    return read_resumes(folder)
