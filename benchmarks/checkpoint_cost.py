"""What periodic checkpoints cost a run: ``--trainer.checkpoint_every N`` against none.

Usage::

    python -m benchmarks.checkpoint_cost [--steps 300] [--every 10] [--rounds 1] [--quick]
                                         [--json PATH] [--md PATH] [-- PIPELINE FLAGS]

The real pipeline (``benchmarks.common.run_pipeline``: the orchestrator, DeepSpeed trainer,
vLLM worker and buffer on one local Ray, evaluation off) runs ``--steps`` steps twice per
round, with checkpoints every ``--every`` steps and with none (``--trainer.checkpoint_every
0 --trainer.checkpoint_every_s 0``; the end of a run saves in both), alternating which goes
first from round to round. A save copies the state on the training thread and writes it in
the background (``pipeline_rl.training.checkpoint_writer``); the driver sends the next step
once the copy is done.

Reported, per arm: the mean step (the run's clock from step 4 to the last step, over those
steps) and the median step; with checkpoints, the copy's time on the training thread (the
driver's console line) and the extra time of the steps a save touched (the step after each
save, less the run's median step). The cost: the mean step with checkpoints against without
(the ratio, minus 1), and, within the run with checkpoints, the saves' extra time over its
training time (less noisy: the two runs' completions differ).
"""

from __future__ import annotations

import argparse
import logging
import re
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import Outcome, at_least, config, hardware, main as bench_main, ray_session, run_pipeline

_WARMUP = 3
_COPIED = re.compile(r"state copied in ([0-9.]+) s")


@dataclass(frozen=True, slots=True)
class Arm:
    """One run's figures (module docstring); ``every`` 0: no periodic checkpoint."""

    every: int
    steps: int
    mean_step_s: float
    median_step_s: float
    saves: int
    copy_s: list[float]
    save_extra_s: list[float]

    @property
    def in_run_cost(self) -> float:
        """The saves' extra time over the run's training time (steps after the warm-up)."""
        return sum(self.save_extra_s) / (self.mean_step_s * (self.steps - _WARMUP))


class _Copies(logging.Handler):
    """Collects the copy times of the driver's checkpoint lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        m = _COPIED.search(record.getMessage())
        if m:
            self.seconds.append(float(m.group(1)))


def one_arm(out: Path, steps: int, every: int, flags: list[str]) -> Arm:
    cfg = config([*flags, "--max-steps", str(steps), "--out-dir", str(out),
                  "--trainer.checkpoint_every", str(every), "--trainer.checkpoint_every_s", "0"])
    copies, logger = _Copies(), logging.getLogger("pipeline_rl.run.checkpoints")
    level = logger.level
    logger.addHandler(copies)
    logger.setLevel(logging.INFO)
    try:
        rows = run_pipeline(cfg)
    finally:
        logger.removeHandler(copies)
        logger.setLevel(level)
    at = {int(r["step"]): float(r["unix_time_s"]) for r in rows}
    deltas = {s: at[s] - at[s - 1] for s in at if s - 1 in at and s > _WARMUP + 1}
    median = statistics.median(deltas.values())
    saved = [s for s in range(every, steps, every) if s + 1 in deltas] if every else []
    return Arm(every=every, steps=len(rows), mean_step_s=(at[steps] - at[_WARMUP + 1]) / (steps - _WARMUP - 1),
               median_step_s=median, saves=len(saved), copy_s=copies.seconds[:len(saved)],
               save_extra_s=[deltas[s + 1] - median for s in saved])


def markdown(arms: list[Arm], ratio: float, head: str = "") -> str:
    lines = [head, ""] if head else []
    lines += ["| checkpoints | steps | mean step (s) | median step (s) | saves | copy on the training thread, mean (s) "
             "| extra time of the step after a save, mean (s) | saves' extra time / training time |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for a in arms:
        ckpt = f"every {a.every}" if a.every else "none"
        copy = f"{statistics.mean(a.copy_s):.3f}" if a.copy_s else "-"
        extra = f"{statistics.mean(a.save_extra_s):.3f}" if a.save_extra_s else "-"
        share = f"{a.in_run_cost:.1%}" if a.every else "-"
        lines.append(f"| {ckpt} | {a.steps} | {a.mean_step_s:.3f} | {a.median_step_s:.3f} | {a.saves} | {copy} | "
                     f"{extra} | {share} |")
    lines += ["", f"Mean step with checkpoints against without: {ratio:.3f} ({ratio - 1:+.1%})."]
    return "\n".join(lines)


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=300, help="Steps per run (default 300).")
    p.add_argument("--every", type=int, default=10, help="--trainer.checkpoint_every of the run with checkpoints (default 10).")
    p.add_argument("--rounds", type=int, default=1, help="Pairs of runs, alternating which goes first (default 1).")


def run(args: argparse.Namespace) -> Outcome:
    if args.quick:
        args.steps, args.every, args.rounds = 12, 4, 1
    at_least(args, steps=_WARMUP + 4, every=1, rounds=1)
    arms: list[Arm] = []
    with ray_session(), tempfile.TemporaryDirectory(prefix="checkpoint_cost_") as tmp:
        for r in range(args.rounds):
            for every in ((args.every, 0) if r % 2 == 0 else (0, args.every)):
                arms.append(one_arm(Path(tmp) / f"r{r}_every{every}", args.steps, every, args.run_flags))
                print(markdown(arms[-1:], 1.0).splitlines()[-3], flush=True)
    with_ = statistics.mean(a.mean_step_s for a in arms if a.every)
    without = statistics.mean(a.mean_step_s for a in arms if not a.every)
    hw = hardware()
    res: dict[str, Any] = {"steps": args.steps, "every": args.every, "flags": args.run_flags, "hardware": hw,
                           "arms": [{**asdict(a), "in_run_cost": a.in_run_cost} for a in arms],
                           "ratio": with_ / without}
    cmd = f"launch/async_grpo.py {' '.join(args.run_flags)}".rstrip()
    head = (f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB. {args.steps} steps per run of "
            f"`{cmd}`, evaluation off, {args.rounds} round(s).")
    return Outcome(res, markdown(arms, with_ / without, head))


def main(argv: list[str] | None = None) -> int:
    return bench_main("checkpoint_cost", __doc__, argv, run, flags=flags,
                      quick="A smoke run: 12 steps, checkpoints every 4.",
                      run_flags="Pipeline flags for both runs (e.g. --model smollm2-135m-instruct --task.name word_problems).")


if __name__ == "__main__":
    raise SystemExit(main())
