"""Gradient checkpointing (``--trainer.gradient_checkpointing``): the trainer's peak memory and
step time with it and without.

The real DeepSpeed trainer (one rank, ZeRO-0, the model's own dtype rules: float32 on CPU)
steps on fixed batches of ``--groups`` prompts of ``--prompt-tokens`` tokens with ``--n``
completions of exactly ``--new-tokens`` tokens each (random tokens of the model's vocabulary,
random rewards), one micro-batch per step. Each configuration runs in a fresh process, so its
peak resident memory (``ru_maxrss``) is its own; the configurations alternate within each of
``--rounds`` rounds, so a shared machine's load falls on all of them alike. Configurations:

- ``off``: today's default (prompts shared, no checkpointing);
- ``off_padded``: no checkpointing, padded rows (``--trainer.share_prompts false``), the
  layout checkpointing itself uses (Hugging Face drops a checkpointed layer's KV cache);
- ``on``: ``--trainer.gradient_checkpointing``.

Figures per configuration: ``rss_init_mb`` (peak resident memory once the trainer is built:
weights, gradients' and AdamW's buffers), ``rss_peak_mb`` (after the steps), ``step_peak_mb``
(their difference: what the steps added, activations and logits), ``step_cpu_s`` (the process's
CPU time per step, user + system: on a shared machine it moves far less with the load than
wall time) and ``step_s`` (wall), medians over the steps after the first (left out as warm-up).

Usage: ``python -m benchmarks.grad_checkpointing [--model smollm2-135m-instruct]
[--new-tokens 256] [--json PATH] [--md PATH]``; ``--quick``: the built-in model, a few tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import Outcome, hardware, main as bench_main, repo_on_path

CONFIGS: dict[str, tuple[str, ...]] = {
    "off": (),
    "off_padded": ("--trainer.share_prompts", "false"),
    "on": ("--trainer.gradient_checkpointing", "true"),
}


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="--model of the run (a named "
                   "pretrained model or a folder; default smollm2-135m-instruct).")
    p.add_argument("--new-tokens", type=int, default=256, help="Tokens of every completion (default 256).")
    p.add_argument("--prompt-tokens", type=int, default=64, help="Tokens of every prompt (default 64).")
    p.add_argument("--groups", type=int, default=2, help="Prompts per step (default 2).")
    p.add_argument("--n", type=int, default=4, help="Completions per prompt (default 4).")
    p.add_argument("--steps", type=int, default=3, help="Steps per configuration, the first left out (default 3).")
    p.add_argument("--rounds", type=int, default=1, help="Rounds of every configuration, alternated (default 1).")
    p.add_argument("--child", choices=sorted(CONFIGS), default=None, help="Internal: run one configuration.")


def _groups(vocab: int, args: argparse.Namespace, seed: int) -> list[Any]:
    import numpy as np

    from pipeline_rl.samples import Completion, Group

    rng = np.random.default_rng(seed)
    out = []
    for g in range(args.groups):
        comps = tuple(Completion(rng.integers(3, vocab, args.new_tokens, dtype=np.int32),
                                 np.full(args.new_tokens, -1.0, np.float32), np.zeros(args.new_tokens, np.int32),
                                 float(rng.random()), "length") for _ in range(args.n))
        out.append(Group(g, g, 0, rng.integers(3, vocab, args.prompt_tokens, dtype=np.int32), comps))
    return out


def _cpu_s() -> float:
    """This process's CPU time so far (every thread, user + system)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _child(args: argparse.Namespace) -> dict[str, Any]:
    from pipeline_rl.cli import parse_config
    from pipeline_rl.driver import resolve_model_dir
    from pipeline_rl.training.trainer import Trainer

    batch = args.groups * args.n
    model = ["--model", args.model] if args.model else []
    cfg, _ = parse_config([*model, "--rollout.n", str(args.n), "--trainer.batch_size", str(batch),
                           "--trainer.micro_batch_size", str(batch), "--trainer.micro_batch_tokens", "0",
                           "--rollout.max_new_tokens", str(args.new_tokens),
                           "--rollout.max_model_len", str(args.new_tokens + args.prompt_tokens + 8),
                           *CONFIGS[args.child]], check_cpu=False)
    trainer = Trainer(cfg, resolve_model_dir(cfg))
    vocab = int(trainer.model.config.vocab_size)
    init = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times, cpu = [], []
    for s in range(args.steps):
        groups = _groups(vocab, args, s)
        c0, t0 = _cpu_s(), time.perf_counter()
        trainer.step(groups)
        times.append(time.perf_counter() - t0)
        cpu.append(_cpu_s() - c0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {"config": args.child, "rss_init_mb": init, "rss_peak_mb": peak, "step_peak_mb": peak - init,
           "step_times_s": times, "step_cpu_s": cpu, "share_prompts": trainer.share_prompts,
           "checkpointing": bool(trainer.engine.module.is_gradient_checkpointing)}
    trainer.close()
    return out


def _run(args: argparse.Namespace) -> Outcome:
    if args.quick:
        args.model, args.new_tokens, args.prompt_tokens, args.steps = "", 8, 4, 2
    if args.child is not None:
        print(json.dumps(_child(args)), flush=True)
        return Outcome(None, summary="")
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    t_start = time.time()
    for _ in range(args.rounds):
        for name in CONFIGS:
            argv = [sys.executable, "-m", "benchmarks.grad_checkpointing", "--child", name,
                    "--model", args.model, "--new-tokens", str(args.new_tokens), "--prompt-tokens",
                    str(args.prompt_tokens), "--groups", str(args.groups), "--n", str(args.n),
                    "--steps", str(args.steps)]
            done = subprocess.run(argv, capture_output=True, text=True, env=_child_env(), check=False)
            if done.returncode != 0:
                tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
                return Outcome(None, status=1, summary=f"grad_checkpointing: {name} failed: {tail}")
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    result = _summarise(runs, args, time.time() - t_start)
    return Outcome(result, _report(result))


def _child_env() -> dict[str, str]:
    """This environment for a configuration's process, less a process group's rendezvous (a
    caller that holds one, a test, would hand the child its port)."""
    group = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    return {k: v for k, v in os.environ.items() if k not in group} | repo_on_path()


def _summarise(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, wall_s: float) -> dict[str, Any]:
    per: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        steps = [t for r in rs for t in r["step_times_s"][1:]] or [t for r in rs for t in r["step_times_s"]]
        cpus = [t for r in rs for t in r["step_cpu_s"][1:]] or [t for r in rs for t in r["step_cpu_s"]]
        per[name] = {"rss_init_mb": max(r["rss_init_mb"] for r in rs), "rss_peak_mb": max(r["rss_peak_mb"] for r in rs),
                     "step_peak_mb": max(r["step_peak_mb"] for r in rs), "step_s": statistics.median(steps),
                     "step_cpu_s": statistics.median(cpus),
                     "first_step_s": statistics.median(r["step_times_s"][0] for r in rs)}
    ratios = {f"{k}_on_over_{base}": per["on"][k] / per[base][k]
              for base in ("off", "off_padded") for k in ("rss_peak_mb", "step_peak_mb", "step_s", "step_cpu_s") if per[base][k]}
    return {"model": args.model or "built-in", "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
            "groups": args.groups, "n": args.n, "steps": args.steps, "rounds": args.rounds, "configs": per,
            "ratios": ratios, "wall_s": wall_s, "load_avg_1m_at_end": os.getloadavg()[0], "hardware": hardware()}


def _report(r: dict[str, Any]) -> str:
    rows = [f"| {name} | {c['rss_peak_mb']:.0f} | {c['step_peak_mb']:.0f} | {c['step_cpu_s']:.2f} | {c['step_s']:.2f} |"
            for name, c in r["configs"].items()]
    q, hw = r["ratios"], r["hardware"]
    return "\n".join([
        f"# Gradient checkpointing: {r['model']}, {r['groups']} x {r['n']} completions of {r['new_tokens']} "
        f"tokens (prompts {r['prompt_tokens']})", "",
        f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB, no GPU; the trainer on one "
        f"thread, float32, ZeRO-0; {r['rounds']} round(s) of each configuration alternated, {r['steps']} steps "
        f"each (the first left out of the step time); the machine shared with other work (load average "
        f"{r['load_avg_1m_at_end']:.1f} at the end).", "",
        "| configuration | peak RSS (MB) | added by the steps (MB) | step CPU (s) | step wall (s) |",
        "|---|---|---|---|---|", *rows, "",
        f"on / off: peak {q.get('rss_peak_mb_on_over_off', 0):.2f}x, added by the steps "
        f"{q.get('step_peak_mb_on_over_off', 0):.2f}x, step CPU time {q.get('step_cpu_s_on_over_off', 0):.2f}x "
        f"(wall {q.get('step_s_on_over_off', 0):.2f}x); on / off_padded: "
        f"{q.get('rss_peak_mb_on_over_off_padded', 0):.2f}x, {q.get('step_peak_mb_on_over_off_padded', 0):.2f}x, "
        f"{q.get('step_cpu_s_on_over_off_padded', 0):.2f}x (wall {q.get('step_s_on_over_off_padded', 0):.2f}x). "
        "CPU time is the process's own (user + system, every thread): on a shared machine it moves "
        "far less with the load than wall time does.", ""])


def main(argv: list[str] | None = None) -> int:
    return bench_main("grad_checkpointing", __doc__, argv, _run, flags=_flags,
                      quick="The built-in model, 8-token completions, 2 steps (a smoke run).")


if __name__ == "__main__":
    sys.exit(main())
