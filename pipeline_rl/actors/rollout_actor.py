"""The rollout worker's Ray actor: one vLLM engine generating for the pipeline.

Wraps :class:`~pipeline_rl.rollout.worker.RolloutWorker` (usable and tested without
Ray): process set-up, the Ray-facing methods, and the one staging thread every weight
call runs on.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from pipeline_rl.actors.buffer_actor import RayAdmission
from pipeline_rl.actors.process import end_of_startup, setup_actor_process
from pipeline_rl.config import Config
from pipeline_rl.resources import CoreSlot
from pipeline_rl.run_key import RunKey, install

if TYPE_CHECKING:
    from ray import ObjectRef

    from pipeline_rl.rollout.eval_feed import EvalRequest, EvalResult
    from pipeline_rl.rollout.worker import WorkerStats
    from pipeline_rl.weight_sync.paths import Placement

T = TypeVar("T")


class WeightLoadFailed(RuntimeError):
    """A rollout worker could not take the weights the trainer published (fatal to the run)."""


class RolloutActor:
    """One vLLM rollout worker. Threaded actor: ``run`` holds one thread for the
    generation loop while ``offer_weights``/``stats``/``stop`` are served beside it."""

    def __init__(self, cfg: Config, worker_id: int, model_dir: str, buffer_name: str,
                 core: CoreSlot | None = None, gpu_memory: float | None = None, *,
                 key: RunKey | None = None) -> None:
        """``key``: the run key, installed for this process (the buffer's sender and the
        weight channel prove it; the agent endpoint's key is derived from it).
        ``buffer_name``: the buffer actor's Ray name; its socket address is asked for here,
        so the driver starts this actor while the buffer is still starting. ``core``: the
        core slot this worker's process is pinned to (None: unpinned); ``gpu_memory``: the
        share of its GPU's memory vLLM may take when the GPU is shared (``GpuPlan.memory``)."""
        setup_actor_process(cfg, f"rollout-{worker_id}", core=core)
        install(key)
        from pipeline_rl.rollout.worker import RolloutWorker
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
        admission = RayAdmission(buffer_name)
        self._worker = RolloutWorker(cfg, worker_id=worker_id, model_dir=model_dir,
                                     buffer_address=admission.buffer_address(), admission=admission,
                                     task=task, eval_task=eval_task, gpu_memory=gpu_memory,
                                     endpoint_key=None if key is None else key.derive("agent-endpoint").hex())
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

    def placement(self) -> Placement:
        """Where this worker runs (Ray node, device, GPU): the publisher picks its weight path by it."""
        from pipeline_rl.weight_sync.paths import local_placement

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
