"""One life of the run (:class:`Orchestrator`): its actors started (``start.py``), the step
loop, supervised (``supervise.py``), its actors stopped (``stop.py``) or, after a failure a
restart heals, handed on (``carry.py``). The run's lives in turn: ``run/life/__init__.py``.
Its duties outside the life's room: the Ray cluster (``run/cluster.py``), the step records
(``run/recorder.py``), checkpoints (``run/checkpoints.py``), held-out evaluation
(``run/evaluations.py``, the worker's half in ``pipeline_rl.rollout.eval_feed``).

Invariants the loop keeps: the trainer version only grows, one per step (the trainer
owns it, the driver follows); every step's metrics are logged before the next step's
are; a stop request (signal) is honoured between steps and within half a second while
waiting for one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from pipeline_rl.config import Config
from pipeline_rl.run.evaluations import Evaluations
from pipeline_rl.metrics import EvalMetrics, StepMetrics
from pipeline_rl.run.checkpoints import CheckpointPolicy
from pipeline_rl.run.cluster import Cluster, say
from pipeline_rl.run.recorder import StepRecorder
from pipeline_rl.run.life.carry import Carried, RunIdentity
from pipeline_rl.run.life.run_folder import RunFolder
from pipeline_rl.run.life.start import Actors, Started, start_actors
from pipeline_rl.run.life.stop import stop_actors
from pipeline_rl.run.life.supervise import OrchestratorError, Supervisor
from pipeline_rl.run.remote_calls import CallFailed, RayCalls, WorkerCall, WorkerLost

if TYPE_CHECKING:
    from pipeline_rl.actors.handles import BufferHandle, RolloutHandle, TrainerHandle

log = logging.getLogger("pipeline_rl.run.life.one_life")

_EVAL_FINAL_TIMEOUT_S = 300.0  # the end-of-run evaluation must finish by then


class Orchestrator:
    """Starts Ray (unless given one) and every actor on enter, runs steps in :meth:`train`,
    stops the actors (and the Ray it started) on exit."""

    def __init__(self, cfg: Config, model_dir: str, stop: threading.Event, folder: RunFolder,
                 restarts: int = 0, cluster: Cluster | None = None, *, identity: RunIdentity | None = None,
                 carried: Carried | None = None, carry: bool = False) -> None:
        """``folder``: the run folder (:func:`~pipeline_rl.run.life.start.open_run`), which
        also holds the version the run starts at; ``restarts``: the run's restarts before
        this start (``run/life/heal.py``), recorded on every step; ``cluster``: a Ray that
        outlives this orchestrator (its caller shuts it down); None: its own. A life of a
        run that restarts itself: ``identity``, the run's (None: a new one); ``carried``, what
        the last life handed on (``run/life/carry.py``); ``carry``: on a failure a restart heals,
        this life's spare trainer ranks, and its rollout workers unless the failure was
        theirs, are left running for the next life (:attr:`carried`) instead of killed."""
        self.restarts = restarts
        self._identity = identity or RunIdentity.new()
        self._from_last, self._carry = carried, carry
        #: What this life leaves running for the next (empty unless ``carry``).
        self.carried = Carried()
        self.folder = folder
        # Actors may run in another working directory: they get the run folder absolute.
        self.out = self.folder.path.resolve()   # trainers save checkpoints there
        self.cfg = cfg.model_copy(update={"out_dir": str(self.out)})
        self.model_dir = model_dir
        self.stop = stop
        self.version = 0
        self._calls = RayCalls()
        self._owns_cluster = cluster is None
        self._cluster = Cluster(self.cfg, model_dir) if cluster is None else cluster
        self._checkpoints = CheckpointPolicy(self.cfg, self.out)
        # the actors as start-up creates them, to stop them if it fails half-way
        self._started = Started()
        #: Seconds the actors took to stop (None: not yet).
        self.stopped_in_s: float | None = None
        self._actors: Actors | None = None
        self._supervisor: Supervisor | None = None
        self._recorder: StepRecorder | None = None
        self._evals = Evaluations(self.cfg.eval, lambda: self._parts()[0].since_start(), self._calls,
                                  self._read_answers)

    def __enter__(self) -> "Orchestrator":
        try:
            self._start()
        except BaseException:
            self._shutdown()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        # A failure the run's restart heals: what is left of this life is killed, not wound down,
        # but what may go on into the next life.
        err = ev if isinstance(ev, OrchestratorError) and ev.restartable else None
        keep = Carried()
        if err is not None and self._carry:
            keep = Carried(self._started.workers if err.workers_sound else [], self._started.spares)
        self._shutdown(graceful=err is None, keep=keep)

    def _start(self) -> None:
        began = time.monotonic()
        where = self._cluster.start()
        actors = start_actors(self.cfg, self.model_dir, where, self.stop, self._started,
                              self.folder.start_version, self._identity, self._from_last)
        self._actors, self.version = actors, actors.version
        # The starting evaluation goes out first: the workers hold their weights until it is
        # answered, and training does not wait for it.
        if self.version < self.cfg.max_steps:
            self._evals.begin_start(self.version, self._live_workers())
        self._recorder = StepRecorder(self.folder, self._calls, actors.workers, actors.buffer, self.restarts)
        self._supervisor = Supervisor(self.cfg, self._calls, actors.buffer, actors.trainers, actors.workers,
                                      self.stop, self._checkpoints, lambda: self.version,
                                      self._worker_lost)
        self._checkpoints.restart_clock()
        logs = "" if self.cfg.log_level == "debug" else f"; actor logs in {self.out / 'logs'}"
        say(f"training: {self.cfg.max_steps} steps at staleness {self.cfg.staleness} (actors started in "
            f"{time.monotonic() - began:.1f} s){logs}")

    def _read_answers(self, calls: Sequence[WorkerCall]) -> list[Any] | None:
        """The workers' answers, read by the supervisor (it handles a dead worker)."""
        return self._parts()[1].answers(calls)

    def _worker_lost(self, notice: WorkerLost) -> None:
        """The supervisor's notice of a lost worker, to whom it concerns."""
        if notice.restarted:
            self._parts()[0].worker_restarted(notice.index)
        self._evals.worker_lost(notice)

    def _shutdown(self, graceful: bool = True, keep: Carried | None = None) -> None:
        """Stop this life's actors but those kept for the next life (``keep``: all of a kind or none)."""
        began = time.monotonic()
        self.carried = keep = keep or Carried()
        s = self._started
        stop_actors(s.buffer, s.trainers + ([] if keep.spares else s.spares), [] if keep.workers else s.workers,
                    graceful=graceful)
        self.stopped_in_s = time.monotonic() - began
        if self._recorder is not None:
            self._recorder.close()
        if self._owns_cluster:
            self._cluster.shutdown()

    @property
    def actors(self) -> Actors:
        assert self._actors is not None, "the actors start when the run is entered (with ... as orch)"
        return self._actors

    @property
    def steps_done(self) -> int:
        return self._recorder.steps_done if self._recorder is not None else 0

    @property
    def history(self) -> list[StepMetrics]:
        """The most recent steps (bounded; the whole record is ``OUT_DIR/metrics.jsonl``)."""
        return list(self._recorder.history) if self._recorder is not None else []

    # ------------------------------------------------------------------ the loop

    def train(self) -> list[StepMetrics]:
        """Run steps until ``max_steps`` (or a stop request); checkpoint; print a summary."""
        rec, sup, evals = *self._parts(), self._evals
        sup.watchdog.touch()  # start-up has its own bounds: not a stall
        refs = self._submit_step() if self._more_steps() else None
        while refs is not None:
            reports = sup.await_step(refs)
            if reports is None:
                break
            self.version = reports[0].result.version   # the trainer owns the version
            # The next step goes out before this one is logged: the driver's bookkeeping
            # (worker and buffer stats, the metrics sinks) overlaps the trainer's work instead
            # of leaving it idle. A due evaluation is asked for first, then runs beside the
            # training steps; a checkpoint must see these weights.
            save = self._checkpoints.due(self.version) and self.version < self.cfg.max_steps
            evals.start_due(self.version, self._live_workers(), self._log_eval,
                            last=self.version >= self.cfg.max_steps)
            refs = self._submit_step() if self._more_steps() and not save else None
            sup.watchdog.step_done(rec.record(reports, self.version).step_time_s)
            evals.collect(self._log_eval)
            if save:
                self.checkpoint()
                refs = self._submit_step() if self._more_steps() else None
        self._end(evals)
        return self.history

    def _end(self, evals: Evaluations) -> None:
        """The final checkpoint, evaluation and summary (none after an abandoned step)."""
        rec, sup = self._parts()
        if sup.abandoned_step:
            log.warning("stopped during a training step: no final checkpoint (the step's weights "
                        "would not match its version); the last periodic checkpoint is resumable")
            return
        if not rec.steps_done:
            return
        path = self.checkpoint(wait=True)
        if self.cfg.lora is not None and self.cfg.lora.merge_at_end:   # the adapter folded into the base
            from pipeline_rl.training.lora import write_merged

            log.info("merged model: %s", write_merged(path, self._checkpoints.folder.parent / "merged"))
        if not self.stop.is_set():
            try:
                evals.finish(self.version, self._live_workers(), self._log_eval, _EVAL_FINAL_TIMEOUT_S)
            except TimeoutError as e:
                raise OrchestratorError(str(e)) from None
        print(rec.summary(), flush=True)

    def _log_eval(self, metrics: EvalMetrics) -> None:
        """An evaluation's record, and its score for the best checkpoint (``--trainer.keep_checkpoints``)."""
        self._parts()[0].log_eval(metrics)
        self._checkpoints.evaluated(metrics.step, metrics.greedy_accuracy)

    def _parts(self) -> tuple[StepRecorder, Supervisor]:
        assert self._recorder is not None and self._supervisor is not None, "use it as: with ... as orch"
        return self._recorder, self._supervisor

    def _live_workers(self) -> list[RolloutHandle]:
        return [w.handle for w in self.actors.workers]

    def _more_steps(self) -> bool:
        return self.version < self.cfg.max_steps and not self.stop.is_set()

    def _submit_step(self) -> list[Any]:
        """Start one pipeline step on every trainer rank (the supervisor awaits it)."""
        return [t.train_step.remote(self.cfg.trainer.batch_timeout_s) for t in self.actors.trainers]

    def checkpoint(self, wait: bool = False) -> Path:
        """Save a resumable checkpoint of every rank under ``OUT_DIR/checkpoints``, written in
        the background; ``wait``: return once it is complete on disk."""
        rec, sup = self._parts()
        try:
            path = self._checkpoints.save(self.actors.trainers, self.version, self._calls)
            if wait:
                self._checkpoints.written(self.actors.trainers, self._calls)
        except CallFailed as e:
            raise sup.trainer_failure(e) from None
        sup.watchdog.touch()
        return path
