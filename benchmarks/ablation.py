"""Staleness x off-policy correction ablation over seeds, in fp32 and bf16 generation,
run as Ray tasks on one machine or a cluster.

The grid: staleness {0, 1, 2, 4, 8} x correction {none, tis, icepop,
seq-mask-tis} x generation dtype {float32, bfloat16} (``--rollout.dtype``;
bf16 generation against an fp32 trainer gives a realistic generator/trainer
mismatch on CPU) x ``--seeds`` seeds. An *arm* is one (dtype, staleness,
correction); a *cell* is one arm at one seed. Every cell runs the real pipeline
(Ray, vLLM, DeepSpeed, ZeroMQ) from the same model folder with the same budget
(``--steps`` optimizer steps); seeds ``--seed .. --seed + seeds - 1``.

Placement: every cell is one Ray task in a placement group of its own, one CPU
per actor it starts (rollout workers + trainer ranks, packed on one node); its
actors are captured by the group, so a cell never spreads over nodes and never
competes with another for a core. The driver keeps as many cells running as
the nodes have room for (a node with ``C`` CPUs runs ``C // cpus per cell``).
``--ray-address`` joins a running cluster (every node needs this repository
at the same path and the project installed, as for any pipeline run there);
without it a local Ray is started with one CPU per core. Each cell's run
folder (``metrics.jsonl``, logs) is written on the node that ran it; its
record comes back to the driver as the task's result.

Outputs, under ``--out`` (default ``runs/bench_ablation``):

- ``cells/<cell>/cell.json`` (``<cell>`` = ``bf16_s2_tis_seed1``): the cell's
  status, wall time, node and metrics rows, written by the driver when the
  cell ends. A cell whose record matches the grid's settings is finished and
  skipped on a rerun, so an interrupted grid resumes cell by cell; a failed
  cell records its error and is retried on a rerun;
- ``ablation.json``, ``ablation.md``, ``ablation_<dtype>.png``,
  ``ablation_final.png``: per arm, the mean and 95% interval over seeds of
  every figure, significance against ``none``, curves with bands
  (``benchmarks/ablation_report.py`` defines them all, ``benchmarks/ablation_plots.py``
  draws them; ``benchmarks/ablation_cells.py`` the arms, cells and records).

``--quick`` (the smoke grid for a 2-core CPU machine): staleness {0, 2, 8} x
all four corrections, bfloat16 generation only, 100 steps each of the
pipeline's default configuration; ``--quick --seeds 3`` is 36 cells, about
14 minutes on 2 cores (``benchmarks/results/ablation.md``). Without ``--quick``
the full grid (40 arms x 200 steps x seeds) runs unattended.

The grid runs in a child process that the script restarts (``--max-restarts``,
finished cells kept) if it dies: Ray ends its driver process when its node goes
away, which no ``except`` can catch.

``--corrections`` takes any ``--correction.type`` preset (``m2po`` too) and ``--losses`` any
``--algorithm.loss`` (``gspo``, ``gspo-token``, ``cispo``, ...): the arms are their cross product,
an arm of another loss than reinforce labelled ``loss+correction``. ``--arms`` lists the arms instead
(``none,tis,m2po,gspo@behaviour+none``): a correction alone is reinforce's; ``@behaviour`` sets
``--algorithm.ratio_reference``.

Usage: ``python -m benchmarks.ablation [--quick] [--seeds N] [--staleness 0,2]
[--corrections tis,icepop,m2po] [--losses reinforce,gspo] [--dtypes bfloat16] [--steps N] [--ray-address ADDR]
[--json PATH] [-- extra pipeline flags]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, get_args

from benchmarks.ablation_cells import Arm, Cell, CellResult, CellStatus, GridSettings
from benchmarks.ablation_plots import plot
from benchmarks.ablation_report import build_result, markdown
from benchmarks.common import (BadFlag, Outcome, at_least, config, main as bench_main, ray_session, repo_on_path,
                               run_pipeline)
from pipeline_rl.config import CorrectionName, LossName, RatioReference   # torch-free

STALENESS = (0, 1, 2, 4, 8)
CORRECTIONS = ("none", "tis", "icepop", "seq-mask-tis")
#: What --corrections and --losses accept: every --correction.type preset (custom needs flags of its
#: own, which would reach every arm) and every --algorithm.loss.
CORRECTION_CHOICES = tuple(c for c in get_args(CorrectionName) if c != "custom")
LOSSES = get_args(LossName)
REFERENCES = get_args(RatioReference)
DTYPES = ("float32", "bfloat16")
DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}

QUICK_STALENESS = (0, 2, 8)
QUICK_DTYPES = ("bfloat16",)
QUICK_STEPS = 100
FULL_STEPS = 200
DEFAULT_SEEDS = 3
#: Pipeline flags --quick adds (none: the built-in default model, task and batch).
QUICK_FLAGS: tuple[str, ...] = ()


# ---------------------------------------------------------------------------- grid

def parse_list(flag: str, text: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise BadFlag(f"{flag}: give a comma-separated list (got {text!r})")
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise BadFlag(f"{flag}: unknown value(s) {', '.join(bad)} (allowed: {', '.join(allowed)})")
    return items


def parse_arms(text: str) -> list[tuple[str, str, str]]:
    """``--arms``: (loss, reference, correction) from ``correction`` (reinforce's),
    ``loss+correction`` or ``loss@reference+correction`` (``--algorithm.ratio_reference``)."""
    arms = []
    for item in parse_list("--arms", text):
        spec, _, corr = item.rpartition("+")
        loss, _, ref = (spec or "reinforce").partition("@")
        ref = ref or "proximal"
        if (loss not in LOSSES or corr not in CORRECTION_CHOICES or ref not in REFERENCES
                or (loss == "reinforce" and ref != "proximal")):
            raise BadFlag(f"--arms: unknown arm {item!r} (a correction of {', '.join(CORRECTION_CHOICES)}, "
                          f"or loss+correction or loss@reference+correction with a loss of "
                          f"{', '.join(x for x in LOSSES if x != 'reinforce')} and a reference of "
                          f"{', '.join(REFERENCES)})")
        arms.append((loss, ref, corr))
    return list(dict.fromkeys(arms))


def grid(staleness: str, corrections: str, dtypes: str, seeds: list[int], losses: str = "reinforce",
         arms: str | None = None) -> list[Cell]:
    """The cells, dtype-major, then staleness, loss, correction, seed; ``arms`` (``--arms``) lists
    the (loss, correction) pairs instead of crossing ``losses`` with ``corrections``."""
    try:
        ks = [int(x) for x in parse_list("--staleness", staleness)]
    except ValueError:
        raise BadFlag(f"--staleness: give non-negative integers (got {staleness!r})") from None
    if any(k < 0 for k in ks):
        raise BadFlag(f"--staleness: give non-negative integers (got {staleness!r})")
    if arms is not None:
        triples = parse_arms(arms)
    else:
        corrs = parse_list("--corrections", corrections, CORRECTION_CHOICES)
        objs = parse_list("--losses", losses, LOSSES)
        triples = [(o, "proximal", c) for o in dict.fromkeys(objs) for c in dict.fromkeys(corrs)]
    dts = [DTYPE_ALIASES[d] for d in parse_list("--dtypes", dtypes, tuple(DTYPE_ALIASES))]
    return [Cell(Arm(d, k, c, o, r), s) for d in dict.fromkeys(dts) for k in dict.fromkeys(ks)
            for o, r, c in triples for s in seeds]


def cell_dir(out: Path, cell: Cell) -> Path:
    return out / "cells" / cell.name


def load_finished(path: Path, settings_key: str) -> CellResult | None:
    """The cell's record when it finished under the same settings, else None."""
    record = path / "cell.json"
    if not record.is_file():
        return None
    try:
        data = json.loads(record.read_text())
        cell = Cell.from_dict(data["cell"])
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    if data.get("status") != "done" or data.get("settings_key") != settings_key:
        return None
    return CellResult(cell, settings_key, "done", data["wall_s"], data["rows"], None, data.get("node"),
                      data.get("evals", []))


def save_record(path: Path, res: CellResult) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "cell.json.tmp"
    tmp.write_text(json.dumps({"cell": asdict(res.cell), "settings_key": res.settings_key,
                               "status": res.status, "wall_s": res.wall_s, "error": res.error,
                               "node": res.node, "rows": res.rows, "evals": res.evals}))
    tmp.replace(path / "cell.json")


def run_cell(cell: Cell, settings: GridSettings, out: Path, keep_checkpoints: bool) -> CellResult:
    """Run one cell through the real pipeline (in the Ray task that hosts it); a failure
    is recorded, not raised (the grid goes on)."""
    import ray

    from pipeline_rl.metrics import read_metrics

    path = cell_dir(out, cell)
    (path / "cell.json").unlink(missing_ok=True)
    cfg = config(["--model.path", settings.model_dir, *settings.flags, *cell.flags(),
                  "--max-steps", str(settings.steps), "--out-dir", str(path),
                  "--trainer.checkpoint_every", "0"])
    t0 = time.perf_counter()
    status: CellStatus = "failed"
    error: str | None = None
    try:
        rows = run_pipeline(cfg)
        if len(rows) == settings.steps:
            status = "done"
        else:
            error = f"stopped after {len(rows)} of {settings.steps} steps"
    except Exception as e:  # noqa: BLE001 - an unattended grid records the failure and goes on
        traceback.print_exc()
        rows, error = [], f"{type(e).__name__}: {e}".splitlines()[0]
    if not keep_checkpoints:
        shutil.rmtree(path / "checkpoints", ignore_errors=True)
    evals = read_metrics(path / "eval.jsonl") if (path / "eval.jsonl").is_file() else []
    return CellResult(cell, settings.key(), status, time.perf_counter() - t0, rows, error,
                      ray.get_runtime_context().get_node_id(), evals)


# ---------------------------------------------------------------------------- Ray

def cell_slots(cpus_per_cell: int) -> dict[str, int]:
    """Node id -> how many cells that node can run at once (only nodes with room for one)."""
    import ray

    slots = {}
    for node in ray.nodes():
        fits = int(node.get("Resources", {}).get("CPU", 0.0)) // cpus_per_cell
        if node.get("Alive") and fits > 0:
            slots[node["NodeID"]] = fits
    return slots


def run_cells(todo: list[Cell], settings: GridSettings, out: Path, keep_checkpoints: bool,
              cpus_per_cell: int, on_done: Any) -> None:
    """Run ``todo`` as Ray tasks, as many at once as the nodes have room for; call
    ``on_done(result)`` as each ends (in completion order)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    slots = cell_slots(cpus_per_cell)
    if not slots:
        raise BadFlag(f"no node of the Ray cluster has the {cpus_per_cell} CPUs a cell needs "
                      "(rollout workers + trainer ranks, on one node)")
    at_once = sum(slots.values())
    print(f"ablation: {cpus_per_cell} CPUs per cell, {at_once} cell(s) at once on {len(slots)} node(s)",
          flush=True)
    remote = ray.remote(num_cpus=0, max_retries=0)(run_cell)
    queue: deque[Cell] = deque(todo)
    running: dict[Any, tuple[Cell, Any, float]] = {}  # task ref -> (cell, placement group, start)
    while queue or running:
        while queue and len(running) < at_once:
            cell = queue.popleft()
            pg = placement_group([{"CPU": 1.0}] * cpus_per_cell, strategy="STRICT_PACK")
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_capture_child_tasks=True)
            ref = remote.options(scheduling_strategy=strategy).remote(cell, settings, out, keep_checkpoints)
            running[ref] = (cell, pg, time.perf_counter())
        ready, _ = ray.wait(list(running), num_returns=1)
        cell, pg, t0 = running.pop(ready[0])
        try:
            res = ray.get(ready[0])
        except Exception as e:  # noqa: BLE001 - the task's worker died: record it, go on
            res = CellResult(cell, settings.key(), "failed", time.perf_counter() - t0, [],
                             f"{type(e).__name__}: {e}".splitlines()[0])
        remove_placement_group(pg)
        on_done(res)


# ---------------------------------------------------------------------------- main

def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--staleness", default=None, help="Comma list (default 0,1,2,4,8).")
    p.add_argument("--corrections", default=None, help=f"Comma list of --correction.type presets "
                   f"({', '.join(CORRECTION_CHOICES)}; default {','.join(CORRECTIONS)}).")
    p.add_argument("--losses", default="reinforce", help=f"Comma list of --algorithm.loss values ({', '.join(LOSSES)}; "
                   "default reinforce), crossed with --corrections; an arm with another loss is labelled "
                   "loss+correction and compared against reinforce with none.")
    p.add_argument("--arms", default=None, help="Comma list of arms instead of --losses x --corrections: "
                   "a correction preset (with reinforce), loss+correction, or loss@reference+correction "
                   "(--algorithm.ratio_reference), e.g. none,tis,m2po,gspo@behaviour+none.")
    p.add_argument("--dtypes", default=None, help="Comma list of generation dtypes: float32/fp32, "
                   "bfloat16/bf16 (default both).")
    p.add_argument("--steps", type=int, default=None, help=f"Optimizer steps per cell (default {FULL_STEPS}; "
                   f"--quick: {QUICK_STEPS}).")
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="Seeds per arm (default "
                   f"{DEFAULT_SEEDS}; intervals and tests need at least 2).")
    p.add_argument("--seed", type=int, default=0, help="First seed (default 0): seeds seed..seed+seeds-1.")
    p.add_argument("--model", default=None, help="Model folder (default: the built-in model).")
    p.add_argument("--ray-address", default=None, help="Join the Ray cluster at this address (e.g. "
                   "ray://head:10001 or head:6379); default: a local Ray, one CPU per core.")
    p.add_argument("--threshold", type=float, default=None, help="Reward threshold for 'steps to "
                   "threshold' (default: half-way from the mean start reward to the best final reward).")
    p.add_argument("--collapse-tol", type=float, default=0.05, help="Collapse tolerance below the start "
                   "reward (default 0.05).")
    p.add_argument("--alpha", type=float, default=0.05, help="Family-wise significance level of the "
                   "comparisons against 'none' (Holm-corrected Welch t-tests; default 0.05).")
    p.add_argument("--rerun", action="store_true", help="Rerun finished cells too.")
    p.add_argument("--max-restarts", type=int, default=2, help="Restarts of the grid process when it "
                   "dies (e.g. Ray's node went away); finished cells are kept (default 2).")
    p.add_argument("--in-process", action="store_true", help="Run the grid in this process, no restarts.")
    p.add_argument("--keep-checkpoints", action="store_true", help="Keep each cell's final checkpoint.")


@dataclass(frozen=True, slots=True)
class Plan:
    """The resolved command line: the cells, what they share, and what one cell needs."""

    cells: list[Cell]
    settings: GridSettings
    cpus_per_cell: int


def resolve(args: argparse.Namespace) -> Plan:
    """The plan of the command line (a bad flag: :class:`BadFlag`), checked before anything starts."""
    quick = args.quick
    steps = args.steps if args.steps is not None else (QUICK_STEPS if quick else FULL_STEPS)
    at_least(args, seeds=1, seed=0)
    if steps < 1:
        raise BadFlag("--steps: must be >= 1")
    if not 0.0 < args.alpha < 1.0:
        raise BadFlag(f"--alpha must be in (0, 1), got {args.alpha}")
    cells = grid(args.staleness or ",".join(map(str, QUICK_STALENESS if quick else STALENESS)),
                 args.corrections or ",".join(CORRECTIONS),
                 args.dtypes or ",".join(QUICK_DTYPES if quick else DTYPES),
                 list(range(args.seed, args.seed + args.seeds)), args.losses, args.arms)
    if args.arms is not None and (args.corrections is not None or args.losses != "reinforce"):
        raise BadFlag("--arms: give either --arms or --losses/--corrections, not both")
    flags = (*(QUICK_FLAGS if quick else ()), *args.run_flags)
    # Validate the shared flags once, before anything starts (a bad flag fails in a second, not per cell).
    from pipeline_rl.driver import resolve_model_dir
    from pipeline_rl.resources import cpus_needed

    base = config([*(["--model.path", args.model] if args.model else []), *flags])
    if base.ray.rollout_resource or base.ray.trainer_resource or base.ray.address:
        raise BadFlag("--ray.address/--ray.rollout_resource/--ray.trainer_resource: a cell is placed on one "
                      "node by the grid; give the cluster with --ray-address instead")
    model_dir = str(Path(resolve_model_dir(base)).resolve())
    return Plan(cells, GridSettings(steps, model_dir, tuple(flags)), cpus_needed(base))


#: Exit status of a grid process some of whose cells failed (a crash of the process is any other).
CELLS_FAILED = 3


def run(args: argparse.Namespace, argv: list[str]) -> Outcome:
    """Run the grid in a child process and restart it (finished cells kept) when it dies:
    Ray ends its driver process when its node goes away, which no ``except`` can catch.
    The child reports; this process only when the child gave up."""
    plan = resolve(args)
    if args.in_process:
        return run_grid(args, plan)
    if args.rerun:  # forget finished cells here, once, so a restarted child keeps what it finished
        for cell in plan.cells:
            (cell_dir(args.out, cell) / "cell.json").unlink(missing_ok=True)
    child = [sys.executable, "-m", "benchmarks.ablation", "--in-process", *[a for a in argv if a != "--rerun"]]
    for attempt in range(args.max_restarts + 1):
        code = subprocess.run(child, check=False, env={**os.environ, **repo_on_path()}).returncode
        if code in (0, CELLS_FAILED):
            return Outcome(None, status=0 if code == 0 else 1)
        print(f"ablation: the grid process died (exit status {code}); "
              + ("restarting it, finished cells are kept" if attempt < args.max_restarts else "giving up"),
              file=sys.stderr, flush=True)
    return report(collect(plan, args.out), args, plan.settings, wall_s=0.0, status=1)


def collect(plan: Plan, out: Path) -> list[CellResult]:
    """The finished cells' records; a cell not finished is a failed placeholder."""
    key = plan.settings.key()
    return [load_finished(cell_dir(out, c), key) or CellResult(c, key, "failed", 0.0, [], "not finished")
            for c in plan.cells]


def run_grid(args: argparse.Namespace, plan: Plan) -> Outcome:
    """Run every unfinished cell on Ray (local or ``--ray-address``), then report."""
    t0 = time.perf_counter()
    finished, _ = run_unfinished("ablation", plan, args.out, rerun=args.rerun, keep_checkpoints=args.keep_checkpoints,
                                 ray_address=args.ray_address)
    key = plan.settings.key()
    results = [finished[c] or CellResult(c, key, "failed", 0.0, [], "not finished") for c in plan.cells]
    return report(results, args, plan.settings, time.perf_counter() - t0,
                  status=0 if all(r.status == "done" for r in results) else CELLS_FAILED)


def run_unfinished(name: str, plan: Plan, out: Path, *, rerun: bool = False, keep_checkpoints: bool = False,
                   ray_address: str | None = None, about: Callable[[CellResult], str] = lambda res: ""
                   ) -> tuple[dict[Cell, CellResult | None], int]:
    """Run on Ray every cell of ``plan`` not finished under its settings (every cell with
    ``rerun``), saving each one's record under ``out`` as it ends and saying so in one line
    (``about``: what that line adds). Returns every cell's record (None: not finished) and
    how many cells ran."""
    out.mkdir(parents=True, exist_ok=True)
    settings, key = plan.settings, plan.settings.key()
    finished = {c: load_finished(cell_dir(out, c), key) for c in plan.cells}
    todo = [c for c in plan.cells if rerun or finished[c] is None]
    print(f"{name}: {len(plan.cells)} cells, {len(plan.cells) - len(todo)} already finished, {len(todo)} "
          f"to run ({settings.steps} steps each) -> {out}", flush=True)
    if todo and ray_address is None and (slow := slow_bf16_here({c.arm.dtype for c in todo})):
        print(f"{name}: {slow}: generation in float32 is the fast choice here", flush=True)
    done_count = len(plan.cells) - len(todo)

    def on_done(res: CellResult) -> None:
        nonlocal done_count
        done_count += 1
        save_record(cell_dir(out, res.cell), res)
        finished[res.cell] = res
        where = f" on node {res.node[:8]}" if res.node else ""
        print(f"[{done_count}/{len(plan.cells)}] {res.cell.name}: {res.status} in {res.wall_s:.0f} s{where}"
              + about(res) + (f" ({res.error})" if res.error else ""), flush=True)

    if todo:
        with ray_session(ray_address):
            run_cells(todo, settings, out, keep_checkpoints, plan.cpus_per_cell, on_done)
    return finished, len(todo)


def slow_bf16_here(dtypes: set[str]) -> str | None:
    """The line for bfloat16 cells run on this machine's CPU when it has no native bfloat16
    (``pipeline_rl.resources.slow_bf16_line``), else None."""
    from pipeline_rl.resources import slow_bf16_line, this_cpuinfo
    from pipeline_rl.rollout.engines.engine_factory import resolve_device

    if "bfloat16" not in dtypes or resolve_device("auto") != "cpu":
        return None
    return slow_bf16_line("bfloat16", this_cpuinfo())


def report(results: list[CellResult], args: argparse.Namespace, settings: GridSettings, wall_s: float,
           status: int) -> Outcome:
    result = build_result(results, settings, args.threshold, args.collapse_tol, args.alpha, wall_s)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(result, args.out)
    return Outcome(result, markdown(result), status)


EPILOG = (f"--quick: staleness {','.join(map(str, QUICK_STALENESS))} x all corrections, "
          f"{','.join(QUICK_DTYPES)} generation only, {QUICK_STEPS} steps per cell of the default "
          f"model, task and batch. Explicit --staleness/--corrections/--dtypes/--steps override it. "
          f"Without --quick: the full grid, {len(STALENESS) * len(CORRECTIONS) * len(DTYPES)} arms "
          f"x {FULL_STEPS} steps x --seeds.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return bench_main("ablation", __doc__, argv, lambda args: run(args, argv), flags=flags,
                      quick="The 2-core smoke grid (see below).", out="runs/bench_ablation", epilog=EPILOG,
                      run_flags="Extra pipeline flags, after -- (e.g. -- --trainer.lr 5e-4).")


if __name__ == "__main__":
    raise SystemExit(main())
