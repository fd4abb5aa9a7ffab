"""Starting and stopping a run's actors, with typed handles. Workers (vLLM), buffer and
trainers (DeepSpeed) start at once (the workers find the buffer by name), the workers first:
theirs is the longest start, and Ray hands its pre-started processes to the first actors
asking. The trainers are asked
to start DeepSpeed as soon as they exist (on one node; across nodes once they name their
node), not after the buffer is up. Every wait says what it waits
for; a failure or ``_TIMEOUT_S`` ends the run in one line.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline_rl.actors.handles import BufferHandle, TrainerHandle
from pipeline_rl.config import Config
from pipeline_rl.net import free_port
from pipeline_rl.run.ahead import TRAINING, import_ahead
from pipeline_rl.run.cluster import Placement, say
from pipeline_rl.run.run_folder import RunFolder, open_run_folder
from pipeline_rl.run_key import RunKey
from pipeline_rl.run.supervisor import OrchestratorError, WorkerSlot, describe_failure

log = logging.getLogger("pipeline_rl.run.startup")

_TIMEOUT_S = 900.0      # a start-up phase that takes longer ends the run
_SAY_EVERY_S = 30.0
_SHUTDOWN_WAIT_S = 5.0  # per shutdown phase: a failed run must still end within seconds


@dataclass(frozen=True, slots=True)
class Actors:
    """A run's actors, started and ready: the first weights are published and every
    worker's generation loop is running. ``version``: the trainers' starting version."""

    buffer: BufferHandle
    trainers: list[TrainerHandle]
    workers: list[WorkerSlot]
    version: int


class StartupWait:
    """``ray.get`` during start-up, saying what it waits for; a stop raises KeyboardInterrupt."""

    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop

    def __call__(self, refs: Sequence[Any], what: str, role: str) -> list[Any]:
        import ray

        t0, pending = time.monotonic(), list(refs)
        while pending:
            if self._stop.is_set():
                raise KeyboardInterrupt
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=_SAY_EVERY_S)
            waited = time.monotonic() - t0
            if pending and waited >= _TIMEOUT_S:
                raise OrchestratorError(f"start-up: gave up waiting for {what} after {waited:.0f} s")
            if pending:
                log.warning("start-up: still waiting for %s (%.0f s so far)", what, waited)
        try:
            return list(ray.get(list(refs)))
        except ray.exceptions.RayError as e:
            raise OrchestratorError(f"start-up: {describe_failure(e, role)}") from None


def start_actors(cfg: Config, model_dir: str, where: Placement, stop: threading.Event,
                 started: Callable[[BufferHandle | None, list[TrainerHandle], list[WorkerSlot]], None],
                 start_version: int) -> Actors:
    """Create every actor, bring it up and start generation at ``start_version`` (the run
    folder's). ``started`` learns of the actors as soon as they exist, so a start-up
    failure can still stop them. A fresh run key (``pipeline_rl.run_key``) goes to every
    actor as a constructor argument; this process keeps no other copy."""
    from pipeline_rl.actors.placement import remote_classes

    wait = StartupWait(stop)
    buffer_name = f"pipeline_rl_buffer_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    classes = remote_classes(cfg, where.node_id, buffer_name, gpus=where.gpus)
    memory = where.gpus.memory if where.gpus else None
    key = RunKey.new()

    workers = [WorkerSlot(i, classes.new_rollout(cfg, i, model_dir, buffer_name, where.cores.workers[i], memory,
                                                 key), core=where.cores.workers[i])
               for i in range(cfg.rollout.num_workers)]
    started(None, [], workers)
    buffer = classes.new_buffer(cfg, where.host, start_version, where.cores.worker_slots, key)
    n = cfg.trainer.num_ranks
    trainers = [classes.new_trainer(cfg, model_dir, r, n, buffer, where.cores.ranks[r], memory, key)
                for r in range(n)]
    started(buffer, trainers, workers)
    ahead = import_ahead(TRAINING)   # while the actors start
    setups = _setup_trainers(trainers, where, wait)
    address = wait([buffer.address.remote()], "the replay buffer to bind its socket", "replay buffer")[0]
    say(f"buffer: listening on {address}")
    version = _start_trainers(cfg, trainers, setups, wait)
    wait([w.handle.ready.remote() for w in workers], f"{len(workers)} rollout worker(s) to start vLLM",
         "rollout worker")
    say(f"rollout: {len(workers)} vLLM worker(s) ready ({cfg.rollout.dtype})")
    paths = wait([trainers[0].set_workers.remote([w.handle for w in workers])],
                 "the trainer to register the workers", "trainer")[0]
    say("weights: " + ", ".join(f"worker {i} via {p}" for i, p in enumerate(paths)))
    wait([t.publish_current.remote() for t in trainers], "the first weights to be published", "trainer")
    for w in workers:
        w.start(version, cfg.groups_per_step)
    if cfg.rollout.standby and not where.gpus:   # built beside the run, once start-up is done
        for w in workers:
            w.standby = classes.new_standby(cfg, w.index, model_dir, buffer_name, key)
    del key
    ahead.join()   # long done: the workers' start took seconds
    return Actors(buffer, trainers, workers, version)


def open_run(cfg: Config) -> RunFolder:
    """The run's folder, opened once, with the version the run starts at read once."""
    return open_run_folder(cfg.out_dir, cfg.resume, resume_version(cfg))


def resume_version(cfg: Config) -> int:
    """The version a ``--resume`` checkpoint holds (0 for a fresh run); a bad checkpoint
    fails here, before the buffer and the trainers start."""
    if not cfg.resume:
        return 0
    from pipeline_rl.training.checkpoint import CheckpointError, read_run_state

    try:
        return read_run_state(cfg.resume).version
    except CheckpointError as e:
        raise OrchestratorError(f"--resume: {e}") from None


def _setup_trainers(trainers: list[TrainerHandle], where: Placement, wait: StartupWait) -> list[Any]:
    """Ask every rank to join the rendezvous and build its DeepSpeed engine (not waited for)."""
    master = (wait([trainers[0].node_ip.remote()], "the trainer to start", "trainer")[0]
              if where.multi_node else "127.0.0.1")
    port = free_port()
    return [t.setup.remote(master, port) for t in trainers]


def _start_trainers(cfg: Config, trainers: list[TrainerHandle], setups: list[Any], wait: StartupWait) -> int:
    """Wait for DeepSpeed on every rank (:func:`_setup_trainers`), then load the resumed
    checkpoint; the version."""
    n = cfg.trainer.num_ranks
    versions = wait(setups, f"{n} trainer rank(s) to start DeepSpeed", "trainer")
    say(f"trainer: {n} rank(s) ready (DeepSpeed ZeRO-{cfg.trainer.zero_stage})")
    if cfg.resume:
        versions = wait([t.load_checkpoint.remote(cfg.resume) for t in trainers],
                        "the trainers to load the checkpoint", "trainer")
        log.info("resumed from %s at version %d", cfg.resume, int(versions[0]))
    return int(versions[0])


def stop_actors(buffer: BufferHandle | None, trainers: Sequence[TrainerHandle], workers: Sequence[WorkerSlot],
                graceful: bool = True) -> None:
    """Stop every actor, each phase bounded by ``_SHUTDOWN_WAIT_S``: workers stop generating,
    trainers close their publishers, the buffer closes; then all are killed. Not ``graceful``
    (a life of the run that is about to restart: nothing of it is kept), all are killed at
    once: a worker blocked sending to a dead buffer, or to a full one that a dead trainer no
    longer drains, would hold its phase for the whole bound."""
    import ray

    if not ray.is_initialized():
        return
    if not graceful:
        _kill_all(buffer, trainers, workers)
        return
    for w in workers:
        _quiet(lambda: w.handle.stop.remote())
    runs = [w.run_ref for w in workers if w.run_ref is not None]
    if runs:
        _quiet(lambda: ray.wait(runs, num_returns=len(runs), timeout=_SHUTDOWN_WAIT_S))
    closing = [t.close.remote() for t in trainers]
    if closing:
        _quiet(lambda: ray.wait(closing, num_returns=len(closing), timeout=_SHUTDOWN_WAIT_S))
    if buffer is not None:
        _quiet(lambda: ray.get(buffer.close.remote(), timeout=_SHUTDOWN_WAIT_S))
    _kill_all(buffer, trainers, workers)


def _kill_all(buffer: BufferHandle | None, trainers: Sequence[TrainerHandle], workers: Sequence[WorkerSlot]) -> None:
    import ray

    handles: list[Any] = [w.handle for w in workers] + [w.standby for w in workers] + list(trainers) + [buffer]
    for handle in handles:
        if handle is not None:
            _quiet(lambda: ray.kill(handle))


def _quiet(fn: Callable[[], object]) -> None:
    """Best-effort shutdown step: log, never raise."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - shutdown must go on
        log.debug("shutdown step failed: %s", e)
