"""What bounds a pipeline step on the default run: each side of the pipeline alone.

A pipeline step at staleness ``k >= 1`` can be no shorter than the longer of its two sides,
each on its own core: the trainer's step on one batch and the generator's time for one
batch. This measures both alone, in this process, one thread, on an idle machine, with the
run's own configuration (the built-in model and task unless flags say otherwise):

- ``trainer_step_ms``: ``Trainer.step`` (DeepSpeed, the corrected loss, the optimizer step)
  on batches of the run's shape (its prompts' token length; completions of up to the
  median over generated rounds of a round's longest completion: micro-batches are padded
  to their longest row), at 1 and at ``--threads`` threads;
- ``generate_batch_ms``: the in-process vLLM engine (``InprocessEngine``) generating one batch of
  ``groups_per_step`` prompts x ``n`` completions of the run's task, alone and with
  ``k + 1`` batches in flight at once (what the admission budget allows at staleness ``k``),
  with the engine steps it took and the milliseconds per engine step.

``bound_step_ms`` = max(trainer step, generated batch at ``k + 1`` in flight): no schedule
of these two pieces on two cores steps faster. ``--peers FILE`` (a ``benchmarks/peers.py``
JSON of the same machine) adds TRL's median step time and the ratio of the bound to it.
Both sides are the pieces of :class:`benchmarks.local.LocalPipeline`, each alone.

Usage: ``python -m benchmarks.step_bound [--batches 30] [--staleness 2] [--peers FILE]
[--json PATH] [-- RUN FLAGS]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.common import BadFlag, Outcome, at_least, config, hardware, main as bench_main
from benchmarks.local import LocalPipeline
from benchmarks.synthetic import synthetic_groups

if TYPE_CHECKING:
    from pipeline_rl.config import Config


def _ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 2)


def generate(cfg: Config, model_dir: str, batches: int, in_flight: int) -> dict[str, float]:
    """Milliseconds per batch (and per engine step) with ``in_flight`` batches at once, on a fresh engine."""
    from pipeline_rl.rollout.engines.engine import GenRequest, SamplingConfig

    sampling = SamplingConfig(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature)
    per_batch, per_step, round_steps, lengths, prompt_lens, longest = [], [], [], [], [], []
    prompt_id = 0
    with closing(LocalPipeline(cfg, model_dir=model_dir)) as local:
        engine, task = local.engine, local.task
        for rnd in range(-1, batches // in_flight):       # round -1 warms the engine up
            for _ in range(in_flight * cfg.groups_per_step):
                ids = tuple(engine.encode(task.prompt(prompt_id).text, add_special_tokens=True))
                prompt_lens.append(len(ids))
                for i in range(cfg.rollout.n):
                    engine.add(GenRequest(f"{prompt_id}:{i}", ids, sampling))
                prompt_id += 1
            t, steps, done = time.perf_counter(), 0, []
            while engine.num_unfinished():
                done += [len(s.token_ids) for s in engine.step()]
                steps += 1
            dt = time.perf_counter() - t
            if rnd >= 0:
                lengths += done
                longest.append(max(done))
                per_batch.append(dt / in_flight)
                per_step.append(dt / steps)
                round_steps.append(steps)
    return {"batch_ms": _ms(per_batch), "engine_step_ms": _ms(per_step),
            "engine_steps_per_round": statistics.median(round_steps),
            # a batch's shape: micro-batches are padded to their longest row
            "prompt_tokens": max(prompt_lens), "completion_tokens_max": int(statistics.median(longest)),
            "completion_tokens_mean": round(statistics.fmean(lengths), 2)}


def train(cfg: Config, model_dir: str, batches: int, prompt_len: int, completion_len: int,
          threads: int) -> float:
    """Median milliseconds of ``Trainer.step`` on run-shaped batches at ``threads`` threads."""
    times = []
    with closing(LocalPipeline(cfg, model_dir=model_dir, trainer_threads=threads)) as local:  # sets the threads
        trainer = local.trainer
        for i in range(batches + 5):                       # the first 5: allocator and kernel warm-up
            groups = synthetic_groups(cfg.groups_per_step, cfg.rollout.n, prompt_len=prompt_len,
                                      max_completion_len=completion_len, version=trainer.version, seed=i)
            t = time.perf_counter()
            trainer.step(groups)
            if i >= 5:
                times.append(time.perf_counter() - t)
    return _ms(times)


def markdown(r: dict[str, Any]) -> str:
    hw, g1, gk = r["hardware"], r["generate_1"], r["generate_k"]
    lines = [f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB, no GPU. Each side alone, "
             f"one process, medians of {r['batches']} batches; a batch = {r['batch_shape']}.", "",
             "| piece | ms per batch | notes |", "|---|---:|---|",
             f"| trainer step, 1 thread | {r['trainer_step_ms'][1]} | prompt {g1['prompt_tokens']} tokens, "
             f"completions up to {g1['completion_tokens_max']} (a round's longest, median) |",
             f"| trainer step, {r['threads']} threads | {r['trainer_step_ms'][r['threads']]} | |",
             f"| vLLM, one batch in flight | {g1['batch_ms']} | {g1['engine_steps_per_round']} engine steps "
             f"of {g1['engine_step_ms']} ms; completions {g1['completion_tokens_mean']} tokens on average |",
             f"| vLLM, {r['in_flight']} batches in flight | {gk['batch_ms']} | "
             f"{gk['engine_steps_per_round']} engine steps of {gk['engine_step_ms']} ms per round |", "",
             f"Bound on a pipeline step at staleness {r['staleness']}: **{r['bound_step_ms']} ms** "
             f"(the longer side, each on its own core)."]
    if "trl_step_ms" in r:
        lines.append(f"TRL's median step in `{r['peers']}`: {r['trl_step_ms']} ms; the bound is "
                     f"**{r['bound_vs_trl']}x** it.")
    return "\n".join(lines)


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=int, default=30, help="Batches timed per measurement (default 30).")
    p.add_argument("--staleness", type=int, default=2, help="k: batches in flight = k + 1 (default 2).")
    p.add_argument("--threads", type=int, default=2, help="Trainer threads of the second trainer figure.")
    p.add_argument("--peers", type=Path, default=None, help="A peers JSON: add TRL's step and the ratio.")


def run(args: argparse.Namespace) -> Outcome:
    at_least(args, batches=1, staleness=0, threads=1)
    if args.peers is not None and not args.peers.is_file():
        raise BadFlag(f"--peers: no such file: {args.peers}")
    from pipeline_rl.driver import resolve_model_dir

    cfg = config(list(args.run_flags))
    model_dir = str(resolve_model_dir(cfg))
    in_flight = args.staleness + 1
    g1 = generate(cfg, model_dir, args.batches, 1)
    gk = generate(cfg, model_dir, args.batches * in_flight, in_flight)
    steps = {t: train(cfg, model_dir, args.batches, int(g1["prompt_tokens"]), int(g1["completion_tokens_max"]), t)
             for t in (1, args.threads)}
    result: dict[str, Any] = {
        "hardware": hardware(), "batches": args.batches, "staleness": args.staleness, "in_flight": in_flight,
        "threads": args.threads, "batch_shape": f"{cfg.groups_per_step} prompts x {cfg.rollout.n} completions",
        "generate_1": g1, "generate_k": gk, "trainer_step_ms": steps,
        "bound_step_ms": max(steps[1], gk["batch_ms"])}
    if args.peers is not None:
        trl = json.loads(args.peers.read_text())["summary"]["systems"].get("trl")
        if trl is not None:
            result.update(peers=str(args.peers), trl_step_ms=round(trl["step_time_s"]["median"] * 1e3, 2))
            result["bound_vs_trl"] = round(result["bound_step_ms"] / result["trl_step_ms"], 2)
    return Outcome(result, markdown(result))


def main(argv: list[str] | None = None) -> int:
    return bench_main("step_bound", __doc__, argv, run, flags=flags,
                      run_flags="Flags of launch/async_grpo.py, after --.")


if __name__ == "__main__":
    raise SystemExit(main())
