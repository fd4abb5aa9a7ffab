"""Version bookkeeping under PPO epochs: does every counter agree, and does the buffer evict?

Usage::

    python -m benchmarks.versions [--steps 20] [--staleness 0 1 2] [--json PATH] [--md PATH]

For each staleness ``k`` the real pipeline (orchestrator, trainer, vLLM worker, buffer,
on one local Ray) runs ``--steps`` steps of the built-in default twice, with
``--algorithm.loss ppo --algorithm.ppo_epochs 1`` and ``... 2``, checkpointing every
``steps/2`` steps; the ``ppo_epochs 2`` run is then resumed from its middle checkpoint
and run to the end. Per run it checks and reports:

- ``steps_ok``: the step rows count 1..N and each row's version equals its step
  (a version counts batches, however many optimizer steps a batch gets);
- ``checkpoints_ok``: checkpoint folders are ``step_{steps/2}`` and ``step_{steps}`` and
  each one's saved version equals the number in its name;
- ``lag_max``: the largest lag trained on (must be at most ``k``);
- ``evicted_per_group``: groups evicted as stale per group trained.

Output: a Markdown table (stdout and ``--md``), the figures in ``--json``. The exit
status is 1 if a check fails.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common import BadFlag, Outcome, config, hardware, main as bench_main, ray_session, run_pipeline


@dataclass(frozen=True, slots=True)
class VersionRun:
    """One run's checks and figures (see the module docstring)."""

    staleness: int
    ppo_epochs: int
    resumed_from: int | None
    steps: int
    final_version: int
    steps_ok: bool
    checkpoints_ok: bool
    lag_max: int
    groups_trained: int
    evicted: int

    @property
    def evicted_per_group(self) -> float:
        return self.evicted / self.groups_trained if self.groups_trained else 0.0

    @property
    def ok(self) -> bool:
        return self.steps_ok and self.checkpoints_ok and self.lag_max <= self.staleness


def one_run(out: Path, staleness: int, epochs: int, steps: int, resume: Path | None = None) -> VersionRun:
    from pipeline_rl.training.checkpoint import checkpoint_name, read_run_state

    half = steps // 2
    argv = ["--staleness", str(staleness), "--max-steps", str(steps), "--out-dir", str(out),
            "--algorithm.loss", "ppo", "--algorithm.ppo_epochs", str(epochs),
            "--trainer.checkpoint_every", str(half), "--trainer.checkpoint_every_s", "0"]
    if resume is not None:
        argv += ["--resume", str(resume)]
    cfg = config(argv)
    rows = run_pipeline(cfg)
    first = half + 1 if resume is not None else 1
    steps_ok = ([(int(r["step"]), int(r["version"])) for r in rows]
                == [(s, s) for s in range(first, steps + 1)])
    ckpts = out / "checkpoints"
    expected = [checkpoint_name(v) for v in ((steps,) if resume is not None else (half, steps))]
    names = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
    checkpoints_ok = names == expected and all(
        read_run_state(ckpts / n).version == int(n.split("_")[1]) for n in names)
    return VersionRun(
        staleness=staleness, ppo_epochs=epochs, resumed_from=half if resume is not None else None,
        steps=len(rows), final_version=int(rows[-1]["version"]) if rows else 0,
        steps_ok=steps_ok, checkpoints_ok=checkpoints_ok,
        lag_max=max(int(r["lag_max"]) for r in rows) if rows else 0,
        groups_trained=len(rows) * cfg.groups_per_step, evicted=int(rows[-1]["evicted"]) if rows else 0)


def markdown(runs: list[VersionRun], steps: int) -> str:
    lines = [f"Versions under PPO epochs: {steps} steps per run, checkpoints every {steps // 2}.", "",
             "| staleness | ppo_epochs | resumed from | steps | final version | steps = versions "
             "| checkpoints | lag max | evicted per trained group |",
             "|---:|---:|---:|---:|---:|:---:|:---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r.staleness} | {r.ppo_epochs} | {r.resumed_from if r.resumed_from is not None else '-'} "
                     f"| {r.steps} | {r.final_version} | {'yes' if r.steps_ok else 'NO'} "
                     f"| {'yes' if r.checkpoints_ok else 'NO'} | {r.lag_max} | {r.evicted_per_group:.3f} |")
    return "\n".join(lines)


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=20, help="Steps per run (even, >= 4; default 20).")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2], help="Staleness values (default 0 1 2).")


def run(args: argparse.Namespace) -> Outcome:
    if args.steps < 4 or args.steps % 2:
        raise BadFlag("--steps must be even and >= 4")
    from pipeline_rl.training.checkpoint import checkpoint_name

    runs: list[VersionRun] = []
    with ray_session(), tempfile.TemporaryDirectory(prefix="versions_") as tmp:
        for k in args.staleness:
            for epochs in (1, 2):
                out = Path(tmp) / f"k{k}_e{epochs}"
                runs.append(one_run(out, k, epochs, args.steps))
                print(markdown(runs[-1:], args.steps).splitlines()[-1], flush=True)
                if epochs == 2:
                    ckpt = out / "checkpoints" / checkpoint_name(args.steps // 2)
                    runs.append(one_run(Path(tmp) / f"k{k}_e2_resumed", k, 2, args.steps, resume=ckpt))
                    print(markdown(runs[-1:], args.steps).splitlines()[-1], flush=True)
    return Outcome({"steps": args.steps, "hardware": hardware(),
                    "runs": [{**asdict(r), "evicted_per_group": r.evicted_per_group, "ok": r.ok} for r in runs]},
                   markdown(runs, args.steps), 0 if all(r.ok for r in runs) else 1)


def main(argv: list[str] | None = None) -> int:
    return bench_main("versions", __doc__, argv, run, flags=flags)


if __name__ == "__main__":
    raise SystemExit(main())
