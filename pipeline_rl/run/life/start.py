"""Starting a life's actors, with typed handles. Workers (vLLM), buffer and trainers
(DeepSpeed) start at once (the workers find the buffer by name), the workers first: theirs
is the longest start, and Ray hands its pre-started processes to the first actors asking.
The trainers are asked to start DeepSpeed as soon as they exist (on one node; across nodes
once they name their node), not after the buffer is up. Every wait says what it waits for;
a failure or ``_TIMEOUT_S`` ends the run in one line.

What the run's last life handed on (``run/life/carry.py``) is taken up first: its rollout
workers renewed, its spare trainer ranks adopted; whatever it lacks is a new actor. Stopping
the actors: ``run/life/stop.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline_rl.actors.handles import BufferHandle, RolloutHandle, TrainerHandle
from pipeline_rl.config import Config
from pipeline_rl.net import rendezvous_port
from pipeline_rl.resources import slow_bf16_line, this_cpuinfo
from pipeline_rl.run.ahead import TRAINING, import_ahead
from pipeline_rl.run.cluster import Placement, say
from pipeline_rl.run.life.carry import Carried, RunIdentity, adopt_spares, renew_workers, renewed
from pipeline_rl.run.life.run_folder import RunFolder, open_run_folder
from pipeline_rl.run.life.slots import WorkerSlot
from pipeline_rl.run.life.supervise import OrchestratorError, describe_failure

log = logging.getLogger("pipeline_rl.run.life.start")

_TIMEOUT_S = 900.0      # a start-up phase that takes longer ends the run
_SAY_EVERY_S = 30.0


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


@dataclass(slots=True)
class Started:
    """One life's actors as start-up creates them, each filled in as soon as it exists (so a
    start-up failure can still stop them); ``spares``: the trainer ranks' spares
    (``--run.spare_trainers``), built once start-up is done."""

    buffer: BufferHandle | None = None
    trainers: list[TrainerHandle] = field(default_factory=list)
    workers: list[WorkerSlot] = field(default_factory=list)
    spares: list[TrainerHandle] = field(default_factory=list)


def start_actors(cfg: Config, model_dir: str, where: Placement, stop: threading.Event, started: Started,
                 start_version: int, identity: RunIdentity, carried: Carried | None = None) -> Actors:
    """Create every actor, bring it up and start generation at ``start_version`` (the run
    folder's), filling in ``started`` as the actors come to exist. ``carried``: what the
    run's last life handed on (module docstring); whatever it lacks is a new actor."""
    from pipeline_rl.actors.placement import remote_classes

    carried = carried or Carried()
    wait = StartupWait(stop)
    classes = remote_classes(cfg, where.node_id, identity.buffer_name, gpus=where.gpus)
    memory = where.gpus.memory if where.gpus else None
    key = identity.key

    def new_rollout(i: int) -> RolloutHandle:
        return classes.new_rollout(cfg, i, model_dir, identity.buffer_name, where.cores.workers[i], memory, key)

    def new_trainers(buffer: BufferHandle) -> list[TrainerHandle]:
        n = cfg.trainer.num_ranks
        return [classes.new_trainer(cfg, model_dir, r, n, buffer, where.cores.ranks[r], memory, key) for r in range(n)]

    renewing = renew_workers(cfg, carried.workers)   # first: each waits for the new buffer's name
    kept = {w.index: w for w in carried.workers}
    workers = started.workers = [kept.get(i) or WorkerSlot(i, new_rollout(i), core=where.cores.workers[i])
                                 for i in range(cfg.rollout.num_workers)]
    buffer = started.buffer = classes.new_buffer(cfg, where.host, start_version, where.cores.worker_slots, key)
    started.trainers = list(carried.spares)   # to be stopped if their adoption fails half-way
    trainers = started.trainers = adopt_spares(cfg, carried.spares, buffer) or new_trainers(buffer)
    ahead = import_ahead(TRAINING)   # while the actors start
    setups = _setup_trainers(trainers, where, wait)
    address = wait([buffer.address.remote()], "the replay buffer to bind its socket", "replay buffer")[0]
    say(f"buffer: listening on {address}")
    version = _start_trainers(cfg, trainers, setups, wait)
    replaced = renewed(workers, renewing, new_rollout)
    fresh = [w for w in workers if w.index not in kept or w.index in replaced]
    wait([w.handle.ready.remote() for w in fresh], f"{len(fresh)} rollout worker(s) to start vLLM", "rollout worker")
    say(f"rollout: {len(workers)} vLLM worker(s) ready ({cfg.rollout.dtype})"
        + (f", {len(workers) - len(fresh)} carried from the run's last life" if len(fresh) < len(workers) else ""))
    if not where.gpus and not where.multi_node and (slow := slow_bf16_line(cfg.rollout.dtype, this_cpuinfo())):
        say(f"rollout: {slow}: --rollout.dtype float32 (or auto) is the fast choice here")
    paths = wait([trainers[0].set_workers.remote([w.handle for w in workers])],
                 "the trainer to register the workers", "trainer")[0]
    say("weights: " + ", ".join(f"worker {i} via {p}" for i, p in enumerate(paths)))
    wait([t.publish_current.remote() for t in trainers], "the first weights to be published", "trainer")
    for w in workers:
        w.start(version, cfg.groups_per_step)
    if not where.gpus:   # built beside the run, once start-up is done (CPU runs: a GPU would need its own)
        if cfg.rollout.standby:
            for w in workers:
                if w.standby is None:
                    w.standby = classes.new_standby(cfg, w.index, model_dir, identity.buffer_name, key)
        if cfg.run.spare_trainers and cfg.run.max_restarts:
            n = cfg.trainer.num_ranks
            started.spares = [classes.new_spare(cfg, model_dir, r, n, buffer, where.cores.ranks[r], key)
                              for r in range(n)]
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
    port = rendezvous_port()
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


