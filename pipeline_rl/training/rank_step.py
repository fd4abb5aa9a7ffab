"""The step every trainer rank runs (:class:`RankStep`) and where its batches come from
(:class:`BatchSource`): wait for the rank's share, train, publish, open the next version.

Invariant: a failed (or stalled) background checkpoint write of any rank is raised by every
rank's step, in one line (``training.checkpoint_writer``: ``CheckpointWriter.check``): after
the step's collectives, so no rank is left waiting in one, and, through :func:`await_step`,
every second while a step is under way (the trainer actor's wait), so it reaches the driver
within a second or two of the failure, not at the next checkpoint."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol, TypeVar

from pipeline_rl.samples import Group
from pipeline_rl.reports import RankStepReport
from pipeline_rl.training.trainer import Trainer
from pipeline_rl.weight_sync.publish.publisher import WeightPublisher

T = TypeVar("T")


class BatchSource(Protocol):
    """Where a rank's batches come from: the :class:`ReplayBuffer` itself (tests,
    benchmarks) or an adapter over the buffer's Ray actor (the pipeline)."""

    def get_batch(self, num_groups: int, trainer_version: int, timeout_s: float | None = None, *,
                  rank: int = 0) -> list[Group] | None: ...

    def set_version(self, version: int) -> None: ...


class RankStep:
    """The step every trainer rank runs -- the pipeline's trainer actors, the tests and the
    trainer benchmark alike: wait for this rank's share of the next batch, train on it,
    publish the new weights, open the buffer's admission budget for the next version.

    The loop around it (how many steps, checkpoints, supervision) is the driver's
    (:class:`pipeline_rl.run.life.one_life.Orchestrator`). The version is the trainer's
    (:attr:`Trainer.version`, one per batch): the driver reads it from the reports.
    ``publisher`` is given on the rank that publishes (rank 0) and None elsewhere; under
    ZeRO-3 every rank still joins the gather.
    """

    def __init__(self, trainer: Trainer, source: BatchSource, publisher: WeightPublisher | None) -> None:
        self.trainer, self.source, self.publisher = trainer, source, publisher
        self.share = trainer.cfg.groups_per_step // trainer.world_size

    def __call__(self, timeout_s: float) -> RankStepReport | None:
        """One step; None when no batch came within ``timeout_s``."""
        from pipeline_rl.faults import inject

        t0 = time.perf_counter()
        tr = self.trainer
        groups = self.source.get_batch(self.share, tr.version, timeout_s, rank=tr.rank)
        if not groups:
            return None
        wait_s = time.perf_counter() - t0
        inject(tr.cfg.fault, "trainer_step", tr.version)
        result = tr.step(groups)
        t1, step_end_at = time.perf_counter(), time.time()
        self.publish()
        publish_s = time.perf_counter() - t1
        if tr.rank == 0:   # opens the admission budget for the next version now
            self.source.set_version(tr.version)
        tr.writer.check()   # a failed checkpoint write of any rank ends the run now (module docstring)
        return RankStepReport(result, wait_s, publish_s, time.perf_counter() - t0, step_end_at)

    def publish(self) -> None:
        """Publish the current weights (every rank calls it: a ZeRO-3 gather is collective)."""
        if self.publisher is None and not self.trainer.weights_collective:
            return
        pub = self.publisher
        update = self.trainer.weights(allocate=pub.allocator() if pub else None, on_device=bool(pub and pub.on_device()))
        if self.publisher is not None:
            self.publisher.publish(update)


def await_step(step: Future[T], check: Callable[[], None], every_s: float = 1.0) -> T:
    """``step``'s result (a step running on another thread); meanwhile ``check()`` every
    ``every_s`` (the writer's :meth:`~pipeline_rl.training.checkpoint_writer.CheckpointWriter.check`):
    what it raises is raised at once, the step going on where it runs (its collectives end as
    on every other rank)."""
    while True:
        try:
            return step.result(timeout=every_s)
        except TimeoutError:
            check()
