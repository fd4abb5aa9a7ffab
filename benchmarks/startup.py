"""Where the time from the command to the first step goes, and what bounds it.

Two measurements, each in fresh processes:

1. **The real command** (``launch/async_grpo.py --max-steps 3``, every other flag at its
   default, the built-in model, ``--repeats`` times): the wall clock of each start-up
   phase line the driver prints (Ray, buffer, trainer, workers, training), of the
   starting evaluation's line and of the first step's line, from the command.
2. **The pieces alone**, one process at a time: ``import ray`` plus the start of a local
   Ray as the command starts it (``local_ray.start_local``); ``import vllm``; building the
   rollout worker's vLLM engine (``InprocessEngine``: the rest of vLLM's imports, the
   model, the KV cache) after ``import vllm``; the trainer's whole start (its imports,
   torch, transformers and DeepSpeed, and its DeepSpeed engine: ``Trainer``); all but
   Ray's with the garbage collector off, as the actors run them.

The two are interleaved (one command, then each piece once, per repeat), so that a drift
in the machine's speed reaches both sides of the ratio alike.

Bounds: ``slowest_actor_s``, the slowest actor's own start (the rollout worker's vLLM
import + engine build, or the trainer's, whichever is longer), which no command that
starts that actor can beat; ``chain_s`` = the command's Ray line + the rollout worker's
start, the chain of a command whose worker starts importing only once Ray is up (as the
command's does: its actors are Ray's own worker processes, started through Ray's public
API; ``docs/design.md`` section 8).

Usage: ``python -m benchmarks.startup [--repeats 3] [--json PATH] [--md PATH]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Outcome, at_least, config, hardware, main as bench_main

#: The console line that marks each phase (its first words), in the order printed.
PHASES = (("ray", "Ray:"), ("buffer", "buffer:"), ("trainer", "trainer:"), ("workers", "rollout:"),
          ("training", "training:"), ("start_eval", "eval after step 0 "), ("first_step", "step    1 "))

#: The actors import and build with the garbage collector off (``setup_actor_process``).
_NO_GC = "import gc; gc.disable(); "
_PIECES = {
    "ray_init": "import os; os.environ['RAY_AUTH_MODE']='disabled'; "   # as the command starts it
                "from pipeline_rl.runtime_env import ACTOR_ENV; from pipeline_rl.run.local_ray import start_local; "
                "start_local(num_cpus=2, object_store_mb=200, env=ACTOR_ENV, logging_level=30)",
    "import_vllm": _NO_GC + "import vllm",
    "vllm_engine": _NO_GC + "import vllm; t = time.perf_counter(); "   # its build after ``import vllm``
                   "from pipeline_rl.rollout.engines.engine import EngineConfig; "
                   "from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine; "
                   "InprocessEngine(EngineConfig(model_dir={model_dir!r}))",
    "trainer_start": _NO_GC + "from pipeline_rl import runtime_env; from pipeline_rl.net import free_port; "
                     "port = free_port(); runtime_env.for_rendezvous('127.0.0.1', port, 0, 1); "
                     "from pipeline_rl.config import Config; from pipeline_rl.training.trainer import Trainer; "
                     "Trainer(Config(), {model_dir!r}, master_addr='127.0.0.1', master_port=port)",
}


def _piece_code(name: str, model_dir: str) -> str:
    """The piece, timed inside its process: a process's exit (Ray's shutdown, vLLM's
    atexit hooks) is not part of a run's start-up."""
    return ("import time; t = time.perf_counter(); " + _PIECES[name].format(model_dir=model_dir)
            + "; print('PIECE_S', time.perf_counter() - t, flush=True)")


def _env() -> dict[str, str]:
    from pipeline_rl.runtime_env import ACTOR_ENV

    return {**os.environ, **ACTOR_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "DS_ACCELERATOR": "cpu"}


def time_command(out_dir: Path) -> dict[str, float]:
    """Seconds from the command to each phase line of one real run."""
    cmd = [sys.executable, str(ROOT / "launch" / "async_grpo.py"), "--max-steps", "3", "--out-dir", str(out_dir)]
    start = time.perf_counter()
    seen: dict[str, float] = {}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                          env=_env()) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.perf_counter() - start
            for name, head in PHASES:
                if name not in seen and line.startswith(head):
                    seen[name] = now
        code = proc.wait()
    if code != 0 or len(seen) != len(PHASES):
        raise RuntimeError(f"the run exited with {code} after phases {sorted(seen)} (see {out_dir}/logs)")
    return seen


def time_piece(name: str, model_dir: str) -> float:
    """Seconds of one piece in a fresh process (the engine: its build after ``import vllm``)."""
    done = subprocess.run([sys.executable, "-c", _piece_code(name, model_dir)], capture_output=True, text=True,
                          cwd=ROOT, env=_env(), check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return float(next(ln.split()[1] for ln in done.stdout.splitlines() if ln.startswith("PIECE_S")))


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 2)


def markdown(result: dict[str, Any]) -> str:
    hw, cmd, pieces = result["hardware"], result["command"], result["pieces"]
    lines = [f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB, no GPU. "
             f"Medians of {result['repeats']} runs; seconds from the command.", "",
             "| phase line | at (s) | range |", "|---|---:|---|"]
    for name, _ in PHASES:
        xs = [r[name] for r in cmd]
        lines.append(f"| {name} | {_median(xs)} | {min(xs):.2f}–{max(xs):.2f} |")
    lines += ["", "Pieces alone (fresh process, idle machine; seconds):", "", "| piece | s |", "|---|---:|"]
    for name, xs in pieces.items():
        lines.append(f"| {name} | {_median(xs)} |")
    first, slowest, chain = result["first_step_s"], result["slowest_actor_s"], result["chain_s"]
    lines += ["", f"Command to first step: **{first} s**. The slowest actor's own start (the rollout "
              f"worker's vLLM import + engine build, or the trainer's start, alone): **{slowest} s**, the "
              f"command at **{first / slowest:.2f}x** it; the chain Ray line + the rollout worker's start (a "
              f"worker importing only once Ray is up, as the command's does): {chain} s, the command "
              f"at {first / chain:.2f}x it."]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> Outcome:
    at_least(args, repeats=1)
    from pipeline_rl.driver import resolve_model_dir

    model_dir = str(resolve_model_dir(config([])))
    # Interleaved (a command, then each piece once, per repeat): this machine's speed drifts
    # by tens of percent within minutes, and the ratio must compare like with like.
    command: list[dict[str, float]] = []
    pieces: dict[str, list[float]] = {name: [] for name in _PIECES}
    for i in range(args.repeats):
        command.append(time_command(args.out / f"run{i}"))
        for name in _PIECES:
            pieces[name].append(time_piece(name, model_dir))
    rollout = _median(pieces["import_vllm"]) + _median(pieces["vllm_engine"])
    result = {"hardware": hardware(), "repeats": args.repeats, "command": command, "pieces": pieces,
              "slowest_actor_s": round(max(rollout, _median(pieces["trainer_start"])), 2),
              # Ray as the command starts it (its own line), then the worker's serial chain.
              "chain_s": round(_median([r["ray"] for r in command]) + rollout, 2),
              "first_step_s": _median([r["first_step"] for r in command])}
    return Outcome(result, markdown(result))


def main(argv: list[str] | None = None) -> int:
    return bench_main("startup", __doc__, argv, run, out="runs/bench_startup", flags=lambda p: p.add_argument(
        "--repeats", type=int, default=3, help="Runs of each measurement (default 3)."))


if __name__ == "__main__":
    raise SystemExit(main())
