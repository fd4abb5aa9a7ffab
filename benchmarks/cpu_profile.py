"""Where a pipeline step's CPU goes: each process of a real run, per step.

Runs ``launch/async_grpo.py`` (the default run unless flags after ``--`` say otherwise;
evaluation and periodic checkpoints off), waits ``--warmup-s`` after its first step, then
reads every process's CPU time from ``/proc`` at the start and end of a ``--window-s``
window and the run's ``metrics.jsonl`` for the steps inside it. Processes are grouped by
role: ``trainer`` (the DeepSpeed actor), ``rollout`` (the vLLM worker), ``buffer``,
``driver`` (the command's own process) and ``ray`` (Ray's own processes: GCS, raylet,
dashboard and agents). For each role: cores used over the window and milliseconds of CPU
per pipeline step. Also: the pipeline step, the trainer's step inside the pipeline
(``train_step_s``) and the trainer's idle share, medians over the window's steps.

On a 2-core machine the table answers whether a run is short of CPU (the roles' cores sum
near 2) or of latency (well below 2, with both sides waiting on each other), and how much
CPU each side spends per step beyond its work alone (``python -m benchmarks.step_bound``).
Linux only (``/proc``).

Usage: ``python -m benchmarks.cpu_profile [--warmup-s 15] [--window-s 10] [--json PATH]
[--md PATH] [-- RUN FLAGS]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, BadFlag, Outcome, at_least, hardware, main as bench_main

#: Role of a process, by a marker in its command line (first match wins).
ROLES: tuple[tuple[str, str], ...] = (("ray::TrainerActor", "trainer"), ("ray::RolloutActor", "rollout"),
                                      ("ray::BufferActor", "buffer"), ("ray::", "ray"), ("/ray/", "ray"))


def role_of(cmdline: str, driver_pid: int, pid: int) -> str | None:
    """The role of process ``pid`` with ``cmdline``; None for processes of other programs."""
    if pid == driver_pid:
        return "driver"
    for marker, role in ROLES:
        if marker in cmdline:
            return role
    return None


def cpu_seconds(stat_line: str, ticks_per_s: float) -> float:
    """utime + stime of a ``/proc/PID/stat`` line, in seconds (the command may hold spaces)."""
    fields = stat_line.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / ticks_per_s


def snapshot(driver_pid: int) -> dict[int, tuple[str, float]]:
    """pid -> (role, CPU seconds) of every process of the run, now."""
    tick = float(os.sysconf("SC_CLK_TCK"))
    out: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            role = role_of(cmd, driver_pid, int(entry.name))
            if role is not None:
                out[int(entry.name)] = (role, cpu_seconds((entry / "stat").read_text(), tick))
        except OSError:    # the process ended meanwhile
            continue
    return out


def cores_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                  seconds: float) -> dict[str, float]:
    """Cores each role used between two snapshots ``seconds`` apart (processes in both)."""
    used: dict[str, float] = {}
    for pid, (role, cpu) in after.items():
        if pid in before:
            used[role] = used.get(role, 0.0) + (cpu - before[pid][1]) / seconds
    return {r: round(c, 3) for r, c in sorted(used.items(), key=lambda kv: -kv[1])}


def window_steps(metrics: Path, start: float, end: float) -> list[dict[str, Any]]:
    """The steps of ``metrics.jsonl`` that ended inside ``[start, end]`` (Unix time)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r for r in rows if start <= r["unix_time_s"] <= end]


def summarize(cores: dict[str, float], steps: list[dict[str, Any]]) -> dict[str, Any]:
    if len(steps) < 2:
        raise RuntimeError(f"only {len(steps)} steps in the window: lengthen --window-s or the run")
    step_s = (steps[-1]["time_s"] - steps[0]["time_s"]) / (len(steps) - 1)
    return {"cores": cores, "cores_total": round(sum(cores.values()), 3), "steps": len(steps),
            "step_ms": round(step_s * 1e3, 2),
            "cpu_ms_per_step": {r: round(c * step_s * 1e3, 2) for r, c in cores.items()},
            "train_step_ms": round(statistics.median(s["train_step_s"] for s in steps) * 1e3, 2),
            "trainer_idle_frac": round(statistics.median(s["trainer_idle_frac"] for s in steps), 3)}


def markdown(r: dict[str, Any]) -> str:
    hw = r["hardware"]
    lines = [f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB, no GPU. "
             f"`launch/async_grpo.py {' '.join(r['run_flags'])}`; a {r['window_s']} s window "
             f"{r['warmup_s']} s after the first step, {r['steps']} steps.", "",
             "| process | cores | CPU ms per pipeline step |", "|---|---:|---:|"]
    lines += [f"| {role} | {c} | {r['cpu_ms_per_step'][role]} |" for role, c in r["cores"].items()]
    lines += [f"| **all** | **{r['cores_total']}** | "
              f"**{round(sum(r['cpu_ms_per_step'].values()), 2)}** |", "",
              f"Pipeline step: **{r['step_ms']} ms**; the trainer's step inside it (median): "
              f"{r['train_step_ms']} ms; trainer idle (waiting for a batch): {r['trainer_idle_frac']}."]
    return "\n".join(lines)


def measure(run_flags: list[str], warmup_s: float, window_s: float, out_dir: Path) -> dict[str, Any]:
    """Run the command, measure the window, stop the run."""
    cmd = [sys.executable, str(ROOT / "launch" / "async_grpo.py"), "--max-steps", "1000000", "--eval.every", "0",
           "--trainer.checkpoint_every", "0", "--trainer.checkpoint_every_s", "0", "--out-dir", str(out_dir),
           *run_flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    console = out_dir / "console.log"     # a file, not a pipe: a full pipe would stall the driver
    with console.open("w") as sink, subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT,
                                                     env=env) as proc:
        try:
            while "\nstep " not in "\n" + console.read_text():
                if proc.poll() is not None:
                    raise RuntimeError(f"the run ended before its first step (exit {proc.returncode}; "
                                       f"{console})")
                time.sleep(0.2)
            time.sleep(warmup_s)
            t0, before = time.time(), snapshot(proc.pid)
            time.sleep(window_s)
            t1, after = time.time(), snapshot(proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return summarize(cores_by_role(before, after, t1 - t0), window_steps(out_dir / "metrics.jsonl", t0, t1))


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--warmup-s", type=float, default=15.0, help="Seconds after the first step before "
                   "measuring (default 15).")
    p.add_argument("--window-s", type=float, default=10.0, help="Seconds measured (default 10).")


def run(args: argparse.Namespace) -> Outcome:
    at_least(args, warmup_s=0)
    if args.window_s <= 0:
        raise BadFlag(f"--window-s must be > 0, got {args.window_s}")
    if not Path("/proc/self/stat").exists():
        raise BadFlag("needs Linux's /proc")
    out_dir = Path(tempfile.mkdtemp(prefix="cpu_profile_"))
    try:
        result = measure(list(args.run_flags), args.warmup_s, args.window_s, out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    result.update(hardware=hardware(), run_flags=list(args.run_flags), warmup_s=args.warmup_s,
                  window_s=args.window_s)
    return Outcome(result, markdown(result))


def main(argv: list[str] | None = None) -> int:
    return bench_main("cpu_profile", __doc__, argv, run, flags=flags,
                      run_flags="Flags of launch/async_grpo.py, after --.")


if __name__ == "__main__":
    raise SystemExit(main())
