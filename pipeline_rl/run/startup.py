"""Starting and stopping a run's actors, with typed handles. Workers (vLLM), buffer and
trainers (DeepSpeed) start at once (the workers find the buffer by name), the workers first:
theirs is the longest start, and Ray hands its pre-started processes to the first actors
asking. The trainers are asked
to start DeepSpeed as soon as they exist (on one node; across nodes once they name their
node), not after the buffer is up. Every wait says what it waits
for; a failure or ``_TIMEOUT_S`` ends the run in one line.

A life of the run that restarts (``run/restarts.py``) may hand its rollout workers to the
next: those are renewed (``RolloutActor.renew``: a second or less) instead of started (a
vLLM start: 11 s of a core on CPU, minutes on a GPU); one that cannot be is replaced by its
standby or a new actor, and one console line says which and why. Every life shares the
:class:`RunIdentity`, so a carried worker, and a process Ray restarts with its first
constructor arguments, find the current life's buffer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline_rl.actors.handles import BufferHandle, RolloutHandle, TrainerHandle
from pipeline_rl.calls import first_line
from pipeline_rl.config import Config
from pipeline_rl.net import rendezvous_port
from pipeline_rl.run.ahead import TRAINING, import_ahead
from pipeline_rl.run.cluster import Placement, say
from pipeline_rl.run.run_folder import RunFolder, open_run_folder
from pipeline_rl.run_key import RunKey
from pipeline_rl.run.supervisor import OrchestratorError, WorkerSlot, cause_of, describe_failure

log = logging.getLogger("pipeline_rl.run.startup")

_TIMEOUT_S = 900.0      # a start-up phase that takes longer ends the run
_SAY_EVERY_S = 30.0
_SHUTDOWN_WAIT_S = 5.0  # per shutdown phase: a failed run must still end within seconds
_RENEW_TIMEOUT_S = 30.0  # a carried worker not renewed by then is replaced by a new actor


@dataclass(frozen=True, slots=True)
class RunIdentity:
    """What every life of one run shares: the replay buffer's Ray name (each life's buffer
    registers under it once the last one is killed) and the run key (``pipeline_rl.run_key``:
    made once per run, handed to each actor as a constructor argument; the driver holds it
    only here, for the run's lives)."""

    buffer_name: str
    key: RunKey = field(repr=False)

    @classmethod
    def new(cls) -> "RunIdentity":
        return cls(f"pipeline_rl_buffer_{os.getpid()}_{uuid.uuid4().hex[:8]}", RunKey.new())


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


@dataclass(slots=True)
class Carried:
    """What a life of the run hands to the next (``run/restarts.py``): its rollout workers,
    renewed there, and its trainer ranks' spares, adopted there (empty: none)."""

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

    renewing = _renew(cfg, carried.workers)   # first: each waits for the new buffer's name
    kept = {w.index: w for w in carried.workers}
    workers = started.workers = [kept.get(i) or WorkerSlot(i, new_rollout(i), core=where.cores.workers[i])
                                 for i in range(cfg.rollout.num_workers)]
    buffer = started.buffer = classes.new_buffer(cfg, where.host, start_version, where.cores.worker_slots, key)
    started.trainers = list(carried.spares)   # to be stopped if their adoption fails half-way
    trainers = started.trainers = _adopted(cfg, carried.spares, buffer) or new_trainers(buffer)
    ahead = import_ahead(TRAINING)   # while the actors start
    setups = _setup_trainers(trainers, where, wait)
    address = wait([buffer.address.remote()], "the replay buffer to bind its socket", "replay buffer")[0]
    say(f"buffer: listening on {address}")
    version = _start_trainers(cfg, trainers, setups, wait)
    replaced = _renewed(workers, renewing, new_rollout)
    fresh = [w for w in workers if w.index not in kept or w.index in replaced]
    wait([w.handle.ready.remote() for w in fresh], f"{len(fresh)} rollout worker(s) to start vLLM", "rollout worker")
    say(f"rollout: {len(workers)} vLLM worker(s) ready ({cfg.rollout.dtype})"
        + (f", {len(workers) - len(fresh)} carried from the run's last life" if len(fresh) < len(workers) else ""))
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


def _adopted(cfg: Config, spares: Sequence[TrainerHandle], buffer: BufferHandle) -> list[TrainerHandle]:
    """The last life's spare ranks, adopted for this life (``TrainerActor.adopt``); none when
    there are none or one fails to answer within ``_RENEW_TIMEOUT_S`` (every spare is then
    killed: the ranks start as new actors, which one console line says with why)."""
    import ray

    if not spares:
        return []
    refs = [t.adopt.remote(cfg, buffer) for t in spares]
    ray.wait(refs, num_returns=len(refs), timeout=_RENEW_TIMEOUT_S)
    failures = [f for f in map(_failure, refs) if f is not None]
    if len(spares) == cfg.trainer.num_ranks and not failures:
        return list(spares)
    say(f"trainer: spare ranks not adopted ({len(spares)} of {cfg.trainer.num_ranks} ranks: "
        f"{cause_of(failures[0]) if failures else 'a spare per rank is needed'}): new ranks start in their place")
    for t in spares:
        _kill(t)
    return []


def _renew(cfg: Config, carried: Sequence[WorkerSlot]) -> dict[int, Any]:
    """Ask every carried worker, and its standby, to renew itself for this life (not waited
    for; a standby is up again once its renewal answers, ``WorkerSlot.renew_standby``): its
    slot starts again from no restarts (the group ids and prompts of the life, as a new
    actor's). The workers' ``renew`` calls by index."""
    refs = {}
    for w in carried:
        w.restarts, w.run_ref = 0, None
        standby = w.standby
        if standby is not None:
            w.renew_standby(lambda: standby.renew.remote(cfg))
        refs[w.index] = w.handle.renew.remote(cfg)
    return refs


def _renewed(slots: Sequence[WorkerSlot], refs: dict[int, Any], new_rollout: Callable[[int], RolloutHandle]) -> set[int]:
    """Wait up to ``_RENEW_TIMEOUT_S`` for the workers' renewals. A worker that failed to
    renew (its process died, or an engine that cannot be carried) gives its place to its
    standby when that is renewed (the worker, if its process died, becomes the standby Ray
    restarts), else to a new actor; one console line names each such worker, why and what
    took its place. The indices given a new actor."""
    import ray

    from pipeline_rl.run.remote_calls import RayCalls

    if refs:
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=_RENEW_TIMEOUT_S)
    replaced, told = set(), []
    for w in slots:
        failure = _failure(refs[w.index]) if w.index in refs else None
        if failure is None:
            continue
        why = f"worker {w.index} not renewed ({cause_of(failure)})"
        died = isinstance(failure, ray.exceptions.RayActorError)
        if w.wait_standby(RayCalls(), _RENEW_TIMEOUT_S) and _took_over(w):
            if not died:   # alive but unusable: no standby for this life
                _kill(w.standby)
                w.standby = None
            told.append(f"{why}: its standby takes its place")
            continue
        _kill(w.handle)
        w.handle = new_rollout(w.index)
        replaced.add(w.index)
        told.append(f"{why}: a new actor starts in its place")
    if told:
        say("rollout: " + "; ".join(told))
    return replaced


