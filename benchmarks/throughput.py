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
longest sequence).

The overlap bound ``(T_gen + T_train) / max(T_gen, T_train)`` is measured in
the same run, from the ``sync_same_placement`` steps (T_train: the trainer's
step; T_gen: the rest of the synchronous step). Figures are medians over
repeats with their min-max spread; every time is a ratio or carries the
hardware it was measured on.

Usage: ``python benchmarks/throughput.py [--quick] [--repeats 3] [--json PATH]``.
Writes ``OUT/throughput.json``, ``OUT/throughput.md`` and ``OUT/throughput.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RunSummary, config, hardware, run_pipeline, start_ray, stop_ray, summarize  # noqa: E402

ASYNC_STALENESS = (1, 2, 4)


@dataclass(frozen=True, slots=True)
class Workload:
    """A named set of flags shared by every configuration of one comparison."""

    name: str
    flags: tuple[str, ...]


def workloads(quick: bool, model_dir: str | None) -> list[Workload]:
    model = ("--model.path", model_dir) if model_dir else ()
    if quick:
        return [Workload("default", (*model, "--rollout.max_new_tokens", "8", "--rollout.n", "4",
                                     "--trainer.batch_size", "8", "--trainer.micro_batch_size", "8"))]
    untrained = _untrained_model()
    return [Workload("default", model),
            Workload("longtail", ("--model.path", untrained, "--rollout.max_new_tokens", "160",
                                  "--rollout.max_model_len", "256"))]


