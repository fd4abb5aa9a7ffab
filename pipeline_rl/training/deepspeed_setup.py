"""DeepSpeed set-up for a trainer rank (``pipeline_rl.training.trainer``): its device,
config dict, process group, and DeepSpeed's accelerator.

CPU specifics (docs/design.md, platform notes): gloo, torch's optimizers (no JIT-compiled C++ op), the
shared-memory comm op skipped, ``TORCH_EXTENSIONS_DIR`` under the project, one thread.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

import torch

from pipeline_rl import runtime_env
from pipeline_rl.config import Config, Device
from pipeline_rl.net import rendezvous_port
from pipeline_rl.training.optimizers import muon_config

log = logging.getLogger(__name__)



def pick_device(want: Device, rank: int) -> torch.device:
    """The rank's device for ``model.device`` ``want`` (CUDA: made the current device)."""
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("model.device: cuda requested but no CUDA device is present")
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def deepspeed_config(cfg: Config, world_size: int, device_type: str = "cpu") -> dict[str, Any]:
    """The DeepSpeed config dict for ``cfg`` on ``device_type`` (external API: DeepSpeed takes a dict)."""
    t = cfg.trainer
    per_rank = t.batch_size // world_size
    micro = min(t.micro_batch_size, per_rank)
    gas = -(-per_rank // micro)
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if cfg.model.trainer_dtype(device_type) == "bfloat16":
        ds["bf16"] = {"enabled": True}
    return ds | muon_config(cfg)


def prepare_trained_model(model: Any, cfg: Config) -> Any:
    """The trained model as the trainer runs it. ``--trainer.gradient_checkpointing``: Hugging
    Face's (non-reentrant) checkpointing of every decoder layer, and the model in training mode
    (Hugging Face checkpoints only while ``model.training``; the built-in and most chat models
    have no dropout, so the mode changes nothing else). Off: the model as loaded."""
    if cfg.trainer.gradient_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(f"trainer.gradient_checkpointing: {type(model).__name__} does not support it")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model


def init_distributed(rank: int, world_size: int, master_addr: str | None, master_port: int | None,
                     backend: str) -> None:
    """Join (or create) the process group; a process holds one group for its lifetime.
    Address and port: the arguments, else ``MASTER_ADDR`` / ``MASTER_PORT`` from the
    environment, else loopback and (one rank only) a free port."""
    import deepspeed
    import deepspeed.comm.comm as ds_comm
    import deepspeed.utils.groups as ds_groups
    import torch.distributed as dist

    # DeepSpeed keeps one communication backend object per process, bound to the process
    # group alive when it was made; an in-process vLLM engine destroys and re-creates the
    # default group, which would leave that object stale. Re-wrap the current group.
    ds_comm.cdb = None
    ds_groups._WORLD_GROUP = None  # DeepSpeed's cached clone of the default group, likewise
    ds_groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    if dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise RuntimeError(f"trainer: this process is already rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, cannot become rank {rank} of {world_size}")
        if dist.get_backend() != backend:
            raise RuntimeError(f"trainer: this process already holds a {dist.get_backend()} process "
                               f"group; a trainer on this device needs {backend} (one device kind "
                               f"per process)")
        # a group made by another library (vLLM's engine in the same process) leaves no
        # LOCAL_RANK, which deepspeed.initialize requires
        os.environ.setdefault("LOCAL_RANK", "0")
        return
    master_addr = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    if master_port is None and os.environ.get("MASTER_PORT", "").isdigit():
        master_port = int(os.environ["MASTER_PORT"])
    if master_port is None:
        if world_size > 1:
            raise ValueError("trainer: master_port (or MASTER_PORT) is required with world_size > 1")
        master_port = rendezvous_port()
    runtime_env.for_rendezvous(master_addr, master_port, rank, world_size)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                               rank=rank, world_size=world_size)


def prepare_cpu_deepspeed() -> None:
    """docs/design.md, platform notes: no JIT C++ builds on CPU (shm comm op skipped), extensions under the project."""
    runtime_env.for_trainer("cpu")
    setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)


def prepare_cuda_deepspeed() -> None:
    """DeepSpeed picks its accelerator once per process, from ``DS_ACCELERATOR`` when set (the
    test suite and CPU runs set ``cpu``); a CUDA trainer needs DeepSpeed's CUDA accelerator, else
    the engine keeps the model on the CPU. Raises when DeepSpeed already chose another one."""
    replaced = runtime_env.for_trainer("cuda")
    if replaced is not None:
        log.info("trainer: model.device is cuda; DS_ACCELERATOR=%s replaced by cuda", replaced)
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name != "cuda":
        raise RuntimeError(f"trainer: DeepSpeed already uses its {name} accelerator in this "
                           f"process; a CUDA trainer needs its own process")
