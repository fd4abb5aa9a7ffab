"""pipeline_rl against what a user would run instead: TRL's ``GRPOTrainer``, side by side
on the same model folder, task, batch, group size, learning rate, sampling and machine.

Systems (``--systems``, default ``trl,s0,s2``): ``trl`` (``python -m benchmarks.peers_trl``:
synchronous, Hugging Face ``generate``, one process with ``--trl-threads`` torch
threads), ``s0`` (``launch/async_grpo.py --staleness 0``: synchronous, vLLM and
DeepSpeed in their own processes), ``s2`` (``--staleness 2``, the default) and any
other ``sN`` (``--staleness N``), each with the project's default held-out evaluation
(as users run it; TRL evaluates nothing), or without it as ``sN-noeval``
(``--eval.every 0``: what evaluation costs, both arms in one run).
Every run is a fresh process started by this script with the same settings:
``--prompts`` x ``--n`` completions per step (default 4 x 8 = 32), lr 2e-4 constant,
temperature 1, top-p 1, at most ``--max-new-tokens`` new tokens, group mean/std
advantages, token-normalised loss, no KL, ``--steps`` steps, seeds
``0 .. --seeds - 1`` (with the defaults, the project's runs are its default command).
Runs are interleaved (seed-major) so a drift of the machine touches every system alike.

How each side is installed (``benchmarks/peers_env.py``; the report names each side's
environment and the versions it imports): TRL in a virtual environment of its own, built
once from TRL's pins under ``.cache/peers-trl-venv`` (torch 2.13.0 CPU, no vLLM), as its
users install it; the project in its own ``.venv``. ``--trl-env project`` runs TRL from the
project's environment instead (the suite's quick test: nothing to build, offline).

What differs, and why (the script cannot make these equal):

- the generator: vLLM (pipeline_rl) against ``transformers.generate`` (TRL without
  vLLM: TRL's vLLM path needs a CUDA server or colocated GPU engine);
- the environments: each side its own (above), with the same torch and transformers;
- the processes: pipeline_rl runs a rollout worker and a trainer on one core each;
  TRL runs one process, given both cores' worth of threads (``--trl-threads 2``);
- random streams: same seeds, but the two sample with different generators, so
  runs are compared over seeds, not one to one.

Per run: steps, training time and wall time (from the command, start-up included)
until the trailing ``--window``-step mean reward first reaches ``--target`` (full
windows only); start-up (command to the first step's start); the median step time;
generated tokens per second of training time. Per system: medians and ranges over
seeds; ratios pipeline_rl / TRL of the medians.

Outputs (``--out``, default ``runs/bench_peers``): ``peers.json``, ``peers.md``,
``peers.png`` (every run's trailing-mean reward against wall time since its
command, both systems on one plot), and each run's log and metrics.

Usage: ``python -m benchmarks.peers [--seeds 3] [--steps 400] [--systems trl,s0,s2]
[--target 0.8] [--window 40] [--json PATH] [--md PATH] [--png PATH] [-- --task.* flags]``.
The heavy-tailed task: ``python -m benchmarks.peers --steps 120 --systems trl,s0,s2,s8
--lr 5e-5 --max-new-tokens 492 --max-model-len 512 -- --task.name countdown
--task.digits 3`` (lr 5e-5 for both systems: at 2e-4 the project's run lost the counting
the long answers need within 20 steps).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, BadFlag, Outcome, at_least, config, hardware, main as bench_main, pyplot
from benchmarks.peers_env import describe
from benchmarks.peers_heldout import (HeldOut, fmt as _f, fmt_range as _mr, heldout_bounds, heldout_markdown,
                                      read_held_out)
from benchmarks.stats import median_range, trailing_mean

SYSTEMS = ("trl", "s0", "s2")   # the default set; any sN (pipeline_rl --staleness N) is accepted
_DIST_ENV = frozenset({"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                       "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE"})
LABEL = {"trl": "TRL GRPOTrainer (sync, HF generate)"}
NOEVAL = "-noeval"


def label(system: str) -> str:
    """``trl``, ``sN`` or ``sN-noeval`` (pipeline_rl at staleness N), as the report names it."""
    if system in LABEL:
        return LABEL[system]
    staleness = system[1:].removesuffix(NOEVAL)
    return f"pipeline_rl --staleness {staleness}" + (" --eval.every 0" if system.endswith(NOEVAL) else "")


@dataclass(frozen=True, slots=True)
class Settings:
    """What every run shares."""

    steps: int
    prompts: int
    n: int
    lr: float
    max_new_tokens: int
    max_model_len: int  # vLLM's context (pipeline_rl only: HF generate has no such setting)
    temperature: float
    task_flags: tuple[str, ...]
    trl_threads: int
    model_dir: str
    builtin: bool  # model_dir is the built-in model (no --model given)
    trl_python: str = sys.executable  # the interpreter TRL runs in (its own environment, or the project's)
    eval_every: int = 0     # held-out greedy evaluation every N steps on both sides (0: the project's default only)
    eval_prompts: int = 32


@dataclass(frozen=True, slots=True)
class Curve:
    """One run's per-step record: wall clock at each step's end, seconds since its
    training started, reward, completion tokens per sequence."""

    unix_time_s: list[float]
    time_s: list[float]
    reward: list[float]
    completion_len: list[float]
    evals: list[HeldOut] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run's figures (None: the target was never reached, or the run failed)."""

    system: str
    seed: int
    ok: bool
    error: str | None
    steps: int
    startup_s: float | None
    steps_to_target: int | None
    train_s_to_target: float | None
    wall_s_to_target: float | None
    step_time_s: float | None
    tokens_per_s: float | None
    final_reward: float | None
    wall_s: float
    greedy_first: float | None = None
    greedy_last: float | None = None
    heldout_steps_to_target: int | None = None
    heldout_train_s_to_target: float | None = None
    heldout_wall_s_to_target: float | None = None
    heldout_train_s_last: float | None = None   # the last evaluation's times: a run that never
    heldout_wall_s_last: float | None = None    # reached the target had not by then


