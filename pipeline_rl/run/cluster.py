"""The Ray cluster of a run: the one ``--ray-address`` names (or an embedding program's), or
a private local one sized for the run; checked to fit every actor; shut down only if started here."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline_rl import runtime_env
from pipeline_rl.config import Config
from pipeline_rl.resources import CorePlan, GpuPlan, plan_cores
from pipeline_rl.run.supervisor import OrchestratorError

if TYPE_CHECKING:
    from pipeline_rl.run.preload import PreloadServer

log = logging.getLogger("pipeline_rl.run.cluster")


def say(line: str) -> None:
    """One progress line on the console (start-up phases), as the step lines are."""
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the actors go on this cluster: ``host`` is the address the buffer binds and
    the trainers meet at (loopback on one node), ``gpus`` the GPU plan (None: CPU),
    ``cores`` the core each actor is pinned to (one machine, CPU runs)."""

    node_id: str
    multi_node: bool
    host: str
    gpus: GpuPlan | None
    cores: CorePlan
    preloaded: bool = False   # the rollout workers' processes come from a preload server


class Cluster:
    """Ray for one run (see the module docstring); :meth:`shutdown` is safe to call twice."""

    def __init__(self, cfg: Config, model_dir: str | None = None) -> None:
        """``model_dir``: the run's model, whose classes a preload server imports ahead."""
        self.cfg = cfg
        self.model_dir = model_dir
        self._preload: PreloadServer | None = None
        self._ray_narrowed = False   # Ray's own processes started kept off the workers' cores
        self._started = False
        self._session_dir: str | None = None
        self._affinity: set[int] | None = None   # this process's CPUs before it kept off the workers'

    def start(self) -> Placement:
        """Join or start Ray, check the cluster fits the run (one line naming what is
        missing otherwise), and plan the placement."""
        self._start_preload()   # first: its imports run while Ray starts
        import ray

        if ray.is_initialized():  # an embedding program (a test, a notebook) owns Ray
            pass
        elif self.cfg.ray.address:
            ray.init(address=self.cfg.ray.address, runtime_env={"env_vars": _actor_env()}, log_to_driver=True,
                     logging_level=self._logging_level())
            say(f"Ray: joined the cluster at {self.cfg.ray.address}")
        else:
            self._start_local()
        from pipeline_rl.resources import check_cluster

        problem = check_cluster(self.cfg, ray.cluster_resources())
        if problem:
            raise OrchestratorError(problem)
        return self._placement()

    def _start_local(self) -> None:
        """A private local Ray: no token file in the home folder unless the user chose an
        auth mode; the actors' output goes to their log files, or to this console with
        ``--log-level debug``."""
        from pipeline_rl.run.local_ray import start_local

        runtime_env.for_local_ray()
        cpus = self._local_cpus()
        env = {**_actor_env(), **(self._preload.worker_env() if self._preload else {})}
        if self._preload is not None:
            env.update(self._leave_workers_cores_to_preload())
        ctx = start_local(num_cpus=cpus, object_store_mb=self.cfg.ray.object_store_mb, env=env,
                          logging_level=self._logging_level(), log_to_driver=self.cfg.log_level == "debug",
                          dashboard=self.cfg.ray.dashboard)
        self._started = True
        say(f"Ray: started locally with {cpus} CPUs")
        self._session_dir = getattr(ctx, "address_info", {}).get("session_dir")

    def _placement(self) -> Placement:
        import ray

        from pipeline_rl.actors.placement import gpu_plan

        try:
            gpus = gpu_plan(self.cfg)
        except ValueError as e:
            raise OrchestratorError(str(e)) from None
        if gpus is not None:
            say(gpus.describe())
        alive = len([n for n in ray.nodes() if n.get("Alive")])
        cores = plan_cores(self.cfg, alive_nodes=alive, on_gpus=gpus is not None)
        if cores.pinned:
            log.info("pinning each of %d rollout worker(s) and %d trainer rank(s) to a core of its own",
                     len(cores.workers), len(cores.ranks))
            if self._started and self._affinity is None:   # the run's own driver, not an embedding program
                from pipeline_rl.actors.process import keep_off

                self._affinity = keep_off(cores.worker_slots)
        host = ray.util.get_node_ip_address() if alive > 1 else "127.0.0.1"
        return Placement(ray.get_runtime_context().get_node_id(), alive > 1, host, gpus, cores,
                         preloaded=self._preload is not None and gpus is None)

    def started(self) -> None:
        """The actors are up: Ray's own processes that this run started (its GCS, raylet and
        their helpers) float over every CPU again, as without :meth:`_leave_workers_cores_to_preload`
        (the actors keep the cores they took; this process keeps off the workers')."""
        if not self._ray_narrowed or self._affinity is None:
            return
        for pid in _ray_processes():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(pid, self._affinity)

    def _leave_workers_cores_to_preload(self) -> dict[str, str]:
        """Before Ray starts, when the rollout workers will be pinned: the preload server
        takes their cores, and this process (hence every process Ray starts: its own, the
        buffer's, the trainers') keeps off them until shutdown. The imports the server does
        then run beside Ray's start, not under it (5 alternated commands: first step 6.19 s
        against 6.41 s; Ray's line 1.48 s against 1.13 s, off the critical path). Returns
        the actors' variable naming the CPUs their core slots index (see
        ``actors.process.plan_cpus``), empty when nothing is pinned."""
        from pipeline_rl.actors.process import PLAN_CPUS_ENV, keep_off, plan_cpus

        assert self._preload is not None
        plan = plan_cores(self.cfg, alive_nodes=1, on_gpus=False)
        cpus = plan_cpus()
        if not plan.pinned or len(cpus) < plan.worker_slots[0].of:
            return {}
        self._preload.pin({cpus[s.index] for s in plan.worker_slots})
        self._affinity = keep_off(plan.worker_slots)
        self._ray_narrowed = self._affinity is not None
        return {PLAN_CPUS_ENV: ",".join(map(str, cpus))}

    def _start_preload(self) -> None:
        """Start the rollout workers' preload server (``run.preload``) when this run will
        start its own local Ray on a machine without GPUs, unless ``--ray.preload false``."""
        ray = sys.modules.get("ray")
        if (not self.cfg.ray.preload or self.cfg.ray.address or self.model_dir is None
                or (ray is not None and ray.is_initialized()) or not cpu_only_machine()):
            return
        from pipeline_rl.run.preload import PreloadServer

        self._preload = PreloadServer(self.model_dir, quota=self.cfg.rollout.num_workers,
                                      after=1 + self.cfg.trainer.num_ranks,
                                      log_path=Path(self.cfg.out_dir or ".") / "logs" / "preload.log")

    def _logging_level(self) -> int:
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

    def shutdown(self) -> None:
        """Stop the local Ray this run started (a joined or embedding one stays)."""
        import ray

        if self._started and ray.is_initialized():
            ray.shutdown()
            if self._session_dir:  # Ray leaves its plasma store's socket file behind
                shutil.rmtree(Path(self._session_dir) / "sockets", ignore_errors=True)
        self._started = False
        if self._preload is not None:
            self._preload.stop()
            self._preload = None
        if self._affinity is not None:
            from pipeline_rl.actors.process import set_affinity

            set_affinity(self._affinity)
            self._affinity = None


#: Where a machine's GPUs show (NVIDIA's driver, AMD's ROCm): a process forked from a
#: preload server must not inherit a GPU context, so such machines start workers plainly.
GPU_DEVICE_PATHS = ("/proc/driver/nvidia/gpus", "/dev/nvidia0", "/dev/kfd")


def cpu_only_machine() -> bool:
    """No GPU device on this machine (see :data:`GPU_DEVICE_PATHS`)."""
    return not any(os.path.exists(p) for p in GPU_DEVICE_PATHS)


def _ray_processes() -> list[int]:
    """The processes of the local Ray this process started (its GCS, raylet, ...), by id."""
    try:
        import ray._private.worker as worker

        node: Any = worker._global_node
        return [info.process.pid for infos in node.all_processes.values() for info in infos
                if getattr(info, "process", None) is not None]
    except Exception:  # noqa: BLE001 - another Ray: they stay where they are
        return []


def _actor_env() -> dict[str, Any]:
    """The environment variables every actor process starts with."""
    return dict(runtime_env.ACTOR_ENV)