def _took_over(w: WorkerSlot) -> bool:
    """Swap ``w``'s renewed standby in, on the slot's core; False (swapped back) when it fails."""
    import ray

    w.swap()
    try:
        ray.get(w.handle.take_over.remote(w.core), timeout=_RENEW_TIMEOUT_S)
        return True
    except Exception as e:  # noqa: BLE001 -- any failure: a new actor takes the place
        log.info("rollout worker %d: its standby could not take over: %s", w.index, first_line(e))
        w.swap()
        w.standby_up = False
        return False


def _failure(ref: Any) -> BaseException | None:
    """What a ``renew`` or ``adopt`` call failed with (None: it returned)."""
    import ray

    try:
        ray.get(ref, timeout=0)
        return None
    except Exception as e:  # noqa: BLE001 -- any failure: something else takes its place
        return e


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


def stop_actors(buffer: BufferHandle | None, trainers: Sequence[TrainerHandle], workers: Sequence[WorkerSlot],
                graceful: bool = True) -> None:
    """Stop every actor, each phase bounded by ``_SHUTDOWN_WAIT_S``: workers stop generating,
    trainers close their publishers, the buffer closes; then all are killed. Not ``graceful``
    (a life of the run that is about to restart), all are killed at once: a worker blocked
    sending to a dead buffer, or to a full one that a dead trainer no longer drains, would
    hold its phase for the whole bound."""
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
    handles: list[Any] = [w.handle for w in workers] + [w.standby for w in workers] + list(trainers) + [buffer]
    for handle in handles:
        _kill(handle)


def _kill(handle: Any) -> None:
    """Kill an actor (None: nothing), never raising."""
    import ray

    if handle is not None:
        _quiet(lambda: ray.kill(handle))


def _quiet(fn: Callable[[], object]) -> None:
    """Best-effort shutdown step: log, never raise."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - shutdown must go on
        log.debug("shutdown step failed: %s", e)
