"""What a run needs from Ray, checked before any actor is placed.

Every rollout worker and every trainer rank takes one CPU; the buffer takes
none. On a local Ray the driver sizes Ray to fit (oversubscribing the cores
when needed, said in one line); on a cluster a shortfall is one line naming
what is missing, instead of actors that wait forever to be placed.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeline_rl.config import Config


def cpus_needed(cfg: Config) -> int:
    """CPUs the run's actors ask Ray for (one per rollout worker and trainer rank)."""
    return cfg.rollout.num_workers + cfg.trainer.num_ranks


def check_cluster(cfg: Config, resources: Mapping[str, float]) -> str | None:
    """One line naming what the cluster lacks for this run, or None when it fits.

    ``resources`` is ``ray.cluster_resources()`` (totals over live nodes)."""
    need = cpus_needed(cfg)
    have = float(resources.get("CPU", 0.0))
    if have < need:
        return (f"the Ray cluster has {have:g} CPUs, the run needs {need} "
                f"({cfg.rollout.num_workers} rollout worker(s) + {cfg.trainer.num_ranks} trainer "
                f"rank(s), one CPU each): add nodes, or lower --rollout.num_workers / "
                f"--trainer.num_ranks" + (" / raise --ray.num_cpus" if cfg.ray.num_cpus else ""))
    for flag, name in (("--ray.rollout_resource", cfg.ray.rollout_resource),
                       ("--ray.trainer_resource", cfg.ray.trainer_resource)):
        if name and float(resources.get(name, 0.0)) <= 0.0:
            return f"{flag}: no node of the Ray cluster declares the resource {name!r}"
    return None
