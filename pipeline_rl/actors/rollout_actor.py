"""The rollout worker's Ray actor: one vLLM engine generating for the pipeline.

Wraps :class:`~pipeline_rl.rollout.worker.RolloutWorker` (usable and tested without
Ray): process set-up, the Ray-facing methods, and the one staging thread every weight
call runs on.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from pipeline_rl.actors.buffer_actor import RayAdmission
from pipeline_rl.actors.process import (
    end_of_startup, lower_to_idle_priority, pin_to_core, raise_to_parent_priority, restore_priority,
    setup_actor_process,
)
from pipeline_rl.config import Config
from pipeline_rl.resources import CoreSlot
from pipeline_rl.run_key import RunKey
from pipeline_rl.weight_sync.protocol import SYNC_CALLS, SyncClient

if TYPE_CHECKING:
    from pipeline_rl.buffer.sender import GroupSender
    from pipeline_rl.rollout.engines.engine import GenerationEngine
    from pipeline_rl.rollout.eval_feed import EvalRequest, EvalResult
    from pipeline_rl.rollout.worker import RolloutWorker, WorkerStats
    from pipeline_rl.tasks.base import Task
    from pipeline_rl.weight_sync.channels.paths import Placement

T = TypeVar("T")

_LOOP_END_WAIT_S = 10.0   # a generation loop asked to end does so within a step
_CONNECT_SLICE_S = 2.0    # a buffer's socket is tried this long before its name is looked up again


def _connected_worker(cfg: Config, worker_id: int, model_dir: str, buffer_name: str, task: Task,
                      eval_task: Task | None, gpu_memory: float | None, key: RunKey | None,
                      engine: GenerationEngine | None) -> RolloutWorker:
    """A rollout worker joined to the buffer now registered as ``buffer_name`` (waiting for
    it to bind), around ``engine`` (None: a new one)."""
    from pipeline_rl.rollout.worker import RolloutWorker

    admission, sender = _join_buffer(cfg, worker_id, buffer_name, key)
    return RolloutWorker(cfg, worker_id=worker_id, model_dir=model_dir, buffer_address=sender.address,
                         admission=admission, task=task, eval_task=eval_task, gpu_memory=gpu_memory, key=key,
                         engine=engine, sender=sender)


def _join_buffer(cfg: Config, worker_id: int, buffer_name: str, key: RunKey | None) -> tuple[RayAdmission, GroupSender]:
    """The admission source and the sender of the buffer registered as ``buffer_name``. The
    buffer of a life of the run that is ending may still hold the name when it is looked up
    (a process Ray restarts while the run restarts itself): a buffer that does not answer
    within ``_CONNECT_SLICE_S`` is looked up again by name, until one answers or
    ``--buffer.send_timeout_s`` passed (then the last error is raised)."""
    import ray

    from pipeline_rl.buffer.sender import GroupSender
    from pipeline_rl.buffer.types import BufferUnreachable

    deadline = time.monotonic() + cfg.buffer.send_timeout_s
    while True:
        admission = RayAdmission(buffer_name)
        try:
            address = admission.buffer_address()
            return admission, GroupSender(address, worker_id, cfg.buffer.send_timeout_s,
                                          connect_timeout_s=_CONNECT_SLICE_S, key=key)
        except (BufferUnreachable, ray.exceptions.RayActorError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class WeightLoadFailed(RuntimeError):
    """A rollout worker could not take the weights the trainer published (fatal to the run)."""


class RolloutActor:
    """One vLLM rollout worker. Threaded actor: ``run`` holds one thread for the
    generation loop while the weight calls, ``stats`` and ``stop`` are served beside it."""

    def __init__(self, cfg: Config, worker_id: int, model_dir: str, buffer_name: str,
                 core: CoreSlot | None = None, gpu_memory: float | None = None, *,
                 key: RunKey | None = None, standby: bool = False) -> None:
        """``key``: the run key (the buffer's sender and the weight channels prove it; the
        agent endpoint's token is derived from it).
        ``buffer_name``: the buffer actor's Ray name; its socket address is asked for here,
        so the driver starts this actor while the buffer is still starting. ``core``: the
        core slot this worker's process is pinned to (None: unpinned); ``gpu_memory``: the
        share of its GPU's memory vLLM may take when the GPU is shared (``GpuPlan.memory``);
        ``standby``: the worker's standby (``run/life/slots.py``): it logs to its own file and
        is built unpinned, at the lowest CPU priority, until :meth:`take_over` (so is a
        process Ray restarted while the run keeps standbys)."""
        import ray

        # A process Ray restarts while the run keeps standbys becomes the slot's standby, or
        # is handed the slot by take_over: built like a standby until then.
        again = cfg.rollout.standby and ray.get_runtime_context().was_current_actor_reconstructed
        unpinned = standby or again
        setup_actor_process(cfg, f"rollout-{worker_id}" + ("-standby" if standby else ""),
                            core=None if unpinned else core)
        # built with only the CPU the pinned worker and trainer leave (process.lower_to_idle_priority)
        self._priority = lower_to_idle_priority() if unpinned else None
        from pipeline_rl.tasks.build import build_task_for_model
        from pipeline_rl.tasks.chat import plugin_reward
        from pipeline_rl.tasks.tokenizer import task_tokenizer

        # The model's tokenizer (loaded once): prompts reach the engine rendered by its chat template.
        tokenizer = task_tokenizer(cfg.task, model_dir)
        task = build_task_for_model(cfg.task, model_dir, seed=cfg.seed, evaluation=cfg.eval, tokenizer=tokenizer)
        eval_task = (build_task_for_model(cfg.task, model_dir, seed=cfg.seed, split="eval",
                                          evaluation=cfg.eval, tokenizer=tokenizer, reward_fn=plugin_reward(task))
                     if cfg.eval.every else None)   # the plug-in reward resolved (a remote one probed) once
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stager")
        self._new_worker: Callable[[Config, GenerationEngine | None], RolloutWorker] = lambda c, engine: (
            _connected_worker(c, worker_id, model_dir, buffer_name, task, eval_task, gpu_memory, key, engine))
        self._worker = self._new_worker(cfg, None)
        end_of_startup()

    def ready(self) -> bool:
        return True

    def renew(self, cfg: Config) -> int:
        """Carry this worker into the run's next life (``run/life/carry.py``: the trainer or the
        buffer died, and this worker did not), under that life's ``cfg``: its generation loop
        ended, what it started dropped, and a new worker made around the same engine
        (``GenerationEngine.renew``: nothing of the old life left in it), joined to the new
        life's buffer (a new actor under the same Ray name, proving the same run key); the
        new life publishes its weights to it and starts its loop as for a new actor. Runs on
        the staging thread, after any weight call still in progress. Returns the pid; raises
        when the engine cannot be carried (the driver then starts a new actor)."""
        return self._stager.submit(self._renew, cfg).result()

    def _renew(self, cfg: Config) -> int:
        old = self._worker
        if not old.end_loop(_LOOP_END_WAIT_S):
            raise RuntimeError(f"its generation loop did not end within {_LOOP_END_WAIT_S:.0f} s")
        # Closed beside: a send to the dead buffer may block its scorer up to --buffer.send_timeout_s.
        threading.Thread(target=old.close, kwargs={"close_engine": False, "linger_s": 0.0},
                         name="close-last-life", daemon=True).start()
        old.engine.renew()
        self._worker = self._new_worker(cfg, old.engine)
        return os.getpid()

    def take_over(self, core: CoreSlot | None) -> int:
        """A standby takes a dead worker's place: its core, when the run pins, and the run's
        priority; returns its pid."""
        if core is not None and pin_to_core(core) is not None:
            raise_to_parent_priority()   # as a pinned worker
        else:
            restore_priority(self._priority)   # as an unpinned one: where Ray started it
        self._priority = None
        return os.getpid()

    def run(self, start_counter: int = 0) -> WorkerStats:
        """The generation loop (returns when stopped); group ids and prompts continue
        from ``start_counter``."""
        worker = self._worker
        worker.start_at(start_counter)
        try:
            return worker.run()
        except Exception:
            if worker.ended_on_request:   # renew ended it: the life it generated for is over
                return worker.stats()
            raise

    # The trainer's weight calls (``weight_sync.protocol.SYNC_CALLS``: the worker's own
    # methods, set on this class below, none written here). All on the one staging thread:
    # Ray serves concurrent calls on a pool of threads, and every thread that frees an
    # update's arrays grows its own malloc arena (measured: resident memory grew ~20 MB per
    # 1,000 updates that way). Failing to take new weights is fatal to this worker: it could
    # never reach a newer version, so the admission budget would hold it idle forever; the
    # error ends :meth:`run` (the driver then ends the run naming it).

    def placement(self) -> Placement:
        """Where this worker runs (Ray node, device, GPU): the publisher picks its weight path by it."""
        from pipeline_rl.weight_sync.channels.paths import local_placement

        return local_placement()

    def _take(self, call: Callable[..., T], *args: Any) -> T:
        try:
            return self._stager.submit(call, *args).result()
        except Exception as e:
            from pipeline_rl.calls import first_line

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


def _on_stager(name: str) -> Callable[..., Any]:
    """The worker's weight call ``name`` as the actor's method: the current worker's own,
    run on the staging thread (:meth:`RolloutActor._take`); its signature and doc are the
    protocol's (``SyncClient``), which Ray and the typed handle read."""
    declared = getattr(SyncClient, name)

    def call(self: RolloutActor, *args: Any) -> Any:
        return self._take(getattr(self._worker, name), *args)

    call.__name__, call.__qualname__, call.__doc__ = name, f"RolloutActor.{name}", declared.__doc__
    call.__signature__ = inspect.signature(declared)  # type: ignore[attr-defined]
    return call


for _name in SYNC_CALLS:
    setattr(RolloutActor, _name, _on_stager(_name))


if TYPE_CHECKING:
    def _serves(worker: RolloutWorker) -> SyncClient:
        return worker   # the calls set above are the worker's: a renamed one is a type error here
