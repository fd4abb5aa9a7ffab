"""Which way an update takes from the trainer to one rollout worker.

- ``shm``: trainer and worker on one machine: the trainer lays each version out once
  in a shared-memory segment and every such worker loads from it
  (``pipeline_rl.weight_sync.channels.shm``); no byte crosses a socket.
- ``gloo``: across machines: a two-member gloo group per worker, the bytes broadcast in
  buckets (``pipeline_rl.weight_sync.channels.gloo``); the fallback that works everywhere.
- ``ipc``: trainer and worker on one GPU: CUDA IPC handles of the trainer's bf16
  snapshot, the engine copies from them (``pipeline_rl.weight_sync.channels.cuda_ipc``).
- ``nccl``: different GPUs, vLLM's packed NCCL broadcast (``pipeline_rl.weight_sync.channels.nccl``).
  Not yet run on two GPUs: ``auto`` never picks it (it is not in :data:`GPU_PATHS`);
  forcing it is allowed where it can run (CUDA, two GPUs or more), else refused in one
  line.

``auto`` chooses from the two sides' :class:`Placement` (Ray node id, device, GPU):
one GPU shared -> ``ipc``; two GPUs -> ``nccl``; otherwise one node -> ``shm``, else
``gloo``. ``--rollout.weight_path`` forces one; a forced path the placement cannot
take is refused with one line. What each path needs of the placement, and which
``auto`` may take, is its row of ``path_table.PATH_TABLE``: nothing here goes by a
path's name.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from pipeline_rl.weight_sync.channels.path_table import PATH_TABLE, Fit, PathName, WeightPath

#: The CUDA paths ``auto`` picks (``nccl`` is forced only, until it has run on two GPUs).
GPU_PATHS: frozenset[str] = frozenset(name for name, row in PATH_TABLE.items() if row.gpu_default)


class PathError(ValueError):
    """A forced path the two sides' placement cannot take (one line)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one side of a transfer runs: Ray's node id (the host name outside Ray), its
    device (``cpu``/``cuda``) and, on CUDA, the UUID of its GPU."""

    node_id: str
    device: str = "cpu"
    gpu_uuid: str | None = None


def local_placement(device: str | None = None) -> Placement:
    """This process's placement, from public APIs only: ``ray.get_runtime_context()``'s
    node id (the host name when Ray is not running) and torch's current CUDA device
    (``device="cpu"`` skips asking)."""
    node = socket.gethostname()
    try:
        import ray

        if ray.is_initialized():
            node = str(ray.get_runtime_context().get_node_id())
    except ImportError:  # pragma: no cover - ray is a dependency
        pass
    if device == "cpu":
        return Placement(node)
    import torch

    if not torch.cuda.is_available() or device not in (None, "cuda"):
        return Placement(node)
    index = torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", index))
    return Placement(node, "cuda", uuid)


def choose_path(trainer: Placement, worker: Placement, forced: WeightPath = "auto",
                gpu_paths: frozenset[str] = frozenset()) -> PathName:
    """The path for one worker (module docstring). ``gpu_paths``: the CUDA paths ``auto``
    may pick (``ipc``; ``nccl`` once it has run on two GPUs)."""
    fit = _fit(trainer, worker)
    if forced == "auto":
        return _auto(fit, gpu_paths)
    row = PATH_TABLE.get(forced)
    if row is None:
        raise PathError(f"--rollout.weight_path {forced!r}: not one of auto, {', '.join(PATH_TABLE)}")
    for need in row.needs:
        if not need.holds(fit):
            raise PathError(f"--rollout.weight_path {forced}: {need.refusal}")
    if row.forced_needs_gpu_paths and forced not in gpu_paths:
        raise PathError(f"--rollout.weight_path {forced}: not available with the installed vLLM")
    return forced


def _fit(trainer: Placement, worker: Placement) -> Fit:
    """What the two placements share (a GPU is shared only on one node)."""
    same_node = trainer.node_id == worker.node_id
    both_cuda = trainer.device == "cuda" and worker.device == "cuda"
    return Fit(same_node, both_cuda, both_cuda and same_node and trainer.gpu_uuid == worker.gpu_uuid)


def _auto(fit: Fit, gpu_paths: frozenset[str]) -> PathName:
    """``auto``'s choice: the first GPU path among ``gpu_paths`` that fits, else the first
    host path that fits (a host path with no needs always does)."""
    gpu = [name for name, row in PATH_TABLE.items() if row.auto == "gpu" and name in gpu_paths and row.fits(fit)]
    host = [name for name, row in PATH_TABLE.items() if row.auto == "host" and row.fits(fit)]
    return (gpu + host)[0]
