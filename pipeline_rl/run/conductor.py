"""Placement, the step loop and supervision of one run (used by :mod:`pipeline_rl.driver`).

Who runs where (one CPU each on CPU machines; the buffer takes no CPU of its own):

- ``BufferActor`` on the driver's node: ZeroMQ PULL bound to loopback on a
  one-node cluster, to the node's IP on a multi-node one;
- ``TrainerActor`` × ``trainer.num_ranks``: DeepSpeed data-parallel ranks,
  rendezvous at rank 0's node IP;
- ``RolloutActor`` × ``rollout.num_workers``: vLLM engines, restarted by Ray
  when they die (``max_restarts=-1``).

On one machine with a core for every worker and rank (CPU runs), each is pinned to
a core of its own (``--ray.pin_cores``, :func:`pipeline_rl.resources.plan_cores`).

Invariants the loop keeps: the trainer version only grows, one per step; every
step's metrics are logged before the next step's are; a stop request (signal)
is honoured between steps and within ``_POLL_S`` while waiting for one.

Failures end the run with one line naming the actor and the cause
(:class:`OrchestratorError`), checked every ``_POLL_S`` while a step is awaited:
an exception inside any actor method (a worker's weight update or engine step,
a trainer step, the buffer), a dead buffer or trainer process, a worker process
that died more than ``rollout.max_restarts`` times, and a run that stopped
progressing (the :class:`~pipeline_rl.run.supervisor.Watchdog`: the message says
who waits for what). Every such message names the newest checkpoint to resume
from, or says that there is none; checkpoints are taken every
``trainer.checkpoint_every`` steps, every ``trainer.checkpoint_every_s`` seconds
and at the end.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from pipeline_rl.actors.handles import BufferHandle, RolloutHandle, TrainerHandle
from pipeline_rl.actors.placement import ActorClasses
from pipeline_rl.config import Config
from pipeline_rl.evaluation import Evaluations
from pipeline_rl.metrics import (
    MetricsLogger,
    StepMetrics,
    WeightSyncLatency,
    read_evals,
    read_history,
    summary_table,
)
from pipeline_rl.net import free_port
from pipeline_rl.resources import CorePlan, plan_cores
from pipeline_rl.run.supervisor import Watchdog, cause_of, describe_failure, first_line

if TYPE_CHECKING:
    from ray import ObjectRef

    from pipeline_rl.reports import RankStepReport
    from pipeline_rl.rollout.worker import WorkerStats
    from pipeline_rl.buffer.types import BufferStats

log = logging.getLogger("pipeline_rl.run.conductor")

_POLL_S = 0.5
_STOP_GRACE_S = 3.0
_SHUTDOWN_WAIT_S = 5.0      # per shutdown phase: a failed run must still end within seconds
_STARTUP_TIMEOUT_S = 900.0  # a start-up phase that takes longer ends the run
_STARTUP_SAY_EVERY_S = 30.0
_HISTORY_STEPS = 1000      # steps of metrics the driver keeps in memory
_STATS_EVERY_S = 0.25      # worker and buffer statistics for the step lines: one poll at most this often
_RESTART_TIMEOUT_S = 300.0  # a restarted rollout worker must have its engine up by then
_EVAL_FINAL_TIMEOUT_S = 300.0  # the end-of-run evaluation must finish by then


def say(line: str) -> None:
    """One progress line on the console (start-up phases), as the step lines are."""
    print(line, file=sys.stderr, flush=True)


class OrchestratorError(RuntimeError):
    """The run cannot go on (a trainer died, no batch came in time, start-up failed)."""


@dataclass(slots=True)
class _WorkerState:
    """What the driver tracks per rollout worker between stats polls."""

    handle: RolloutHandle
    run_ref: "ObjectRef[WorkerStats] | None" = None
    tokens: int = 0
    idle_s: float = 0.0
    stalls_seen: int = 0
    restarts: int = 0


@dataclass(slots=True)
class _WorkerDelta:
    """Sums over the workers that answered a stats poll."""

    tokens: int = 0
    idle_s: float = 0.0
    stalls_ms: list[float] = field(default_factory=list)
    answered: int = 0


@dataclass(frozen=True, slots=True)
class _Rates:
    """The workers' generation over the last completed stats window: tokens per second,
    the share of time their engines idled, the mean weight-update stall (ms), the mean
    weight sync (ms, :class:`WeightSyncLatency`) of the versions resolved in it."""

    tokens_per_s: float = 0.0
    idle_frac: float = 0.0
    stall_ms: float = 0.0
    sync_ms: float = 0.0


class _StatsPoll:
    """Worker and buffer statistics for the step lines, polled at most every
    ``_STATS_EVERY_S`` and never waited for: a poll's answers are taken at a later step
    once all are in (a worker that has not answered within 2 s is left out of that
    window). Every step is labelled with the rates of the last completed window and the
    last buffer snapshot. A poll is a call into every worker and the buffer, whose cores
    generate and serve: once a step (tens of ms) cost them more than the numbers are worth."""

    def __init__(self, workers: list[_WorkerState], buffer: BufferHandle, start: float) -> None:
        self._workers, self._buffer = workers, buffer
        self._refs: list[Any] = []     # the poll in flight: worker stats..., buffer stats
        self._sent = start             # when the poll in flight was sent
        self._window_start = start     # when the last completed poll was sent
        self.rates = _Rates()
        self.buffer: BufferStats | None = None
        self.sync = WeightSyncLatency(len(workers))

    def update(self) -> None:
        """Take the poll in flight if it is complete; send the next when it is due. The
        first call waits for the buffer's snapshot (every step line needs one)."""
        import ray

        now = time.perf_counter()
        if self._refs:
            ready, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
            if len(ready) < len(self._refs) and now - self._sent < 2.0:
                return
            self._take(set(ready))
        if now - self._window_start >= _STATS_EVERY_S or self.buffer is None:
            self._refs = [w.handle.stats.remote() for w in self._workers] + [self._buffer.stats.remote()]
            self._sent = now
            if self.buffer is None:
                self.buffer = ray.get(self._refs[-1])

    def _take(self, ready: set[Any]) -> None:
        import ray

        *worker_refs, buffer_ref = self._refs
        self._refs = []
        if buffer_ref in ready:
            self.buffer = ray.get(buffer_ref)
        delta = _WorkerDelta()
        for i, (w, ref) in enumerate(zip(self._workers, worker_refs)):
            if ref not in ready:
                continue
            try:
                st = ray.get(ref)
            except ray.exceptions.RayError:
                continue
            delta.tokens += max(0, st.tokens_generated - w.tokens)
            delta.idle_s += max(0.0, st.idle_s - w.idle_s)
            new = st.updates_applied - w.stalls_seen  # stall_ms holds the most recent ones only
            delta.stalls_ms += list(st.stall_ms[-new:]) if new > 0 else []
            delta.answered += 1
            w.tokens, w.idle_s, w.stalls_seen = st.tokens_generated, st.idle_s, st.updates_applied
            for applied in st.applied:
                self.sync.applied(i, applied.version, applied.at)
        synced = self.sync.resolve()
        window = self._sent - self._window_start
        self._window_start = self._sent
        if window <= 0 or not delta.answered:
            return
        self.rates = _Rates(
            tokens_per_s=delta.tokens / window,
            idle_frac=min(1.0, delta.idle_s / (window * delta.answered)),
            stall_ms=statistics.fmean(delta.stalls_ms) if delta.stalls_ms else self.rates.stall_ms,
            sync_ms=statistics.fmean(synced) if synced else self.rates.sync_ms)


