"""The pipeline in this process, wired as a run wires it: :class:`LocalPipeline`.

The buffer actor's ``ReplayBuffer`` and ``BufferServer``, a rollout actor's ``RolloutWorker``
(task and in-process vLLM engine built from the configuration as that actor builds them)
sending over ZeroMQ, and a trainer rank's ``Trainer`` with the ranks' own step
(:class:`~pipeline_rl.training.rank_step.RankStep`: batch from the buffer, train, offer the
weights to the worker, open the admission budget) -- no Ray, no other process. Each piece
is built on first use, so a benchmark takes what it measures: the whole loop (the
colocated synchronous schedule of ``throughput``), buffer and worker (``soak --in-process``,
``rollout``), the trainer and its step (``trainer``) or the engine and the trainer each
alone (``step_bound``). ``close`` (``with contextlib.closing(LocalPipeline(...))``) closes
what was built here; an engine, task or publisher passed in stays the caller's.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline_rl.buffer import BufferServer, ReplayBuffer
    from pipeline_rl.config import Config
    from pipeline_rl.rollout.engines.engine import GenerationEngine
    from pipeline_rl.rollout.worker import RolloutWorker
    from pipeline_rl.tasks.base import Task
    from pipeline_rl.training.rank_step import RankStep
    from pipeline_rl.training.trainer import Trainer
    from pipeline_rl.weight_sync.publish.publisher import WeightPublisher


class LocalPipeline:
    """The pieces of one pipeline (see the module docstring). ``trainer_threads``: torch
    threads of the trainer (None: leave the process's setting); ``publisher``: where the
    rank step publishes (default: straight to this pipeline's worker, on the training
    thread)."""

    def __init__(self, cfg: Config, *, model_dir: str | None = None, engine: GenerationEngine | None = None,
                 task: Task | None = None, publisher: WeightPublisher | None = None,
                 trainer_threads: int | None = 1) -> None:
        self.cfg = cfg
        if model_dir is None:
            from pipeline_rl.driver import resolve_model_dir

            model_dir = str(resolve_model_dir(cfg))
        self.model_dir = model_dir
        given = {"engine": engine, "task": task, "publisher": publisher}
        self._given = {name for name, piece in given.items() if piece is not None}
        self.__dict__.update({name: given[name] for name in self._given})   # the properties' values
        self._threads = trainer_threads

    @cached_property
    def engine(self) -> GenerationEngine:
        from pipeline_rl.rollout.engines.engine import engine_config
        from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine

        return InprocessEngine(engine_config(self.cfg.rollout, self.model_dir, seed=self.cfg.seed, fault=self.cfg.fault))

    @cached_property
    def task(self) -> Task:
        from pipeline_rl.tasks.build import build_task_for_model

        return build_task_for_model(self.cfg.task, self.model_dir, seed=self.cfg.seed, evaluation=self.cfg.eval)

    @cached_property
    def buffer(self) -> ReplayBuffer:
        return self.server.buffer

    @cached_property
    def server(self) -> BufferServer:
        from pipeline_rl.buffer.server import configured_server

        return configured_server(self.cfg)

    @cached_property
    def worker(self) -> RolloutWorker:
        from pipeline_rl.rollout.worker import RolloutWorker

        return RolloutWorker(self.cfg, 0, self.model_dir, self.server.address, self.buffer, self.task,
                             engine=self.engine)

    @cached_property
    def trainer(self) -> Trainer:
        from pipeline_rl.training.trainer import Trainer

        return Trainer(self.cfg, self.model_dir, num_threads=self._threads)

    @cached_property
    def publisher(self) -> WeightPublisher:
        from pipeline_rl.weight_sync.publish.publisher import WeightPublisher

        # A worker in this process takes the update straight from the training thread.
        return WeightPublisher([self.worker], background=False, path="object_store")

    @cached_property
    def rank_step(self) -> RankStep:
        from pipeline_rl.training.rank_step import RankStep

        return RankStep(self.trainer, self.buffer, self.publisher)

    def close(self) -> None:
        """Close what was built here, the worker first (it sends into the server)."""
        built = {name for name in ("worker", "server", "engine", "trainer", "publisher")
                 if name in self.__dict__ and name not in self._given}
        if "worker" in self.__dict__:
            self.worker.close(close_engine="engine" in built)
        elif "engine" in built:
            self.engine.close()
        if "publisher" in built:
            self.publisher.close()
        if "server" in built:
            self.server.close()
        if "trainer" in built:
            self.trainer.close()
