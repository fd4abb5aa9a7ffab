"""The Ray actors the driver places: buffer, rollout worker, trainer rank.

Each wraps a plain class (``ReplayBuffer`` + ``BufferServer``, ``RolloutWorker``,
``Trainer``) that is fully usable and tested without Ray; this module only adds
process set-up (one thread per process, vLLM in-process), Ray-facing methods,
and the typed messages that cross Ray calls. Control goes through these calls;
samples go through ZeroMQ; weights through Ray's object store.

The classes are decorated by :func:`remote_classes` at run time (no Ray import,
no side effect at module import).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pipeline_rl.actors.process import end_of_startup, setup_actor_process
from pipeline_rl.config import Config
from pipeline_rl.faults import FAULT_ENV, inject
from pipeline_rl.resources import CoreSlot, GpuPlan, plan_gpus

if TYPE_CHECKING:
    from ray import ObjectRef

    from pipeline_rl.actors.evaluation import EvalRequest, EvalResult
    from pipeline_rl.actors.publish import WeightPublisher
    from pipeline_rl.actors.rollout_worker import WorkerStats
    from pipeline_rl.actors.reports import RankStepReport
    from pipeline_rl.actors.trainer import RankStep, Trainer
    from pipeline_rl.buffer.types import Admission, BufferStats
    from pipeline_rl.samples import Group

#: A Ray actor handle (Ray's own type says nothing about the methods it exposes).
ActorHandle = Any
T = TypeVar("T")


# --------------------------------------------------------------------------- buffer


class BufferActor:
    """The replay buffer and its ZeroMQ receiver in one process.

    Threaded actor: ``acquire`` (workers), ``get_batch`` (trainer ranks, blocking)
    and ``stats`` (driver) run concurrently; the buffer itself is thread-safe.
    """

    def __init__(self, cfg: Config, bind_host: str, start_version: int = 0) -> None:
        setup_actor_process(cfg, "buffer", uses_torch=False)
        from pipeline_rl.buffer import BufferServer, ReplayBuffer
        from pipeline_rl.wire import WireLimits

        self._buffer = ReplayBuffer(cfg.buffer.capacity_groups, cfg.staleness, cfg.groups_per_step,
                                    num_ranks=cfg.trainer.num_ranks, start_version=start_version)
        address = cfg.buffer.address or f"tcp://{bind_host}:*"
        limits = WireLimits(max_message_bytes=int(cfg.buffer.max_message_mb * 2**20))
        self._server = BufferServer(self._buffer, address, limits=limits)
        end_of_startup()

    def address(self) -> str:
        return self._server.address

    def acquire(self, worker_id: int, max_groups: int, timeout_s: float = 0.0) -> Admission:
        return self._buffer.acquire(worker_id, max_groups, timeout_s)

    def set_version(self, version: int) -> None:
        self._buffer.set_version(version)

    def get_batch(self, num_groups: int, trainer_version: int, timeout_s: float,
                  rank: int) -> list[Group] | None:
        inject("buffer", trainer_version)
        return self._buffer.get_batch(num_groups, trainer_version, timeout_s, rank=rank)

    def watch(self, poll_s: float = 0.5) -> str | None:
        """Block until the buffer closes (None) or its receiver thread fails (one line
        saying why); the driver keeps one call pending as a health sentinel, so a dead
        buffer process also shows as this call failing."""
        while not self._buffer.closed:
            error = self._server.error
            if error is not None:
                return f"receiver thread crashed: {type(error).__name__}: {error}"
            time.sleep(poll_s)
        return None

    def ping(self) -> bool:
        return True

    def worker_lost(self, worker_id: int) -> int:
        return self._buffer.worker_lost(worker_id)

    def release(self, worker_id: int, count: int) -> int:
        return self._buffer.release(worker_id, count)

    def stats(self) -> BufferStats:
        return self._buffer.stats()

    def close(self) -> None:
        self._server.close()
        self._buffer.close()


class RayAdmission:
    """Adapter: the rollout worker's admission source, backed by the buffer actor (found
    by its Ray name: an actor handle among a restartable actor's constructor arguments
    makes Ray log an error at every start)."""

    def __init__(self, buffer_name: str, wait_s: float = 30.0) -> None:
        """Finds the buffer by name, waiting up to ``wait_s`` for the name to be registered
        (the driver starts this worker right after asking for the buffer)."""
        import ray

        deadline = time.monotonic() + wait_s
        while True:
            try:
                self._buffer: ActorHandle = ray.get_actor(buffer_name)
                return
            except ValueError:   # not registered (yet)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def request(self, worker_id: int, max_groups: int, timeout_s: float = 0.0) -> "Future[Admission]":
        """The buffer's answer, on a future: the caller goes on while the call is in flight."""
        future: Future[Admission] = self._buffer.acquire.remote(worker_id, max_groups, timeout_s).future()
        return future

    def release(self, worker_id: int, count: int) -> int:
        import ray

        return int(ray.get(self._buffer.release.remote(worker_id, count)))

    def buffer_address(self) -> str:
        """The ZeroMQ address the buffer's socket is bound to (waits for the buffer to bind)."""
        import ray

        return str(ray.get(self._buffer.address.remote()))


