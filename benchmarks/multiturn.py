"""The multi-turn, tool-using task learnt by RL: ``calc`` on the built-in model, per seed.

Usage::

    python -m benchmarks.multiturn [--seeds 3] [--steps 200] [--minutes 10] [--agent] [-- FLAGS]

One run of the real pipeline (``--staleness 2``, GRPO, the flags of :data:`FLAGS`, then
any after ``--``) per seed, back to back on one local Ray. The task (``--task.name calc``,
:mod:`pipeline_rl.tasks.calc`): ``calc 4821*7396=``; the model can only score by calling
the calculator (``[4821*7396]``), reading its reply (``=35655316;``) and copying it as
its answer. The warm start (built once before the runs, cached; not timed) shows the tool
episode in 25% of its examples and a decoy (the operands written together) in 75%, so
the model starts calling the tool in about a quarter of its samples and answers with
the decoy when greedy.

Reported per seed: held-out greedy success (the run's own evaluation, whole episodes with
the same environment, ``--eval.every``) at step 0 and at the end, the first evaluation
at or above :data:`TARGET` and when it came, the steps and wall time (actor start-up
included), and whether the run met the bar: step 0 at most :data:`START_MAX`, the end at
least :data:`TARGET`, within ``--minutes``. ``--minutes`` also stops a run that has not
finished by then (its last periodic evaluation then counts as its end).

``--agent`` runs every seed twice, the environment form and then the same task as an agent
function through the rollout worker's OpenAI-compatible endpoint (:data:`AGENT`), and reports
each form's tokens/s (the mean of its steps') and their ratio, measured in the same session.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Outcome, at_least, config, hardware, main as bench_main, ray_session, run_pipeline

#: The pipeline flags of every run (then the seed's, then any after ``--``).
FLAGS = ["--staleness", "2", "--task.name", "calc"]
#: ``calc`` as agent code (``--agent``): the same episodes through the endpoint.
AGENT = "pipeline_rl.tasks.calc_agent:calc"
#: Held-out greedy success the run must reach, and the most it may start at.
TARGET, START_MAX = 0.8, 0.3


@dataclass(frozen=True, slots=True)
class SeedRun:
    seed: int
    steps: int
    wall_s: float
    train_s: float
    greedy_start: float
    greedy_end: float
    sampled_start: float
    sampled_end: float
    reached_step: int | None      # the first evaluation at or above TARGET, None if none
    reached_s: float | None       # its training time (s)
    reward_first: float           # mean training reward over the first and last 10% of steps
    reward_last: float
    stopped_early: bool           # --minutes ran out before the last step
    passed: bool
    curve: list[tuple[int, float]]   # (step, held-out greedy success) of every evaluation
    form: str = "env"                # env: the task's environment; agent: AGENT through the endpoint
    tokens_per_s: float = 0.0        # the mean of the steps' tokens/s


def one_run(seed: int, out: Path, flags: list[str], minutes: float, form: str = "env") -> SeedRun:
    """One seed's run in ``form``; ``minutes``: the wall-time bar and the deadline."""
    from pipeline_rl.metrics import read_evals

    agent = ["--task.agent", AGENT] if form == "agent" else []
    cfg = config([*FLAGS, "--seed", str(seed), "--out-dir", str(out), *agent, *flags], evaluation=True)
    t0 = time.perf_counter()
    rows = run_pipeline(cfg, watch=lambda orch: deadline(orch.stop, minutes * 60.0))
    wall = time.perf_counter() - t0
    evals = read_evals(out / "eval.jsonl")
    if not evals:
        raise RuntimeError(f"seed {seed}: no held-out evaluation in {out} (is --eval.every on?)")
    first, last = evals[0], evals[-1]
    reached = next((e for e in evals if e.greedy_accuracy >= TARGET), None)
    times = {int(r["step"]): float(r["time_s"]) for r in rows}
    k = max(1, len(rows) // 10)
    return SeedRun(
        seed=seed, steps=len(rows), wall_s=wall, train_s=float(rows[-1]["time_s"]) if rows else 0.0,
        greedy_start=first.greedy_accuracy, greedy_end=last.greedy_accuracy,
        sampled_start=first.mean_at_k, sampled_end=last.mean_at_k,
        reached_step=reached.step if reached else None,
        reached_s=times.get(reached.step) if reached else None,
        reward_first=sum(r["reward_mean"] for r in rows[:k]) / k if rows else 0.0,
        reward_last=sum(r["reward_mean"] for r in rows[-k:]) / k if rows else 0.0,
        stopped_early=len(rows) < cfg.max_steps,
        passed=first.step == 0 and first.greedy_accuracy <= START_MAX and last.greedy_accuracy >= TARGET
        and wall <= minutes * 60.0,
        curve=[(e.step, e.greedy_accuracy) for e in evals], form=form,
        tokens_per_s=sum(r["tokens_per_s"] for r in rows) / len(rows) if rows else 0.0)


@contextlib.contextmanager
def deadline(stop: threading.Event, seconds: float) -> Iterator[None]:
    """Set ``stop`` (the run ends after its current step) if the block outlives ``seconds``."""
    timer = threading.Timer(seconds, stop.set)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def warm_start_info() -> dict[str, Any]:
    """Build (or find) the calc warm start the runs start from; its recipe, probe and build time."""
    from pipeline_rl.config import ModelConfig, TaskConfig
    from pipeline_rl.models import default_model_dir
    from pipeline_rl.models.default import INFO_FILE

    t0 = time.perf_counter()
    folder = default_model_dir(ModelConfig(), TaskConfig(name="calc"))
    info: dict[str, Any] = json.loads((folder / INFO_FILE).read_text())
    return {"folder": folder.name, "probe": info.get("probe"), "build_s": info.get("build_s"),
            "found_in_s": round(time.perf_counter() - t0, 1)}


def markdown(result: dict[str, Any]) -> str:
    runs = [SeedRun(**r) for r in result["runs"]]
    lines = [f"`python -m benchmarks.multiturn {' '.join(result['argv'])}`".replace(" `", "`"),
             "", f"Flags: `{' '.join(result['flags'])}`; {result['hardware']['cpu']}, "
             f"{result['hardware']['cores']} cores.", "",
             "| seed | form | held-out greedy, step 0 -> end | sampled mean@k, step 0 -> end | first eval >= "
             f"{TARGET} (step, training s) | steps | wall time (s) | tokens/s | train reward first -> last 10% | met |",
             "|---:|---|---|---|---|---:|---:|---:|---|---|"]
    for r in runs:
        reached = f"{r.reached_step}, {r.reached_s:.0f} s" if r.reached_step is not None and r.reached_s is not None \
            else (str(r.reached_step) if r.reached_step is not None else "never")
        lines.append(f"| {r.seed} | {r.form} | {r.greedy_start:.3f} -> {r.greedy_end:.3f} | {r.sampled_start:.3f} -> "
                     f"{r.sampled_end:.3f} | {reached} | {r.steps}{' (stopped)' if r.stopped_early else ''} "
                     f"| {r.wall_s:.1f} | {r.tokens_per_s:.0f} | {r.reward_first:.3f} -> {r.reward_last:.3f} "
                     f"| {'yes' if r.passed else 'no'} |")
    lines += ["", "Held-out greedy success by step: " + "; ".join(
        f"seed {r.seed}{' (agent)' if r.form == 'agent' else ''}: " + ", ".join(f"{step} {acc:.2f}" for step, acc in r.curve) for r in runs) + "."]
    pairs = [(e, a) for e in runs if e.form == "env" for a in runs if a.form == "agent" and a.seed == e.seed]
    if pairs:
        ratios = [e.tokens_per_s / a.tokens_per_s for e, a in pairs if a.tokens_per_s > 0]
        lines += ["", "Environment form's tokens/s over the agent form's (the endpoint's overhead), per seed: "
                  + ", ".join(f"{x:.2f}x" for x in ratios) + "."]
    probe = result["warm_start"].get("probe") or {}
    unit = "runs" if any(r.form == "agent" for r in runs) else "seeds"
    lines += ["", f"{sum(r.passed for r in runs)} of {len(runs)} {unit} met the bar (step 0 <= {START_MAX}, "
              f"end >= {TARGET}, within {result['minutes']:g} minutes). Warm start "
              f"{result['warm_start']['folder']} (built once, {result['warm_start'].get('build_s')} s on one "
              f"core, not in the wall times): its own probe (256 held-out prompts, transformers) "
              f"sampled {probe.get('sampled_reward', float('nan')):.3f}, greedy "
              f"{probe.get('greedy_reward', float('nan')):.3f}."]
    return "\n".join(lines)


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=int, default=3, help="Runs, seeds 0..N-1 (default 3).")
    p.add_argument("--steps", type=int, default=200, help="Steps per run (--max-steps; default 200).")
    p.add_argument("--eval-every", type=int, default=20, help="Held-out evaluation every N steps "
                   "(--eval.every; default 20) and at the end.")
    p.add_argument("--minutes", type=float, default=10.0, help="Wall-time bar and deadline of each run "
                   "(default 10).")
    p.add_argument("--agent", action="store_true", help="Also run each seed as the agent function "
                   f"{AGENT} through the endpoint, and compare the two forms' tokens/s.")