def trailing(values: list[float], window: int) -> list[float | None]:
    """Trailing ``window``-step means, None until the window is full."""
    return [m if i >= window - 1 else None for i, m in enumerate(trailing_mean(values, window))]


def measure(system: str, seed: int, launched: float, curve: Curve | None, wall_s: float, s: Settings,
            target: float, window: int, error: str | None, heldout_target: float | None = None) -> RunResult:
    """The figures of one run from its curve (``launched``: wall clock at its command)."""
    if curve is None or not curve.reward:
        return RunResult(system, seed, False, error or "no steps", 0, None, None, None, None, None, None,
                         None, wall_s)
    means = trailing(curve.reward, window)
    hit = next((i for i, m in enumerate(means) if m is not None and m >= target), None)
    first_start = curve.unix_time_s[0] - curve.time_s[0]
    steps_time = [b - a for a, b in zip(curve.time_s, curve.time_s[1:])]
    tokens = sum(curve.completion_len) * s.prompts * s.n
    k = max(1, len(curve.reward) // 10)
    ev = curve.evals
    reached = next((e for e in ev if heldout_target is not None and e.greedy >= heldout_target), None)
    return RunResult(
        system, seed, error is None and len(curve.reward) == s.steps, error, len(curve.reward),
        first_start - launched, hit + 1 if hit is not None else None,
        curve.time_s[hit] if hit is not None else None,
        curve.unix_time_s[hit] - launched if hit is not None else None,
        statistics.median(steps_time) if steps_time else None,
        tokens / curve.time_s[-1] if curve.time_s[-1] > 0 else None,
        statistics.fmean(curve.reward[-k:]), wall_s,
        ev[0].greedy if ev else None, ev[-1].greedy if ev else None,
        reached.step if reached else None, reached.train_s if reached else None,
        reached.unix_time_s - launched if reached else None,
        ev[-1].train_s if ev else None, ev[-1].unix_time_s - launched if ev else None)


# ---------------------------------------------------------------------------- runs

def command(system: str, seed: int, s: Settings, run_dir: Path) -> list[str]:
    py = sys.executable
    if system == "trl":
        return [s.trl_python, "-m", "benchmarks.peers_trl", "--model", s.model_dir,
                "--out", str(run_dir / "metrics.jsonl"), "--seed", str(seed), "--max-steps", str(s.steps),
                "--prompts", str(s.prompts), "--n", str(s.n), "--lr", str(s.lr),
                "--temperature", str(s.temperature), "--max-new-tokens", str(s.max_new_tokens),
                "--threads", str(s.trl_threads), f"--task-flags={' '.join(s.task_flags)}",
                "--eval-every", str(s.eval_every), "--eval-prompts", str(s.eval_prompts)]
    staleness = system[1:].removesuffix(NOEVAL)
    # The built-in model is what the plain command uses (no --model.path: the folder is the
    # same, and the command a user runs skips the checks of a user's folder).
    model = [] if s.builtin else ["--model.path", s.model_dir]
    evaluation = (["--eval.every", "0"] if system.endswith(NOEVAL) else
                  ["--eval.every", str(s.eval_every), "--eval.num_prompts", str(s.eval_prompts)] if s.eval_every else [])
    return [py, str(ROOT / "launch" / "async_grpo.py"), "--staleness", staleness, "--seed", str(seed),
            "--max-steps", str(s.steps), "--out-dir", str(run_dir), *model,
            "--rollout.n", str(s.n), "--trainer.batch_size", str(s.prompts * s.n),
            "--trainer.lr", str(s.lr), "--rollout.temperature", str(s.temperature),
            "--rollout.max_new_tokens", str(s.max_new_tokens),
            "--rollout.max_model_len", str(s.max_model_len), *evaluation,
            "--trainer.checkpoint_every", "0", *s.task_flags]


def read_curve(path: Path) -> Curve | None:
    from pipeline_rl.metrics import read_metrics

    if not path.is_file():
        return None
    rows = [r for r in read_metrics(path) if "unix_time_s" in r]
    if not rows:
        return None
    return Curve([float(r["unix_time_s"]) for r in rows], [float(r["time_s"]) for r in rows],
                 [float(r["reward_mean"]) for r in rows], [float(r["completion_len_mean"]) for r in rows],
                 read_held_out(path.with_name("eval.jsonl"), rows))


def run_one(system: str, seed: int, s: Settings, out: Path, timeout_s: float) -> tuple[float, Curve | None,
                                                                                      float, str | None]:
    """Run one system at one seed in a fresh process; returns (launch wall clock, curve,
    wall seconds, error line or None)."""
    run_dir = out / f"{system}_seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "eval.jsonl"):
        (run_dir / name).unlink(missing_ok=True)
    # A fresh process of its own: no torch.distributed rendezvous inherited from the caller
    # (a caller that ran DeepSpeed in-process leaves MASTER_PORT & co. set, still bound).
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    if system == "trl":
        env["OMP_NUM_THREADS"] = str(s.trl_threads)
    launched = time.time()
    with (run_dir / "console.log").open("w") as log:
        try:
            code = subprocess.run(command(system, seed, s, run_dir), stdout=log, stderr=subprocess.STDOUT,
                                  env=env, cwd=ROOT, timeout=timeout_s, check=False).returncode
            error = None if code == 0 else f"exit status {code} (see {run_dir / 'console.log'})"
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout_s:.0f} s"
    return launched, read_curve(run_dir / "metrics.jsonl"), time.time() - launched, error


