"""A slow environment costs its own episodes latency, not the pipeline throughput.

Usage: ``python -m benchmarks.slow_env [--steps 120] [--warmup 20] [--sleep-ms 50] [-- FLAGS]``.

With ``--hang-frac 0.3 --hang-s 30 --timeout-s 1`` the second arm is a *hung* environment
instead: that share of its steps block ``--hang-s`` (a hung sandbox), both arms run with
``--task.env_timeout_s`` at ``--timeout-s`` (target: >= 0.5x the tokens/s of the arm
without hangs; ``--md benchmarks/results/hung_env.md`` keeps it apart).

Runs the real pipeline (Ray, a vLLM worker, the DeepSpeed trainer, ZeroMQ) on the built-in
multi-turn task ``calc`` twice in one invocation: with its calculator environment as is
(instant), and with the same environment sleeping ``--sleep-ms`` in every step (a tool
call, a sandbox, an HTTP call; two steps per episode). Reported per arm: the generated
tokens per second and the steps per second (medians over the steps after ``--warmup``),
and the slow arm's ratio to the instant one (target: >= 0.7 for tokens/s).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Outcome, at_least, config, hardware, main as bench_main, ray_session, run_pipeline
from pipeline_rl.tasks.calc import CalcEnv
from pipeline_rl.tasks.env import EnvReply

#: The rollout workers read the sleep from here (they run in processes of their own).
SLEEP_ENV = "PIPELINE_RL_SLOW_ENV_S"


#: The hung arm's share of hanging steps and their length, read by the workers.
HANG_FRAC_ENV, HANG_S_ENV = "PIPELINE_RL_HANG_FRAC", "PIPELINE_RL_HANG_S"


class SlowCalcEnv(CalcEnv):
    """The calculator, answering every step after ``$PIPELINE_RL_SLOW_ENV_S`` seconds."""

    def step(self, turn: str) -> EnvReply:
        time.sleep(float(os.environ.get(SLEEP_ENV, "0.05")))
        return super().step(turn)


class HungCalcEnv(CalcEnv):
    """The calculator, whose steps block ``$PIPELINE_RL_HANG_S`` seconds on a
    ``$PIPELINE_RL_HANG_FRAC`` share of calls (every call is drawn on its own)."""

    def step(self, turn: str) -> EnvReply:
        if random.random() < float(os.environ.get(HANG_FRAC_ENV, "0.3")):
            time.sleep(float(os.environ.get(HANG_S_ENV, "30")))
        return super().step(turn)


def one_arm(name: str, out: Path, steps: int, warmup: int, flags: list[str]) -> dict[str, Any]:
    cfg = config(["--task.name", "calc", "--max-steps", str(steps), "--eval.every", "0",
                  "--out-dir", str(out / name), *flags])
    rows = run_pipeline(cfg)[warmup:]
    step_s = statistics.median(r["step_time_s"] for r in rows)
    return {"arm": name, "steps": len(rows) + warmup, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
            "steps_per_s": 1.0 / step_s if step_s else 0.0, "reward_last": rows[-1]["reward_mean"]}


def run(args: argparse.Namespace) -> Outcome:
    at_least(args, steps=args.warmup + 5, sleep_ms=1)
    hung = args.hang_frac > 0
    env = {SLEEP_ENV: str(args.sleep_ms / 1e3), HANG_FRAC_ENV: str(args.hang_frac), HANG_S_ENV: str(args.hang_s)}
    both = ["--task.env_timeout_s", str(args.timeout_s)] if hung else []
    slow = (f"{args.hang_frac:.0%} of steps hang {args.hang_s:g} s" if hung else f"sleep {args.sleep_ms} ms",
            "benchmarks.slow_env:HungCalcEnv" if hung else "benchmarks.slow_env:SlowCalcEnv")
    with tempfile.TemporaryDirectory(prefix="slow_env_") as tmp, ray_session(env=env):
        arms = [one_arm("instant", Path(tmp), args.steps, args.warmup, [*both, *args.run_flags]),
                one_arm(slow[0], Path(tmp), args.steps, args.warmup,
                        ["--task.env", slow[1], *both, *args.run_flags])]
    ratio = {k: arms[1][k] / arms[0][k] if arms[0][k] else 0.0 for k in ("tokens_per_s", "steps_per_s")}
    result = {"hardware": hardware(), "steps": args.steps, "warmup": args.warmup, "sleep_ms": args.sleep_ms,
              "hang_frac": args.hang_frac, "hang_s": args.hang_s, "timeout_s": args.timeout_s,
              "arms": arms, "ratio": ratio}
    what = (f"A hung environment ({slow[0]}, --task.env_timeout_s {args.timeout_s:g})" if hung
            else f"A slow environment ({args.sleep_ms} ms per step)")
    flags = (f"--hang-frac {args.hang_frac:g} --hang-s {args.hang_s:g} --timeout-s {args.timeout_s:g}" if hung
             else f"--sleep-ms {args.sleep_ms}")
    lines = [f"# {what} against an instant one", "",
             f"`python -m benchmarks.slow_env --steps {args.steps} --warmup {args.warmup} {flags}` (the built-in "
             f"multi-turn task calc; medians over steps {args.warmup + 1}-"
             f"{args.steps}; {result['hardware'].get('cpu', '?')})", "",
             "| arm | tokens/s | steps/s | reward (last step) |", "|---|---:|---:|---:|"]
    lines += [f"| {a['arm']} | {a['tokens_per_s']:.0f} | {a['steps_per_s']:.2f} | {a['reward_last']:.3f} |" for a in arms]
    lines += ["", f"{'Hung' if hung else 'Slow'} / instant: tokens/s **{ratio['tokens_per_s']:.2f}x**, "
                  f"steps/s {ratio['steps_per_s']:.2f}x."]
    return Outcome(result, "\n".join(lines) + "\n")


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=120, help="Steps per arm.")
    p.add_argument("--warmup", type=int, default=20, help="First steps of each arm left out of the medians.")
    p.add_argument("--sleep-ms", type=int, default=50, help="The slow environment's sleep per step (ms).")
    p.add_argument("--hang-frac", type=float, default=0.0, help="Share of steps that hang (> 0: the hung arm).")
    p.add_argument("--hang-s", type=float, default=30.0, help="How long a hung step blocks (s).")
    p.add_argument("--timeout-s", type=float, default=1.0, help="--task.env_timeout_s of both arms (hung mode).")


def main(argv: list[str] | None = None) -> int:
    return bench_main("slow_env", __doc__, argv, run, flags=_flags, run_flags="Pipeline flags for both arms.")


if __name__ == "__main__":
    raise SystemExit(main())
