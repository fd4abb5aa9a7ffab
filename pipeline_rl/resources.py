"""What a run needs from Ray, checked before any actor is placed.

Every rollout worker and every trainer rank takes one CPU; the buffer takes
none. On a local Ray the driver sizes Ray to fit (oversubscribing the cores
when needed, said in one line); on a cluster a shortfall is one line naming
what is missing, instead of actors that wait forever to be placed.

On one machine with a core for each, every rollout worker and trainer rank also
gets a core of its own (:func:`plan_cores`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class CoreSlot:
    """The core one actor process takes on a machine the whole run shares: the
    ``index``-th (in ascending order) of the CPUs the process may run on. ``of`` is how
    many slots the run hands out on that machine; with fewer CPUs than that the actor
    stays unpinned (see :func:`pipeline_rl.actors.process.pin_to_core`)."""

    index: int
    of: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.of:
            raise ValueError(f"core slot {self.index} outside 0..{self.of - 1}")


@dataclass(frozen=True, slots=True)
class CorePlan:
    """Which core each rollout worker and each trainer rank takes (None: not pinned).

    Invariant: either every actor has a slot, all distinct, or none has one. The
    buffer, the driver and Ray's own processes are never pinned: they float to
    whichever core is idle at the moment."""

    workers: tuple[CoreSlot | None, ...]
    ranks: tuple[CoreSlot | None, ...]

    @property
    def pinned(self) -> bool:
        return any(s is not None for s in self.workers + self.ranks)


def plan_cores(cfg: Config, *, alive_nodes: int, on_gpus: bool) -> CorePlan:
    """A core of its own for every rollout worker (slots ``0 .. W-1``) and trainer rank
    (slots ``W .. W+R-1``) when ``--ray.pin_cores`` is on, the run is on one machine
    (one live Ray node) and on CPUs. Each actor checks on its start that the machine
    has a CPU for every slot; else no actor is pinned.

    Why: on a small machine a worker or rank whose threads the kernel moves between
    cores, beside the buffer's and the driver's, loses its caches and waits for a core
    behind its peer (measured on 2 cores: about 20% more steps per second pinned)."""
    w, r = cfg.rollout.num_workers, cfg.trainer.num_ranks
    if not cfg.ray.pin_cores or alive_nodes != 1 or on_gpus:
        return CorePlan((None,) * w, (None,) * r)
    n = w + r
    return CorePlan(tuple(CoreSlot(i, n) for i in range(w)), tuple(CoreSlot(w + i, n) for i in range(r)))