# ---------------------------------------------------------------------------- report

FIGURES = ("steps_to_target", "train_s_to_target", "wall_s_to_target", "startup_s", "step_time_s",
           "tokens_per_s", "final_reward", "greedy_first", "greedy_last", "heldout_steps_to_target",
           "heldout_train_s_to_target", "heldout_wall_s_to_target", "heldout_train_s_last", "heldout_wall_s_last")


def summarize(runs: list[RunResult]) -> dict[str, Any]:
    systems = list(dict.fromkeys(r.system for r in runs))
    per: dict[str, dict[str, Any]] = {
        sys_: {f: median_range([getattr(r, f) for r in runs if r.system == sys_]) for f in FIGURES}
        for sys_ in systems}
    for sys_ in systems:
        mine = [r for r in runs if r.system == sys_]
        per[sys_]["runs"] = len(mine)
        per[sys_]["reached"] = sum(r.steps_to_target is not None for r in mine)
    ratios: dict[str, dict[str, float | None]] = {}
    if "trl" in per:
        for sys_ in (x for x in systems if x != "trl"):
            ratios[sys_] = {}
            for f in ("train_s_to_target", "wall_s_to_target", "startup_s", "step_time_s", "tokens_per_s",
                      "heldout_train_s_to_target", "heldout_wall_s_to_target"):
                a, b = per[sys_][f]["median"], per["trl"][f]["median"]
                ratios[sys_][f] = a / b if a is not None and b else None
            ratios[sys_].update(heldout_bounds(per[sys_], per["trl"]))
    return {"systems": per, "ratios_vs_trl": ratios}