# --------------------------------------------------------------------------- rollout


class WeightLoadFailed(RuntimeError):
    """A rollout worker could not take the weights the trainer published (fatal to the run)."""


class RolloutActor:
    """One vLLM rollout worker. Threaded actor: ``run`` holds one thread for the
    generation loop while ``offer_weights``/``stats``/``stop`` are served beside it."""

    def __init__(self, cfg: Config, worker_id: int, model_dir: str, buffer_name: str,
                 core: CoreSlot | None = None, gpu_memory: float | None = None) -> None:
        """``buffer_name``: the buffer actor's Ray name; its socket address is asked for here,
        so the driver starts this actor while the buffer is still starting. ``core``: the
        core slot this worker's process is pinned to (None: unpinned); ``gpu_memory``: the
        share of its GPU's memory vLLM may take when the GPU is shared (``GpuPlan.memory``)."""
        setup_actor_process(cfg, f"rollout-{worker_id}", core=core)
        from pipeline_rl.actors.rollout_worker import RolloutWorker
        from pipeline_rl.tasks import build_task_for_model, task_tokenizer

        # The model's tokenizer (loaded once): prompts reach the engine rendered by its chat template.
        tokenizer = task_tokenizer(cfg.task, model_dir)
        task = build_task_for_model(cfg.task, model_dir, seed=cfg.seed, evaluation=cfg.eval, tokenizer=tokenizer)
        eval_task = (build_task_for_model(cfg.task, model_dir, seed=cfg.seed, split="eval",
                                          evaluation=cfg.eval, tokenizer=tokenizer) if cfg.eval.every else None)
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stager")
        admission = RayAdmission(buffer_name)
        self._worker = RolloutWorker(cfg, worker_id=worker_id, model_dir=model_dir,
                                     buffer_address=admission.buffer_address(), admission=admission,
                                     task=task, eval_task=eval_task, gpu_memory=gpu_memory)
        end_of_startup()

    def ready(self) -> bool:
        return True

    def run(self, start_counter: int = 0) -> WorkerStats:
        """The generation loop (returns when stopped); group ids and prompts continue
        from ``start_counter``."""
        self._worker.start_at(start_counter)
        return self._worker.run()

    def offer_weights(self, refs: list[ObjectRef]) -> None:
        """Take new weights. Failing to take them is fatal to this worker: it could never
        reach a newer version, so the admission budget would hold it idle forever. The
        error ends :meth:`run` (the driver then ends the run naming it) and is re-raised."""
        # Always on the one staging thread: Ray serves concurrent calls on a pool of
        # threads, and every thread that frees an update's arrays grows its own malloc
        # arena (measured: resident memory grew ~20 MB per 1,000 updates that way).
        self._take(self._worker.offer_weights, refs)

    # vLLM's weight-transfer calls (the trainer's publisher drives them). All on the one
    # staging thread, like offers; a failure is fatal to this worker, as for an offer.
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._take(self._worker.init_weight_transfer_engine, init_info)

    def start_weight_update(self) -> None:
        self._take(self._worker.start_weight_update)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._take(self._worker.update_weights, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._take(self._worker.finish_weight_update, weight_version)

    def receive_update(self, update_info: dict[str, Any], weight_version: str) -> float:
        """The three calls of one update in one (the trainer's channel makes this one)."""
        return self._take(self._worker.receive_update, update_info, weight_version)

    def _take(self, call: Callable[..., T], *args: Any) -> T:
        try:
            return self._stager.submit(call, *args).result()
        except Exception as e:
            from pipeline_rl.supervision import first_line

            self._worker.fail(WeightLoadFailed(f"taking new weights failed: {first_line(e)}"))
            raise

    def stats(self) -> WorkerStats:
        return self._worker.stats()

    def evaluate(self, request: EvalRequest) -> EvalResult:
        """Evaluate held-out prompts with the current weights, beside generation (blocks
        this call's thread until every answer is scored)."""
        return self._worker.evaluate(request).result()

    def stop(self) -> None:
        self._worker.stop()

    def pid(self) -> int:
        return os.getpid()


# --------------------------------------------------------------------------- trainer


class _BufferSource:
    """The buffer's Ray actor seen as a :class:`~pipeline_rl.actors.trainer.BatchSource`."""

    def __init__(self, buffer: ActorHandle) -> None:
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
                 buffer: ActorHandle, core: CoreSlot | None = None, gpu_memory: float | None = None) -> None:
        """``gpu_memory``: the share of its GPU's memory this rank may take when the GPU is
        shared with other actors (None: not capped)."""
        setup_actor_process(cfg, f"trainer-{rank}", core=core)
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
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                          RANK=str(self._rank), WORLD_SIZE=str(self._world_size), LOCAL_RANK="0")
        from pipeline_rl.actors.publish import WeightPublisher
        from pipeline_rl.actors.trainer import RankStep, Trainer

        self._trainer_or_none = Trainer(self._cfg, self._model_dir, rank=self._rank,
                                world_size=self._world_size, master_addr=master_addr,
                                master_port=master_port, gpu_memory=self._gpu_memory)
        self._publisher = (WeightPublisher(transport=self._cfg.rollout.weight_transport)
                           if self._rank == 0 else None)
        self._rank_step = RankStep(self._trainer, _BufferSource(self._buffer), self._publisher)
        end_of_startup()
        return int(self._trainer.version)

    def set_workers(self, workers: list[ActorHandle]) -> None:
        """Rank 0: the rollout workers to publish to; workers new to the publisher get the
        newest published weights at once."""
        if self._publisher is not None:
            self._publisher.set_workers(workers)

    def offer_latest(self, workers: list[ActorHandle]) -> None:
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
        publish, open the admission budget); None when no batch came within ``timeout_s``."""
        return self._on_torch_thread(lambda: self._step(timeout_s))

    def save_checkpoint(self, path: str) -> str:
        return self._on_torch_thread(lambda: str(self._trainer.save_checkpoint(path)))

    def load_checkpoint(self, path: str) -> int:
        return self._on_torch_thread(lambda: int(self._trainer.load_checkpoint(path).version))

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.close(timeout_s=5.0)


def remote_classes(cfg: Config, buffer_node_id: str, buffer_name: str, *,
                   gpus: GpuPlan | None) -> tuple[Any, Any, Any]:
    """The Ray actor classes (buffer, rollout, trainer) with their resources; the
    buffer is pinned to ``buffer_node_id`` (the driver's node) and named ``buffer_name``
    (the rollout workers find it by that name); ``gpus``: :func:`gpu_plan` (None: CPU)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def needs(resource: str | None) -> dict[str, float]:
        return {resource: 0.001} if resource else {}

    # A fault to inject (tests) reaches the actors of a Ray the driver did not start too.
    env = {"runtime_env": {"env_vars": {FAULT_ENV: os.environ[FAULT_ENV]}}} if os.environ.get(FAULT_ENV) else {}
    here = NodeAffinitySchedulingStrategy(buffer_node_id, soft=False)
    per_actor = gpus.per_actor if gpus else 0   # without a GPU request Ray hides every GPU
    buffer_cls = _actor(BufferActor).options(num_cpus=0, max_concurrency=32, scheduling_strategy=here,
                                             name=buffer_name, **env)
    rollout_cls = _actor(RolloutActor).options(
        num_cpus=1, num_gpus=per_actor, max_concurrency=8, max_restarts=-1, max_task_retries=0,
        resources=needs(cfg.ray.rollout_resource), **env)
    trainer_cls = _actor(TrainerActor).options(num_cpus=1, num_gpus=per_actor, max_concurrency=2,
                                               resources=needs(cfg.ray.trainer_resource), **env)
    return buffer_cls, rollout_cls, trainer_cls


def gpu_plan(cfg: Config) -> GpuPlan | None:
    """How the actors take the cluster's GPUs (:func:`pipeline_rl.resources.plan_gpus`);
    None on CPU. A GPU each where there are enough, shared where there are fewer."""
    import ray

    return plan_gpus(cfg, float(ray.cluster_resources().get("GPU", 0)))


def _actor(cls: type) -> Any:
    import ray

    return ray.remote(cls)