@dataclass(slots=True)
class _Clock:
    start: float = field(default_factory=time.perf_counter)
    last_step_end: float = field(default_factory=time.perf_counter)

    def since_start(self) -> float:
        return time.perf_counter() - self.start


class Orchestrator:
    """Starts Ray and every actor on enter, runs steps in :meth:`train`, stops all on exit."""

    def __init__(self, cfg: Config, model_dir: str, stop: threading.Event) -> None:
        # Actors may run in another working directory: they get the run folder absolute.
        self.cfg = cfg.model_copy(update={"out_dir": str(Path(cfg.out_dir).resolve())})
        self.model_dir = model_dir
        self.stop = stop
        self.out = Path(cfg.out_dir)
        self._started_ray = False
        self._abandoned_step = False  # a stop left a train step unfinished: no final checkpoint
        self._ray_session_dir: str | None = None
        self._gpu_memory: float | None = None   # each actor's share of a shared GPU (GpuPlan.memory)
        self._buffer_or_none: BufferHandle | None = None
        self._trainers: list[TrainerHandle] = []
        self._workers: list[_WorkerState] = []
        self._logger: MetricsLogger | None = None
        self._buffer_watch: "ObjectRef[str | None] | None" = None
        self._watchdog = Watchdog(cfg.watchdog_s)
        self._last_checkpoint_t = time.monotonic()
        self.version = 0
        #: The most recent steps (bounded: a long run must not grow the driver; the whole
        #: record is ``OUT_DIR/metrics.jsonl``).
        self.history: deque[StepMetrics] = deque(maxlen=_HISTORY_STEPS)
        self.steps_done = 0

    @property
    def _buffer(self) -> BufferHandle:
        assert self._buffer_or_none is not None, "the buffer actor was not started"
        return self._buffer_or_none

    # ------------------------------------------------------------------ start / stop

    def __enter__(self) -> "Orchestrator":
        try:
            self._start()
        except BaseException:
            self._shutdown()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._shutdown()

    def _start(self) -> None:
        import ray

        from pipeline_rl.actors.placement import gpu_plan, remote_classes

        cfg = self.cfg
        self._init_ray()
        buffer_name = f"pipeline_rl_buffer_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        try:
            gpus = gpu_plan(cfg)
        except ValueError as e:
            raise OrchestratorError(str(e)) from None
        on_gpus = gpus is not None
        if gpus is not None:
            say(gpus.describe())
        self._gpu_memory = gpus.memory if gpus is not None else None
        classes = remote_classes(cfg, ray.get_runtime_context().get_node_id(), buffer_name, gpus=gpus)
        alive_nodes = len([n for n in ray.nodes() if n.get("Alive")])
        multi_node = alive_nodes > 1
        host = ray.util.get_node_ip_address() if multi_node else "127.0.0.1"
        # The workers (vLLM), the buffer and the trainers (DeepSpeed) start at once: the workers
        # find the buffer by its name and ask for its address themselves, so no phase waits
        # for another to begin. The workers come first: their start is the longest (vLLM's
        # imports), and Ray hands its pre-started processes to the first actors asking.
        cores = self._plan_cores(alive_nodes=alive_nodes, on_gpus=on_gpus)
        self._workers = [_WorkerState(classes.new_rollout(cfg, i, self.model_dir, buffer_name, cores.workers[i],
                                                          self._gpu_memory))
                         for i in range(cfg.rollout.num_workers)]
        self._buffer_or_none = classes.new_buffer(cfg, host, self._resume_version())
        self._trainers = self._create_trainers(classes, cores)
        address = self._wait([self._buffer.address.remote()], "the replay buffer to bind its socket",
                             "replay buffer")[0]
        say(f"buffer: listening on {address}")
        self._buffer_watch = self._buffer.watch.remote()
        self._start_trainers(multi_node)
        self._wait([w.handle.ready.remote() for w in self._workers],
                   f"{len(self._workers)} rollout worker(s) to start vLLM", "rollout worker")
        say(f"rollout: {len(self._workers)} vLLM worker(s) ready ({cfg.rollout.dtype})")
        self._wait([self._trainers[0].set_workers.remote([w.handle for w in self._workers])],
                   "the trainer to register the workers", "trainer")
        self._wait([t.publish_current.remote() for t in self._trainers],
                   "the first weights to be published", "trainer")
        for w in self._workers:
            w.run_ref = w.handle.run.remote(self._start_counter(w))
        self.out.mkdir(parents=True, exist_ok=True)
        self._logger = MetricsLogger(self.out)
        self._last_checkpoint_t = time.monotonic()
        logs = "" if cfg.log_level == "debug" else f"; actor logs in {self.out / 'logs'}"
        say(f"training: {cfg.max_steps} steps at staleness {cfg.staleness}{logs}")

    def _actor_env(self) -> dict[str, str]:
        """The environment variables every actor process starts with."""
        from pipeline_rl.actors.process import ACTOR_ENV

        env = dict(ACTOR_ENV)
        return env

    def _init_ray(self) -> None:
        """Join the cluster Ray the config names (or the one an embedding program
        started), or start a local one sized for the run; then check that the cluster
        can place every actor (one line naming what is missing otherwise)."""
        import ray

        cfg = self.cfg
        if ray.is_initialized():  # an embedding program (a test, a notebook) owns Ray
            pass
        elif cfg.ray.address:
            ray.init(address=cfg.ray.address, runtime_env={"env_vars": self._actor_env()}, log_to_driver=True,
                     logging_level=self._ray_logging_level())
            say(f"Ray: joined the cluster at {cfg.ray.address}")
        else:
            # A private local Ray: no token file in the home folder, unless the user chose an
            # auth mode.
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            cpus = self._local_cpus()
            from pipeline_rl.run.local_ray import start_local

            # The actors' output goes to their log files, or to this console with --log-level debug.
            ctx = start_local(num_cpus=cpus, object_store_mb=cfg.ray.object_store_mb,
                              env=self._actor_env(), logging_level=self._ray_logging_level(),
                              log_to_driver=cfg.log_level == "debug", dashboard=cfg.ray.dashboard)
            self._started_ray = True
            say(f"Ray: started locally with {cpus} CPUs")
            self._ray_session_dir = getattr(ctx, "address_info", {}).get("session_dir")
        from pipeline_rl.resources import check_cluster

        problem = check_cluster(cfg, ray.cluster_resources())
        if problem:
            raise OrchestratorError(problem)

    def _ray_logging_level(self) -> int:
        return logging.INFO if self.cfg.log_level == "debug" else logging.WARNING

    def _local_cpus(self) -> int:
        """CPUs of a local Ray: ``--ray.num_cpus``, else this machine's cores, raised to
        what the actors need (oversubscribing, said in one line) so nothing waits for
        CPUs that will never come."""
        from pipeline_rl.resources import cpus_needed

        need = cpus_needed(self.cfg)
        if self.cfg.ray.num_cpus is not None:
            return self.cfg.ray.num_cpus
        have = os.cpu_count() or 1
        if need > have:
            log.warning("oversubscribing: %d actors of one CPU each on %d cores (steps will be slower)",
                        need, have)
        return max(need, have)

    def _wait(self, refs: "list[ObjectRef[Any]]", what: str, role: str) -> list[Any]:
        """``ray.get(refs)`` during start-up, saying every ``_STARTUP_SAY_EVERY_S`` what it
        waits for; a failure or ``_STARTUP_TIMEOUT_S`` ends the run with one line."""
        import ray

        t0 = time.monotonic()
        pending = list(refs)
        while pending:
            if self.stop.is_set():
                raise KeyboardInterrupt
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=_STARTUP_SAY_EVERY_S)
            waited = time.monotonic() - t0
            if pending and waited >= _STARTUP_TIMEOUT_S:
                raise OrchestratorError(f"start-up: gave up waiting for {what} after {waited:.0f} s")
            if pending:
                log.warning("start-up: still waiting for %s (%.0f s so far)", what, waited)
        try:
            return list(ray.get(refs))
        except ray.exceptions.RayError as e:
            raise OrchestratorError(f"start-up: {describe_failure(e, role)}") from None

    def _resume_version(self) -> int:
        """The version a ``--resume`` checkpoint holds (0 for a fresh run); a bad
        checkpoint fails here, before any actor starts."""
        if not self.cfg.resume:
            return 0
        from pipeline_rl.training.checkpoint import CheckpointError, read_run_state

        try:
            return read_run_state(self.cfg.resume).version
        except CheckpointError as e:
            raise OrchestratorError(f"--resume: {e}") from None

    def _create_trainers(self, classes: ActorClasses, cores: CorePlan) -> list[TrainerHandle]:
        n = self.cfg.trainer.num_ranks
        return [classes.new_trainer(self.cfg, self.model_dir, r, n, self._buffer, cores.ranks[r], self._gpu_memory)
                for r in range(n)]

    def _plan_cores(self, *, alive_nodes: int, on_gpus: bool) -> CorePlan:
        """A core of its own for each worker and rank on one machine (``plan_cores``)."""
        plan = plan_cores(self.cfg, alive_nodes=alive_nodes, on_gpus=on_gpus)
        if plan.pinned:
            log.info("pinning each of %d rollout worker(s) and %d trainer rank(s) to a core of its own",
                     len(plan.workers), len(plan.ranks))
        return plan

    def _start_trainers(self, multi_node: bool) -> None:
        n = self.cfg.trainer.num_ranks
        master = (self._wait([self._trainers[0].node_ip.remote()], "the trainer to start", "trainer")[0]
                  if multi_node else "127.0.0.1")
        port = free_port()
        versions = self._wait([t.setup.remote(master, port) for t in self._trainers],
                              f"{n} trainer rank(s) to start DeepSpeed", "trainer")
        self.version = int(versions[0])
        say(f"trainer: {n} rank(s) ready (DeepSpeed ZeRO-{self.cfg.trainer.zero_stage})")
        if self.cfg.resume:
            versions = self._wait([t.load_checkpoint.remote(self.cfg.resume) for t in self._trainers],
                                  "the trainers to load the checkpoint", "trainer")
            self.version = int(versions[0])
            log.info("resumed from %s at version %d", self.cfg.resume, self.version)

    def _shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for w in self._workers:
            _quiet(lambda: w.handle.stop.remote())
        runs = [w.run_ref for w in self._workers if w.run_ref is not None]
        if runs:
            _quiet(lambda: ray.wait(runs, num_returns=len(runs), timeout=_SHUTDOWN_WAIT_S))
        closing = [t.close.remote() for t in self._trainers]
        if closing:
            _quiet(lambda: ray.wait(closing, num_returns=len(closing), timeout=_SHUTDOWN_WAIT_S))
        if self._buffer_or_none is not None:
            _quiet(lambda: ray.get(self._buffer.close.remote(), timeout=_SHUTDOWN_WAIT_S))
        handles: list[Any] = [w.handle for w in self._workers] + self._trainers + [self._buffer_or_none]
        for handle in handles:
            if handle is not None:
                _quiet(lambda: ray.kill(handle))
        if self._logger is not None:
            self._logger.close()
        if self._started_ray:
            ray.shutdown()
            if self._ray_session_dir:  # Ray leaves its plasma store's socket file behind
                shutil.rmtree(Path(self._ray_session_dir) / "sockets", ignore_errors=True)

    # ------------------------------------------------------------------ the loop

    def train(self) -> list[StepMetrics]:
        """Run steps until ``max_steps`` (or a stop request); checkpoint; print a summary."""
        clock = _Clock()
        stats = _StatsPoll(self._workers, self._buffer, clock.start)
        first_step = self.version
        evals = Evaluations(self.cfg.eval, clock.since_start)
        if evals.enabled and self.version < self.cfg.max_steps:
            evals.launch(self.version, self.version, self._live_workers())   # the starting point
        self._watchdog.touch()  # start-up has its own bounds (``_wait``): not a stall
        refs = self._submit_step() if self._more_steps() else None
        while refs is not None:
            reports = self._await_step(refs)
            if reports is None:
                break
            # The next step goes out before this one is logged: the driver's bookkeeping
            # (worker and buffer stats, the metrics sinks) overlaps the trainer's work instead
            # of leaving it idle. Not when a checkpoint or an evaluation must see these weights.
            save = self._checkpoint_due() and self.version < self.cfg.max_steps
            between = save or evals.due(self.version)
            refs = self._submit_step() if self._more_steps() and not between else None
            self._log_step(reports, clock, stats)
            self._evaluate(evals, final=False)
            if save:
                self.checkpoint()
            if between and self._more_steps():
                refs = self._submit_step()
        if self._abandoned_step:
            log.warning("stopped during a training step: no final checkpoint (the step's weights "
                        "would not match its version); the last periodic checkpoint is resumable")
        elif self.steps_done:
            self.checkpoint()
            if not self.stop.is_set():
                self._evaluate(evals, final=True)
            assert self._logger is not None
            self._logger.close()  # flushed: the summary reads the whole record back
            history = read_history(self.out / "metrics.jsonl")[-self.steps_done:]
            ran = [e for e in read_evals(self.out / "eval.jsonl") if e.step >= first_step]
            print(summary_table(history, ran, stats.sync.all_ms), flush=True)
        return list(self.history)

    def _live_workers(self) -> list[RolloutHandle]:
        return [w.handle for w in self._workers]

    def _evaluate(self, evals: Evaluations, *, final: bool) -> None:
        """Collect a finished evaluation and launch a due one; ``final``: wait for the one
        in flight, then evaluate the final weights (unless that one already did) and wait."""
        if not evals.enabled:
            return
        assert self._logger is not None
        done = evals.poll(_EVAL_FINAL_TIMEOUT_S if final else 0.0)
        if done is not None:
            self._logger.log_eval(done)
        if final and evals.in_flight_step is not None:
            raise OrchestratorError(f"the evaluation after step {evals.in_flight_step} did not finish "
                                    f"within {_EVAL_FINAL_TIMEOUT_S:.0f} s")
        if final:
            if done is None or done.version != self.version:
                evals.launch(self.version, self.version, self._live_workers())
                last = evals.poll(_EVAL_FINAL_TIMEOUT_S)
                if last is not None:
                    self._logger.log_eval(last)
                elif evals.in_flight_step is not None:
                    raise OrchestratorError(f"the final evaluation did not finish within "
                                            f"{_EVAL_FINAL_TIMEOUT_S:.0f} s")
        elif evals.due(self.version):
            evals.launch(self.version, self.version, self._live_workers())

    def _checkpoint_due(self) -> bool:
        every, every_s = self.cfg.trainer.checkpoint_every, self.cfg.trainer.checkpoint_every_s
        return bool((every and self.version % every == 0)
                    or (every_s and time.monotonic() - self._last_checkpoint_t >= every_s))

    def _more_steps(self) -> bool:
        return self.version < self.cfg.max_steps and not self.stop.is_set()

    def _submit_step(self) -> "list[ObjectRef[RankStepReport | None]]":
        """Start one pipeline step on every trainer rank (:meth:`_await_step` collects it)."""
        return [t.train_step.remote(self.cfg.trainer.batch_timeout_s) for t in self._trainers]

    def _await_step(self, refs: "list[ObjectRef[RankStepReport | None]]") -> "list[RankStepReport] | None":
        """The step's reports; None when a stop request abandoned it. Supervises the buffer
        and the workers, and the progress watchdog, while it waits."""
        import ray

        pending = list(refs)
        while pending:
            if self.stop.is_set():
                # Let a step already under way finish (a checkpoint taken meanwhile would hold
                # its weights under the previous version's name); give up on one still waiting.
                _, pending = ray.wait(pending, num_returns=len(pending), timeout=_STOP_GRACE_S)
                if pending:
                    self._abandoned_step = True
                    return None
                break
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL_S)
            self._check_buffer()
            self._supervise_workers()
            if pending and self._watchdog.overdue():
                raise OrchestratorError(self._with_checkpoint(self._stalled()))
        try:
            reports = ray.get(refs)
        except ray.exceptions.RayError as e:
            raise self._failure(e) from None
        done = [r for r in reports if r is not None]
        if len(done) < len(reports):
            raise OrchestratorError(self._with_checkpoint(
                f"no batch within --trainer.batch_timeout_s={self.cfg.trainer.batch_timeout_s} "
                f"at version {self.version}"))
        versions = {r.result.version for r in done}
        if len(versions) != 1:   # ranks step together through their collectives
            raise OrchestratorError(f"trainer ranks disagree on the version after a step: {sorted(versions)}")
        self.version = versions.pop()   # the trainer owns the version; the driver follows it
        return done

    def _failure(self, e: BaseException) -> OrchestratorError:
        """The one-line error for a failed trainer call: a dead buffer is named as such
        (a trainer waiting on it fails too), else the innermost failing actor."""
        self._check_buffer(probe=True)
        return OrchestratorError(self._with_checkpoint(
            f"{describe_failure(e, 'trainer')} (at version {self.version})"))

    def _with_checkpoint(self, message: str) -> str:
        """``message`` plus where to resume from: the newest complete checkpoint, or none."""
        from pipeline_rl.training.checkpoint import latest_checkpoint

        latest = latest_checkpoint(self.out / "checkpoints")
        if latest is None:
            return f"{message}; no checkpoint was saved yet"
        return f"{message}; resume with --resume {latest}"

    def _check_buffer(self, *, probe: bool = False) -> None:
        """End the run if the buffer's health sentinel answered (its receiver thread
        crashed, or its process died); with ``probe``, also ask it directly."""
        import ray

        if self._buffer_watch is None:
            return
        ready, _ = ray.wait([self._buffer_watch], timeout=0)
        why: str | None = None
        if ready:
            try:
                why = ray.get(self._buffer_watch) or "it closed while the run was going on"
            except ray.exceptions.RayError as e:
                why = f"its process died ({first_line(e)})"
        elif probe:
            try:
                ray.get(self._buffer.ping.remote(), timeout=2.0)
            except ray.exceptions.GetTimeoutError:
                pass
            except ray.exceptions.RayError as e:
                why = f"its process died ({first_line(e)})"
        if why is not None and not self.stop.is_set():
            raise OrchestratorError(self._with_checkpoint(f"replay buffer failed: {why}"))

    def _stalled(self) -> str:
        """Who waits for what, in one line, when the watchdog fires."""
        import ray

        share = self.cfg.groups_per_step
        parts = [f"no step completed for {self._watchdog.waited_s():.0f} s (watchdog bound "
                 f"{self._watchdog.bound_s():.0f} s, --watchdog-s): the trainer waits for a batch of "
                 f"{share} groups at version {self.version}"]
        try:
            buf = ray.get(self._buffer.stats.remote(), timeout=2.0)
            adm = buf.admission
            parts.append(f"the buffer holds {buf.fill} groups (capacity {buf.capacity}, "
                         f"{sum(buf.evicted.values())} evicted); admission budget {adm.used}/{adm.limit} "
                         f"used at version {adm.version}")
        except ray.exceptions.RayError as e:
            parts.append(f"the buffer does not answer ({first_line(e)})")
        refs = [w.handle.stats.remote() for w in self._workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=2.0)
        for i, ref in enumerate(refs):
            if ref not in ready:
                parts.append(f"rollout worker {i} does not answer")
                continue
            st = ray.get(ref)
            parts.append(f"rollout worker {i} holds weights v{st.version}, {st.in_flight_groups} "
                         f"groups in flight, {st.groups_sent} sent, "
                         f"{'generating' if st.in_flight_groups else 'idle: no admission'}")
        return "; ".join(parts)

    def _supervise_workers(self) -> None:
        """Restart the generation loop of a worker whose process died (Ray restarts the
        process) up to ``rollout.max_restarts`` times; an exception raised inside a
        worker ends the run."""
        import ray

        runs = [w.run_ref for w in self._workers]
        done, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
        for idx, w in enumerate(self._workers):
            if w.run_ref not in done or self.stop.is_set():
                continue
            try:
                ray.get(w.run_ref)
                why = "its generation loop returned"
            except ray.exceptions.RayActorError as e:
                why = f"its process died ({first_line(e)})"
            except ray.exceptions.RayError as e:
                raise OrchestratorError(self._with_checkpoint(
                    f"rollout worker {idx} failed: {cause_of(e)} "
                    f"(at version {self.version})")) from None
            if w.restarts >= self.cfg.rollout.max_restarts:
                raise OrchestratorError(self._with_checkpoint(
                    f"rollout worker {idx} stopped {w.restarts + 1} times, more than "
                    f"--rollout.max_restarts={self.cfg.rollout.max_restarts} allows: {why}"))
            lost = ray.get(self._buffer.worker_lost.remote(idx))
            w.restarts += 1
            w.tokens, w.idle_s, w.stalls_seen = 0, 0.0, 0
            log.warning("rollout worker %d stopped (%s): restarting, %d in-flight groups lost",
                        idx, why, lost)
            if not self._await_restart(w, idx):
                return
            try:
                ray.get(self._trainers[0].offer_latest.remote([w.handle]))
            except ray.exceptions.RayError as e:
                raise self._failure(e) from None
            w.run_ref = w.handle.run.remote(self._start_counter(w))

    def _await_restart(self, w: _WorkerState, idx: int) -> bool:
        """Wait until Ray has restarted a worker's process and its engine is up (calls to
        an actor that is still restarting fail as "unavailable"); False on a stop request."""
        import ray

        deadline = time.monotonic() + _RESTART_TIMEOUT_S
        while not self.stop.is_set():
            try:
                ray.get(w.handle.ready.remote(), timeout=_POLL_S * 10)
                return True
            except ray.exceptions.GetTimeoutError:
                pass
            except ray.exceptions.ActorUnavailableError:
                time.sleep(_POLL_S)
            except ray.exceptions.RayError as e:
                raise OrchestratorError(self._with_checkpoint(
                    f"rollout worker {idx} could not be restarted: {cause_of(e)}")) from None
            if time.monotonic() > deadline:
                raise OrchestratorError(self._with_checkpoint(
                    f"rollout worker {idx} did not come back within {_RESTART_TIMEOUT_S:.0f} s "
                    f"of its restart"))
        return False

    def _start_counter(self, w: _WorkerState) -> int:
        """Where a worker's group counter starts: past the groups of a resumed run, and in a
        fresh range of 2**28 per restart (group ids stay unique; prompts do not repeat)."""
        return (w.restarts << 28) + self.version * self.cfg.groups_per_step

    # ------------------------------------------------------------------ metrics / checkpoints

    def _log_step(self, reports: "list[RankStepReport]", clock: _Clock, stats: _StatsPoll) -> None:
        now = time.perf_counter()
        step_wall = now - clock.last_step_end
        clock.last_step_end = now
        stats.sync.published(self.version, reports[0].step_end_at)   # rank 0 publishes
        stats.update()
        rates, buf = stats.rates, stats.buffer
        assert buf is not None
        res = [r.result for r in reports]
        lm = res[0].metrics
        m = StepMetrics(
            step=self.version, version=self.version, time_s=clock.since_start(),
            reward_mean=statistics.fmean(r.reward_mean for r in res),
            tokens_per_s=rates.tokens_per_s,
            lag_mean=statistics.fmean(r.lag.mean for r in res), lag_max=max(r.lag.max for r in res),
            evicted=sum(buf.evicted.values()), mismatch_kl=float(lm.mismatch_kl_k1),
            masked_frac=float(lm.masked_token_frac),
            mixed_version_frac=statistics.fmean(r.mixed_version_frac for r in res),
            trainer_idle_frac=min(1.0, max(r.wait_s for r in reports) / step_wall) if step_wall else 0.0,
            weight_update_stall_ms=rates.stall_ms, weight_sync_ms=rates.sync_ms,
            step_time_s=step_wall, loss=float(res[0].loss), buffer_fill=buf.fill,
            completion_len_mean=sum(r.num_tokens for r in res) / max(1, sum(r.num_seqs for r in res)),
            entropy=statistics.fmean(r.entropy for r in res),
            extra={"mismatch_kl_k3": float(lm.mismatch_kl_k3), "ess": float(lm.ess),
                   "masked_seq_frac": float(lm.masked_seq_frac), "clipped_frac": float(lm.clipped_frac),
                   "train_step_s": float(res[0].step_time_s), "groups_lost": float(buf.admission.lost),
                   "worker_restarts": float(sum(w.restarts for w in self._workers)),
                   "generator_idle_frac": rates.idle_frac,
                   # Wall clock, so a caller can measure from its own start (start-up included).
                   "unix_time_s": time.time()},
        )
        self.history.append(m)
        self.steps_done += 1
        self._watchdog.step_done(step_wall)
        assert self._logger is not None
        self._logger.log(m)

    def checkpoint(self) -> Path:
        """Save a resumable checkpoint of every rank under ``OUT_DIR/checkpoints``."""
        import ray

        from pipeline_rl.training.checkpoint import checkpoint_name

        path = self.out / "checkpoints" / checkpoint_name(self.version)
        try:
            ray.get([t.save_checkpoint.remote(str(path)) for t in self._trainers])
        except ray.exceptions.RayError as e:
            raise self._failure(e) from None
        self._last_checkpoint_t = time.monotonic()
        self._watchdog.touch()
        log.info("checkpoint saved: %s", path)
        return path


def _quiet(fn: Callable[[], object]) -> None:
    """Best-effort shutdown step: log, never raise."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - shutdown must go on
        log.debug("shutdown step failed: %s", e)