def markdown(result: dict[str, Any]) -> str:
    hw, st, summ = result["hardware"], result["settings"], result["summary"]
    lines = [f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB, no GPU. "
             f"{st['prompts']} prompts x {st['n']} completions per step, lr {st['lr']}, temperature "
             f"{st['temperature']}, at most {st['max_new_tokens']} new tokens, {st['steps']} steps, seeds "
             f"{', '.join(map(str, st['seeds']))}; target: trailing {st['window']}-step mean reward >= "
             f"{st['target']}. Medians (range) over seeds.", "",
             *(f"- {describe(label(side) if side == 'trl' else side, info)}"
               for side, info in result.get("installs", {}).items()), "",
             "| system | reached | steps to target | training time to target (s) | wall time to target, "
             "start-up incl. (s) | start-up (s) | step time (s) | tokens/s | final reward |",
             "|---|---|---|---|---|---|---|---|---|"]
    for sys_, d in summ["systems"].items():
        lines.append(f"| {label(sys_)} | {d['reached']}/{d['runs']} | {_mr(d['steps_to_target'], '.0f')} | "
                     f"{_mr(d['train_s_to_target'])} | {_mr(d['wall_s_to_target'])} | {_mr(d['startup_s'])} | "
                     f"{_mr(d['step_time_s'], '.3f')} | {_mr(d['tokens_per_s'], '.0f')} | "
                     f"{_mr(d['final_reward'], '.3f')} |")
    if summ["ratios_vs_trl"]:
        lines += ["", "Ratios of medians, pipeline_rl / TRL (below 1 = pipeline_rl takes less; tokens/s: "
                  "above 1 = pipeline_rl generates faster):", "",
                  "| system | training time to target | wall time to target | start-up | step time | tokens/s |",
                  "|---|---|---|---|---|---|"]
        for sys_, r in summ["ratios_vs_trl"].items():
            lines.append(f"| {label(sys_)} | {_f(r['train_s_to_target'])} | {_f(r['wall_s_to_target'])} | "
                         f"{_f(r['startup_s'])} | {_f(r['step_time_s'])} | {_f(r['tokens_per_s'])} |")
    lines += heldout_markdown(summ, st, label)
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    colors = {"trl": "tab:red", "s0": "tab:blue", "s2": "tab:green", "s8": "tab:purple"}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    seen = set()
    for run in result["curves"]:
        means = trailing(run["reward"], result["settings"]["window"])
        xs = [t - run["launched"] for t, m in zip(run["unix_time_s"], means) if m is not None]
        ys = [m for m in means if m is not None]
        name = label(run["system"]) if run["system"] not in seen else None
        seen.add(run["system"])
        ax.plot(xs, ys, color=colors.get(run["system"], "k"), lw=1.2, alpha=0.8, label=name)
    ax.axhline(result["settings"]["target"], color="grey", ls=":", lw=1)
    ax.set_xlabel("wall time since the command (s), start-up included")
    ax.set_ylabel(f"reward, trailing {result['settings']['window']}-step mean")
    ax.set_title(f"pipeline_rl vs TRL GRPOTrainer, {len(result['settings']['seeds'])} seeds each, "
                 f"{result['hardware']['cores']} CPU cores", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------- main

def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=int, default=3, help="Seeds per system (default 3).")
    p.add_argument("--steps", type=int, default=400, help="Steps per run (default 400).")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="Comma list of trl and sN (pipeline_rl "
                   "at --staleness N); default trl,s0,s2.")
    p.add_argument("--target", type=float, default=0.8, help="Reward target (default 0.8).")
    p.add_argument("--window", type=int, default=40, help="Trailing window of the target (default 40 steps).")
    p.add_argument("--prompts", type=int, default=4, help="Prompts per step (default 4).")
    p.add_argument("--n", type=int, default=8, help="Completions per prompt (default 8; GRPO needs a group).")
    p.add_argument("--lr", type=float, default=2e-4, help="Learning rate (default 2e-4).")
    p.add_argument("--max-new-tokens", type=int, default=16, help="Completion limit (default 16).")
    p.add_argument("--max-model-len", type=int, default=256, help="pipeline_rl's vLLM context length "
                   "(default 256; HF generate has no such limit): at least prompt + --max-new-tokens.")
    p.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature (default 1).")
    p.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process (default 2).")
    p.add_argument("--trl-env", choices=("clean", "project"), default="clean",
                   help="TRL's environment: clean (default: its own, built once from its pins under "
                   ".cache/peers-trl-venv, no vLLM) or project (this one; the suite's quick test).")
    p.add_argument("--model", default=None, help="Model folder (default: the built-in model).")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="Limit per run (default 1800 s).")
    p.add_argument("--report", type=Path, default=None, help="Run nothing: rebuild the report of this "
                   "finished comparison's peers.json (with --json/--md to write it).")
    p.add_argument("--png", type=Path, default=None, help="Also write the plot here.")
    p.add_argument("--eval-every", type=int, default=0, help="Held-out greedy evaluation every N steps on both "
                   "sides, on the same --eval-prompts prompts of the task's held-out split (TRL: Hugging Face "
                   "generate, its time left out of TRL's). Default 0: the project's runs evaluate as by "
                   "default and TRL not at all.")
    p.add_argument("--eval-prompts", type=int, default=32, help="Held-out prompts per evaluation (default 32).")
    p.add_argument("--heldout-target", type=float, default=None, help="Also time both sides to this held-out "
                   "greedy accuracy (needs --eval-every).")


