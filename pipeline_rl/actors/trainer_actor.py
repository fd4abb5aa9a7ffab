"""A trainer rank's Ray actor (DeepSpeed); rank 0 also publishes the weights.

Wraps :class:`~pipeline_rl.training.trainer.Trainer` and its pipeline step (usable and
tested without Ray): process set-up, the Ray-facing methods, and the one thread all of
the rank's torch work runs on.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from pipeline_rl import runtime_env
from pipeline_rl.actors.process import (
    end_of_startup, lower_to_idle_priority, pin_to_core, raise_to_parent_priority, restore_priority,
    setup_actor_process,
)
from pipeline_rl.config import Config
from pipeline_rl.resources import CoreSlot
from pipeline_rl.run_key import RunKey

if TYPE_CHECKING:
    from pipeline_rl.actors.handles import BufferHandle, RolloutHandle
    from pipeline_rl.reports import RankStepReport
    from pipeline_rl.samples import Group
    from pipeline_rl.training.rank_step import RankStep
    from pipeline_rl.training.trainer import Trainer
    from pipeline_rl.weight_sync.publish.publisher import WeightPublisher

T = TypeVar("T")


def _prepare(cfg: Config) -> None:
    """Import and warm, ahead, what building a rank's trainer imports and warms (the
    ``Trainer`` module, transformers' model classes, DeepSpeed, PEFT for a LoRA run, the
    loss kernel): 7 of the 9 s a new trainer process took to start on 2 cores, measured."""
    import deepspeed  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    from pipeline_rl.correction.loss import warm_up
    from pipeline_rl.training.lora import trained_weights
    from pipeline_rl.training.rank_step import RankStep  # noqa: F401
    from pipeline_rl.training.trainer import Trainer  # noqa: F401
    from pipeline_rl.weight_sync.publish.publisher import WeightPublisher  # noqa: F401

    trained_weights(cfg.lora).preload()
    warm_up(cfg.algorithm, cfg.correction, "cpu")


class _BufferSource:
    """The buffer's Ray actor seen as a :class:`~pipeline_rl.training.rank_step.BatchSource`."""

    def __init__(self, buffer: BufferHandle) -> None:
        self._buffer = buffer

    def get_batch(self, num_groups: int, trainer_version: int, timeout_s: float | None = None, *,
                  rank: int = 0) -> list[Group] | None:
        import ray

        groups: list[Group] | None = ray.get(self._buffer.get_batch.remote(
            num_groups, trainer_version, timeout_s, rank))
        return groups

    def set_version(self, version: int) -> None:
        self._buffer.set_version.remote(version)   # fire and forget: the buffer ignores an older one