def run(args: argparse.Namespace) -> Outcome:
    at_least(args, seeds=1, steps=1, eval_every=1, minutes=0.1)
    argv = [f"--seeds {args.seeds}", f"--steps {args.steps}", f"--eval-every {args.eval_every}",
            f"--minutes {args.minutes:g}", *(["--agent"] if args.agent else []),
            *(["--", *args.run_flags] if args.run_flags else [])]
    flags = ["--max-steps", str(args.steps), "--eval.every", str(args.eval_every), *args.run_flags]
    warm = warm_start_info()
    with ray_session(), tempfile.TemporaryDirectory(prefix="multiturn_") as tmp:
        forms = ("env", "agent") if args.agent else ("env",)
        runs = [one_run(seed, Path(tmp) / f"seed{seed}-{form}", flags, args.minutes, form)
                for seed in range(args.seeds) for form in forms]
    result = {"hardware": hardware(), "argv": argv, "flags": [*FLAGS, *flags], "minutes": args.minutes,
              "target": TARGET, "start_max": START_MAX, "warm_start": warm, "runs": [asdict(r) for r in runs]}
    return Outcome(result, markdown(result), status=0 if all(r.passed for r in runs) else 1)


def main(argv: list[str] | None = None) -> int:
    results = ROOT / "benchmarks" / "results"
    return bench_main("multiturn", __doc__, argv, run, flags=flags, json_path=results / "multiturn.json",
                      md_path=results / "multiturn.md",
                      run_flags="Extra pipeline flags, after -- (e.g. -- --trainer.lr 5e-4).")


if __name__ == "__main__":
    raise SystemExit(main())
