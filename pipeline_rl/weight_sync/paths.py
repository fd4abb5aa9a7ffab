"""Which way an update takes from the trainer to one rollout worker.

- ``shm``: trainer and worker on one machine: the trainer lays each version out once
  in a shared-memory segment and every such worker loads from it
  (``pipeline_rl.weight_sync.shm``); no byte crosses a socket.
- ``gloo``: across machines: a two-member gloo group per worker, the bytes broadcast in
  buckets (``pipeline_rl.weight_sync.gloo``); the fallback that works everywhere.
- ``ipc``: trainer and worker on one GPU: CUDA IPC handles of the trainer's bf16
  snapshot, the engine copies from them (``pipeline_rl.weight_sync.cuda_ipc``).
- ``nccl``: different GPUs, vLLM's packed NCCL broadcast (``pipeline_rl.weight_sync.nccl``).
  Not yet run on two GPUs: ``auto`` never picks it (it is not in :data:`GPU_PATHS`);
  forcing it is allowed where it can run (CUDA, two GPUs or more), else refused in one
  line.

``auto`` chooses from the two sides' :class:`Placement` (Ray node id, device, GPU):
one GPU shared -> ``ipc``; two GPUs -> ``nccl``; otherwise one node -> ``shm``, else
``gloo``. ``--rollout.weight_path`` forces one; a forced path the placement cannot
take is refused with one line.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Literal

WeightPath = Literal["auto", "shm", "gloo", "ipc", "nccl", "object_store"]
ResolvedPath = Literal["shm", "gloo", "ipc", "nccl", "object_store"]


#: The CUDA paths ``auto`` picks (``nccl`` is forced only, until it has run on two GPUs).
GPU_PATHS: frozenset[str] = frozenset({"ipc"})


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
                gpu_paths: frozenset[str] = frozenset()) -> ResolvedPath:
    """The path for one worker (module docstring). ``gpu_paths``: the CUDA paths ``auto``
    may pick (``ipc``; ``nccl`` once it has run on two GPUs)."""
    same_node = trainer.node_id == worker.node_id
    both_cuda = trainer.device == "cuda" and worker.device == "cuda"
    same_gpu = both_cuda and same_node and trainer.gpu_uuid == worker.gpu_uuid
    if forced == "auto":
        if same_gpu and "ipc" in gpu_paths:
            return "ipc"
        if both_cuda and not same_gpu and "nccl" in gpu_paths:
            return "nccl"
        return "shm" if same_node else "gloo"
    if forced == "shm" and not same_node:
        raise PathError("--rollout.weight_path shm: the trainer and a rollout worker are on different "
                        "nodes (use gloo or auto)")
    if forced == "ipc" and not same_gpu:
        raise PathError("--rollout.weight_path ipc: needs the trainer and the worker on one GPU (use auto)")
    if forced == "nccl" and not both_cuda:
        raise PathError("--rollout.weight_path nccl: needs the trainer and the worker on GPUs (use auto)")
    if forced == "nccl" and same_gpu:
        raise PathError("--rollout.weight_path nccl: the trainer and the worker share one GPU (use ipc or auto)")
    if forced == "ipc" and forced not in gpu_paths:
        raise PathError(f"--rollout.weight_path {forced}: not available with the installed vLLM")
    return forced