class TrainerActor:
    """One data-parallel trainer rank (DeepSpeed). Rank 0 publishes weights."""

    def __init__(self, cfg: Config, model_dir: str, rank: int, world_size: int,
                 buffer: BufferHandle, core: CoreSlot | None = None, gpu_memory: float | None = None, *,
                 key: RunKey | None = None, spare: bool = False) -> None:
        """``gpu_memory``: the share of its GPU's memory this rank may take when the GPU is
        shared with other actors (None: not capped); ``key``: the run key (rank 0's weight
        channels prove it to the workers); ``spare``: a spare of rank ``rank`` (``--run.
        spare_trainers``): unpinned, at the lowest CPU priority (``process.lower_to_idle_priority``),
        it imports and warms what a rank's start needs (:func:`_prepare`), then idles until a
        restarted life of the run takes it (:meth:`adopt`)."""
        setup_actor_process(cfg, f"trainer-{rank}" + ("-spare" if spare else ""), core=None if spare else core)
        self._priority = lower_to_idle_priority() if spare else None
        self._core = core
        self._key = key
        self._gpu_memory = gpu_memory
        self._cfg = cfg
        self._model_dir = model_dir
        self._rank = rank
        self._world_size = world_size
        self._buffer = buffer
        self._trainer_or_none: Trainer | None = None
        self._publisher: WeightPublisher | None = None
        self._rank_step: RankStep | None = None
        # All torch work of this rank runs on this one thread, in call order (Ray serves
        # calls on a pool of threads; freeing tensors from several of them grows one
        # malloc arena per thread, and steps, saves and loads must not overlap anyway).
        self._torch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")
        if spare:   # on the torch thread: setup() comes after it
            self._torch.submit(_prepare, cfg)

    def adopt(self, cfg: Config, buffer: BufferHandle) -> int:
        """A spare becomes rank ``rank`` of a restarted life of the run: that life's
        configuration and buffer, the rank's core and priority; :meth:`setup` follows as for a
        new rank (after the spare's imports, on the same thread). Returns the pid."""
        self._cfg, self._buffer = cfg, buffer
        if self._core is not None and pin_to_core(self._core) is not None:
            raise_to_parent_priority()   # as a pinned rank
        else:
            restore_priority(self._priority)   # as an unpinned one: where Ray started it
        self._priority = None
        return os.getpid()

    @property
    def _trainer(self) -> Trainer:
        """The rank's trainer (built by :meth:`setup`, which the driver calls first)."""
        if self._trainer_or_none is None:
            raise RuntimeError("TrainerActor: setup() was not called")
        return self._trainer_or_none

    def node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def pid(self) -> int:
        return os.getpid()

    def _on_torch_thread(self, fn: Callable[[], T]) -> T:
        return self._torch.submit(fn).result()

    def setup(self, master_addr: str, master_port: int) -> int:
        """Join the process group (rendezvous at rank 0) and build the DeepSpeed engine;
        returns the starting version."""
        return self._on_torch_thread(lambda: self._setup(master_addr, master_port))

    def _setup(self, master_addr: str, master_port: int) -> int:
        # Ray shows each rank only its own device: local rank 0, whatever the driver inherited
        runtime_env.for_rendezvous(master_addr, master_port, self._rank, self._world_size, local_rank=0)
        from pipeline_rl.run_key import rendezvous_secret
        from pipeline_rl.weight_sync.publish.publisher import WeightPublisher
        from pipeline_rl.training.rank_step import RankStep
        from pipeline_rl.training.trainer import Trainer

        self._trainer_or_none = Trainer(self._cfg, self._model_dir, rank=self._rank,
                                world_size=self._world_size, master_addr=master_addr,
                                master_port=master_port, gpu_memory=self._gpu_memory)
        self._publisher = (WeightPublisher(path=self._cfg.rollout.weight_path,
                                           secret=rendezvous_secret(self._key))
                           if self._rank == 0 else None)
        self._rank_step = RankStep(self._trainer, _BufferSource(self._buffer), self._publisher)
        end_of_startup()
        return int(self._trainer.version)

    def set_workers(self, workers: list[RolloutHandle]) -> list[str]:
        """Rank 0: the rollout workers to publish to; workers new to the publisher get the
        newest published weights at once. Returns the weight path each worker gets."""
        if self._publisher is None:
            return []
        return self._publisher.set_workers(workers)

    def offer_latest(self, workers: list[RolloutHandle]) -> None:
        """Rank 0: give ``workers`` (restarted ones) the newest published weights."""
        if self._publisher is not None:
            self._publisher.offer_latest(workers)

    def publish_current(self) -> None:
        """Publish the current weights (start-up, resume). Every rank calls it: under
        ZeRO-3 gathering the full parameters is a collective."""
        self._on_torch_thread(lambda: self._step.publish())

    @property
    def _step(self) -> RankStep:
        if self._rank_step is None:
            raise RuntimeError("TrainerActor: setup() was not called")
        return self._rank_step

    def train_step(self, timeout_s: float) -> RankStepReport | None:
        """This rank's pipeline step (:class:`RankStep`: wait for the batch share, step,
        publish, open the admission budget); None when no batch came within ``timeout_s``.
        A failed checkpoint write of any rank raises here within a second, even mid-step
        (``rank_step.await_step``)."""
        from pipeline_rl.faults import kill_here
        from pipeline_rl.training.rank_step import await_step

        kill_here(self._cfg.fault, "trainer_kill", self._trainer.version)
        return await_step(self._torch.submit(lambda: self._step(timeout_s)), self._trainer.writer.check)

    def save_checkpoint(self, path: str) -> str:
        """Copy the state for checkpoint ``path`` and return; it is written in the background."""
        return self._on_torch_thread(lambda: str(self._trainer.save_checkpoint(path, background=True)))

    def wait_for_checkpoints(self) -> None:
        """Return once this rank's checkpoint writes are done; raises a failed one's error (any
        rank's), or a stall's after 30 s without progress (``training.checkpoint_progress``)."""
        self._trainer.wait_for_checkpoints()

    def load_checkpoint(self, path: str) -> int:
        return self._on_torch_thread(lambda: int(self._trainer.load_checkpoint(path).version))

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.close(timeout_s=5.0)
