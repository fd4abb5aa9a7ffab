"""A real pretrained chat model, end to end: its learning curve, its generation speed
against bare vLLM on the same core with the same sampling, its weight sync and step
time, all from one run.

Usage::

    python -m benchmarks.real_model [--model smollm2-135m-instruct] [--steps 60]
        [--eval-every 10] [--bare-groups 32] [--json PATH] [--md PATH] [--png PATH] [-- FLAGS]

Two measurements, back to back in one process:

1. **Bare vLLM** (``vllm.LLM.generate``, in-process engine, this process pinned to one
   core as a rollout worker is): the task's training prompts, rendered by the model's chat
   template exactly as the workers render them, ``--bare-groups`` prompts submitted at once
   with the run's own sampling (``n`` = ``--rollout.n``, temperature, top-p 1, top-k off,
   ``--rollout.max_new_tokens``, one log-prob per token, the run's engine dtype, context
   length and concurrency), and vLLM's default prefix caching (as it ships). Generated
   tokens per second over the call (wall time and busy time are one there), best of
   ``--bare-rounds``.
2. **The pipeline** (``launch/async_grpo.py`` through the real orchestrator on a local Ray,
   the run's defaults for the model plus ``FLAGS``): ``--steps`` steps with held-out
   evaluation every ``--eval-every`` steps and at the start.

Reported: the evaluation curve (greedy accuracy, mean@k, pass@k by step, from step 0) and
the training time at which greedy accuracy first rose by 0.3; the sampled tokens' entropy
by step and its largest ratio to step 1's over the first 20 steps; the mismatch KL; the
pipeline's generated tokens/s (the median step row, first 3 steps left out: start-up)
and the same over the rollout worker's busy time (idle on the admission budget taken out),
each as a ratio to bare vLLM's; weight sync (step end to every worker generating with the
new version) and stall p50/p90; median step time; groups skipped for zero reward variance
when the run counts them.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import Outcome, at_least, config, hardware, main as bench_main, pyplot, ray_session, run_pipeline

WARMUP_STEPS = 3       # step rows left out of the rate medians (start-up, first compile of shapes)
ENTROPY_WINDOW = 20    # the acceptance's window: entropy over the first 20 steps
GAIN = 0.3             # the held-out greedy gain timed


@dataclass(frozen=True, slots=True)
class Bare:
    """Bare vLLM on one core: tokens/s of each round (best is the figure)."""

    tokens_per_s: list[float]
    groups: int
    n: int
    max_new_tokens: int
    dtype: str
    mean_completion_tokens: float

    @property
    def best(self) -> float:
        return max(self.tokens_per_s)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def bare_vllm(cfg: Any, model_dir: str, groups: int, rounds: int) -> Bare:
    """``LLM.generate`` on ``groups`` training prompts of the run's task, as a worker
    would sample them, this process pinned to one core for the call."""
    from pipeline_rl.rollout.engines.engine import engine_config
    from pipeline_rl.tasks.build import build_task_for_model

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams, TokensPrompt

    from pipeline_rl.rollout.engines.vllm_compat import hidden_from_vllm_kernel_scan

    ecfg = engine_config(cfg.rollout, model_dir, seed=cfg.seed)
    task = build_task_for_model(cfg.task, model_dir, seed=cfg.seed)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with hidden_from_vllm_kernel_scan("llvmlite.binding.ffi"):
            llm = LLM(model=model_dir, dtype=ecfg.dtype, max_model_len=ecfg.max_model_len,
                      max_num_seqs=ecfg.max_num_seqs, seed=cfg.seed, logprobs_mode="processed_logprobs",
                      enforce_eager=True, disable_log_stats=True,   # prefix caching: vLLM's default
                      kv_cache_memory_bytes=int(ecfg.kv_cache_gib * 2**30))
        tok = llm.get_tokenizer()
        prompts = [TokensPrompt(prompt_token_ids=tok.encode(p.text, add_special_tokens=not p.templated))
                   for p in (task.prompt(i) for i in range(groups))]
        r = cfg.rollout
        sp = SamplingParams(n=r.n, max_tokens=r.max_new_tokens, temperature=r.temperature, top_p=1.0, top_k=0,
                            logprobs=0, skip_special_tokens=False, seed=cfg.seed)
        llm.generate(prompts[:1], sp, use_tqdm=False)  # warm-up
        rates, lens = [], []
        for _ in range(rounds):
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t
            tokens = [len(c.token_ids) for o in outs for c in o.outputs]
            rates.append(sum(tokens) / dt)
            lens.append(statistics.fmean(tokens))
        del llm
        gc.collect()
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)
    return Bare(rates, groups, r.n, r.max_new_tokens, ecfg.dtype, statistics.fmean(lens))


def busy_tokens_per_s(rows: list[dict[str, Any]]) -> float | None:
    """Generated tokens/s over the rollout workers' busy time (idle on the admission budget
    taken out) across ``rows``, per worker; None when the rows do not say. The tokens are all
    the engines generated: training samples' and held-out evaluations', since an engine is
    busy with both. From the run's totals between the first and the last row where the rows
    carry them (``generator_busy_s``), else (older runs) the median of the rows' own windows,
    each a short, noisy interval."""
    first, last = (rows[0], rows[-1]) if rows else ({}, {})
    if "generator_busy_s" in first and "generator_busy_s" in last:
        busy_s = last["generator_busy_s"] - first["generator_busy_s"]
        tokens = sum(last[k] - first[k] for k in ("generated_tokens", "generated_eval_tokens"))
        return tokens / busy_s if busy_s > 0 else None
    busy = [(r["tokens_per_s"] + r.get("eval_tokens_per_s", 0.0)) / max(1e-9, 1.0 - r["generator_idle_frac"])
            for r in rows if "generator_idle_frac" in r and r["generator_idle_frac"] < 1.0]
    return statistics.median(busy) if busy else None


def figures(rows: list[dict[str, Any]], evals: list[dict[str, Any]], bare: Bare) -> dict[str, Any]:
    """The run's figures from its metrics rows and evaluations."""
    steady = rows[WARMUP_STEPS:] or rows
    tps = statistics.median(r["tokens_per_s"] for r in steady) if steady else 0.0
    tps_busy = busy_tokens_per_s(steady)
    ent = [r["entropy"] for r in rows[:ENTROPY_WINDOW]]
    sync = [r["weight_sync_ms"] for r in steady if r.get("weight_sync_ms")]
    stall = [r["weight_update_stall_ms"] for r in steady if r.get("weight_update_stall_ms")]
    at_step = {r["step"]: r["time_s"] for r in rows}
    gain_at = None
    if evals:
        base = evals[0]["greedy_accuracy"]
        hit = next((e for e in evals if e["greedy_accuracy"] >= base + GAIN - 1e-9), None)
        if hit is not None:
            gain_at = {"step": hit["step"], "train_s": at_step.get(hit["step"], hit["time_s"]),
                       "greedy": hit["greedy_accuracy"]}
    skipped = [r.get("zero_variance_groups") for r in rows if r.get("zero_variance_groups") is not None]
    return {
        "steps": len(rows), "train_s": rows[-1]["time_s"] if rows else 0.0,
        "tokens_per_s": tps, "tokens_per_s_busy": tps_busy,
        "bare_tokens_per_s": bare.best, "ratio_vs_bare": tps / bare.best if bare.best else None,
        "ratio_busy_vs_bare": tps_busy / bare.best if (tps_busy and bare.best) else None,
        "entropy_step1": ent[0] if ent else None,
        "entropy_max_ratio_first20": max(ent) / ent[0] if ent and ent[0] > 0 else None,
        "mismatch_kl_max_first20": max((r["mismatch_kl"] for r in rows[:ENTROPY_WINDOW]), default=None),
        "weight_sync_ms_p50": _percentile(sync, 0.5), "weight_sync_ms_p90": _percentile(sync, 0.9),
        "stall_ms_p50": _percentile(stall, 0.5), "stall_ms_p90": _percentile(stall, 0.9),
        "step_time_s_median": statistics.median(r["step_time_s"] for r in steady) if steady else None,
        "greedy_first": evals[0]["greedy_accuracy"] if evals else None,
        "greedy_last": evals[-1]["greedy_accuracy"] if evals else None,
        "greedy_gain_reached": gain_at,
        "zero_variance_groups": skipped[-1] if skipped else None,
    }


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(res: dict[str, Any]) -> str:
    f, b, hw = res["figures"], res["bare"], res["hardware"]
    gain = f["greedy_gain_reached"]
    lines = [f"Machine: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB, no GPU. Model "
             f"`{res['model']}` ({res['model_dir']}); flags: `{' '.join(res['flags']) or '(defaults)'}`.", "",
             "| figure | value |", "|---|---|",
             f"| held-out greedy, step 0 -> last | {_f(f['greedy_first'], '.3f')} -> {_f(f['greedy_last'], '.3f')} |",
             f"| training time to greedy +{GAIN} | " + (f"{gain['train_s']:.0f} s (step {gain['step']}, greedy "
                                                    f"{gain['greedy']:.3f})" if gain else "not reached") + " |",
             f"| entropy step 1, largest ratio to it over the first {ENTROPY_WINDOW} steps | "
             f"{_f(f['entropy_step1'], '.3f')} nats, {_f(f['entropy_max_ratio_first20'])}x |",
             f"| mismatch KL, largest over the first {ENTROPY_WINDOW} steps | {_f(f['mismatch_kl_max_first20'], '.2e')} |",
             f"| bare vLLM tokens/s (one core, best of {len(b['tokens_per_s'])}) | {_f(f['bare_tokens_per_s'], '.1f')} |",
             f"| pipeline tokens/s (median step), ratio to bare | {_f(f['tokens_per_s'], '.1f')}, "
             f"{_f(f['ratio_vs_bare'])}x |",
             f"| pipeline tokens/s over the worker's busy time, ratio to bare | {_f(f['tokens_per_s_busy'], '.1f')}, "
             f"{_f(f['ratio_busy_vs_bare'])}x |",
             f"| weight sync p50 / p90 (ms) | {_f(f['weight_sync_ms_p50'], '.0f')} / {_f(f['weight_sync_ms_p90'], '.0f')} |",
             f"| stall p50 / p90 (ms) | {_f(f['stall_ms_p50'], '.1f')} / {_f(f['stall_ms_p90'], '.1f')} |",
             f"| median step time (s) | {_f(f['step_time_s_median'])} |",
             f"| steps, training time (s) | {f['steps']}, {f['train_s']:.0f} |"]
    if f["zero_variance_groups"] is not None:
        lines.append(f"| groups skipped for zero reward variance | {f['zero_variance_groups']} |")
    lines += ["", "| eval after step | greedy | mean@k | pass@k | greedy length (tokens) |", "|---:|---:|---:|---:|---:|"]
    for e in res["evals"]:
        lines.append(f"| {e['step']} | {e['greedy_accuracy']:.3f} | {e['mean_at_k']:.3f} | {e['pass_at_k']:.3f} "
                     f"| {e['greedy_len_mean']:.1f} |")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
    ev = res["evals"]
    steps = [e["step"] for e in ev]
    k = ev[0]["k"] if ev else 0
    ax.plot(steps, [e["greedy_accuracy"] for e in ev], "o-", label="greedy")
    ax.plot(steps, [e["mean_at_k"] for e in ev], "s-", label=f"mean@{k}")
    ax.plot(steps, [e["pass_at_k"] for e in ev], "^--", alpha=0.6, label=f"pass@{k}")
    ax.set(xlabel="training step", ylabel="held-out accuracy", ylim=(0, 1.02), title=f"{res['model']}: held-out")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    rows = res["rows"]
    bx.plot([r["step"] for r in rows], [r["entropy"] for r in rows], label="entropy (nats)")
    bx.plot([r["step"] for r in rows], [r["reward_mean"] for r in rows], label="train reward")
    bx.set(xlabel="training step", title="training")
    bx.grid(alpha=0.3)
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="--model of the run (default "
                   "smollm2-135m-instruct, the packaged real chat model).")
    p.add_argument("--steps", type=int, default=60, help="Pipeline steps (default 60).")
    p.add_argument("--eval-every", type=int, default=10, help="Held-out evaluation every N steps (default 10).")
    p.add_argument("--bare-groups", type=int, default=32, help="Prompts in bare vLLM's call (default 32).")
    p.add_argument("--bare-rounds", type=int, default=2, help="Bare vLLM calls; the best is kept (default 2).")
    p.add_argument("--png", type=Path, default=None, help="Also write the curves here.")


