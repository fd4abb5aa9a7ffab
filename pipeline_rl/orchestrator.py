"""Placement, the step loop and supervision of one run (used by :mod:`pipeline_rl.driver`).

Who runs where (one CPU each on CPU machines; the buffer takes no CPU of its own):

- ``BufferActor`` on the driver's node: ZeroMQ PULL bound to loopback on a
  one-node cluster, to the node's IP on a multi-node one;
- ``TrainerActor`` × ``trainer.num_ranks``: DeepSpeed data-parallel ranks,
  rendezvous at rank 0's node IP;
- ``RolloutActor`` × ``rollout.num_workers``: vLLM engines, restarted by Ray
  when they die (``max_restarts=-1``).

Invariants the loop keeps: the trainer version only grows, one per step; every
step's metrics are logged before the next step's are; a stop request (signal)
is honoured between steps and within ``_POLL_S`` while waiting for one.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from pipeline_rl.config import Config
from pipeline_rl.metrics import MetricsLogger, StepMetrics, summary_table

log = logging.getLogger("pipeline_rl.orchestrator")

_POLL_S = 0.5
_STOP_GRACE_S = 3.0


class OrchestratorError(RuntimeError):
    """The run cannot go on (a trainer died, no batch came in time, start-up failed)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class _WorkerState:
    """What the driver tracks per rollout worker between stats polls."""

    handle: Any
    run_ref: Any = None
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


@dataclass(slots=True)
class _Clock:
    start: float = field(default_factory=time.perf_counter)
    last_step_end: float = field(default_factory=time.perf_counter)

    def since_start(self) -> float:
        return time.perf_counter() - self.start


