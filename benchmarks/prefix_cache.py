"""What version-salted prefix caching is worth to the pipeline: the main job with
``--rollout.prefix_caching`` on and off, on long prompts and on the README's.

Two workloads, each run with caching on and off, in turn, ``--rounds`` times:

- ``fewshot``: a ``.jsonl`` data set written here from the ``word_problems`` task: every
  prompt carries the same few-shot preamble of ``--shots`` solved problems before its own
  question (about 520 tokens in all with the default 12 and the chat model's tokenizer).
  A group's ``rollout.n`` copies, and every prompt of a version, share that prefix: with
  caching the engine prefills it once per version; without, once per copy;
- ``readme``: the README's real-model command's task (short word problems, no preamble).

Each run is ``launch/async_grpo.py`` as a user runs it (its own process; the model and
flags after ``--``, default ``--model smollm2-135m-instruct``), ``--steps`` steps,
held-out evaluation off (generation for training only). Reported per run, from its
``metrics.jsonl`` after the first 2 steps (start-up): generated tokens/s over the rollout
worker's busy time (its idle time on the admission budget taken out) and the median
pipeline step; per workload the ratios caching on / off, medians over rounds.

Usage: ``python -m benchmarks.prefix_cache [--steps 8] [--rounds 1] [--shots 12]
[--workloads fewshot readme] [--out DIR] [-- RUN FLAGS]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import BadFlag, Outcome, at_least, hardware, launch_run, main as bench_main
from benchmarks.real_model import busy_tokens_per_s

WORKLOADS = ("fewshot", "readme")
_SKIP = 2   # start-up steps left out


def write_fewshot(path: Path, shots: int, prompts: int = 2000, seed: int = 0) -> Path:
    """``prompts`` word problems as ``{"prompt", "answer"}`` rows, each after the same
    preamble of ``shots`` solved problems (drawn apart from the questions)."""
    from pipeline_rl.tasks.word_problems import word_problem

    rng = random.Random(f"prefix_cache:{seed}")
    examples = [word_problem(rng, 1 + i % 3) for i in range(shots)]
    preamble = "".join(f"Problem: {q}\nAnswer: {a}\n\n" for q, a in examples)
    with path.open("w") as f:
        for i in range(prompts):
            q, a = word_problem(rng, 1 + i % 2)
            f.write(json.dumps({"prompt": f"{preamble}Problem: {q}\nAnswer:", "answer": a}) + "\n")
    return path


def workload_flags(name: str, data: Path) -> list[str]:
    if name == "fewshot":
        return ["--task.name", "dataset", "--task.dataset", str(data), "--rollout.max_model_len", "1024"]
    return ["--task.name", "word_problems"]


def measure_run(folder: Path, flags: list[str]) -> dict[str, float | None]:
    launch_run(folder, flags, folder.with_suffix(".log"), timeout_s=3600)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = rows[_SKIP:] or rows
    return {"busy_tokens_per_s": busy_tokens_per_s(steady),
            "step_s": statistics.median(r["step_time_s"] for r in steady),
            "completion_tokens": statistics.median(r.get("completion_len_mean", 0.0) for r in steady)}


def ratio(on: list[dict[str, Any]], off: list[dict[str, Any]], key: str) -> float | None:
    pairs = [a[key] / b[key] for a, b in zip(on, off, strict=True) if a[key] and b[key]]
    return round(statistics.median(pairs), 3) if pairs else None


def markdown(r: dict[str, Any]) -> str:
    hw = r["hardware"]
    lines = [f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB, no GPU. `launch/async_grpo.py "
             f"{' '.join(r['flags'])}`, {r['steps']} steps per run (first {_SKIP} left out), {r['rounds']} "
             f"round(s), caching on and off in turn; few-shot preamble: {r['shots']} solved problems.", "",
             "| workload | tokens/s over busy time, on / off | ratio | step (s), on / off | step ratio off / on |",
             "|---|---|---:|---|---:|"]
    for name, w in r["workloads"].items():
        on = "/".join(f"{x['busy_tokens_per_s']:.1f}" for x in w["on"])
        off = "/".join(f"{x['busy_tokens_per_s']:.1f}" for x in w["off"])
        son = "/".join(f"{x['step_s']:.2f}" for x in w["on"])
        soff = "/".join(f"{x['step_s']:.2f}" for x in w["off"])
        lines.append(f"| {name} | {on} / {off} | **{w['busy_ratio']}x** | {son} / {soff} | {w['step_ratio']}x |")
    return "\n".join(lines)


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=8, help="Steps per run (default 8; the first 2 are left out).")
    p.add_argument("--rounds", type=int, default=1, help="Rounds of on/off per workload (default 1).")
    p.add_argument("--shots", type=int, default=12,
                   help="Solved problems in the few-shot preamble (default 12: about 500 tokens).")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), help="Which of fewshot, readme (default both).")


def run(args: argparse.Namespace) -> Outcome:
    at_least(args, steps=_SKIP + 1, rounds=1, shots=1)
    bad = sorted(set(args.workloads) - set(WORKLOADS))
    if bad:
        raise BadFlag(f"--workloads: unknown {', '.join(bad)} (known: {', '.join(WORKLOADS)})")
    base = list(args.run_flags) or ["--model", "smollm2-135m-instruct"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = write_fewshot(out / "fewshot.jsonl", args.shots)
    result: dict[str, Any] = {"hardware": hardware(), "flags": base, "steps": args.steps, "rounds": args.rounds,
                              "shots": args.shots, "workloads": {}}
    for name in args.workloads:
        runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
        for k in range(args.rounds):
            for side in ("on", "off"):
                flags_ = [*base, *workload_flags(name, data), "--max-steps", str(args.steps), "--eval.every", "0",
                          "--rollout.prefix_caching", "true" if side == "on" else "false"]
                print(f"prefix_cache: {name}, caching {side}, round {k + 1} ...", flush=True)
                runs[side].append(measure_run(out / f"{name}_{side}_{k}", flags_))
        result["workloads"][name] = {**runs, "busy_ratio": ratio(runs["on"], runs["off"], "busy_tokens_per_s"),
                                     "step_ratio": ratio(runs["off"], runs["on"], "step_s")}
    return Outcome(result, markdown(result))


def main(argv: list[str] | None = None) -> int:
    return bench_main("prefix_cache", __doc__, argv, run, flags=flags, out="runs/bench_prefix_cache",
                      run_flags="Flags of launch/async_grpo.py, after -- (default: --model smollm2-135m-instruct).")


if __name__ == "__main__":
    raise SystemExit(main())
