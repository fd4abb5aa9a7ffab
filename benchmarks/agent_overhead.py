"""The agent endpoint's own cost: one rollout worker running a task in its own form and as agent
code through the endpoint, the two forms alternated.

Usage: ``python -m benchmarks.agent_overhead [--rounds 3] [--groups 500] [--warmup 40] [--agent SPEC] [-- FLAGS]``.

The task is ``calc`` (its environment, and :data:`AGENT`) unless FLAGS name another with the
agent code that does the same (``--agent pipeline_rl.tasks.word_problems_agent:solve -- --model
smollm2-135m-instruct --task.name word_problems``: one chat request per problem, against the
plain single-turn form).

``benchmarks.multiturn --agent`` compares the two forms in the whole pipeline. On a 2-core
machine that number also carries the agent code's own CPU: the ``openai`` client costs about
0.7 ms of CPU per request (a bare ``aiohttp`` call about 0.1 ms), and the agents' process must
share the only other core with the trainer, so its answers queue there. This benchmark takes
the trainer out and measures what the endpoint itself costs the worker:

- One :class:`~pipeline_rl.rollout.worker.RolloutWorker` in this process, pinned to one core as
  the pipeline pins its workers (its agents' process then runs on the other cores), with the
  run's defaults (``--rollout.max_num_seqs 64``, ``--rollout.n 8``) and any FLAGS after ``--``.
  The model is the calc warm start (built and cached once, not timed), which calls the
  calculator in about a quarter of its episodes; a trained checkpoint (``-- --model
  RUN/checkpoints/step_000200`` of a ``--task.name calc`` run) calls it in every one, two model
  turns per episode, as a run does from its first few dozen steps on.
- No trainer and no staleness bound: an in-process buffer takes the groups as they come, so
  both forms keep the engine as full as they can. The engine and the worker are made anew for
  each form and round; the first ``--warmup`` groups are not measured.
- Reported per round and form: tokens/s, the engine's mean batch (tokens per engine step), the
  worker's CPU per 1000 tokens by thread (the engine loop; the endpoint's thread or the
  environments' threads; the rest), the agents' process's CPU per model turn; per round the
  environment form's tokens/s over the agent form's (the endpoint's overhead), and their mean.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, BadFlag, Outcome, at_least, config, hardware, main as bench_main

#: ``calc`` as agent code (the agent form's ``--task.agent``).
AGENT = "pipeline_rl.tasks.calc_agent:calc"
#: The bound the endpoint's overhead is held to (environment form's tokens/s over the agent form's).
LIMIT = 1.25
FORMS = ("env", "agent")
#: The name of the thread that runs the worker's engine loop (its CPU is the "engine" share).
ENGINE_THREAD = "engine-loop"


@dataclass(frozen=True, slots=True)
class FormRun:
    """One form's measured window in one round (CPU in ms per 1000 generated tokens)."""

    round: int
    form: str
    groups: int
    seconds: float
    tokens_per_s: float
    batch: float                 # generated tokens per engine step
    engine_cpu: float            # the worker's engine loop thread
    serving_cpu: float           # the endpoint's thread (agent) or the environments' threads (env)
    other_cpu: float             # the worker's other threads (buffer, sends, rewards, ...)
    host_ms_per_turn: float      # the agents' process, per model turn (0 for the environment form)
    turns_per_episode: float


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of each live thread of this process, by its Python name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for t in threading.enumerate():
        try:
            fields = Path(f"/proc/self/task/{t.native_id}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:   # ended meanwhile
            continue
        out[t.name] = out.get(t.name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def children_cpu() -> float:
    """CPU seconds so far of this process's live children (the worker's agents' process)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def role(thread: str) -> str:
    """Which share a worker thread's CPU counts in: ``engine``, ``serving`` or ``other``."""
    if thread == ENGINE_THREAD:
        return "engine"
    if thread.startswith(("endpoint-", "envs-")):
        return "serving"
    return "other"



def one_form(round_: int, form: str, groups: int, warmup: int, flags: list[str], spec: str = AGENT) -> FormRun:
    """Run a fresh worker in ``form`` until ``warmup + groups`` groups reached the buffer."""
    from pipeline_rl.buffer.replay import ReplayBuffer
    from pipeline_rl.buffer.server import BufferServer
    from pipeline_rl.driver import resolve_model_dir
    from pipeline_rl.rollout.worker import RolloutWorker
    from pipeline_rl.tasks.build import build_task_for_model

    agent = ["--task.agent", spec] if form == "agent" else []
    cfg = config(["--task.name", "calc", "--staleness", "1000", "--seed", str(round_), *agent, *flags])
    model = resolve_model_dir(cfg)
    buffer = ReplayBuffer(capacity_groups=warmup + groups + 64, staleness=10**6, groups_per_step=1)
    server = BufferServer(buffer)
    worker = RolloutWorker(cfg, 0, model, server.address, buffer, build_task_for_model(cfg.task, model, seed=round_))
    loop = threading.Thread(target=worker.run, name=ENGINE_THREAD, daemon=True)
    try:
        loop.start()
        _take(buffer, warmup)
        s0, c0, h0, t0 = worker.stats(), thread_cpu(), children_cpu(), time.perf_counter()
        _take(buffer, groups)
        s1, c1, h1, t1 = worker.stats(), thread_cpu(), children_cpu(), time.perf_counter()
    finally:
        worker.stop()
        loop.join(30)
        worker.close()
        server.close()
    tokens = max(1, s1.tokens_generated - s0.tokens_generated)
    shares = {"engine": 0.0, "serving": 0.0, "other": 0.0}
    for name, seconds in c1.items():
        shares[role(name)] += seconds - c0.get(name, 0.0)
    ended = s1.episodes.episodes - s0.episodes.episodes
    recent = s1.episodes.recent[-ended:] if ended else ()
    turns = statistics.fmean(r.turns for r in recent) if recent else 0.0
    per_k = 1e6 / tokens   # seconds -> ms per 1000 tokens
    return FormRun(round=round_, form=form, groups=groups, seconds=round(t1 - t0, 2),
                   tokens_per_s=tokens / (t1 - t0), batch=tokens / max(1, s1.steps - s0.steps),
                   engine_cpu=shares["engine"] * per_k, serving_cpu=shares["serving"] * per_k,
                   other_cpu=shares["other"] * per_k,
                   host_ms_per_turn=1e3 * (h1 - h0) / max(1.0, ended * turns) if form == "agent" else 0.0,
                   turns_per_episode=turns)


def _take(buffer: Any, count: int, timeout_s: float = 120.0) -> None:
    """Drain ``count`` groups from ``buffer``; a worker that stops sending is one line."""
    got = 0
    while got < count:
        batch = buffer.get_batch(1, trainer_version=0, timeout_s=timeout_s)
        if not batch:
            raise RuntimeError(f"no group reached the buffer in {timeout_s:g} s ({got} of {count} so far)")
        got += len(batch)


def pin_to_one_core() -> int:
    """Pin this process to one core of those it may use (the worker's), as the pipeline pins
    its rollout workers; the agents' process then runs on the others. Needs two."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise BadFlag(f"this benchmark needs 2 CPUs (one for the worker, one for its agents' process); "
                      f"this process may use {len(cpus)}")
    os.sched_setaffinity(0, {cpus[0]})
    return cpus[0]


def ratios(runs: list[FormRun]) -> list[float]:
    """Per round: the environment form's tokens/s over the agent form's."""
    by = {(r.round, r.form): r for r in runs}
    return [by[i, "env"].tokens_per_s / by[i, "agent"].tokens_per_s
            for i in sorted({r.round for r in runs}) if (i, "env") in by and (i, "agent") in by]


def markdown(result: dict[str, Any]) -> str:
    runs = [FormRun(**r) for r in result["runs"]]
    lines = [f"`python -m benchmarks.agent_overhead {' '.join(result['argv'])}`".replace(" `", "`"), "",
             f"{result['hardware']['cpu']}, {result['hardware']['cores']} cores; the worker pinned to CPU "
             f"{result['worker_cpu']}, its agents' process on the others; no trainer. CPU in ms per 1000 "
             "generated tokens.", "",
             "| round | form | tokens/s | engine batch | worker CPU: engine loop | endpoint / environments "
             "| rest | agents' process, ms per turn | turns per episode |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r.round} | {r.form} | {r.tokens_per_s:.0f} | {r.batch:.1f} | {r.engine_cpu:.0f} "
                     f"| {r.serving_cpu:.0f} | {r.other_cpu:.0f} | "
                     f"{f'{r.host_ms_per_turn:.2f}' if r.form == 'agent' else '-'} "
                     f"| {f'{r.turns_per_episode:.2f}' if r.turns_per_episode else '-'} |")
    xs = ratios(runs)
    if xs:
        lines += ["", "Environment form's tokens/s over the agent form's, per round: "
                  + ", ".join(f"{x:.2f}x" for x in xs) + f"; mean **{statistics.fmean(xs):.2f}x** "
                  f"(bound {LIMIT}x)."]
    return "\n".join(lines)


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=3, help="Rounds, each the environment form then the agent "
                   "form (default 3).")
    p.add_argument("--groups", type=int, default=500, help="Groups measured per form and round (default 500).")
    p.add_argument("--warmup", type=int, default=40, help="Groups before the measured ones (default 40).")
    p.add_argument("--agent", default=AGENT, metavar="MODULE:FUNCTION", help="The agent form's code (default "
                   f"{AGENT}; its task, when not calc, named after --).")


def run(args: argparse.Namespace) -> Outcome:
    at_least(args, rounds=1, groups=1, warmup=0)
    # a bad flag or agent spec: one line before anything starts
    config(["--task.name", "calc", *args.run_flags, "--task.agent", args.agent])
    cpu = pin_to_one_core()
    import torch

    torch.set_num_threads(1)   # as every actor of a run
    runs = [one_form(i, form, args.groups, args.warmup, args.run_flags, args.agent)
            for i in range(args.rounds) for form in FORMS]
    argv = [f"--rounds {args.rounds}", f"--groups {args.groups}", f"--warmup {args.warmup}",
            *([f"--agent {args.agent}"] if args.agent != AGENT else []),
            *(["--", *args.run_flags] if args.run_flags else [])]
    xs = ratios(runs)
    result = {"hardware": hardware(), "argv": argv, "worker_cpu": cpu, "limit": LIMIT,
              "runs": [asdict(r) for r in runs], "ratios": xs,
              "mean_ratio": statistics.fmean(xs) if xs else None}
    return Outcome(result, markdown(result), status=0 if xs and statistics.fmean(xs) <= LIMIT else 1)


def main(argv: list[str] | None = None) -> int:
    results = ROOT / "benchmarks" / "results"
    return bench_main("agent_overhead", __doc__, argv, run, flags=flags, json_path=results / "agent_overhead.json",
                      md_path=results / "agent_overhead.md",
                      run_flags="Extra pipeline flags, after -- (e.g. -- --rollout.max_num_seqs 32).")


if __name__ == "__main__":
    raise SystemExit(main())
