"""The run's life, in one room. :func:`run_life` is its one entry (``pipeline_rl.driver``
calls it); a run lives one life, or several when it heals itself (``--run.max_restarts``):

    start (start.py: the actors, what the last life carried taken up first)
      -> supervise (one_life.py: the step loop; supervise.py and slots.py watch the actors)
      -> stop (stop.py: wound down at the end; killed at once after a failure)
      -> finish, or heal (heal.py: is the failure one a restart heals?)
      -> carry (carry.py: workers and spares handed on; run_folder.py: the same folder,
         trimmed to the newest checkpoint) -> the next life's start

Invariants: one Ray for every life (started here, shut down when the last one ends); every
life shares the run's identity (``carry.RunIdentity``); a run that cannot go on ends with
one :class:`~pipeline_rl.run.life.supervise.OrchestratorError` line. Nothing is imported
here until :func:`run_life` runs.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import threading

    from pipeline_rl.config import Config
    from pipeline_rl.run.cluster import Cluster
    from pipeline_rl.run.life.run_folder import RunFolder

__all__ = ["run_life"]


def run_life(cfg: Config, model_dir: str, stop: threading.Event, folder: RunFolder) -> None:
    """Run the whole job, restarting it as ``heal.py`` says; raises the last
    :class:`~pipeline_rl.run.life.supervise.OrchestratorError` (its message: the one line)
    when it cannot go on."""
    from pipeline_rl.run.cluster import Cluster

    cluster = Cluster(cfg, model_dir)   # one Ray for every life of the run
    try:
        _lives(cfg, model_dir, stop, folder, cluster)
    finally:
        cluster.shutdown()


def _lives(cfg: Config, model_dir: str, stop: threading.Event, folder: RunFolder, cluster: Cluster) -> None:
    """The run's lives on ``cluster``: each a new set of actors, from the newest checkpoint."""
    from pipeline_rl.run.life.carry import Carried, RunIdentity
    from pipeline_rl.run.life.heal import RestartPolicy, fault_left, restart_line, restarts_before
    from pipeline_rl.run.life.one_life import Orchestrator
    from pipeline_rl.run.life.run_folder import restart_in
    from pipeline_rl.run.life.stop import stop_actors
    from pipeline_rl.run.life.supervise import OrchestratorError

    policy = RestartPolicy(cfg.run.max_restarts, restarts=restarts_before(folder))
    fault = cfg.fault
    identity, carried = RunIdentity.new(), Carried()
    while True:
        orch = Orchestrator(cfg, model_dir, stop, folder, policy.restarts, cluster, identity=identity,
                            carried=carried, carry=cfg.run.max_restarts > 0)
        try:
            with orch:   # start, then supervise the steps; stop on the way out
                orch.train()
            return   # finish
        except OrchestratorError as e:   # heal, or end here
            why = str(e) if stop.is_set() else policy.refusal(e, orch.steps_done > 0)
            if why is not None:
                stop_actors(None, orch.carried.spares, orch.carried.workers, graceful=False)   # no next life
                if stop.is_set():
                    raise
                raise OrchestratorError(why) from None
            cause = e.cause
        carried = orch.carried   # carry into the next life
        folder, checkpoint = restart_in(folder.path)
        print(restart_line(policy.restarts, cause, orch.stopped_in_s, carried, checkpoint), file=sys.stderr, flush=True)
        fault = fault if fault_left(fault, orch.version) else None
        cfg = cfg.model_copy(update={"resume": checkpoint, "fault": fault})
