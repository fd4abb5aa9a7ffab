"""Does each objective and correction learn? The default run, ``--max-steps`` steps per arm,
with the reward of its first 10 steps against its last 10.

Usage::

    python -m benchmarks.arms_rise [--steps 60] [--arms NAME,...] [--seed 0] [--out DIR]
                                   [--json PATH] [--md PATH] [-- PIPELINE FLAGS]

An arm is a named set of pipeline flags (:data:`ARMS`: every ``--algorithm.loss`` beside
reinforce with the default correction, against the generator's log-probs (``--algorithm.ratio_reference
behaviour``) or in 2 passes against the trainer's own (proximal: in one pass its ratio is 1 and its
gradient REINFORCE's); every correction preset and two compositions beside the default loss). Each runs as a user runs it, ``launch/async_grpo.py --staleness 2`` with the
arm's flags (and those after ``--``), a process each, one after another. Reported per arm:
the mean reward of its first 10 and last 10 steps (``metrics.jsonl``), the rise, and the
run's wall time; the exit status is 1 when an arm failed or did not rise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.common import BadFlag, Outcome, at_least, hardware, launch_run, main as bench_main

_WINDOW = 10

#: name -> the flags it adds to the default run.
ARMS: dict[str, tuple[str, ...]] = {
    "reinforce+tis": (),
    "ppo-2-epochs": ("--algorithm.loss", "ppo", "--algorithm.ppo_epochs", "2"),
    "gspo@behaviour": ("--algorithm.loss", "gspo", "--algorithm.ratio_reference", "behaviour"),
    "gspo-token@behaviour": ("--algorithm.loss", "gspo-token", "--algorithm.ratio_reference", "behaviour"),
    "cispo@behaviour": ("--algorithm.loss", "cispo", "--algorithm.ratio_reference", "behaviour"),
    "cispo-clip-higher-2-epochs": ("--algorithm.loss", "cispo", "--algorithm.ppo_clip_low", "0.2",
                                   "--algorithm.ppo_clip_high", "0.28", "--algorithm.ppo_epochs", "2"),
    "gspo-2-epochs": ("--algorithm.loss", "gspo", "--algorithm.ppo_epochs", "2"),
    "none": ("--correction.type", "none"),
    "icepop": ("--correction.type", "icepop"),
    "seq-mask-tis": ("--correction.type", "seq-mask-tis"),
    "m2po": ("--correction.type", "m2po"),
    "sequence-weight+sequence-rejection": ("--correction.type", "custom", "--correction.weight", "sequence",
                                           "--correction.reject", "sequence", "--correction.reject_hi", "2"),
    "token-weight+geometric-rejection+veto": ("--correction.type", "custom", "--correction.weight", "token",
                                              "--correction.reject", "geometric", "--correction.reject_hi", "1.5",
                                              "--correction.veto", "1e-4"),
}


@dataclass(frozen=True, slots=True)
class ArmResult:
    """One arm's run: reward means of its first and last ``_WINDOW`` steps, its wall time."""

    arm: str
    flags: list[str]
    steps: int
    first: float
    last: float
    wall_s: float

    @property
    def rise(self) -> float:
        return self.last - self.first


def reward_window(rows: list[dict[str, float]]) -> tuple[float, float]:
    """Mean ``reward_mean`` of the first and the last ``_WINDOW`` step rows."""
    if len(rows) < 2 * _WINDOW:
        raise ValueError(f"{len(rows)} step rows, {2 * _WINDOW} needed")
    rewards = [float(r["reward_mean"]) for r in rows]
    return statistics.fmean(rewards[:_WINDOW]), statistics.fmean(rewards[-_WINDOW:])


def _one(name: str, index: int, args: argparse.Namespace) -> ArmResult:
    folder = args.out / f"arm{index}"
    flags = [*ARMS[name], *args.run_flags]
    launch_run(folder, ["--staleness", "2", "--max-steps", str(args.steps), "--seed", str(args.seed), *flags],
               args.out / f"arm{index}.log")
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first, last = reward_window(rows)
    return ArmResult(name, flags, len(rows), first, last, float(rows[-1].get("time_s", 0.0)))


def _run(args: argparse.Namespace) -> Outcome:
    at_least(args, steps=2 * _WINDOW)
    names = list(ARMS) if args.arms is None else [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in names if a not in ARMS]
    if unknown or not names:
        raise BadFlag(f"--arms: unknown arm(s) {', '.join(unknown) or '(none given)'} (known: {', '.join(ARMS)})")
    if "--out-dir" in args.run_flags or "--max-steps" in args.run_flags:
        raise BadFlag("the pipeline flags may not set --out-dir or --max-steps (give --steps)")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for i, name in enumerate(names):
        results.append(_one(name, i, args))
        r = results[-1]
        print(f"arms_rise: {name}: {r.first:.3f} -> {r.last:.3f} ({r.wall_s:.0f} s)", file=sys.stderr, flush=True)
    result = {"steps": args.steps, "seed": args.seed, "flags": list(args.run_flags), "hardware": hardware(),
              "arms": [asdict(r) | {"rise": r.rise} for r in results]}
    return Outcome(result, markdown(result), status=0 if all(r.rise > 0 for r in results) else 1)


def markdown(result: dict[str, Any]) -> str:
    """The report of a result (``arms_rise.json``): one row per arm."""
    hw = result["hardware"]
    flags = " ".join(result["flags"])
    rows = [f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB, no GPU. Each arm: "
            f"`launch/async_grpo.py --staleness 2 --max-steps {result['steps']} --seed {result['seed']}"
            f"{' ' + flags if flags else ''}` plus its flags, one run.", "",
            "| arm | flags | reward, first 10 steps | last 10 steps | rise | wall (s) |", "|---|---|---:|---:|---:|---:|"]
    rows += [f"| {a['arm']} | `{' '.join(a['flags']) or '(none)'}` | {a['first']:.3f} | {a['last']:.3f} | "
             f"{a['rise']:+.3f} | {a['wall_s']:.1f} |" for a in result["arms"]]
    return (f"# Each objective and correction learns: {result['steps']} steps of the default run\n\n"
            + "\n".join(rows) + "\n")


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=60, help="Steps per arm (default 60, at least 20).")
    p.add_argument("--arms", default=None, help="Comma list of arm names (default: every arm of ARMS).")
    p.add_argument("--seed", type=int, default=0, help="The runs' --seed (default 0).")


def main(argv: list[str] | None = None) -> int:
    return bench_main("arms_rise", __doc__, argv, _run, flags=_flags, out="bench_out/arms_rise",
                      run_flags="Pipeline flags for every arm (after --).")


if __name__ == "__main__":
    sys.exit(main())
