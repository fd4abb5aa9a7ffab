"""Trainer benchmark: step time, publish time per step, trainer idle fraction.

The built-in model (``ModelConfig`` defaults: hidden 128, 2 layers, 4 heads) is trained by the
real DeepSpeed trainer (ZeRO from ``--zero-stage``, one rank, gloo, CPU) running the step the
pipeline's trainer ranks run (:class:`pipeline_rl.training.rank_step.RankStep`: wait for the batch,
step, publish, open the admission budget), back to back, fed by a producer thread that
plays the rollout workers: it asks the real :class:`ReplayBuffer` for admission (global budget,
staleness ``--staleness``), generates random well-formed groups (``rollout.n`` completions of up
to ``rollout.max_new_tokens`` tokens) stamped with the version it knows, optionally at a capped
rate (``--gen-groups-per-s``), and puts them into the buffer. After every step the weights are
published through :class:`WeightPublisher` to ``--workers`` Ray actors that fetch each update
from the object store the way a rollout worker does (the object-store weight path).

Figures (``--json PATH`` writes them; the three headline keys are always there):
- ``step_time_s``: mean wall time of ``Trainer.step`` (batch of ``trainer.batch_size`` sequences);
- ``publish_time_s``: mean time publishing costs the training thread per step (copying the
  weights out + handing them to the publisher); ``publish_frac`` = that / step time;
- ``trainer_idle_frac``: time waiting for a batch / loop wall time;
- the first ``warmup_steps`` steps (JIT compilation of the loss kernel, allocator warm-up) are
  left out of every figure and reported as ``first_step_s``;
- background transport per version (``put_s``, ``offer_s``) and ``delivery_s`` (publish call ->
  the worker holding the arrays).

Usage: ``python -m benchmarks.trainer [--duration-s 120] [--workers 1] [--json PATH]``;
``--quick`` runs a few seconds (smoke test). One thread per process (2-core machines).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import Outcome, main as bench_main, ray_session
from benchmarks.local import LocalPipeline
from benchmarks.synthetic import synthetic_groups
from pipeline_rl import runtime_env
from pipeline_rl.config import Config


@dataclass(frozen=True, slots=True)
class BenchResult:
    steps: int
    duration_s: float
    step_time_s: float
    first_step_s: float
    step_time_p90_s: float
    publish_time_s: float
    publish_frac: float
    trainer_idle_frac: float
    tokens_per_s: float
    sequences_per_step: int
    params: int
    update_bytes: int
    workers: int
    put_s: float
    offer_s: float
    delivery_s: float
    superseded: int
    groups_produced: int
    evicted: int
    lag_mean: float


class Receiver:
    """Ray actor standing in for a rollout worker's receiving side: takes the object-store
    path's updates, fetches each from the object store, records when it had it."""

    def __init__(self) -> None:
        self.times: dict[int, float] = {}

    def receive_update(self, update_info: dict[str, Any], weight_version: str) -> float:
        from pipeline_rl.weight_sync.channels.object_store import update_of

        update = update_of(update_info)
        self.times[update.version] = time.time()
        return 0.0

    def placement(self) -> Any:
        from pipeline_rl.weight_sync.channels.paths import local_placement

        return local_placement()

    def received(self) -> dict[int, float]:
        return self.times


class Producer(threading.Thread):
    """Plays the rollout workers: admission -> random groups -> buffer (blocks when full)."""

    def __init__(self, buffer: Any, cfg: Config, groups_per_s: float | None) -> None:
        super().__init__(name="producer", daemon=True)
        self.buffer, self.cfg, self.rate = buffer, cfg, groups_per_s
        self.stop_event = threading.Event()
        self.produced = 0

    def run(self) -> None:
        t0 = time.perf_counter()
        while not self.stop_event.is_set():
            grant = self.buffer.acquire(0, self.cfg.groups_per_step, timeout_s=0.2)
            if grant.granted == 0:
                continue
            for g in synthetic_groups(grant.granted, self.cfg.rollout.n, prompt_len=12,
                                      max_completion_len=self.cfg.rollout.max_new_tokens,
                                      version=max(grant.version, grant.min_version), seed=self.produced,
                                      first_group_id=self.produced):
                if self.rate:
                    time.sleep(max(0.0, t0 + self.produced / self.rate - time.perf_counter()))
                if not self.buffer.put(g, timeout_s=5.0):
                    return
                self.produced += 1