def _untrained_model() -> str:
    from pipeline_rl.models.builtin import build_tiny_model

    out = Path(".cache") / "bench" / "untrained_builtin"
    build_tiny_model(out)
    return str(out)


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
    """Generate a batch with every core, then train on it with every core; repeat."""
    cores = str(os.cpu_count() or 1)
    os.environ.update(OMP_NUM_THREADS=cores, MKL_NUM_THREADS=cores, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    import torch

    torch.set_num_threads(int(cores))  # before vLLM starts: it freezes the thread count
    from pipeline_rl.rollout.worker import RolloutWorker
    from pipeline_rl.training.trainer import Trainer
    from pipeline_rl.buffer import BufferServer, ReplayBuffer
    from pipeline_rl.driver import resolve_model_dir
    from pipeline_rl.tasks import build_task

    cfg = config([*flags, "--staleness", "0"])
    model_dir = resolve_model_dir(cfg)
    gps = cfg.groups_per_step
    buffer = ReplayBuffer(cfg.buffer.capacity_groups, 0, gps)
    server = BufferServer(buffer)
    worker = RolloutWorker(cfg, 0, model_dir, server.address, buffer, build_task(cfg.task, seed=cfg.seed))
    trainer = Trainer(cfg, model_dir, num_threads=None)
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            before = worker.stats().tokens_generated
            worker.run(max_groups=(step + 1) * gps)
            groups = buffer.get_batch(gps, trainer.version, timeout_s=600)
            assert groups is not None
            t1 = time.perf_counter()
            res = trainer.step(groups)
            worker.offer_weights(trainer.weights())
            buffer.set_version(trainer.version)  # opens the admission budget for the next step
            t2 = time.perf_counter()
            tokens = worker.stats().tokens_generated - before
            rows.append({"step": step + 1, "time_s": t2 - start, "step_time_s": t2 - t0,
                         "train_step_s": t2 - t1, "tokens_per_s": tokens / (t2 - t0),
                         "trainer_idle_frac": (t1 - t0) / (t2 - t0),
                         "generator_idle_frac": (t2 - t1) / (t2 - t0),
                         "weight_update_stall_ms": 0.0, "reward_mean": res.reward_mean})
    finally:
        worker.close()
        server.close()
        trainer.close()
    return rows


def overlap_bound(sync: RunSummary) -> float:
    """(T_gen + T_train) / max(T_gen, T_train) from a synchronous run's steps."""
    longest = max(sync.t_gen_s, sync.t_train_s)
    return (sync.t_gen_s + sync.t_train_s) / longest if longest > 0 else 1.0


def compare(workload: Workload, steps: int, warmup: int, out: Path) -> dict[str, Any]:
    """One repeat of every configuration on one workload."""
    runs = [pipeline_summary("sync_same_placement", 0, workload.flags, steps, warmup, out)]
    runs += [pipeline_summary(f"async_s{k}", k, workload.flags, steps, warmup, out)
             for k in ASYNC_STALENESS]
    runs.append(colocated_summary(workload.flags, steps, warmup))
    by = {r.name: r for r in runs}
    s2 = by["async_s2"].step_time_s
    bound = overlap_bound(by["sync_same_placement"])
    speedup_a = by["sync_same_placement"].step_time_s / s2
    return {"runs": [r.as_dict() for r in runs], "overlap_bound": bound,
            "speedup_vs_same_placement_sync": speedup_a,
            "speedup_vs_best_sync": by["sync_colocated"].step_time_s / s2,
            "fraction_of_bound": speedup_a / bound}


def _median_spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def aggregate(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and spread over repeats, per configuration and for the headline ratios."""
    names = [r["name"] for r in repeats[0]["runs"]]
    configs = []
    for name in names:
        rows = [next(x for x in rep["runs"] if x["name"] == name) for rep in repeats]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]
               if isinstance(rows[0][k], (int, float)) and k != "staleness"}
        configs.append({"name": name, "staleness": rows[0]["staleness"], **med,
                        "step_time_s_spread": _median_spread([r["step_time_s"] for r in rows])})
    keys = ("speedup_vs_same_placement_sync", "speedup_vs_best_sync", "overlap_bound", "fraction_of_bound")
    return {"configs": configs, **{k: statistics.median(rep[k] for rep in repeats) for k in keys},
            "spread": {k: _median_spread([rep[k] for rep in repeats]) for k in keys}}


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
                  f"- speed-up at staleness 2 vs the best synchronous schedule (all cores to each "
                  f"phase in turn): **{wl['speedup_vs_best_sync']:.2f}x**",
                  f"- overlap bound (T_gen + T_train) / max(T_gen, T_train), same run: "
                  f"**{wl['overlap_bound']:.2f}x**; achieved {wl['fraction_of_bound']:.0%} of it", ""]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Async vs sync throughput on the same hardware.")
    p.add_argument("--steps", type=int, default=24, help="Optimizer steps per run (default 24).")
    p.add_argument("--warmup", type=int, default=4, help="Steps left out of the figures (default 4).")
    p.add_argument("--repeats", type=int, default=3, help="Repeats of the whole comparison (default 3).")
    p.add_argument("--workloads", default="default,longtail", help="Comma list: default, longtail.")
    p.add_argument("--model", default=None, help="Model folder (default: the built-in model).")
    p.add_argument("--quick", action="store_true", help="Tiny smoke configuration (tests).")
    p.add_argument("--out", type=Path, default=Path("runs/bench_throughput"), help="Output folder.")
    p.add_argument("--json", type=Path, default=None, help="Also write the JSON result here.")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats = 4, 1, 1
    chosen = set(args.workloads.split(","))
    result: dict[str, Any] = {"hardware": hardware(), "workloads": []}
    start_ray()
    try:
        for wl in [w for w in workloads(args.quick, args.model) if w.name in chosen]:
            reps = [compare(wl, args.steps, args.warmup, args.out / wl.name / f"rep{i}")
                    for i in range(args.repeats)]
            result["workloads"].append({"name": wl.name, "repeats": args.repeats, "steps": args.steps,
                                        "warmup": args.warmup, **aggregate(reps)})
    finally:
        stop_ray()
    head = result["workloads"][0]
    result.update({k: head[k] for k in ("configs", "speedup_vs_same_placement_sync",
                                        "speedup_vs_best_sync", "overlap_bound")})
    args.out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2)
    (args.out / "throughput.json").write_text(text)
    if args.json:
        args.json.write_text(text)
    (args.out / "throughput.md").write_text(markdown(result))
    plot(result, args.out / "throughput.png")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
