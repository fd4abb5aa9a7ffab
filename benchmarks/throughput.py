"""Asynchronous vs synchronous RL on the same hardware and work (docs/design.md).

Configurations, each on the same model, task, batch and seed:

- ``sync_same_placement``: the real pipeline at ``--staleness 0`` (one core
  generating, one training, in turn: exactly synchronous);
- ``sync_colocated``: the best conventional synchronous schedule: one process
  gives every core to generation (vLLM), then every core to training
  (DeepSpeed), in turn;
- ``async_s1`` / ``async_s2`` / ``async_s4``: the real pipeline at staleness 1, 2, 4.

Workloads: ``default`` (the built-in model and task) and ``longtail`` (the
untrained built-in model with a long token budget: completion lengths follow
its EOS sampling, from 1 to the budget, so a synchronous round waits for its
longest sequence); ``real_full`` and ``real_lora``: SmolLM2-135M-Instruct on the README's
word problems, fully and with a rank-16 LoRA adapter (held-out evaluation off). ``--configs``
picks the configurations (the staleness-0 run and ``async_s2`` always run: the headline
ratio is theirs).

The overlap bound ``(T_gen + T_train) / max(T_gen, T_train)`` is measured in
the same run, from the ``sync_same_placement`` steps (T_train: the trainer's
step; T_gen: the rest of the synchronous step). Figures are medians over
repeats with their min-max spread; every time is a ratio or carries the
hardware it was measured on.

Usage: ``python -m benchmarks.throughput [--quick] [--repeats 3] [--workloads default,longtail]
[--configs ...] [--json PATH]``.
Writes ``OUT/throughput.json``, ``OUT/throughput.md`` and ``OUT/throughput.png``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from contextlib import closing
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import BadFlag, Outcome, config, hardware, main as bench_main, pyplot, ray_session, run_pipeline
from benchmarks.local import LocalPipeline
from benchmarks.stats import median_range

ASYNC_STALENESS = (1, 2, 4)


@dataclass(frozen=True, slots=True)
class Workload:
    """A named set of flags shared by every configuration of one comparison."""

    name: str
    flags: tuple[str, ...]


#: The real chat model on the README's task, fully and with a LoRA adapter (held-out
#: evaluation off: the figures are training steps).
REAL_MODEL = ("--model", "smollm2-135m-instruct", "--task.name", "word_problems", "--eval.every", "0")
CONFIGS = ("sync_same_placement", "async_s1", "async_s2", "async_s4", "sync_colocated")


def workloads(quick: bool, model_dir: str | None) -> list[Workload]:
    model = ("--model.path", model_dir) if model_dir else ()
    real = [Workload("real_full", REAL_MODEL), Workload("real_lora", (*REAL_MODEL, "--lora.rank", "16"))]
    if quick:
        return [Workload("default", (*model, "--rollout.max_new_tokens", "8", "--rollout.n", "4",
                                     "--trainer.batch_size", "8", "--trainer.micro_batch_size", "8"))]
    untrained = _untrained_model()
    return [*real, Workload("default", model),
            Workload("longtail", ("--model.path", untrained, "--rollout.max_new_tokens", "160",
                                  "--rollout.max_model_len", "256"))]


def _untrained_model() -> str:
    from pipeline_rl.models.tiny_llama import build_tiny_model

    out = Path(".cache") / "bench" / "untrained_builtin"
    build_tiny_model(out)
    return str(out)


@dataclass(frozen=True, slots=True)
class RunSummary:
    """Steady-state figures of one run (the first ``warmup`` steps left out).

    ``t_gen_s``/``t_train_s``: per step, the time the trainer waited for its batch and
    the time it spent training (their sum is the step time of a synchronous run)."""

    name: str
    staleness: int
    step_time_s: float
    tokens_per_s: float
    trainer_idle_frac: float
    generator_idle_frac: float
    weight_update_stall_ms: float
    t_gen_s: float
    t_train_s: float
    reward_first: float
    reward_last: float
    steps: int


def summarize(name: str, staleness: int, rows: list[dict[str, Any]], warmup: int) -> RunSummary:
    """Medians over the steady-state steps of a run."""
    steady = rows[warmup:] if len(rows) > warmup + 1 else rows
    times = [b["time_s"] - a["time_s"] for a, b in zip(steady, steady[1:])] or [steady[0]["step_time_s"]]
    step = statistics.median(times)
    t_train = statistics.median(r.get("train_step_s", 0.0) for r in steady)
    k = max(1, len(rows) // 5)
    return RunSummary(
        name=name, staleness=staleness, step_time_s=step,
        tokens_per_s=statistics.median(r["tokens_per_s"] for r in steady),
        trainer_idle_frac=statistics.median(r["trainer_idle_frac"] for r in steady),
        generator_idle_frac=statistics.median(r.get("generator_idle_frac", 0.0) for r in steady),
        weight_update_stall_ms=statistics.median(r["weight_update_stall_ms"] for r in steady),
        t_gen_s=max(0.0, step - t_train), t_train_s=t_train,
        reward_first=statistics.fmean(r["reward_mean"] for r in rows[:k]),
        reward_last=statistics.fmean(r["reward_mean"] for r in rows[-k:]), steps=len(rows))


def pipeline_summary(name: str, staleness: int, flags: tuple[str, ...], steps: int, warmup: int,
                     out: Path) -> RunSummary:
    cfg = config([*flags, "--staleness", str(staleness), "--max-steps", str(steps),
                  "--out-dir", str(out / name), "--trainer.checkpoint_every", "0"])
    return summarize(name, staleness, run_pipeline(cfg), warmup)


def colocated_summary(flags: tuple[str, ...], steps: int, warmup: int) -> RunSummary:
    """The best conventional synchronous schedule, in a child process (it needs every core
    and its own thread settings)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        rows = pool.apply(_colocated_rows, (flags, steps))
    return summarize("sync_colocated", 0, rows, warmup)


