"""Where the time from the command to the first step goes, and what bounds it.

Two measurements, each in fresh processes on an otherwise idle machine:

1. **The real command** (``launch/async_grpo.py --max-steps 3 --eval.every 0`` on the
   built-in model, ``--repeats`` times): the wall clock of each start-up phase line the
   driver prints (Ray, buffer, trainer, workers, training) and of the first step's line,
   from the command.
2. **The pieces alone**, one process at a time on an idle core: ``import ray`` plus
   the start of a local Ray as the command starts it (``ray_start.start_local``); ``import deepspeed``; ``import vllm``; building the rollout
   worker's vLLM engine (``InprocessEngine``: the rest of vLLM's imports, the model, the KV cache)
   after ``import vllm``; the last three with the garbage collector off, as the actors
   run them.

The rollout worker is the critical path: it cannot start before Ray is up, and its
vLLM import and engine build are one process's serial work. ``bound_s`` = the command's
Ray line + vLLM import + engine build is what the command cannot beat on this machine
(the buffer and the trainer start beside the worker, on the other core).

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
          ("training", "training:"), ("first_step", "step    1 "))

#: The actors import and build with the garbage collector off (``setup_actor_process``).
_NO_GC = "import gc; gc.disable(); "
_PIECES = {
    "ray_init": "import os; os.environ['RAY_AUTH_MODE']='disabled'; "   # as the command starts it
                "from pipeline_rl.runtime_env import ACTOR_ENV; from pipeline_rl.run.local_ray import start_local; "
                "start_local(num_cpus=2, object_store_mb=200, env=ACTOR_ENV, logging_level=30)",
    "import_deepspeed": _NO_GC + "import deepspeed",
    "import_vllm": _NO_GC + "import vllm",
    "vllm_engine": _NO_GC + "import vllm; t = time.perf_counter(); "   # its build after ``import vllm``
                   "from pipeline_rl.rollout.engine import EngineConfig; "
                   "from pipeline_rl.rollout.engine_inprocess import InprocessEngine; "
                   "InprocessEngine(EngineConfig(model_dir={model_dir!r}))",
}


def _piece_code(name: str, model_dir: str) -> str:
    """The piece, timed inside its process: a process's exit (Ray's shutdown, vLLM's
    atexit hooks) is not part of a run's start-up."""
    return ("import time; t = time.perf_counter(); " + _PIECES[name].format(model_dir=model_dir)
            + "; print('PIECE_S', time.perf_counter() - t, flush=True)")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def time_command(out_dir: Path) -> dict[str, float]:
    """Seconds from the command to each phase line of one real run."""
    cmd = [sys.executable, str(ROOT / "launch" / "async_grpo.py"), "--max-steps", "3", "--eval.every", "0",
           "--trainer.checkpoint_every", "0", "--out-dir", str(out_dir)]
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
    lines += ["", "Bound (the command's Ray line, then vLLM import + engine build, one serial chain): "
              f"**{result['bound_s']} s**; command to first step: **{result['first_step_s']} s** "
              f"({result['first_step_s'] / result['bound_s']:.2f}x the bound)."]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> Outcome:
    at_least(args, repeats=1)
    from pipeline_rl.driver import resolve_model_dir

    model_dir = str(resolve_model_dir(config([])))
    command = [time_command(args.out / f"run{i}") for i in range(args.repeats)]
    pieces = {name: [time_piece(name, model_dir) for _ in range(args.repeats)] for name in _PIECES}
    # Ray as the command starts it (its own settings), then the worker's serial chain.
    bound = _median([r["ray"] for r in command]) + _median(pieces["import_vllm"]) + _median(pieces["vllm_engine"])
    result = {"hardware": hardware(), "repeats": args.repeats, "command": command, "pieces": pieces,
              "bound_s": round(bound, 2), "first_step_s": _median([r["first_step"] for r in command])}
    return Outcome(result, markdown(result))


def main(argv: list[str] | None = None) -> int:
    return bench_main("startup", __doc__, argv, run, out="runs/bench_startup", flags=lambda p: p.add_argument(
        "--repeats", type=int, default=3, help="Runs of each measurement (default 3)."))


if __name__ == "__main__":
    raise SystemExit(main())
