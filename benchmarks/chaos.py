"""Chaos benchmark: a long run on a machine that keeps failing still finishes, with nothing
trained twice and little lost, and heals itself: only a whole-run kill needs ``--resume``.

Usage::

    python -m benchmarks.chaos [--steps 2000] [--worker-kills 10] [--trainer-kills 3]
                               [--buffer-kills 2] [--run-kills 2] [--checkpoint-every 100]
                               [--seed 0] [--eval-prompts 128] [--no-baseline] [--out DIR]
                               [--json PATH] [--md PATH] [--quick] [-- PIPELINE FLAGS]

What happens. ``launch/async_grpo.py`` (the default run, ``--max-steps --steps``,
``--trainer.checkpoint_every``, ``--run.max_worker_restarts`` above the number of worker kills,
``--eval.num_prompts --eval-prompts``: see :data:`EVAL_PROMPTS`)
runs as a child process in a process group of its own, writing to ``OUT/chaos``. This
process follows its ``metrics.jsonl`` and, as the steps pass points fixed in advance:

- every ``steps / (worker_kills + 1)`` steps, SIGKILLs the rollout worker that is
  generating (``benchmarks.chaos_kills``; public API only): its standby or Ray's restart
  takes its place, the run goes on;
- at evenly spaced steps between those, SIGKILLs the trainer's rank 0 or the replay buffer
  (``--trainer-kills``, ``--buffer-kills``): the run restarts itself in the same process from
  its newest checkpoint (``--run.max_restarts``). One of the trainer kills strikes during a
  periodic checkpoint write: the launch carries ``--fault checkpoint_write@N``, so the rank
  SIGKILLs itself while it writes ``step_N.partial`` (a save of a small model takes
  milliseconds, too short to hit from outside); the restart must tidy the killed save and
  take the checkpoint before;
- at ``--run-kills`` random steps (seeded), SIGKILLs the whole run at once -- every process
  under it and its process group -- and starts it again with ``--resume OUT/chaos``, the
  only human act. No kill falls in the few steps after another.

Then, unless ``--no-baseline``, the same run unbroken (same flags and seed) in
``OUT/unbroken``. Everything is bounded: a run that completes no step for ``--stall-s``
(start-up included) is killed and reported, and the whole benchmark ends after
``--max-wall-s``.

Reported: steps reached against the target; steps in ``metrics.jsonl`` twice or missing
(and the same for ``eval.jsonl``); per worker kill, the groups lost in flight (the run's
``groups_lost`` counter across the restart), the time from the kill to the first step after
the worker is back (its first new samples: the buffer holds at most a few groups) and the
time lost (those steps' wall time, plus 5, less as many median steps); per trainer, buffer
or whole-run kill, the step killed at, the checkpoint it restarted from, the steps lost (at
most one checkpoint interval), the groups the buffer held (lost with it), the time from the
kill to the first new step and to being back at the killed step; the final held-out greedy
accuracy against the unbroken run's; the wall time against the unbroken run's. The exit
status is 1 when the run did not reach the target or a step is twice or missing in
``metrics.jsonl``. Both columns carry this invocation's stamp (``sources``:
:func:`benchmarks.chaos_report.invocation`), so a column rerun apart shows on the page.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, BadFlag, Outcome, at_least, hardware, main as bench_main
from benchmarks.chaos_kills import ActorKill, actor_pid, busiest_worker, marks_of, resolve as resolve_kills
from benchmarks.chaos_report import acceptance, invocation, markdown, records

_POLL_S = 0.1
#: Held-out prompts per evaluation in both runs. The final greedy accuracy is compared with the
#: unbroken run's to within 0.1; with the run's default 32 prompts one evaluation moved by up to
#: 0.2 between evaluations 50 steps apart of the *unbroken* run (1.000 -> 0.781), so the check
#: read the noise of 32 greedy answers more than the restarts. 128 prompts cost both runs alike
#: (the tiny model answers them in well under a second per evaluation).
EVAL_PROMPTS = 128
#: How many steps after its planned step a kill may land: the harness polls metrics.jsonl and
#: kills from outside while the run goes on (a tiny model's step takes ~50 ms on 2 cores), so
#: the plan keeps this much room after each kill before the next one.
_LATE = 8


@dataclass(frozen=True, slots=True)
class Row:
    """What the benchmark reads of one ``metrics.jsonl`` row."""

    step: int
    at: float
    groups_lost: float
    worker_restarts: float
    buffer_fill: int

    @classmethod
    def of(cls, rec: dict[str, Any]) -> "Row":
        return cls(int(rec["step"]), float(rec["unix_time_s"]), float(rec.get("groups_lost", 0.0)),
                   float(rec.get("worker_restarts", 0.0)), int(rec.get("buffer_fill", 0)))


@dataclass(slots=True)
class WorkerKill:
    """One rollout worker SIGKILLed after ``step`` (of run segment ``segment``)."""

    step: int
    at: float
    segment: int
    pid: int
    restart_step: int | None = None
    groups_lost: float | None = None
    back_s: float | None = None
    time_lost_s: float | None = None


@dataclass(slots=True)
class RunKill:
    """The whole run SIGKILLed after ``step``."""

    step: int
    at: float
    segment: int
    buffer_fill: int
    outside_group: int
    resumed_at: int | None = None
    steps_lost: int | None = None
    restart_s: float | None = None
    time_lost_s: float | None = None


@dataclass(slots=True)
class Timeline:
    """Every row seen, in order, with the segment (the run's launch) it came from."""

    rows: list[tuple[int, Row]] = field(default_factory=list)

    def after(self, segment: int, at: float) -> list[Row]:
        return [r for s, r in self.rows if s == segment and r.at > at]

    def last_before(self, segment: int, at: float) -> Row | None:
        """The segment's last row at or before ``at`` (None: none yet)."""
        return next((r for s, r in reversed(self.rows) if s == segment and r.at <= at), None)


def resolve_worker_kill(k: WorkerKill, timeline: Timeline, med: float, restart_at: float | None) -> None:
    """Fill in what worker kill ``k`` cost. The worker is back at the first row that counts one
    more worker restart; or, when the run restarted itself first (a trainer kill before the
    worker was back: every worker is new), at the first row after that restart (``restart_at``;
    the run's counters start again from zero there). Its time lost ends at ``back`` + 5 steps
    or at that restart, whichever comes first."""
    after = timeline.after(k.segment, k.at)
    base = timeline.last_before(k.segment, k.at)
    if base is None:
        return
    first = [r for r in after if restart_at is None or r.at < restart_at]
    back = next((r for r in first if r.worker_restarts > base.worker_restarts), None)
    if back is None:
        back = next((r for r in after if restart_at is not None and r.at > restart_at), None)
    if back is None:
        return
    k.restart_step, k.back_s = back.step, back.at - k.at
    # The cost is counted within the run's life the kill fell in: a run restart after it
    # is the restart's own cost (its rows start again from the checkpoint's step).
    window = [r for r in first if r.step <= back.step + 5] or [base]
    k.groups_lost = max(r.groups_lost for r in window) - base.groups_lost
    end = window[-1]
    k.time_lost_s = end.at - base.at - (end.step - base.step) * med


class Launch:
    """One launch of the run: a child process in a process group of its own."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self._log = log.open("w")
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "launch" / "async_grpo.py"), *argv], cwd=ROOT,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.log = log

    def below(self) -> list[Any]:
        """The processes under the run now (psutil), to find those that outlive its group."""
        import psutil

        try:
            return [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self, below: list[Any] | None = None) -> int:
        """SIGKILL the whole run at once, as a machine that dies would: every process of
        ``below`` (default: those under the run now) and the process group; the number of
        those outside the group (Ray starts its own processes in sessions of their own, the
        actors among them, so a group kill alone would leave a trainer finishing its save)."""
        import psutil

        below = self.below() if below is None else below
        outside = 0
        for p in below:
            try:
                outside += os.getpgid(p.pid) != self.proc.pid
                p.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        psutil.wait_procs(below, timeout=10)
        self._log.close()
        return outside

    def tail(self) -> str:
        lines = [x for x in self.log.read_text(errors="replace").splitlines() if x.strip()]
        return lines[-1] if lines else "(no output)"


class Tail:
    """``metrics.jsonl`` as it grows (read again from the start when a resume rewrote it)."""

    def __init__(self, path: Path) -> None:
        self.path, self._offset, self._after = path, 0, 0
        self._resumes = 0   # resumes the tail has seen (a resume rewrites the file)

    def new_rows(self) -> list[Row]:
        from pipeline_rl.run.life.run_folder import read_resumes

        marks = read_resumes(self.path.parent)   # written after the rewrite: from then on, read anew
        if len(marks) > self._resumes:
            self._resumes, self._offset, self._after = len(marks), 0, marks[-1].resumed_at
        if not self.path.exists():
            return []
        with self.path.open() as f:
            f.seek(self._offset)
            text = f.read()
        end = text.rfind("\n") + 1   # a line being written waits for the next poll
        self._offset += len(text[:end].encode())
        rows = [Row.of(json.loads(x)) for x in text[:end].splitlines() if x.strip()]
        return [r for r in rows if r.step > self._after]


@dataclass(slots=True)
class Plan:
    """The kills, fixed in advance from the seed: the steps after which a worker dies, those
    after which the trainer or the buffer dies (``actor_at``: (step, kind)), and those after
    which the whole run dies; ``in_save``: the periodic checkpoint (from the second on) whose
    write one trainer kill interrupts (the ``checkpoint_write`` fault). No two kills fall
    within a few steps of each other, and none is planned fewer than ``_LATE`` steps before
    another or before the run's end (a kill from outside lands late)."""

    worker_at: list[int]
    actor_at: list[tuple[int, str]]
    run_at: list[int]
    in_save: int | None

    @classmethod
    def make(cls, steps: int, worker_kills: int, trainer_kills: int, buffer_kills: int, run_kills: int,
             every: int, seed: int) -> "Plan":
        rng = random.Random(seed)
        worker_at = [round((i + 1) * steps / (worker_kills + 1)) for i in range(worker_kills)]
        busy = {s for w in worker_at for s in range(w - 2 - _LATE, w + 8)}
        saves = [s for s in range(2 * every, steps, every) if s not in busy]
        save = rng.choice(saves) if saves and trainer_kills else None
        if save is not None:   # a kill planned before the save lands up to _LATE steps later
            busy |= set(range(save - 4 - _LATE, save + 8))
        kinds = ["trainer"] * (trainer_kills - (save is not None)) + ["buffer"] * buffer_kills
        rng.shuffle(kinds)
        actor_at = []
        for i, kind in enumerate(kinds):
            at = next((s for s in range(round((i + 0.5) * steps / (len(kinds) + 0.5)), steps - 1)
                       if s > every and s not in busy), None)
            if at is not None:
                actor_at.append((at, kind))
                busy |= set(range(at - 4 - _LATE, at + 8 + _LATE))
        pool = sorted(set(range(every + 1, steps - 1 - _LATE)) - busy)
        run_at = sorted(rng.sample(pool, min(len(pool), run_kills)))
        return cls(worker_at, sorted(actor_at), run_at, save)


class Chaos:
    """The chaos run (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, out: Path, flags: list[str]) -> None:
        self.args, self.out, self.flags = args, out, flags
        self.plan = Plan.make(args.steps, args.worker_kills, args.trainer_kills, args.buffer_kills,
                              args.run_kills, args.checkpoint_every, args.seed)
        self.rng = random.Random(args.seed)
        self.timeline = Timeline()
        self.worker_kills: list[WorkerKill] = []
        self.actor_kills: list[ActorKill] = []
        self.run_kills: list[RunKill] = []
        self.failure: str | None = None
        self.deadline = time.monotonic() + args.max_wall_s

    def run(self) -> None:
        tail, segment, resume = Tail(self.out / "metrics.jsonl"), 0, False
        fault = ["--fault", f"checkpoint_write@{self.plan.in_save}"] if self.plan.in_save else []
        while self.failure is None:
            # The fault fires once: a launch (or a restart) past its step does not carry it.
            past = any(r.step >= (self.plan.in_save or 0) for _, r in self.timeline.rows)
            launch = Launch([*self.flags, *([] if past else fault), *(["--resume", str(self.out)] if resume else [])],
                            self.out.parent / f"chaos_segment{segment}.log")
            status = self._follow(launch, tail, segment)
            if status == "done":
                return
            resume, segment = True, segment + 1

    def _follow(self, launch: Launch, tail: Tail, segment: int) -> str:
        """Follow one launch until it ends ("done"), is killed on plan ("killed") or fails."""
        last_progress, step, top, fill = time.monotonic(), 0, 0, 0
        while True:
            rows = tail.new_rows()
            for r in rows:
                self.timeline.rows.append((segment, r))
                step, top, fill = r.step, max(top, r.step), r.buffer_fill
            now = time.monotonic()
            last_progress = now if rows else last_progress
            code = launch.proc.poll()
            if code is not None:
                launch.kill()
                for r in tail.new_rows():   # the rows written after the last look
                    self.timeline.rows.append((segment, r))
                if code == 0 and max((r.step for _, r in self.timeline.rows), default=0) >= self.args.steps:
                    return "done"
                self.failure = f"segment {segment} exited with status {code} at step {step}: {launch.tail()}"
                return "failed"
            if now - last_progress > self.args.stall_s or now > self.deadline:
                launch.kill()
                why = "no step" if now <= self.deadline else "--max-wall-s passed"
                self.failure = f"segment {segment}: {why} for {now - last_progress:.0f} s at step {step}; killed"
                return "failed"
            if self.plan.worker_at and top >= self.plan.worker_at[0] and rows:
                self._kill_worker(step, segment)
            if self._worker_healing(segment):
                pass   # a kill waits for the worker killed before it: each kill's cost is its own
            elif self.plan.actor_at and top >= self.plan.actor_at[0][0] and rows:
                self._kill_actor(step, fill)
            elif self.plan.run_at and top >= self.plan.run_at[0] and rows:
                self.plan.run_at.pop(0)
                outside = launch.kill()
                for r in tail.new_rows():   # the steps it finished before it died
                    self.timeline.rows.append((segment, r))
                    step, fill = r.step, r.buffer_fill
                self.run_kills.append(RunKill(step, time.time(), segment, fill, outside))
                return "killed"
            time.sleep(_POLL_S)

    def _worker_healing(self, segment: int) -> bool:
        """Whether the last worker killed in this segment is not back yet (no row since its
        kill counts one more worker restart than the row before it)."""
        k = self.worker_kills[-1] if self.worker_kills else None
        if k is None or k.segment != segment:
            return False
        base = self.timeline.last_before(segment, k.at)
        counted = base.worker_restarts if base is not None else 0.0
        return not any(r.worker_restarts > counted for r in self.timeline.after(segment, k.at))

    def _kill_worker(self, step: int, segment: int) -> None:
        pid = busiest_worker()
        if pid is None:
            return   # none up right now (one is restarting): the next poll tries again
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.plan.worker_at.pop(0)
        self.worker_kills.append(WorkerKill(step, time.time(), segment, pid))

    def _kill_actor(self, step: int, fill: int) -> None:
        kind = self.plan.actor_at[0][1]
        pid = actor_pid(kind)
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.plan.actor_at.pop(0)
        self.actor_kills.append(ActorKill(kind, step, time.time(), fill))

    def resolve(self) -> None:
        """Fill in what each kill cost, from the rows that followed it."""
        med = self.median_step_s()
        marks, taken = marks_of(self.out), set()
        for k in self.worker_kills:
            resolve_worker_kill(k, self.timeline, med, next((m.unix_time_s for m in marks if m.unix_time_s > k.at), None))
        for rk in self.run_kills:   # a whole-run kill's resume: the first mark after it
            i = next((i for i, m in enumerate(marks) if m.unix_time_s > rk.at and i not in taken), None)
            if i is None:
                continue
            taken.add(i)
            mark = marks[i]
            rk.resumed_at, rk.steps_lost = mark.resumed_at, rk.step - mark.resumed_at
            after = [r for s, r in self.timeline.rows if s == rk.segment + 1]
            killed = [r for s, r in self.timeline.rows if s == rk.segment and r.step == rk.step]
            again = next((r for r in after if r.step >= rk.step), None)
            rk.restart_s = after[0].at - rk.at if after else None
            rk.time_lost_s = again.at - killed[-1].at if again is not None and killed else None
        self.actor_kills += resolve_kills(self.actor_kills, marks, self.timeline.rows, taken)
        self.actor_kills.sort(key=lambda k: k.at)

    def median_step_s(self) -> float:
        gaps = [b.at - a.at for (sa, a), (sb, b) in zip(self.timeline.rows, self.timeline.rows[1:])
                if sa == sb and b.step == a.step + 1]
        return statistics.median(gaps) if gaps else 0.0


def baseline(args: argparse.Namespace, out: Path, flags: list[str]) -> tuple[dict[str, Any], str | None]:
    """The same run unbroken, bounded the same way."""
    launch = Launch(flags, out.parent / "unbroken.log")
    tail, last, failure = Tail(out / "metrics.jsonl"), time.monotonic(), None
    while launch.proc.poll() is None:
        if tail.new_rows():
            last = time.monotonic()
        if time.monotonic() - last > args.stall_s:
            failure = f"unbroken run: no step for {args.stall_s:.0f} s; killed"
            break
        time.sleep(_POLL_S)
    launch.kill()
    if failure is None and launch.proc.returncode != 0:
        failure = f"unbroken run exited with status {launch.proc.returncode}: {launch.tail()}"
    return records(out, args.steps), failure


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=2000, help="Steps the run must reach (default 2000).")
    p.add_argument("--worker-kills", type=int, default=10, help="Rollout-worker SIGKILLs, evenly spaced (default 10).")
    p.add_argument("--trainer-kills", type=int, default=3,
                   help="Trainer SIGKILLs (one of them during a checkpoint write); the run restarts itself (default 3).")
    p.add_argument("--buffer-kills", type=int, default=2,
                   help="Replay-buffer SIGKILLs; the run restarts itself (default 2).")
    p.add_argument("--run-kills", type=int, default=2,
                   help="Whole-run SIGKILLs at random steps, each followed by --resume (default 2).")
    p.add_argument("--checkpoint-every", type=int, default=100, help="--trainer.checkpoint_every (default 100).")
    p.add_argument("--seed", type=int, default=0, help="The run's --seed and the kills' (default 0).")
    p.add_argument("--eval-prompts", type=int, default=EVAL_PROMPTS,
                   help=f"--eval.num_prompts of both runs (default {EVAL_PROMPTS}; see EVAL_PROMPTS).")
    p.add_argument("--no-baseline", action="store_true", help="Skip the unbroken run of the same seed.")
    p.add_argument("--stall-s", type=float, default=300.0,
                   help="A launch that completes no step for this long (start-up included) is killed (default 300).")
    p.add_argument("--max-wall-s", type=float, default=4 * 3600.0,
                   help="The chaos run ends after this long, finished or not (default 14400).")


def run(args: argparse.Namespace) -> Outcome:
    if args.quick:
        args.steps, args.worker_kills, args.run_kills, args.checkpoint_every = 50, 1, 1, 10
        args.trainer_kills, args.buffer_kills, args.no_baseline = 1, 0, True
    at_least(args, steps=4, worker_kills=0, trainer_kills=0, buffer_kills=0, run_kills=0, checkpoint_every=1,
             eval_prompts=1)
    if args.checkpoint_every + args.run_kills + 2 >= args.steps:
        raise BadFlag(f"--steps {args.steps} leaves no room for {args.run_kills} run kill(s) after the first "
                      f"checkpoint (--checkpoint-every {args.checkpoint_every})")
    args.out.mkdir(parents=True, exist_ok=True)
    shared = ["--eval.num_prompts", str(args.eval_prompts), *args.run_flags,
              "--max-steps", str(args.steps), "--seed", str(args.seed),
              "--trainer.checkpoint_every", str(args.checkpoint_every),
              "--run.max_worker_restarts", str(max(3, args.worker_kills + 1))]
    out = args.out / "chaos"
    shutil.rmtree(out, ignore_errors=True)
    chaos = Chaos(args, out, [*shared, "--out-dir", str(out)])
    stamp, t0 = invocation(), time.perf_counter()
    chaos.run()
    chaos_wall = time.perf_counter() - t0
    chaos.resolve()
    res: dict[str, Any] = {
        "steps": args.steps, "seed": args.seed, "checkpoint_every": args.checkpoint_every, "flags": shared,
        "hardware": hardware(), "failure": chaos.failure, "chaos_wall_s": chaos_wall,
        "median_step_s": chaos.median_step_s(), "chaos": records(out, args.steps),
        "worker_kills": [asdict(k) for k in chaos.worker_kills], "actor_kills": [asdict(k) for k in chaos.actor_kills],
        "run_kills": [asdict(k) for k in chaos.run_kills]}
    if not args.no_baseline and chaos.failure is None:
        plain = args.out / "unbroken"
        shutil.rmtree(plain, ignore_errors=True)
        t0 = time.perf_counter()
        res["unbroken"], res["failure"] = baseline(args, plain, [*shared, "--out-dir", str(plain)])
        res["unbroken_wall_s"] = time.perf_counter() - t0
    res["sources"] = {col: stamp for col in ("chaos", "unbroken") if col in res}
    res["acceptance"] = acceptance(res)
    c = res["chaos"]
    ok = res["failure"] is None and c["reached"] >= args.steps and not c["twice"] and not c["missing"]
    return Outcome(res, markdown(res), status=0 if ok else 1)


def main(argv: list[str] | None = None) -> int:
    return bench_main("chaos", __doc__, argv, run, flags=flags, out="runs/chaos",
                      quick="A short run: 50 steps, one worker kill, one trainer kill during a checkpoint write, "
                            "one whole-run kill (checkpoints every 10), no unbroken run.",
                      run_flags="Pipeline flags (launch/async_grpo.py's), after --.")


if __name__ == "__main__":
    raise SystemExit(main())
