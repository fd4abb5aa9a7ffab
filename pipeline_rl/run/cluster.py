"""The Ray cluster of a run: the one ``--ray.address`` or ``RAY_ADDRESS`` names (``ray job
submit`` sets the latter), an embedding program's, or a private local one sized for the
run; checked to fit every actor; shut down only if started here.

Invariants: without ``--ray.address`` and ``RAY_ADDRESS`` the run starts its own Ray
(``ray.init(address="local")``) and never joins another by accident, a cluster from ``ray
start`` on the same machine (live, or a stale record of one) included. On a Ray the run did
not start, nothing is pinned and no process keeps off a core unless ``--ray.pin_cores true``
asks (two runs on one node would otherwise take the same cores).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline_rl import runtime_env
from pipeline_rl.config import Config
from pipeline_rl.resources import CorePlan, GpuPlan, plan_cores
from pipeline_rl.run.life.supervise import OrchestratorError

log = logging.getLogger("pipeline_rl.run.cluster")

#: The variable through which Ray's tooling (``ray job submit``, a cluster's jobs) names the
#: cluster to join; read as ``ray.init`` itself reads it.
RAY_ADDRESS_ENV = "RAY_ADDRESS"


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


def join_address(cfg: Config) -> str | None:
    """The cluster to join: ``--ray.address``, else ``RAY_ADDRESS``; None: start a private Ray."""
    return cfg.ray.address or os.environ.get(RAY_ADDRESS_ENV) or None


class Cluster:
    """Ray for one run (see the module docstring); :meth:`shutdown` is safe to call twice."""

    def __init__(self, cfg: Config, model_dir: str | None = None) -> None:
        self.cfg = cfg
        self.model_dir = model_dir
        self._started = False
        self._session_dir: str | None = None
        self._affinity: set[int] | None = None   # this process's CPUs before it kept off the workers'

    def start(self) -> Placement:
        """Join or start Ray, check the cluster fits the run (one line naming what is
        missing otherwise), and plan the placement."""
        import ray

        address = join_address(self.cfg)
        if ray.is_initialized():  # an embedding program (a test, a notebook) owns Ray
            pass
        elif address:
            ray.init(address=address, runtime_env={"env_vars": _actor_env()}, log_to_driver=True,
                     logging_level=self._logging_level())
            say(f"Ray: joined the cluster at {address}")
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
        ctx = start_local(num_cpus=cpus, object_store_mb=self.cfg.ray.object_store_mb, env=_actor_env(),
                          logging_level=self._logging_level(), log_to_driver=self.cfg.log_level == "debug")
        self._started = True
        say(f"Ray: started locally with {cpus} CPUs")
        self._session_dir = getattr(ctx, "address_info", {}).get("session_dir")

    def _pins(self) -> bool:
        """Whether actors may take cores of their own: on a Ray this run started, unless
        ``--ray.pin_cores false``; on any other only with ``--ray.pin_cores true``."""
        pin = self.cfg.ray.pin_cores
        return pin is True or (pin is None and self._started)

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
        cores = plan_cores(self.cfg, alive_nodes=alive, on_gpus=gpus is not None, pin=self._pins())
        if cores.pinned:
            log.info("pinning each of %d rollout worker(s) and %d trainer rank(s) to a core of its own",
                     len(cores.workers), len(cores.ranks))
            if self._started and self._affinity is None:   # the run's own driver, not an embedding program
                from pipeline_rl.actors.process import keep_off

                self._affinity = keep_off(cores.worker_slots)
        host = ray.util.get_node_ip_address() if alive > 1 else "127.0.0.1"
        return Placement(ray.get_runtime_context().get_node_id(), alive > 1, host, gpus, cores)

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
        if self._affinity is not None:
            from pipeline_rl.actors.process import set_affinity

            set_affinity(self._affinity)
            self._affinity = None


def _actor_env() -> dict[str, Any]:
    """The environment variables every actor process starts with."""
    return dict(runtime_env.ACTOR_ENV)