def resolve(args: argparse.Namespace) -> tuple[list[str], Settings]:
    systems = [x.strip() for x in args.systems.split(",") if x.strip()]
    bad = [x for x in systems if not (x == "trl" or re.fullmatch(r"s\d+(-noeval)?", x))]
    if bad or not systems:
        raise BadFlag(f"--systems: unknown value(s) {', '.join(bad) or '(none)'} (allowed: trl, sN for a "
                      "staleness N, sN-noeval)")
    at_least(args, seeds=1, steps=1, window=1, prompts=1, trl_threads=1, n=2, eval_every=0, eval_prompts=1)
    if args.heldout_target is not None and not args.eval_every:
        raise BadFlag("--heldout-target: needs --eval-every N (held-out evaluations on both sides)")
    if any(not f.startswith("--task.") for f in args.run_flags[::2]):
        raise BadFlag("only --task.* flags may follow '--' (the rest is fixed for both systems)")
    from pipeline_rl.driver import resolve_model_dir

    cfg = config([*(["--model.path", args.model] if args.model else []), *args.run_flags])
    model_dir = str(Path(resolve_model_dir(cfg)).resolve())
    trl_python = sys.executable
    if "trl" in systems and args.trl_env == "clean":
        from benchmarks.peers_env import trl_python as clean_python

        trl_python = str(clean_python(log=lambda line: print(line, flush=True)))
    return systems, Settings(args.steps, args.prompts, args.n, args.lr, args.max_new_tokens,
                             args.max_model_len, args.temperature,
                             tuple(args.run_flags), args.trl_threads, model_dir, args.model is None, trl_python,
                             args.eval_every, args.eval_prompts)


