"""What a run needs from Ray, checked before any actor is placed.

Every rollout worker and every trainer rank takes one CPU; the buffer takes
none. On a local Ray the driver sizes Ray to fit (oversubscribing the cores
when needed, said in one line); on a cluster a shortfall is one line naming
what is missing, instead of actors that wait forever to be placed.

On one machine with a core for each, every rollout worker and trainer rank also
gets a core of its own (:func:`plan_cores`). On GPUs each takes a GPU of its own, or,
with fewer GPUs than actors (one GPU is the common case), a share of one
(:func:`plan_gpus`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

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
    buffer and the driver keep off the rollout workers' cores (:attr:`worker_slots`)
    and float over the others; Ray's own processes float over all."""

    workers: tuple[CoreSlot | None, ...]
    ranks: tuple[CoreSlot | None, ...]

    @property
    def pinned(self) -> bool:
        return any(s is not None for s in self.workers + self.ranks)

    @property
    def worker_slots(self) -> tuple[CoreSlot, ...]:
        """The rollout workers' slots (empty when nothing is pinned)."""
        return tuple(s for s in self.workers if s is not None)


def plan_cores(cfg: Config, *, alive_nodes: int, on_gpus: bool, pin: bool | None = None) -> CorePlan:
    """A core of its own for every rollout worker (slots ``0 .. W-1``) and trainer rank
    (slots ``W .. W+R-1``) when ``pin`` (None: unless ``--ray.pin_cores false``; the
    driver decides by whose Ray it is, ``run.cluster``), the run is on one machine
    (one live Ray node) and on CPUs. Each actor checks on its start that the machine
    has a CPU for every slot; else no actor is pinned.

    Why: on a small machine a worker or rank whose threads the kernel moves between
    cores, beside the buffer's and the driver's, loses its caches and waits for a core
    behind its peer (measured on 2 cores: about 20% more steps per second pinned). The
    buffer and the driver then keep off the rollout workers' cores: generation is the
    pipeline's bound there (the worker's core about 92% busy, the trainer's 71%), and the
    floating processes took part of it. Alternated runs of 300 default steps, median step
    and wall time: in a slow hour 29.6 ms against 33.3 ms and 10.2 s against 11.6 s (6
    pairs), in a fast one 29.1 ms against 29.8 ms and 9.8 s against 10.5 s (4 pairs)."""
    w, r = cfg.rollout.num_workers, cfg.trainer.num_ranks
    if pin is None:
        pin = cfg.ray.pin_cores is not False
    if not pin or alive_nodes != 1 or on_gpus:
        return CorePlan((None,) * w, (None,) * r)
    n = w + r
    return CorePlan(tuple(CoreSlot(i, n) for i in range(w)), tuple(CoreSlot(w + i, n) for i in range(r)))


#: Of a shared GPU's memory, what the actors on it may take together; the rest is left to
#: each process's CUDA context and allocator slack.
SHARED_GPU_USABLE = 0.9


@dataclass(frozen=True, slots=True)
class GpuPlan:
    """How rollout workers and trainer ranks take the run's GPUs.

    ``per_actor``: the Ray GPU request of each (1.0 = a GPU of its own; ``1 / per_gpu`` when
    ``per_gpu`` actors share one GPU, Ray then packing them together); ``memory``: the
    share of its GPU's memory each actor may take when sharing (vLLM's
    ``gpu_memory_utilization``, the trainer's per-process memory fraction), None when
    every actor has a GPU of its own. Invariant: ``per_gpu * per_actor <= 1`` and, when
    sharing, ``per_gpu * memory <= SHARED_GPU_USABLE``."""

    gpus: int
    workers: int
    ranks: int
    per_gpu: int
    per_actor: float
    memory: float | None

    @property
    def shared(self) -> bool:
        return self.per_gpu > 1

    def describe(self) -> str:
        """One line: who shares which GPUs, and how much memory each may take."""
        who = f"{self.workers} rollout worker(s) + {self.ranks} trainer rank(s)"
        if not self.shared:
            return f"GPUs: {who} on {self.workers + self.ranks} GPU(s) of the cluster's {self.gpus}, one each"
        return (f"GPUs: {who} share {self.gpus} GPU(s), up to {self.per_gpu} on each "
                f"(Ray GPU {self.per_actor:g} each); each may take {self.memory:.0%} of its GPU's "
                f"memory (vLLM: KV cache given in bytes within it; trainer: a per-process cap)")


def plan_gpus(cfg: Config, have: float) -> GpuPlan | None:
    """The GPU plan for a cluster with ``have`` GPUs (``ray.cluster_resources()``), or None
    when the actors run on CPU (``--model.device cpu``, or ``auto`` with no GPU). With at
    least one GPU per rollout worker and trainer rank each takes a GPU of its own; with
    fewer, they share: ``ceil(actors / GPUs)`` to a GPU, each with an equal share of its
    memory. ``--model.device cuda`` on a cluster without a GPU is a one-line ValueError."""
    gpus = int(have)
    if cfg.model.device == "cpu" or (cfg.model.device == "auto" and gpus == 0):
        return None
    w, r = cfg.rollout.num_workers, cfg.trainer.num_ranks
    if gpus == 0:
        raise ValueError(f"--model.device cuda: the Ray cluster has no GPU ({w} rollout worker(s) + "
                         f"{r} trainer rank(s) to place)")
    n = w + r
    if gpus >= n:
        return GpuPlan(gpus, w, r, per_gpu=1, per_actor=1.0, memory=None)
    per_gpu = -(-n // gpus)
    # Ray keeps four decimals of a fractional request: round down so per_gpu of them fit.
    per_actor = int(10_000 / per_gpu) / 10_000
    return GpuPlan(gpus, w, r, per_gpu=per_gpu, per_actor=per_actor,
                   memory=round(SHARED_GPU_USABLE / per_gpu, 4))


#: The x86 CPU flags that give vLLM's CPU backend native bfloat16 arithmetic.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def this_cpuinfo() -> str:
    """This machine's ``/proc/cpuinfo`` ("" where there is none)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_has_bf16(cpuinfo: str) -> bool | None:
    """Whether ``/proc/cpuinfo``'s text lists an instruction set with native bfloat16
    (:data:`BF16_CPU_FLAGS`); None when it lists no x86 flags (another architecture)."""
    flags = {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    if not flags:
        return None
    return any(f in flags for f in BF16_CPU_FLAGS)


def slow_bf16_line(dtype: str, cpuinfo: str) -> str | None:
    """One line when ``dtype`` (``--rollout.dtype``) is bfloat16 on a CPU without native
    bfloat16 (``cpuinfo``: this machine's ``/proc/cpuinfo``; the caller checks that the
    engines run on it, on CPU), else None. There vLLM's bfloat16 kernels are emulated: LoRA generation of
    SmolLM2-135M ran at 9 tokens/s against float32's 25 on an AVX2-only AMD EPYC. The line
    names no flag: the caller adds its own."""
    if dtype != "bfloat16" or cpu_has_bf16(cpuinfo) is not False:
        return None
    return ("bfloat16 generation on a CPU without " + " or ".join(BF16_CPU_FLAGS) + " runs about 3x "
            "slower than float32 (no native bfloat16 arithmetic)")