def run(args: argparse.Namespace) -> Outcome:
    from pipeline_rl.driver import resolve_model_dir
    from pipeline_rl.metrics import read_evals

    at_least(args, steps=1, eval_every=1, bare_groups=1, bare_rounds=1)
    out: Path = args.out
    cfg = config(["--model", args.model, "--max-steps", str(args.steps), "--eval.every", str(args.eval_every),
                  "--out-dir", str(out / "run"), *args.run_flags], evaluation=True)
    model_dir = resolve_model_dir(cfg)
    print(f"real_model: bare vLLM, {args.bare_groups} prompts x {cfg.rollout.n} ...", flush=True)
    bare = bare_vllm(cfg, model_dir, args.bare_groups, args.bare_rounds)
    print(f"real_model: bare vLLM {bare.best:.1f} tokens/s; the pipeline, {args.steps} steps ...", flush=True)
    with ray_session():
        rows = run_pipeline(cfg)
    evals = [asdict(e) for e in read_evals(out / "run" / "eval.jsonl")]
    res = {"hardware": hardware(), "model": args.model, "model_dir": model_dir, "flags": args.run_flags,
           "bare": asdict(bare), "figures": figures(rows, evals, bare), "evals": evals,
           "rows": [{k: r.get(k) for k in ("step", "time_s", "reward_mean", "entropy", "mismatch_kl",
                                            "tokens_per_s", "weight_sync_ms", "step_time_s")} for r in rows]}
    for path in (out / "real_model.png", args.png):
        if path is not None:
            plot(res, path)
    return Outcome(res, markdown(res))


def main(argv: list[str] | None = None) -> int:
    return bench_main("real_model", __doc__, argv, run, flags=flags, out="runs/bench_real_model",
                      run_flags="Further pipeline flags, after -- (e.g. --task.name ...).")


if __name__ == "__main__":
    raise SystemExit(main())