def installs(systems: list[str], s: Settings) -> dict[str, Any]:
    """How each side is installed: its environment and the versions it imports."""
    from benchmarks.peers_env import PROJECT_MODULES, TRL_MODULES, installed

    out: dict[str, Any] = {}
    if "trl" in systems:
        out["trl"] = installed(s.trl_python, TRL_MODULES)
    if any(x != "trl" for x in systems):
        out["pipeline_rl"] = installed(sys.executable, PROJECT_MODULES)
    return out


def report(path: Path) -> Outcome:
    """The report of a finished comparison (its ``peers.json``) rebuilt with today's summary:
    each run's last evaluation read back from its curve."""
    result = json.loads(path.read_text())
    curves = {(c["system"], c["seed"]): c for c in result["curves"]}
    runs = []
    for r in result["runs"]:
        curve = curves.get((r["system"], r["seed"]), {})
        ev = curve.get("evals") or []
        last = {"heldout_train_s_last": ev[-1]["train_s"],
                "heldout_wall_s_last": ev[-1]["unix_time_s"] - curve.get("launched", 0.0)} if ev else {}
        runs.append(RunResult(**{**r, **last}))
    result.update(runs=[asdict(r) for r in runs], summary=summarize(runs))
    return Outcome(result, markdown(result), 0)


def run(args: argparse.Namespace) -> Outcome:
    if args.report is not None:
        return report(args.report)
    systems, s = resolve(args)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    runs: list[RunResult] = []
    curves: list[dict[str, Any]] = []
    for seed in range(args.seeds):
        for system in systems:
            print(f"peers: {system} seed {seed} ...", flush=True)
            launched, curve, wall_s, error = run_one(system, seed, s, out, args.timeout_s)
            res = measure(system, seed, launched, curve, wall_s, s, args.target, args.window, error,
                          args.heldout_target)
            runs.append(res)
            if curve is not None:
                curves.append({"system": system, "seed": seed, "launched": launched, **asdict(curve)})
            print(f"peers: {system} seed {seed}: {res.steps} steps in {wall_s:.1f} s, start-up "
                  f"{_f(res.startup_s, '.1f')} s, target at step {res.steps_to_target} "
                  f"({_f(res.train_s_to_target, '.1f')} s training, {_f(res.wall_s_to_target, '.1f')} s wall)"
                  + (f"; {res.error}" if res.error else ""), flush=True)
    result = {"hardware": hardware(), "installs": installs(systems, s),
              "settings": {**asdict(s), "seeds": list(range(args.seeds)), "target": args.target,
                           "heldout_target": args.heldout_target,
                           "window": args.window, "systems": systems},
              "runs": [asdict(r) for r in runs], "summary": summarize(runs), "curves": curves}
    for path in (out / "peers.png", args.png):
        if path is not None:
            plot(result, path)
    return Outcome(result, markdown(result), 0 if all(r.ok for r in runs) else 1)


def main(argv: list[str] | None = None) -> int:
    return bench_main("peers", __doc__, argv, run, flags=flags, out="runs/bench_peers",
                      run_flags="Pipeline --task.* flags, after -- (default: the built-in sort task).")


if __name__ == "__main__":
    raise SystemExit(main())
