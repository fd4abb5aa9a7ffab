"""What the run's insurance costs a healthy run: the default run with its standby (and spare
trainer ranks) against ``--rollout.standby false --run.spare_trainers false``.

Usage::

    python -m benchmarks.standby_cost [--rounds 3] [--out DIR] [--json PATH] [--md PATH]
                                      [-- PIPELINE FLAGS]

Each round runs the README's main job (``launch/async_grpo.py --staleness 2``, plus the
pipeline flags given after ``--``) twice as a user runs it, a process each, once with the
default insurance and once without, alternating which goes first from round to round. Read
from each run's summary table: its wall time (start of training to the end) and its weight
sync p50 and p90 (step end to every worker on it). Reported: per arm the median of the
rounds, and the ratios insured / uninsured of the medians (the target: wall at most 1.03x,
sync p50 at most 1.1x).

Why it costs anything: the standby is a second vLLM engine and the spares a second trainer
process, built beside the run once its start-up is done, on the cores the pinned worker and
trainer run on (``pipeline_rl.actors.process.lower_to_idle_priority``).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import BadFlag, Outcome, at_least, hardware, launch_run, main as bench_main

_OFF = ("--rollout.standby", "false", "--run.spare_trainers", "false")
_WALL = re.compile(r"^\|\s*wall time\s*\|\s*([0-9.]+) s", re.M)
_SYNC = re.compile(r"^\|\s*weight sync, step end -> every worker on it \(p50 / p90\)\s*\|\s*([0-9.]+) / ([0-9.]+) ms",
                   re.M)


@dataclass(frozen=True, slots=True)
class Run:
    """One run's figures: ``insured`` (standby and spares on), its round, wall time and sync."""

    insured: bool
    round: int
    wall_s: float
    sync_p50_ms: float
    sync_p90_ms: float
    process_s: float


def summary_figures(console: str) -> tuple[float, float, float]:
    """Wall time (s), sync p50 and p90 (ms) from a run's summary table; ValueError naming
    what is missing."""
    wall, sync = _WALL.search(console), _SYNC.search(console)
    if wall is None or sync is None:
        raise ValueError(f"no {'wall time' if wall is None else 'weight sync'} row in the run's summary")
    return float(wall.group(1)), float(sync.group(1)), float(sync.group(2))


def _one(insured: bool, rnd: int, out: Path, flags: list[str]) -> Run:
    import time

    folder = out / f"round{rnd}-{'insured' if insured else 'uninsured'}"
    t0 = time.monotonic()
    console = launch_run(folder, ["--staleness", "2", *flags, *(() if insured else _OFF)], out / f"{folder.name}.log")
    wall, p50, p90 = summary_figures(console)
    return Run(insured, rnd, wall, p50, p90, time.monotonic() - t0)


def _median(runs: list[Run], insured: bool, field: str) -> float:
    return statistics.median(getattr(r, field) for r in runs if r.insured == insured)


def _run(args: argparse.Namespace) -> Outcome:
    at_least(args, rounds=1)
    if any(f in args.run_flags for f in ("--rollout.standby", "--run.spare_trainers", "--out-dir")):
        raise BadFlag("the pipeline flags may not set --rollout.standby, --run.spare_trainers or --out-dir")
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for rnd in range(args.rounds):
        order = (True, False) if rnd % 2 == 0 else (False, True)
        for insured in order:
            runs.append(_one(insured, rnd, args.out, list(args.run_flags)))
            print(f"standby_cost: {runs[-1]}", file=sys.stderr, flush=True)
    med = {arm: {f: _median(runs, ins, f) for f in ("wall_s", "sync_p50_ms", "sync_p90_ms", "process_s")}
           for arm, ins in (("insured", True), ("uninsured", False))}
    ratios = {f: med["insured"][f] / med["uninsured"][f] for f in ("wall_s", "sync_p50_ms", "process_s")}
    result = {"flags": list(args.run_flags), "rounds": args.rounds, "runs": [asdict(r) for r in runs],
              "median": med, "ratio": ratios, "hardware": hardware()}
    return Outcome(result, markdown(result))


def markdown(result: dict[str, Any]) -> str:
    """The report of a result (``standby_cost.json``): every run, then the medians and ratios."""
    hw = result["hardware"]
    flags = " ".join(result["flags"])
    rows = [f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB, no GPU. "
            f"`launch/async_grpo.py --staleness 2{' ' + flags if flags else ''}`, {result['rounds']} rounds, "
            "each one run with the standby and spare trainer ranks (the default) and one with "
            "`--rollout.standby false --run.spare_trainers false`, alternating which goes first.", "",
            "| round | arm | wall (s) | sync p50 (ms) | sync p90 (ms) | process (s) |", "|---:|---|---:|---:|---:|---:|"]
    rows += [f"| {r['round']} | {'standby + spares' if r['insured'] else 'neither'} | {r['wall_s']:.1f} | "
             f"{r['sync_p50_ms']:.1f} | {r['sync_p90_ms']:.1f} | {r['process_s']:.1f} |" for r in result["runs"]]
    i, u, ratio = result["median"]["insured"], result["median"]["uninsured"], result["ratio"]
    rows += ["", "| median | standby + spares | neither | ratio |", "|---|---:|---:|---:|",
             f"| wall (s) | {i['wall_s']:.1f} | {u['wall_s']:.1f} | {ratio['wall_s']:.3f}x |",
             f"| sync p50 (ms) | {i['sync_p50_ms']:.1f} | {u['sync_p50_ms']:.1f} | {ratio['sync_p50_ms']:.3f}x |",
             f"| process, start to exit (s) | {i['process_s']:.1f} | {u['process_s']:.1f} | "
             f"{ratio['process_s']:.3f}x |"]
    return "# The insurance's cost to a healthy run\n\n" + "\n".join(rows) + "\n"


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=3, help="Rounds, each one run per arm (default 3).")


def main(argv: list[str] | None = None) -> int:
    return bench_main("standby_cost", __doc__, argv, _run, flags=_flags, out="bench_out/standby_cost",
                      run_flags="Pipeline flags for both arms (after --).")


if __name__ == "__main__":
    sys.exit(main())
