"""Soak benchmark: does any process of the pipeline grow in memory, step after step?

Usage::

    python -m benchmarks.soak [--steps 20000] [--sample-every 100] [--warmup N]
                              [--json PATH] [--md PATH] [--actor-env KEY=VALUE ...]
                              [--in-process] [-- PIPELINE FLAGS]

What is measured. The default mode runs the real pipeline -- the same
:class:`~pipeline_rl.run.life.one_life.Orchestrator` that ``launch/async_grpo.py``
drives, with its defaults and ``--staleness 2`` unless flags after ``--`` say
otherwise -- on a local Ray started here. A sampler thread in the driver reads
the trainer version (one per optimizer step) and, every ``--sample-every``
steps, the resident set size (RSS, ``/proc/PID/statm`` through psutil) of every
process: the buffer, each trainer rank and each rollout worker (their pids come
from Ray's actor table; rollout workers also answer ``pid()``), and the driver
itself. Reading RSS costs microseconds per process, so the sampling does not
perturb the run.

Per process the report gives the RSS at the first and last sample and the
*slope*: the least-squares line of RSS against step over the samples at or
after ``--warmup`` steps (allocator pools, caches and the buffer fill up
first), in KiB per 1,000 steps; also the slope over the second half of the
run alone (a slope that falls from one to the other is something filling up;
one that stays is a leak). A process whose slope exceeds ``--limit-kib``
(500 KiB per 1,000 steps by default) is flagged. A process that restarts (a
rollout worker Ray brought back) starts a new segment; only its last segment
is fitted.

``--in-process`` is the cheap bisection variant: one ``InprocessEngine`` with a
``RolloutWorker`` and an in-process ``ReplayBuffer``/``BufferServer`` in this
process (:class:`benchmarks.local.LocalPipeline` without its trainer), and a
stand-in trainer loop (take a batch at the current version, offer the next
version's weights -- alternating between two read-only copies of the model's
weights, as arrays fetched from Ray's object store are read-only -- open the
admission budget, poll the worker's stats). No Ray, no
DeepSpeed; the one process sampled is this one. ``--offer-threads N`` offers
the updates from N threads in turn, as the calls of a threaded Ray actor land
on the threads of its pool. Flags after ``--`` still
configure the run (``--staleness``, ``--rollout.max_num_seqs``, ...).

``--actor-env KEY=VALUE`` adds environment variables to every actor process
(and to this process with ``--in-process``), e.g. to compare an allocator or
library setting without editing code.

Output: a Markdown table on stdout (and in ``--md``), all samples and fits in
``--json``. The exit status is 0 unless the run itself failed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.common import (BadFlag, Outcome, at_least, config, hardware, main as bench_main, ray_session,
                               run_pipeline)
from benchmarks.local import LocalPipeline

if TYPE_CHECKING:
    from pipeline_rl.config import Config

_ACTOR_CLASSES = {"BufferActor": "buffer", "TrainerActor": "trainer", "RolloutActor": "rollout"}


@dataclass(slots=True)
class Series:
    """RSS samples of one process: ``(step, rss_bytes)`` per sample, and the same
    samples split by kind (``anon``: private heap; ``file``: mapped files;
    ``shmem``: shared memory such as Ray's object store), from ``/proc/PID/status``.
    ``segment_start`` moves when the process was replaced (a new pid, same name)."""

    name: str
    pid: int
    samples: list[tuple[int, int]] = field(default_factory=list)
    parts: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    restarts: int = 0
    segment_start: int = 0  # index in ``samples`` where the current pid's samples begin


@dataclass(frozen=True, slots=True)
class Fit:
    """The memory figures of one process (see the module docstring)."""

    name: str
    pid: int
    samples: int
    first_mib: float
    last_mib: float
    max_mib: float
    slope_kib_per_1k_steps: float | None
    second_half_slope_kib_per_1k_steps: float | None
    part_slopes_kib_per_1k_steps: dict[str, float | None]
    restarts: int
    over_limit: bool


def slope_kib_per_1k(points: list[tuple[int, int]]) -> float | None:
    """Least-squares slope of RSS (bytes) against step, in KiB per 1,000 steps."""
    if len(points) < 3 or len({s for s, _ in points}) < 2:
        return None
    fit = statistics.linear_regression([float(s) for s, _ in points], [float(r) for _, r in points])
    return fit.slope * 1000.0 / 1024.0


def fit_series(series: Series, warmup: int, limit_kib: float) -> Fit:
    seg = series.samples[series.segment_start:]
    steady = [p for p in seg if p[0] >= warmup]
    half = [p for p in steady if p[0] >= (steady[0][0] + steady[-1][0]) / 2] if steady else []
    slope = slope_kib_per_1k(steady)
    rss = [r for _, r in series.samples] or [0]
    parts = {kind: slope_kib_per_1k([p for p in pts[series.segment_start:] if p[0] >= warmup])
             for kind, pts in series.parts.items()}
    return Fit(name=series.name, pid=series.pid, samples=len(series.samples),
               first_mib=rss[0] / 2**20, last_mib=rss[-1] / 2**20, max_mib=max(rss) / 2**20,
               slope_kib_per_1k_steps=slope, second_half_slope_kib_per_1k_steps=slope_kib_per_1k(half),
               part_slopes_kib_per_1k_steps=parts, restarts=series.restarts, over_limit=slope is not None and slope > limit_kib)


class RssSampler:
    """Samples the RSS of named processes whenever the step crosses a multiple of
    ``every``; while :meth:`running`, a daemon thread polls the step every ``poll_s``."""

    def __init__(self, resolve: Callable[[], dict[str, int]], every: int, poll_s: float = 0.02) -> None:
        self._step: Callable[[], int] = lambda: 0   # the current optimizer step
        self._resolve = resolve    # () -> dict[name, pid]: the processes to sample now
        self.every = every
        self.poll_s = poll_s
        self.series: dict[str, Series] = {}
        self._next = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    @contextlib.contextmanager
    def running(self, step: Callable[[], int]) -> Iterator[None]:
        """Sample now, whenever ``step()`` crosses a multiple of ``every`` in the block, and at its end."""
        self._step = step
        self.sample(step())
        self._thread.start()
        try:
            yield
        finally:
            self.sample(step())
            self._stop.set()
            self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            step = self._step()
            if step >= self._next:
                self.sample(step)

    def sample(self, step: int) -> None:
        import psutil

        self._next = (step // self.every + 1) * self.every
        pids = self._resolve()
        for name, pid in pids.items():
            try:
                rss = int(psutil.Process(pid).memory_info().rss)
                parts = rss_parts(pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
                continue
            s = self.series.get(name)
            if s is None:
                s = self.series[name] = Series(name, pid)
            elif s.pid != pid:  # replaced (a restarted rollout worker): a new segment
                s.pid, s.restarts, s.segment_start = pid, s.restarts + 1, len(s.samples)
            s.samples.append((step, rss))
            for kind, value in parts.items():
                s.parts.setdefault(kind, []).append((step, value))


def rss_parts(pid: int) -> dict[str, int]:
    """``anon``/``file``/``shmem`` resident bytes of ``pid`` (Linux ``/proc/PID/status``)."""
    keys = {"RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            fields = line.split()
            if fields and fields[0] in keys:
                out[keys[fields[0]]] = int(fields[1]) * 1024
    return out


# --------------------------------------------------------------------------- the real pipeline


def actor_pids() -> dict[str, int]:
    """``name -> pid`` of the pipeline actors of the Ray this process started, found by
    the title Ray gives an actor's process (``ray::BufferActor``, ``ray::RolloutActor.run``
    while a call runs; what ``ps`` shows), among this process's descendants. Names:
    ``buffer``, ``trainer0``.., ``rollout0``.. (ranks and workers in order of start)."""
    import psutil

    found: list[tuple[float, str, int]] = []
    for proc in psutil.Process().children(recursive=True):
        try:
            title = (proc.cmdline() or [""])[0]
            cls = title.removeprefix("ray::").split(".")[0] if title.startswith("ray::") else ""
            if cls in _ACTOR_CLASSES:
                found.append((proc.create_time(), cls, proc.pid))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    out: dict[str, int] = {}
    counts: dict[str, int] = {}
    for _, cls, pid in sorted(found):
        kind = _ACTOR_CLASSES[cls]
        name = kind if kind == "buffer" else f"{kind}{counts.get(kind, 0)}"
        counts[kind] = counts.get(kind, 0) + 1
        out[name] = pid
    return out


def run_real(cfg: Config, every: int, actor_env: dict[str, str]) -> tuple[RssSampler, float]:
    """Run ``cfg`` through the orchestrator on a local Ray started here, sampling RSS."""
    pids: dict[str, int] = {}
    last_resolve = [0.0]

    def resolve() -> dict[str, int]:
        # Look the actors up again only when a process is gone (a restart) or now and then.
        import psutil

        now = time.monotonic()
        if not pids or now - last_resolve[0] > 60 or not all(psutil.pid_exists(p) for p in pids.values()):
            pids.clear()
            pids.update(actor_pids())
            last_resolve[0] = now
        return {**pids, "driver": os.getpid()}

    sampler = RssSampler(resolve, every)
    log_path = Path(cfg.out_dir or "runs") / "progress.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with ray_session(env=actor_env, object_store_bytes=cfg.ray.object_store_mb * 2**20, num_cpus=cfg.ray.num_cpus):
        t0 = time.perf_counter()
        with log_path.open("w") as log, contextlib.redirect_stdout(log):
            run_pipeline(cfg, watch=lambda orch: sampler.running(lambda: orch.version))
    return sampler, time.perf_counter() - t0


# --------------------------------------------------------------------------- in-process variant


def run_in_process(cfg: Config, every: int, offer_threads: int = 1) -> tuple[RssSampler, float]:
    """One engine + worker + buffer in this process and a stand-in trainer loop.
    ``offer_threads > 1`` offers each update from the next of that many threads in
    turn (as a threaded Ray actor's pool does); 1 offers from this thread."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from pipeline_rl.runtime_env import ACTOR_ENV
    from pipeline_rl.weight_sync.message import WeightUpdate, load_update

    for key, value in ACTOR_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch

    torch.set_num_threads(1)
    with contextlib.closing(LocalPipeline(cfg)) as local:
        buffer, worker = local.buffer, local.worker
        base = load_update(local.model_dir, 0)
        variants = []
        for k in range(2):  # two read-only weight sets, like arrays out of Ray's object store
            arrays = tuple(np.ascontiguousarray(a + np.float32(1e-6 * k)) for a in base.arrays)
            for a in arrays:
                a.setflags(write=False)
            variants.append(arrays)
        pools = [ThreadPoolExecutor(1, thread_name_prefix=f"offer-{i}") for i in range(offer_threads)]
        version = [0]
        sampler = RssSampler(lambda: {"in-process": os.getpid()}, every)
        loop = threading.Thread(target=worker.run, name="rollout", daemon=True)
        t0 = time.perf_counter()
        loop.start()
        try:
            with sampler.running(lambda: version[0]):
                while version[0] < cfg.max_steps:
                    groups = buffer.get_batch(cfg.groups_per_step, version[0], timeout_s=cfg.trainer.batch_timeout_s)
                    if groups is None:
                        raise RuntimeError(f"no batch within {cfg.trainer.batch_timeout_s} s at version {version[0]}")
                    del groups
                    nxt = version[0] + 1
                    update = WeightUpdate(nxt, base.names, variants[nxt % 2])
                    if offer_threads > 1:
                        pools[nxt % offer_threads].submit(worker.offer_weights, update).result()
                    else:
                        worker.offer_weights(update)
                    buffer.set_version(nxt)
                    worker.stats()
                    version[0] = nxt
        finally:
            worker.stop()
            loop.join(30.0)
            for pool in pools:
                pool.shutdown()
    return sampler, time.perf_counter() - t0


# --------------------------------------------------------------------------- report


def markdown(fits: list[Fit], *, steps: int, warmup: int, limit_kib: float, wall_s: float, mode: str) -> str:
    def num(x: float | None) -> str:
        return "n/a" if x is None else f"{x:,.0f}"

    lines = [f"Soak ({mode}): {steps:,} steps in {wall_s:,.0f} s; slopes fitted from step {warmup:,} "
             f"(limit {limit_kib:,.0f} KiB per 1,000 steps).", "",
             "| process | pid | samples | RSS first (MiB) | RSS last (MiB) | RSS max (MiB) "
             "| slope (KiB/1k steps) | 2nd-half slope (KiB/1k steps) | anon / file / shmem slope "
             "| restarts | over limit |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for f in fits:
        lines.append(f"| {f.name} | {f.pid} | {f.samples} | {f.first_mib:,.1f} | {f.last_mib:,.1f} | "
                     f"{f.max_mib:,.1f} | {num(f.slope_kib_per_1k_steps)} | "
                     f"{num(f.second_half_slope_kib_per_1k_steps)} | "
                     f"{' / '.join(num(f.part_slopes_kib_per_1k_steps.get(k)) for k in ('anon', 'file', 'shmem'))} | "
                     f"{f.restarts} | "
                     f"{'yes' if f.over_limit else 'no'} |")
    return "\n".join(lines)


def parse_env(pairs: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise BadFlag(f"--actor-env expects KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=20_000, help="Optimizer steps to run (default 20000).")
    p.add_argument("--sample-every", type=int, default=None,
                   help="Steps between RSS samples (default: steps/200, at least 10).")
    p.add_argument("--warmup", type=int, default=None,
                   help="Slopes are fitted from this step on (default: 10%% of the steps, at least 500 "
                        "when the run is long enough).")
    p.add_argument("--limit-kib", type=float, default=500.0, help="Flag slopes above this (KiB/1k steps).")
    p.add_argument("--out-dir", type=Path, default=None, help="Run folder (default: a temporary one).")
    p.add_argument("--actor-env", action="append", default=[], metavar="KEY=VALUE",
                   help="Extra environment variable for every actor (repeatable).")
    p.add_argument("--in-process", action="store_true", help="One engine + worker + buffer here, no Ray.")
    p.add_argument("--offer-threads", type=int, default=1,
                   help="--in-process: offer updates from this many threads in turn (default 1).")


def run(args: argparse.Namespace) -> Outcome:
    at_least(args, steps=2)
    every = args.sample_every or max(10, args.steps // 200)
    warmup = args.warmup if args.warmup is not None else min(max(500, args.steps // 10), args.steps // 2)
    actor_env = parse_env(args.actor_env)
    with tempfile.TemporaryDirectory(prefix="soak_") as tmp:
        out_dir = args.out_dir or Path(tmp)
        flags = ["--staleness", "2", *args.run_flags, "--max-steps", str(args.steps), "--out-dir", str(out_dir)]
        cfg = config(flags, evaluation=True)
        mode = "in-process" if args.in_process else "pipeline"
        if args.in_process:
            os.environ.update(actor_env)
            sampler, wall_s = run_in_process(cfg, every, max(1, args.offer_threads))
        else:
            sampler, wall_s = run_real(cfg, every, actor_env)
    fits = [fit_series(s, warmup, args.limit_kib) for s in sampler.series.values()]
    table = markdown(fits, steps=args.steps, warmup=warmup, limit_kib=args.limit_kib, wall_s=wall_s, mode=mode)
    return Outcome({
        "mode": mode, "steps": args.steps, "sample_every": every, "warmup": warmup,
        "limit_kib_per_1k_steps": args.limit_kib, "wall_s": wall_s, "pipeline_flags": flags,
        "actor_env": actor_env, "hardware": hardware(),
        "fits": [asdict(f) for f in fits],
        "samples": {s.name: s.samples for s in sampler.series.values()},
        "sample_parts": {s.name: s.parts for s in sampler.series.values()},
    }, table)


def main(argv: list[str] | None = None) -> int:
    return bench_main("soak", __doc__, argv, run, flags=flags,
                      run_flags="Pipeline flags (launch/async_grpo.py's), after -- (default: --staleness 2).")


if __name__ == "__main__":
    raise SystemExit(main())