def run(duration_s: float, *, workers: int = 1, zero_stage: int = 0, staleness: int = 2,
        gen_groups_per_s: float | None = None, max_new_tokens: int = 16,
        warmup_steps: int = 1) -> BenchResult:
    import ray
    import torch

    from pipeline_rl.weight_sync.publish.publisher import WeightPublisher
    from pipeline_rl.reports import RankStepReport
    from pipeline_rl.models.tiny_llama import build_tiny_model

    cfg = Config.model_validate({"staleness": staleness, "trainer": {"zero_stage": zero_stage},
                                 "rollout": {"max_new_tokens": max_new_tokens}})
    m = cfg.model
    with tempfile.TemporaryDirectory() as tmp, \
            (ray_session(object_store_bytes=100 * 2**20) if workers else contextlib.nullcontext()):
        model_dir = build_tiny_model(Path(tmp) / "builtin", hidden_size=m.hidden_size,
                                     num_layers=m.num_layers, num_heads=m.num_heads,
                                     intermediate_size=m.intermediate_size)
        receivers: list[Any] = [ray.remote(num_cpus=0.01)(Receiver).remote() for _ in range(workers)]
        if receivers:
            ray.get([r.received.remote() for r in receivers])
        publisher = WeightPublisher(receivers, path="object_store")
        local = LocalPipeline(cfg, model_dir=str(model_dir), publisher=publisher)
        buffer, rank_step = local.buffer, local.rank_step
        params = sum(p.numel() for p in local.trainer.model.parameters())
        producer = Producer(buffer, cfg, gen_groups_per_s)
        published_at: dict[int, float] = {}
        records: list[RankStepReport] = []
        start = 0.0
        torch.manual_seed(0)
        producer.start()
        while True:
            rec = rank_step(60.0)
            if rec is None:
                raise RuntimeError("trainer benchmark: no batch within 60 s")
            records.append(rec)
            published_at[rec.result.version] = time.time()
            if rec.result.version == warmup_steps:        # the clock starts after the warm-up
                start = time.perf_counter()
            elif rec.result.version > warmup_steps and time.perf_counter() - start >= duration_s:
                break
        publisher.flush(30)
        pstats = publisher.stats()
        producer.stop_event.set()
        buffer.close()
        producer.join(10)
        delivery: list[float] = []
        for r in receivers:
            got = ray.get(r.received.remote())
            delivery += [t - published_at[v] for v, t in got.items() if v in published_at]
        publisher.close()
        local.close()
    recs = records[warmup_steps:]
    wall = sum(r.wall_s for r in recs)
    steps = [r.result.step_time_s for r in recs]
    publish = [r.publish_s for r in recs]
    tokens = sum(r.result.num_tokens for r in recs)
    bstats = buffer.stats()
    step_mean = float(np.mean(steps))
    return BenchResult(
        steps=len(recs), duration_s=wall, step_time_s=step_mean, first_step_s=records[0].result.step_time_s,
        step_time_p90_s=float(np.percentile(steps, 90)), publish_time_s=float(np.mean(publish)),
        publish_frac=float(np.mean(publish)) / step_mean,
        trainer_idle_frac=sum(r.wait_s for r in recs) / wall, tokens_per_s=tokens / wall,
        sequences_per_step=cfg.trainer.batch_size, params=params,
        update_bytes=pstats.bytes_published // max(pstats.published, 1), workers=workers,
        put_s=pstats.put_s / max(pstats.published, 1), offer_s=pstats.offer_s / max(pstats.published, 1),
        delivery_s=float(np.mean(delivery)) if delivery else 0.0, superseded=pstats.superseded,
        groups_produced=producer.produced, evicted=sum(bstats.evicted.values()),
        lag_mean=float(np.mean([r.result.lag.mean for r in recs])))


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration-s", type=float, default=120.0, help="Training wall time to measure.")
    p.add_argument("--workers", type=int, default=1, help="Ray receiver actors (0: no publishing "
                   "transport, weights still copied out every step).")
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1, 2, 3), help="DeepSpeed ZeRO stage (default 0).")
    p.add_argument("--staleness", type=int, default=2, help="Staleness of the buffer's admission (default 2).")
    p.add_argument("--gen-groups-per-s", type=float, default=None,
                   help="Cap the producer's rate (default: as fast as admission allows).")
    p.add_argument("--max-new-tokens", type=int, default=16, help="Longest generated completion (default 16).")


def run_bench(args: argparse.Namespace) -> Outcome:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runtime_env.for_local_ray()
    res = run(min(args.duration_s, 3.0) if args.quick else args.duration_s, workers=args.workers, zero_stage=args.zero_stage,
              staleness=args.staleness, gen_groups_per_s=args.gen_groups_per_s,
              max_new_tokens=args.max_new_tokens)
    return Outcome(asdict(res), f"trainer: {res.steps} steps in {res.duration_s:.1f} s, {res.params / 1e6:.2f} M params, "
                   f"{res.sequences_per_step} seqs/step | step {res.step_time_s * 1e3:.1f} ms (p90 "
                   f"{res.step_time_p90_s * 1e3:.1f}) | publish on training thread {res.publish_time_s * 1e3:.2f} ms "
                   f"= {res.publish_frac:.1%} of a step | background put "
                   f"{res.put_s * 1e3:.2f} ms, offer {res.offer_s * 1e3:.2f} ms, delivery {res.delivery_s * 1e3:.1f} ms "
                   f"to {res.workers} worker(s), {res.update_bytes / 2**20:.2f} MiB/update, {res.superseded} superseded | "
                   f"idle {res.trainer_idle_frac:.1%} | {res.tokens_per_s:.0f} tokens/s | lag {res.lag_mean:.2f}")


def main(argv: list[str] | None = None) -> int:
    return bench_main("trainer", __doc__, argv, run_bench, flags=flags, quick="At most 3 s (smoke test).")


if __name__ == "__main__":
    raise SystemExit(main())
