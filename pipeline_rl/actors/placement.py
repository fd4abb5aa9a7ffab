"""Where the actors go and what they ask Ray for: the three actor classes with their
resources (CPUs, a GPU or a share of one, restarts, the buffer on the driver's node),
constructors that return handles typed by ``pipeline_rl.actors.handles``, and the GPU
plan. The classes are wrapped at run time (no Ray import, no side effect at import).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from pipeline_rl.actors.handles import BufferHandle, RolloutHandle, TrainerHandle
from pipeline_rl.config import Config
from pipeline_rl.resources import CoreSlot, GpuPlan, plan_gpus
from pipeline_rl.run_key import RunKey


@dataclass(frozen=True, slots=True)
class ActorClasses:
    """The three actor classes as Ray places them (resources, restarts, placement), with
    constructors that return typed handles. Each constructor hands the actor the run key
    (``pipeline_rl.run_key``) as an argument: Ray carries it, nothing prints it (a rollout
    worker's agent endpoint takes its own key derived from it, ``rollout/agents/endpoint.py``)."""

    buffer: Any
    rollout: Any
    trainer: Any
    standby: Any
    spare: Any

    def new_buffer(self, cfg: Config, bind_host: str, start_version: int,
                   avoid: tuple[CoreSlot, ...], key: RunKey) -> BufferHandle:
        return cast(BufferHandle, self.buffer.remote(cfg, bind_host, start_version, avoid, key=key))

    def new_rollout(self, cfg: Config, worker_id: int, model_dir: str, buffer_name: str,
                    core: CoreSlot | None, gpu_memory: float | None, key: RunKey) -> RolloutHandle:
        return cast(RolloutHandle, self.rollout.remote(cfg, worker_id, model_dir, buffer_name, core, gpu_memory,
                                                       key=key))

    def new_standby(self, cfg: Config, worker_id: int, model_dir: str, buffer_name: str, key: RunKey) -> RolloutHandle:
        """Rollout worker ``worker_id``'s standby (``run/life/slots.py``): no CPU reserved, unpinned."""
        return cast(RolloutHandle, self.standby.remote(cfg, worker_id, model_dir, buffer_name, None, None,
                                                       key=key, standby=True))

    def new_trainer(self, cfg: Config, model_dir: str, rank: int, world_size: int, buffer: BufferHandle,
                    core: CoreSlot | None, gpu_memory: float | None, key: RunKey) -> TrainerHandle:
        return cast(TrainerHandle, self.trainer.remote(cfg, model_dir, rank, world_size, buffer, core,
                                                       gpu_memory, key=key))

    def new_spare(self, cfg: Config, model_dir: str, rank: int, world_size: int, buffer: BufferHandle,
                  core: CoreSlot | None, key: RunKey) -> TrainerHandle:
        """Trainer rank ``rank``'s spare (``--run.spare_trainers``): no CPU reserved, unpinned
        until adopted."""
        return cast(TrainerHandle, self.spare.remote(cfg, model_dir, rank, world_size, buffer, core, None,
                                                     key=key, spare=True))


def remote_classes(cfg: Config, buffer_node_id: str, buffer_name: str, *,
                   gpus: GpuPlan | None) -> ActorClasses:
    """The Ray actor classes (buffer, rollout, trainer) with their resources; the
    buffer is pinned to ``buffer_node_id`` (the driver's node) and named ``buffer_name``
    (the rollout workers find it by that name); ``gpus``: :func:`gpu_plan` (None: CPU)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pipeline_rl.actors.buffer_actor import BufferActor
    from pipeline_rl.actors.rollout_actor import RolloutActor
    from pipeline_rl.actors.trainer_actor import TrainerActor

    def needs(resource: str | None) -> dict[str, float]:
        return {resource: 0.001} if resource else {}

    here = NodeAffinitySchedulingStrategy(buffer_node_id, soft=False)
    per_actor = gpus.per_actor if gpus else 0   # without a GPU request Ray hides every GPU
    return ActorClasses(
        buffer=_actor(BufferActor).options(num_cpus=0, max_concurrency=32, scheduling_strategy=here,
                                           name=buffer_name),
        rollout=_actor(RolloutActor).options(
            num_cpus=1, num_gpus=per_actor, max_concurrency=8, max_restarts=-1, max_task_retries=0,
            resources=needs(cfg.ray.rollout_resource)),
        trainer=_actor(TrainerActor).options(num_cpus=1, num_gpus=per_actor, max_concurrency=2,
                                             resources=needs(cfg.ray.trainer_resource)),
        # A standby or a spare idles once built: no CPU of Ray's sizing is reserved for it (CPU runs only).
        spare=_actor(TrainerActor).options(num_cpus=0, max_concurrency=2,
                                           resources=needs(cfg.ray.trainer_resource)),
        standby=_actor(RolloutActor).options(
            num_cpus=0, max_concurrency=8, max_restarts=-1, max_task_retries=0,
            resources=needs(cfg.ray.rollout_resource)))


def gpu_plan(cfg: Config) -> GpuPlan | None:
    """How the actors take the cluster's GPUs (:func:`pipeline_rl.resources.plan_gpus`);
    None on CPU. A GPU each where there are enough, shared where there are fewer."""
    import ray

    return plan_gpus(cfg, float(ray.cluster_resources().get("GPU", 0)))


def _actor(cls: type) -> Any:
    import ray

    return ray.remote(cls)
