"""Shared helpers of the run-level benchmarks (throughput, ablation): one local Ray,
running a configuration through the real orchestrator, hardware description,
per-run summaries read back from ``metrics.jsonl``."""

from __future__ import annotations

import logging
import os
import platform
import statistics
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline_rl.cli import parse_config  # noqa: E402
from pipeline_rl.config import Config  # noqa: E402
from pipeline_rl.metrics import read_metrics  # noqa: E402


def hardware() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem_gib, 1),
            "gpu": None, "python": platform.python_version()}


def write_files(outputs: list[tuple[Path | None, str]]) -> None:
    """Write each ``(path, text)`` whose path is given (parents made, a final newline)."""
    for path, body in outputs:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body + "\n")


def report(result: dict[str, Any], md: str, json_path: Path | None, md_path: Path | None) -> int:
    """A benchmark's end: its JSON and Markdown to the paths given, the Markdown printed;
    returns the exit status (0)."""
    import json

    write_files([(json_path, json.dumps(result, indent=1)), (md_path, md)])
    print(md)
    return 0


def config(argv: list[str]) -> Config:
    """The run configuration of ``argv``, with held-out evaluation off unless ``argv``
    turns it on (run-level benchmarks compare training speed and reward)."""
    cfg, _ = parse_config(["--eval.every", "0", *argv])
    return cfg


def start_ray(address: str | None = None, env: dict[str, str] | None = None, *,
              object_store_bytes: int = 200 * 2**20, log_to_driver: bool = False) -> None:
    """Join the Ray cluster at ``address``, or start a local Ray with one CPU per core
    and ``object_store_bytes`` of object store; every worker gets the actors'
    environment plus ``env``."""
    import ray

    from pipeline_rl.actors.process import ACTOR_ENV

    os.environ.update({k: v for k, v in ACTOR_ENV.items() if k not in os.environ})
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    env_vars = {**ACTOR_ENV, **(env or {})}
    if address:
        ray.init(address=address, runtime_env={"env_vars": env_vars}, log_to_driver=log_to_driver)
        return
    from pipeline_rl.run.local_ray import start_local   # as the command starts its local Ray

    start_local(num_cpus=os.cpu_count() or 2, object_store_mb=-(-object_store_bytes // 2**20),
                env=env_vars, logging_level=logging.WARNING, log_to_driver=log_to_driver)


def stop_ray() -> None:
    import ray

    ray.shutdown()


def run_pipeline(cfg: Config) -> list[dict[str, Any]]:
    """Run one configuration through the real orchestrator; return its metrics rows."""
    from pipeline_rl.driver import resolve_model_dir
    from pipeline_rl.run.conductor import Orchestrator

    metrics = Path(cfg.out_dir) / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    with Orchestrator(cfg, resolve_model_dir(cfg), threading.Event()) as orch:
        orch.train()
    return read_metrics(metrics)


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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(name: str, staleness: int, rows: list[dict[str, Any]], warmup: int) -> RunSummary:
    """Medians over the steady-state steps of a run."""
    steady = rows[warmup:] if len(rows) > warmup + 1 else rows
    times = [b["time_s"] - a["time_s"] for a, b in zip(steady, steady[1:])] or [steady[0]["step_time_s"]]
    step = statistics.median(times)
    idle = statistics.median(r["trainer_idle_frac"] for r in steady)
    t_train = statistics.median(r.get("train_step_s", 0.0) for r in steady)
    k = max(1, len(rows) // 5)
    return RunSummary(
        name=name, staleness=staleness, step_time_s=step,
        tokens_per_s=statistics.median(r["tokens_per_s"] for r in steady),
        trainer_idle_frac=idle,
        generator_idle_frac=statistics.median(r.get("generator_idle_frac", 0.0) for r in steady),
        weight_update_stall_ms=statistics.median(r["weight_update_stall_ms"] for r in steady),
        t_gen_s=max(0.0, step - t_train), t_train_s=t_train,
        reward_first=statistics.fmean(r["reward_mean"] for r in rows[:k]),
        reward_last=statistics.fmean(r["reward_mean"] for r in rows[-k:]), steps=len(rows))
