"""The trainer's knobs on the real chat model: Muon against AdamW, warm-up + cosine against the
constant rate, by held-out greedy accuracy.

Each variant is a whole run of the real pipeline (``launch/async_grpo.py``'s orchestrator, its
own local Ray) of ``--model`` on ``--task.name word_problems`` for ``--steps`` steps with a
held-out evaluation every ``--eval-every`` steps (the run's own: greedy accuracy on the same
32 held-out prompts each time), once per seed. Variants (the pretrained profile's defaults
otherwise: lr 2e-5, 32 new tokens, 4 prompts x 8 per step):

- ``adamw``: today's default, AdamW at a constant rate;
- ``muon``: ``--trainer.optimizer muon --trainer.optimizer.lr M`` (``--muon-lr``, default 1.6e-4:
  Moonlight's rule for matching Muon's update size to AdamW's, ``0.2 sqrt(max(A, B)) lr``
  with the model's widest matrix, 1536, and lr 2e-5; not tuned further);
- ``cosine``: ``--trainer.lr_schedule cosine --trainer.warmup_steps 3``.

Runs go seed by seed (every variant of seed 0, then of seed 1, ...), so a run cut short by
``--not-after`` (no run starts after that UTC time) still compares the variants on the seeds
it reached; the JSON and the report are rewritten after every run.

``--add-to JSON`` continues an earlier result of the same settings (one cut short): its runs
are kept and not run again, and the rest are added.

Usage: ``python -m benchmarks.trainer_knobs [--seeds 0 1] [--steps 30] [--not-after 23:55]
[--add-to JSON] [--json PATH] [--md PATH]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Outcome, config, hardware, main as bench_main, ray_session, run_pipeline, write_files

VARIANTS: dict[str, tuple[str, ...]] = {
    "adamw": (),
    "muon": ("--trainer.optimizer", "muon"),
    "cosine": ("--trainer.lr_schedule", "cosine", "--trainer.warmup_steps", "3"),
}


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="--model of every run (default smollm2-135m-instruct).")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="Seeds (default 0 1).")
    p.add_argument("--steps", type=int, default=30, help="Steps per run (default 30).")
    p.add_argument("--eval-every", type=int, default=10, help="Held-out evaluation every N steps (default 10).")
    p.add_argument("--muon-lr", type=float, default=1.6e-4, help="--trainer.optimizer.lr of the muon variant (default 1.6e-4).")
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS),
                   help="Variants to run (default all, in the order adamw, muon, cosine).")
    p.add_argument("--not-after", default=None, metavar="HH:MM", help="Start no run after this UTC time.")
    p.add_argument("--add-to", type=Path, default=None, metavar="JSON",
                   help="An earlier result of the same settings: its runs are kept, the others run.")


def _too_late(not_after: str | None) -> bool:
    if not_after is None:
        return False
    now = dt.datetime.now(dt.timezone.utc)
    h, m = (int(x) for x in not_after.split(":"))
    return (now.hour, now.minute) > (h, m) and now.hour >= h - 12   # same evening, no day wrap


def _one(args: argparse.Namespace, variant: str, seed: int) -> dict[str, Any]:
    from pipeline_rl.metrics import read_evals

    extra = list(VARIANTS[variant]) + (["--trainer.optimizer.lr", str(args.muon_lr)] if variant == "muon" else [])
    out = args.out / f"{variant}-seed{seed}"
    cfg = config(["--model", args.model, "--task.name", "word_problems", "--max-steps", str(args.steps),
                  "--eval.every", str(args.eval_every), "--seed", str(seed), "--out-dir", str(out), *extra],
                 evaluation=True)
    t0 = time.time()
    with ray_session():
        rows = run_pipeline(cfg)
    evals = read_evals(out / "eval.jsonl")
    return {"variant": variant, "seed": seed, "flags": extra, "wall_s": time.time() - t0,
            "greedy": {e.step: e.greedy_accuracy for e in evals},
            "reward_last5": sum(r["reward_mean"] for r in rows[-5:]) / max(1, len(rows[-5:])),
            "lr_first_last": [rows[0].get("lr", 0.0), rows[-1].get("lr", 0.0)] if rows else []}


def _earlier(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The runs of ``--add-to`` (none without it); exits 2 when its settings differ."""
    import json

    if args.add_to is None:
        return []
    try:
        old = json.loads(args.add_to.read_text())
    except (OSError, ValueError) as e:
        sys.exit(f"trainer_knobs: --add-to {args.add_to}: cannot read it ({e})")
    mine = {"model": args.model, "steps": args.steps, "eval_every": args.eval_every, "muon_lr": args.muon_lr}
    differ = [k for k, v in mine.items() if old.get(k) != v]
    if differ:
        sys.exit(f"trainer_knobs: --add-to {args.add_to}: other settings ({', '.join(differ)}: "
                 f"{', '.join(str(old.get(k)) for k in differ)})")
    return list(old["runs"])


