"""The default demo, measured: what it learns on held-out prompts, what evaluation costs,
and its wall time against the previous default.

Usage::

    python -m benchmarks.demo [--steps 400] [--json PATH] [--md PATH] [--png PATH]

Three runs of the real pipeline (``--staleness 2``, every other setting at its
default) on one local Ray, back to back:

- ``default``: the default run as shipped -- the built-in model with its default
  warm start (the decoy recipe), held-out evaluation every ``--eval.every`` steps
  (default 50) and at the end;
- ``no-eval``: the same with ``--eval.every 0`` (evaluation's cost to training:
  steps per second of ``default`` against this one);
- ``previous``: the previous default -- the smoothing warm start
  (``WarmStartRecipe(smoothing=0.368)``, greedy-right from the start) -- for the
  wall-time comparison; it is evaluated at its start and end only
  (``--eval.every`` equal to the step count), so its wall time includes those two
  evaluations.

Reported: per run, wall time (actor start-up included; Ray itself is started once),
training time and steps per second; for ``default`` the evaluation curve (greedy
accuracy, mean@k and pass@k against steps, PNG) and the start/end table; for
``previous`` its start/end evaluation.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common import Outcome, config, hardware, main as bench_main, pyplot, ray_session, run_pipeline


@dataclass(frozen=True, slots=True)
class DemoRun:
    name: str
    steps: int
    wall_s: float
    train_s: float
    steps_per_s: float
    reward_first: float
    reward_last: float
    evals: list[dict[str, float]]


def one_run(name: str, out: Path, flags: list[str]) -> DemoRun:
    from pipeline_rl.metrics import read_evals

    cfg = config(["--staleness", "2", "--out-dir", str(out), *flags])
    t0 = time.perf_counter()
    rows = run_pipeline(cfg)
    wall = time.perf_counter() - t0
    train_s = float(rows[-1]["time_s"]) if rows else 0.0
    k = max(1, len(rows) // 10)
    return DemoRun(
        name=name, steps=len(rows), wall_s=wall, train_s=train_s,
        steps_per_s=len(rows) / train_s if train_s else 0.0,
        reward_first=sum(r["reward_mean"] for r in rows[:k]) / k,
        reward_last=sum(r["reward_mean"] for r in rows[-k:]) / k,
        evals=[asdict(e) for e in read_evals(out / "eval.jsonl")])


def median_run(runs: list[DemoRun]) -> DemoRun:
    """Median timings over rounds; rewards and evaluations of the last round."""
    last = runs[-1]
    return DemoRun(name=last.name, steps=last.steps, wall_s=statistics.median(r.wall_s for r in runs),
                   train_s=statistics.median(r.train_s for r in runs),
                   steps_per_s=statistics.median(r.steps_per_s for r in runs),
                   reward_first=last.reward_first, reward_last=last.reward_last, evals=last.evals)


def markdown(runs: dict[str, DemoRun]) -> str:
    d, n = runs["default"], runs["no-eval"]
    lines = ["| run | steps | wall time (s) | training time (s) | steps/s | train reward first -> last 10% |",
             "|---|---:|---:|---:|---:|---|"]
    for r in runs.values():
        lines.append(f"| {r.name} | {r.steps} | {r.wall_s:.1f} | {r.train_s:.1f} | {r.steps_per_s:.2f} "
                     f"| {r.reward_first:.3f} -> {r.reward_last:.3f} |")
    lines += ["", f"Evaluation overhead: {d.steps_per_s:.2f} steps/s with evaluation against "
              f"{n.steps_per_s:.2f} without ({d.steps_per_s / n.steps_per_s:.3f}x)."
              if n.steps_per_s else "", ""]
    lines += ["| model | eval after step | greedy accuracy | sampled mean@k | pass@k |", "|---|---:|---:|---:|---:|"]
    for name in ("previous", "default"):
        for e in runs[name].evals[:1] + runs[name].evals[-1:]:
            lines.append(f"| {name} | {e['step']} | {e['greedy_accuracy']:.3f} | {e['mean_at_k']:.3f} "
                         f"| {e['pass_at_k']:.3f} |")
    return "\n".join(lines)


def plot(run: DemoRun, path: Path) -> None:
    plt = pyplot()
    steps = [e["step"] for e in run.evals]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    k = int(run.evals[0]["k"]) if run.evals else 0
    ax.plot(steps, [e["greedy_accuracy"] for e in run.evals], "o-", label="greedy accuracy")
    ax.plot(steps, [e["mean_at_k"] for e in run.evals], "s-", label=f"sampled (T=1), mean@{k}")
    ax.plot(steps, [e["pass_at_k"] for e in run.evals], "^--", label=f"pass@{k}", alpha=0.6)
    n = int(run.evals[0]["num_prompts"]) if run.evals else 0
    ax.set(xlabel="training step", ylabel="held-out accuracy", ylim=(0, 1.02),
           title=f"Default run: {n} held-out sort prompts")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=400, help="Steps per run (default 400, the default run's).")
    p.add_argument("--png", type=Path, default=None, help="Write the evaluation curve here.")
    p.add_argument("--repeats", type=int, default=1, help="Rounds of the three runs, each round in a "
                   "rotated order (so no run always goes first); figures are medians over rounds, "
                   "the curve and table from the last round.")


def run(args: argparse.Namespace) -> Outcome:
    from pipeline_rl.config import ModelConfig, TaskConfig
    from pipeline_rl.models import WarmStartRecipe, default_model_dir

    previous = default_model_dir(ModelConfig(), TaskConfig(), recipe=WarmStartRecipe(smoothing=0.368))
    steps = ["--max-steps", str(args.steps)]
    flags = {"default": [*steps, "--eval.every", "50"], "no-eval": [*steps, "--eval.every", "0"],
             "previous": [*steps, "--model.path", str(previous), "--eval.every", str(args.steps)]}
    rounds: list[dict[str, DemoRun]] = []
    with ray_session(), tempfile.TemporaryDirectory(prefix="demo_") as tmp:
        names = list(flags)
        for r in range(args.repeats):
            order = names[r % 3:] + names[:r % 3]
            rounds.append({n: one_run(n, Path(tmp) / f"{n}_{r}", flags[n]) for n in order})
    runs = {n: median_run([rd[n] for rd in rounds]) for n in names}
    table = markdown(runs)
    if args.repeats > 1:
        table += "\n\n" + f"Medians over {args.repeats} rounds (orders rotated); per round, steps/s: " + "; ".join(
            ", ".join(f"{n} {rd[n].steps_per_s:.2f}" for n in names) for rd in rounds) + "."
    if args.png is not None:
        plot(runs["default"], args.png)
    return Outcome({"hardware": hardware(), "runs": {k: asdict(v) for k, v in runs.items()},
                    "rounds": [{k: asdict(v) for k, v in rd.items()} for rd in rounds]}, table)


def main(argv: list[str] | None = None) -> int:
    return bench_main("demo", __doc__, argv, run, flags=flags)


if __name__ == "__main__":
    raise SystemExit(main())