class Orchestrator:
    """Starts Ray and every actor on enter, runs steps in :meth:`train`, stops all on exit."""

    def __init__(self, cfg: Config, model_dir: str, stop: threading.Event) -> None:
        self.cfg = cfg
        self.model_dir = model_dir
        self.stop = stop
        self.out = Path(cfg.out_dir)
        self._started_ray = False
        self._abandoned_step = False  # a stop left a train step unfinished: no final checkpoint
        self._ray_session_dir: str | None = None
        self._buffer: Any = None
        self._trainers: list[Any] = []
        self._workers: list[_WorkerState] = []
        self._logger: MetricsLogger | None = None
        self.version = 0
        self.history: list[StepMetrics] = []

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

        from pipeline_rl.actors.remote import remote_classes
        from pipeline_rl.driver import ACTOR_ENV

        cfg = self.cfg
        runtime_env = {"env_vars": {**ACTOR_ENV, "VLLM_CPU_KVCACHE_SPACE": str(cfg.rollout.kv_cache_gib)}}
        if ray.is_initialized():  # an embedding program (a test, a notebook) owns Ray
            pass
        elif cfg.ray.address:
            ray.init(address=cfg.ray.address, runtime_env=runtime_env, log_to_driver=True)
        else:
            # A private local Ray: no token file in the home folder (PLATFORM.md), unless the
            # user chose an auth mode.
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ctx = ray.init(num_cpus=cfg.ray.num_cpus or os.cpu_count(), include_dashboard=False,
                           object_store_memory=cfg.ray.object_store_mb * 2**20,
                           runtime_env=runtime_env)
            self._started_ray = True
            self._ray_session_dir = getattr(ctx, "address_info", {}).get("session_dir")
        buffer_cls, rollout_cls, trainer_cls = remote_classes(cfg, ray.get_runtime_context().get_node_id())
        multi_node = len([n for n in ray.nodes() if n.get("Alive")]) > 1
        host = ray.util.get_node_ip_address() if multi_node else "127.0.0.1"
        self._buffer = buffer_cls.remote(cfg, host, self._resume_version())
        address = ray.get(self._buffer.address.remote())
        log.info("buffer listening on %s", address)
        self._start_trainers(trainer_cls, multi_node)
        self._workers = [_WorkerState(rollout_cls.remote(cfg, i, self.model_dir, address, self._buffer))
                         for i in range(cfg.rollout.num_workers)]
        ray.get([w.handle.ready.remote() for w in self._workers])
        ray.get(self._trainers[0].set_workers.remote([w.handle for w in self._workers]))
        ray.get([t.publish_current.remote() for t in self._trainers])
        for w in self._workers:
            w.run_ref = w.handle.run.remote(self._start_counter(w))
        self.out.mkdir(parents=True, exist_ok=True)
        self._logger = MetricsLogger(self.out)

    def _resume_version(self) -> int:
        """The version a ``--resume`` checkpoint holds (0 for a fresh run); a bad
        checkpoint fails here, before any actor starts."""
        if not self.cfg.resume:
            return 0
        from pipeline_rl.actors.checkpoint import CheckpointError, read_run_state

        try:
            return read_run_state(self.cfg.resume).version
        except CheckpointError as e:
            raise OrchestratorError(f"--resume: {e}") from None

    def _start_trainers(self, trainer_cls: Any, multi_node: bool) -> None:
        import ray

        n = self.cfg.trainer.num_ranks
        self._trainers = [trainer_cls.remote(self.cfg, self.model_dir, r, n, self._buffer)
                          for r in range(n)]
        master = ray.get(self._trainers[0].node_ip.remote()) if multi_node else "127.0.0.1"
        port = free_port()
        versions = ray.get([t.setup.remote(master, port) for t in self._trainers])
        self.version = int(versions[0])
        if self.cfg.resume:
            versions = ray.get([t.load_checkpoint.remote(self.cfg.resume) for t in self._trainers])
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
            _quiet(lambda: ray.wait(runs, num_returns=len(runs), timeout=10.0))
        for t in self._trainers:
            _quiet(lambda: ray.get(t.close.remote(), timeout=10.0))
        if self._buffer is not None:
            _quiet(lambda: ray.get(self._buffer.close.remote(), timeout=10.0))
        for handle in [w.handle for w in self._workers] + self._trainers + [self._buffer]:
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
        while self.version < self.cfg.max_steps and not self.stop.is_set():
            reports = self._one_step()
            if reports is None:
                break
            self._log_step(reports, clock)
            every = self.cfg.trainer.checkpoint_every
            if every and self.version % every == 0 and self.version < self.cfg.max_steps:
                self.checkpoint()
        if self._abandoned_step:
            log.warning("stopped during a training step: no final checkpoint (the step's weights "
                        "would not match its version); the last periodic checkpoint is resumable")
        elif self.history:
            self.checkpoint()
            print(summary_table(self.history), flush=True)
        return self.history

    def _one_step(self) -> list[Any] | None:
        import ray

        refs = [t.train_step.remote(self.cfg.trainer.batch_timeout_s) for t in self._trainers]
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
            self._supervise_workers()
        try:
            reports = ray.get(refs)
        except ray.exceptions.RayActorError as e:
            raise self._trainer_died(e) from None
        if any(r is None for r in reports):
            raise OrchestratorError(f"no batch within --trainer.batch_timeout_s="
                                    f"{self.cfg.trainer.batch_timeout_s} at version {self.version}")
        self.version += 1
        return reports

    def _trainer_died(self, e: BaseException) -> OrchestratorError:
        return OrchestratorError(f"a trainer rank died at version {self.version} "
                                 f"({type(e).__name__}); resume from the last checkpoint in "
                                 f"{self.out / 'checkpoints'} with --resume")

    def _supervise_workers(self) -> None:
        """Restart the generation loop of a worker that died (Ray restarts its process)."""
        import ray

        runs = [w.run_ref for w in self._workers]
        done, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
        for w in self._workers:
            if w.run_ref not in done or self.stop.is_set():
                continue
            try:
                ray.get(w.run_ref)
                why = "returned"
            except ray.exceptions.RayError as e:
                why = type(e).__name__
            idx = self._workers.index(w)
            lost = ray.get(self._buffer.worker_lost.remote(idx))
            w.restarts += 1
            w.tokens, w.idle_s, w.stalls_seen = 0, 0.0, 0
            log.warning("rollout worker %d stopped (%s): restarted, %d in-flight groups lost",
                        idx, why, lost)
            try:
                ray.get(self._trainers[0].offer_latest.remote([w.handle]))
            except ray.exceptions.RayActorError as e:
                raise self._trainer_died(e) from None
            w.run_ref = w.handle.run.remote(self._start_counter(w))

    def _start_counter(self, w: _WorkerState) -> int:
        """Where a worker's group counter starts: past the groups of a resumed run, and in a
        fresh range of 2**28 per restart (group ids stay unique; prompts do not repeat)."""
        return (w.restarts << 28) + self.version * self.cfg.groups_per_step

    # ------------------------------------------------------------------ metrics / checkpoints

    def _worker_deltas(self) -> "_WorkerDelta":
        """Tokens, engine idle seconds and weight-update stalls (ms) of all workers since
        the last poll (a worker that does not answer within 2 s is skipped this time)."""
        import ray

        refs = [w.handle.stats.remote() for w in self._workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=2.0)
        delta = _WorkerDelta()
        for w, ref in zip(self._workers, refs):
            if ref not in ready:
                continue
            try:
                st = ray.get(ref)
            except ray.exceptions.RayError:
                continue
            delta.tokens += max(0, st.tokens_generated - w.tokens)
            delta.idle_s += max(0.0, st.idle_s - w.idle_s)
            delta.stalls_ms += list(st.stall_ms[w.stalls_seen:])
            delta.answered += 1
            w.tokens, w.idle_s, w.stalls_seen = st.tokens_generated, st.idle_s, len(st.stall_ms)
        return delta

    def _log_step(self, reports: list[Any], clock: _Clock) -> None:
        import ray

        now = time.perf_counter()
        step_wall = now - clock.last_step_end
        clock.last_step_end = now
        wd = self._worker_deltas()
        gen_idle = wd.idle_s / (step_wall * wd.answered) if wd.answered and step_wall > 0 else 0.0
        buf = ray.get(self._buffer.stats.remote())
        res = [r.result for r in reports]
        lm = res[0].metrics
        m = StepMetrics(
            step=self.version, version=self.version, time_s=clock.since_start(),
            reward_mean=statistics.fmean(r.reward_mean for r in res),
            tokens_per_s=wd.tokens / step_wall if step_wall > 0 else 0.0,
            lag_mean=statistics.fmean(r.lag.mean for r in res), lag_max=max(r.lag.max for r in res),
            evicted=sum(buf.evicted.values()), mismatch_kl=float(lm.mismatch_kl_k1),
            masked_frac=float(lm.masked_token_frac),
            mixed_version_frac=statistics.fmean(r.mixed_version_frac for r in res),
            trainer_idle_frac=min(1.0, max(r.wait_s for r in reports) / step_wall) if step_wall else 0.0,
            weight_update_stall_ms=statistics.fmean(wd.stalls_ms) if wd.stalls_ms else 0.0,
            step_time_s=step_wall, loss=float(res[0].loss), buffer_fill=buf.fill,
            completion_len_mean=sum(r.num_tokens for r in res) / max(1, sum(r.num_seqs for r in res)),
            extra={"mismatch_kl_k3": float(lm.mismatch_kl_k3), "ess": float(lm.ess),
                   "masked_seq_frac": float(lm.masked_seq_frac), "clipped_frac": float(lm.clipped_frac),
                   "train_step_s": float(res[0].step_time_s), "groups_lost": float(buf.admission.lost),
                   "worker_restarts": float(sum(w.restarts for w in self._workers)),
                   "generator_idle_frac": min(1.0, gen_idle)},
        )
        self.history.append(m)
        assert self._logger is not None
        self._logger.log(m)

    def checkpoint(self) -> Path:
        """Save a resumable checkpoint of every rank under ``OUT_DIR/checkpoints``."""
        import ray

        from pipeline_rl.actors.checkpoint import checkpoint_name

        path = self.out / "checkpoints" / checkpoint_name(self.version)
        try:
            ray.get([t.save_checkpoint.remote(str(path), self.version) for t in self._trainers])
        except ray.exceptions.RayActorError as e:
            raise self._trainer_died(e) from None
        log.info("checkpoint saved: %s", path)
        return path


def _quiet(fn: Any) -> None:
    """Best-effort shutdown step: log, never raise."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - shutdown must go on
        log.debug("shutdown step failed: %s", e)