def _colocated_rows(flags: tuple[str, ...], steps: int) -> list[dict[str, Any]]:
    """Generate a batch with every core, then train on it with every core (the trainer
    ranks' step: train, hand the weights to the worker, open the next admission); repeat."""
    cores = str(os.cpu_count() or 1)
    os.environ.update(OMP_NUM_THREADS=cores, MKL_NUM_THREADS=cores, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    import torch

    torch.set_num_threads(int(cores))  # before vLLM starts: it freezes the thread count
    cfg = config([*flags, "--staleness", "0"])
    gps = cfg.groups_per_step
    rows: list[dict[str, Any]] = []
    with closing(LocalPipeline(cfg, trainer_threads=None)) as local:
        worker, rank_step = local.worker, local.rank_step
        start = time.perf_counter()
        for step in range(steps):
            t0 = time.perf_counter()
            before = worker.stats().tokens_generated
            worker.run(max_groups=(step + 1) * gps)
            rep = rank_step(600.0)
            assert rep is not None
            t2 = time.perf_counter()
            t1 = t2 - (rep.wall_s - rep.wait_s)   # the batch in hand: training starts
            tokens = worker.stats().tokens_generated - before
            rows.append({"step": step + 1, "time_s": t2 - start, "step_time_s": t2 - t0,
                         "train_step_s": t2 - t1, "tokens_per_s": tokens / (t2 - t0),
                         "trainer_idle_frac": (t1 - t0) / (t2 - t0),
                         "generator_idle_frac": (t2 - t1) / (t2 - t0),
                         "weight_update_stall_ms": 0.0, "reward_mean": rep.result.reward_mean})
    return rows


def overlap_bound(sync: RunSummary) -> float:
    """(T_gen + T_train) / max(T_gen, T_train) from a synchronous run's steps."""
    longest = max(sync.t_gen_s, sync.t_train_s)
    return (sync.t_gen_s + sync.t_train_s) / longest if longest > 0 else 1.0


def compare(workload: Workload, steps: int, warmup: int, out: Path,
            configs: tuple[str, ...] = CONFIGS) -> dict[str, Any]:
    """One repeat of ``configs`` (``sync_same_placement`` and ``async_s2`` always) on one workload."""
    runs = [pipeline_summary("sync_same_placement", 0, workload.flags, steps, warmup, out)]
    runs += [pipeline_summary(f"async_s{k}", k, workload.flags, steps, warmup, out)
             for k in ASYNC_STALENESS if k == 2 or f"async_s{k}" in configs]
    if "sync_colocated" in configs:
        runs.append(colocated_summary(workload.flags, steps, warmup))
    by = {r.name: r for r in runs}
    s2 = by["async_s2"].step_time_s
    bound = overlap_bound(by["sync_same_placement"])
    speedup_a = by["sync_same_placement"].step_time_s / s2
    best = by["sync_colocated"].step_time_s / s2 if "sync_colocated" in by else None
    return {"runs": [asdict(r) for r in runs], "overlap_bound": bound,
            "speedup_vs_same_placement_sync": speedup_a, "speedup_vs_best_sync": best,
            "fraction_of_bound": speedup_a / bound}


def aggregate(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and spread over repeats, per configuration and for the headline ratios."""
    names = [r["name"] for r in repeats[0]["runs"]]
    configs = []
    for name in names:
        rows = [next(x for x in rep["runs"] if x["name"] == name) for rep in repeats]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]
               if isinstance(rows[0][k], (int, float)) and k != "staleness"}
        configs.append({"name": name, "staleness": rows[0]["staleness"], **med,
                        "step_time_s_spread": median_range([r["step_time_s"] for r in rows])})
    keys = [k for k in ("speedup_vs_same_placement_sync", "speedup_vs_best_sync", "overlap_bound",
                        "fraction_of_bound") if repeats[0][k] is not None]
    return {"configs": configs, "speedup_vs_best_sync": None,
            **{k: statistics.median(rep[k] for rep in repeats) for k in keys},
            "spread": {k: median_range([rep[k] for rep in repeats]) for k in keys}}


def markdown(result: dict[str, Any]) -> str:
    hw = result["hardware"]
    lines = [f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB, no GPU.", ""]
    for wl in result["workloads"]:
        lines += [f"### Workload `{wl['name']}` ({wl['repeats']} repeat(s), {wl['steps']} steps, "
                  f"first {wl['warmup']} left out)", "",
                  "| config | staleness | step time (s) | tokens/s | trainer idle | generator idle | "
                  "update stall (ms) |", "|---|---|---|---|---|---|---|"]
        for c in wl["configs"]:
            sp = c["step_time_s_spread"]
            lines.append(f"| {c['name']} | {c['staleness']} | {c['step_time_s']:.3f} "
                         f"({sp['min']:.3f}-{sp['max']:.3f}) | {c['tokens_per_s']:.0f} | "
                         f"{c['trainer_idle_frac']:.2f} | {c['generator_idle_frac']:.2f} | "
                         f"{c['weight_update_stall_ms']:.2f} |")
        lines += ["", f"- speed-up at staleness 2 vs staleness 0 (same placement): "
                      f"**{wl['speedup_vs_same_placement_sync']:.2f}x**",
                  *([f"- speed-up at staleness 2 vs the best synchronous schedule (all cores to each "
                     f"phase in turn): **{wl['speedup_vs_best_sync']:.2f}x**"]
                    if wl["speedup_vs_best_sync"] is not None else []),
                  f"- overlap bound (T_gen + T_train) / max(T_gen, T_train), same run: "
                  f"**{wl['overlap_bound']:.2f}x**; achieved {wl['fraction_of_bound']:.0%} of it", ""]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    wls = result["workloads"]
    fig, axes = plt.subplots(1, len(wls), figsize=(6 * len(wls), 4), squeeze=False)
    for ax, wl in zip(axes[0], wls):
        names = [c["name"] for c in wl["configs"]]
        times = [c["step_time_s"] for c in wl["configs"]]
        errs = [[c["step_time_s"] - c["step_time_s_spread"]["min"] for c in wl["configs"]],
                [c["step_time_s_spread"]["max"] - c["step_time_s"] for c in wl["configs"]]]
        colors = ["#888" if n.startswith("sync") else "#3a7" for n in names]
        ax.bar(names, times, yerr=errs, color=colors)
        ax.set_ylabel("wall time per optimizer step (s)")
        ax.set_title(f"{wl['name']}: async s2 = {wl['speedup_vs_same_placement_sync']:.2f}x sync "
                     f"(bound {wl['overlap_bound']:.2f}x)")
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{result['hardware']['cores']} CPU cores, no GPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=24, help="Optimizer steps per run (default 24).")
    p.add_argument("--warmup", type=int, default=4, help="Steps left out of the figures (default 4).")
    p.add_argument("--repeats", type=int, default=3, help="Repeats of the whole comparison (default 3).")
    p.add_argument("--workloads", default="default,longtail",
                   help="Comma list: default, longtail, real_full, real_lora (the real chat model).")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"Comma list of configurations (sync_same_placement and async_s2 always run): "
                        f"{', '.join(CONFIGS)}.")
    p.add_argument("--model", default=None, help="Model folder (default: the built-in model).")


def run(args: argparse.Namespace) -> Outcome:
    if args.quick:
        args.steps, args.warmup, args.repeats = 4, 1, 1
    chosen = set(args.workloads.split(","))
    configs = tuple(args.configs.split(","))
    unknown = sorted((chosen - {"default", "longtail", "real_full", "real_lora"}) | (set(configs) - set(CONFIGS)))
    if unknown:
        raise BadFlag(f"--workloads/--configs: unknown {', '.join(unknown)}")
    result: dict[str, Any] = {"hardware": hardware(), "workloads": []}
    with ray_session():
        for wl in [w for w in workloads(args.quick, args.model) if w.name in chosen]:
            reps = [compare(wl, args.steps, args.warmup, args.out / wl.name / f"rep{i}", configs)
                    for i in range(args.repeats)]
            result["workloads"].append({"name": wl.name, "repeats": args.repeats, "steps": args.steps,
                                        "warmup": args.warmup, **aggregate(reps)})
    head = result["workloads"][0]
    result.update({k: head[k] for k in ("configs", "speedup_vs_same_placement_sync",
                                        "speedup_vs_best_sync", "overlap_bound")})
    args.out.mkdir(parents=True, exist_ok=True)
    plot(result, args.out / "throughput.png")
    return Outcome(result, markdown(result))


def main(argv: list[str] | None = None) -> int:
    return bench_main("throughput", __doc__, argv, run, flags=flags, quick="Tiny smoke configuration (tests).",
                      out="runs/bench_throughput")


if __name__ == "__main__":
    raise SystemExit(main())