def _run(args: argparse.Namespace) -> Outcome:
    runs = _earlier(args)
    done = {(run["variant"], run["seed"]) for run in runs}
    skipped: list[str] = []
    result: dict[str, Any] = {}
    for seed in args.seeds:
        for variant in args.variants:
            if (variant, seed) in done:
                continue
            if _too_late(args.not_after):
                skipped.append(f"{variant}-seed{seed}")
                continue
            try:
                runs.append(_one(args, variant, seed))
            except Exception as e:   # one failed run is reported; the others still run
                first = str(e).splitlines()[0] if str(e) else ""
                skipped.append(f"{variant}-seed{seed} (failed: {type(e).__name__}: {first})")
            result = _result(args, runs, skipped)
            write_files([(args.json, _json(result)), (args.md, _report(result))])
    result = _result(args, runs, skipped)
    return Outcome(result, _report(result))


def _json(result: dict[str, Any]) -> str:
    import json

    return json.dumps(result, indent=2) + "\n"


def _result(args: argparse.Namespace, runs: list[dict[str, Any]], skipped: list[str]) -> dict[str, Any]:
    import os

    return {"model": args.model, "steps": args.steps, "eval_every": args.eval_every, "muon_lr": args.muon_lr,
            "runs": runs, "not_run": skipped, "load_avg_1m_at_end": os.getloadavg()[0], "hardware": hardware(),
            "date": dt.date.today().isoformat()}


def _greedy_at(run: dict[str, Any], step: int) -> float | None:
    """A run's greedy accuracy after ``step`` (its keys are ints in memory, strings from JSON)."""
    greedy = run["greedy"]
    return greedy.get(step, greedy.get(str(step)))


def _report(r: dict[str, Any]) -> str:
    steps = sorted({int(s) for run in r["runs"] for s in run["greedy"]})
    head = "| variant | seed | " + " | ".join(f"step {s}" for s in steps) + " | run (s) |"
    rows = [f"| {run['variant']} | {run['seed']} | "
            + " | ".join(f"{_greedy_at(run, s) if _greedy_at(run, s) is not None else float('nan'):.3f}" for s in steps)
            + f" | {run['wall_s']:.0f} |" for run in r["runs"]]
    means = []
    for variant in dict.fromkeys(run["variant"] for run in r["runs"]):
        mine = [run for run in r["runs"] if run["variant"] == variant]
        cells = [[g for run in mine if (g := _greedy_at(run, s)) is not None]
                 for s in steps]
        means.append(f"| {variant} | mean of {len(mine)} | "
                     + " | ".join(f"{sum(c) / len(c):.3f}" if c else "-" for c in cells)
                     + f" | {sum(run['wall_s'] for run in mine) / len(mine):.0f} |")
    hw = r["hardware"]
    not_run = ", ".join(r["not_run"]) or "none"
    return "\n".join([
        f"# The trainer's knobs on {r['model']}: held-out greedy accuracy by step (word_problems)", "",
        f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB, no GPU "
        f"(load average {r['load_avg_1m_at_end']:.1f} at the end); {r['steps']} steps per run, the pretrained "
        f"profile's defaults, muon_lr {r['muon_lr']:g}; {r['date']}. Not run (the time ran out, or failed): {not_run}.", "",
        head, "|---|---:|" + "---:|" * (len(steps) + 1), *rows, *means, "",
        "Greedy accuracy over 32 held-out prompts (one prompt = 0.031).", ""])


def main(argv: list[str] | None = None) -> int:
    return bench_main("trainer_knobs", __doc__, argv, _run, flags=_flags, out="runs/trainer_knobs")


if __name__ == "__main__":
    sys.exit(main())
