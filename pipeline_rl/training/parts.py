"""The parts of a trainer rank (``pipeline_rl.training.trainer``), one function per concern.

``Trainer.__init__`` calls them in this order, and the order is part of the contract:

1. :func:`check_rank`: the rank and the batch split, before anything is touched;
2. :func:`place_rank`: the device (CUDA: made current) and its limits (memory share, threads);
3. :func:`join_process_group`: DeepSpeed ready for that device, then the process group;
   every engine (and DeepSpeed's collectives) needs the group first;
4. :func:`trained_model`: the model loaded, prepared, LoRA-wrapped (the adapter's
   initialisation seeded by ``cfg.seed``);
5. :func:`start_engine`: the DeepSpeed engine and its optimizer over the trained parameters;
6. :func:`checkpoint_writer`: the engine's checkpoint files go through the rank's writer;
7. :func:`lr_schedule`, :func:`moving_average`: the rate of each step, the EMA (rank 0);
8. :func:`skip_lone_allreduce`: one ZeRO-0 rank does not reduce its gradients;
9. :func:`reference_model`: the KL reference, when it is a second model;
10. :func:`record_grad_norm`: the pre-clip gradient norm kept under ZeRO-0.

Each function does only its own concern; none reads a trainer. Nothing happens at import
(DeepSpeed and Hugging Face are imported inside the functions that use them).
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pipeline_rl.config import Config, Device
from pipeline_rl.training.checkpoint_writer import CheckpointWriter, Staging, background_engine, writer_for
from pipeline_rl.training.deepspeed_setup import (
    deepspeed_config, init_distributed, pick_device, prepare_cpu_deepspeed, prepare_cuda_deepspeed,
    prepare_trained_model,
)
from pipeline_rl.training.ema import EmaWeights
from pipeline_rl.training.lora import AdapterWeights, FullWeights
from pipeline_rl.training.optimizers import make_optimizer
from pipeline_rl.training.schedule import LRSchedule


def check_rank(cfg: Config, rank: int, world_size: int) -> None:
    """``rank`` is in ``[0, world_size)`` and ``trainer.batch_size`` splits evenly over the
    ranks; otherwise a one-line ``ValueError``. Touches nothing."""
    if not 0 <= rank < world_size:
        raise ValueError(f"trainer: rank {rank} is not in [0, {world_size})")
    if cfg.trainer.batch_size % world_size:
        raise ValueError(f"trainer.batch_size {cfg.trainer.batch_size} does not split over "
                         f"{world_size} ranks")


def place_rank(want: Device, rank: int, *, num_threads: int | None, gpu_memory: float | None) -> torch.device:
    """The rank's device (``deepspeed_setup.pick_device``; CUDA: made the current device), with
    this process's limits on it: a GPU shared with rollout engines keeps its allocator within
    ``gpu_memory`` (a fraction), a CPU rank runs ``num_threads`` threads; ``None``: unchanged."""
    device = pick_device(want, rank)
    if gpu_memory is not None and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(gpu_memory, device)
    if num_threads is not None and device.type == "cpu":
        torch.set_num_threads(num_threads)
    return device


def join_process_group(device: torch.device, rank: int, world_size: int, master_addr: str | None,
                       master_port: int | None) -> None:
    """DeepSpeed prepared for ``device`` (its accelerator; the CPU specifics), its logger at
    WARNING, then this process in the process group (gloo on CPU, NCCL on CUDA;
    ``deepspeed_setup.init_distributed``). Precedes every engine: a process holds one group."""
    if device.type == "cpu":
        prepare_cpu_deepspeed()
    else:
        prepare_cuda_deepspeed()
    import deepspeed  # noqa: F401  (imported, its logger made, before the level is set)

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    init_distributed(rank, world_size, master_addr, master_port, "gloo" if device.type == "cpu" else "nccl")


def load_model(cfg: Config, path: Path, device_type: str) -> Any:
    """The Hugging Face causal LM at ``path`` in the trainer's dtype for ``device_type``
    (``model.trainer_dtype``), on the CPU, its KV cache off (``use_cache = False``)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if cfg.model.trainer_dtype(device_type) == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.config.use_cache = False
    return model


def trained_model(cfg: Config, model_dir: Path, device_type: str, trained: FullWeights | AdapterWeights) -> Any:
    """The model the engine trains: loaded (:func:`load_model`), prepared
    (``deepspeed_setup.prepare_trained_model``: gradient checkpointing), and with ``--lora``
    wrapped by PEFT (``training.lora.wrap``, seeded by ``cfg.seed``), its adapter then the only
    parameters with ``requires_grad``."""
    return trained.wrap(prepare_trained_model(load_model(cfg, model_dir, device_type), cfg), model_dir, cfg.seed)


def start_engine(cfg: Config, model: Any, world_size: int, device_type: str) -> Any:
    """The DeepSpeed engine over ``model``'s parameters that require gradients, with the
    configured optimizer (``training.optimizers.make_optimizer``) and DeepSpeed config
    (``deepspeed_setup.deepspeed_config``). Needs the process group (:func:`join_process_group`)."""
    import deepspeed

    trained = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=trained, optimizer=make_optimizer(cfg, trained),
        config=deepspeed_config(cfg, world_size, device_type))
    return engine


def checkpoint_writer(engine: Any, rank: int, world_size: int, staging: Staging) -> CheckpointWriter:
    """The rank's checkpoint writer (``checkpoint_writer.writer_for`` the engine's module),
    installed as the engine's checkpoint engine: every DeepSpeed file of a save is copied into
    ``staging`` and written on the writer's thread."""
    writer = writer_for(engine.module, rank, world_size)
    engine.checkpoint_engine = background_engine(writer, staging)
    return writer


def lr_schedule(cfg: Config, engine: Any) -> LRSchedule:
    """The learning rate of each step on the engine's optimizer (``training.schedule``):
    ``trainer.lr_schedule`` from ``trainer.lr`` over ``max_steps`` after ``warmup_steps``."""
    t = cfg.trainer
    return LRSchedule(engine.optimizer, schedule=t.lr_schedule, warmup_steps=t.warmup_steps,
                      total_steps=cfg.max_steps, base_lr=t.lr)


def moving_average(cfg: Config, engine: Any, rank: int) -> EmaWeights | None:
    """The moving average of the engine's weights (``training.ema``), kept by rank 0 only and
    only with ``trainer.ema_decay > 0``; otherwise ``None``."""
    decay = cfg.trainer.ema_decay
    return EmaWeights(engine.module, decay) if decay > 0 and rank == 0 else None


def skip_lone_allreduce(engine: Any, world_size: int, zero_stage: int) -> None:
    """One rank without ZeRO has nothing to all-reduce: DeepSpeed would still flatten, "reduce"
    and copy back every gradient at each step (a division by a world size of 1), so the
    engine's backward all-reduce is turned off. Other set-ups: the engine as it is."""
    if world_size == 1 and zero_stage == 0:
        engine.enable_backward_allreduce = False


def reference_model(cfg: Config, model_dir: Path, device: torch.device,
                    trained: FullWeights | AdapterWeights) -> Any | None:
    """The KL reference as a second model: the one at ``model_dir``, frozen (eval, no
    gradients) on ``device``, when ``algorithm.kl_coef > 0`` without LoRA. ``None`` otherwise:
    no KL term needs none, and with LoRA the reference is the trained model with its adapter off."""
    if not trained.reference_needed(cfg.algorithm.kl_coef > 0):
        return None
    return load_model(cfg, model_dir, device.type).eval().requires_grad_(False).to(device)


class GradNormRecord:
    """The last pre-clip gradient norm the clip hook saw (:func:`record_grad_norm`); ``None``
    when no hook records it (ZeRO 1-3, where the engine reports it) or before the first step."""

    def __init__(self) -> None:
        self.last: float | None = None


def record_grad_norm(engine: Any, world_size: int, zero_stage: int) -> GradNormRecord:
    """DeepSpeed reports the pre-clip gradient norm under ZeRO 1-3 only; without ZeRO it clips
    through ``engine.clip_fp32_gradients`` and drops the norm, so under ZeRO-0 this engine's
    method is replaced by one that clips identically and records the norm in the returned
    record. Under ZeRO 1-3 the engine is left as it is and the record stays ``None``."""
    record = GradNormRecord()
    if zero_stage != 0:
        return record
    from deepspeed.runtime.utils import clip_grad_norm_

    # One rank: torch's clip (same norm, same 1e-6, same coefficient) in a few
    # multi-tensor ops, without DeepSpeed's per-tensor loop and its all-reduce over a
    # group of one (0.17 ms a step against 0.36 ms on the built-in model).
    one_rank = world_size == 1 and engine.mpu is None
    clip: Any = (partial(torch.nn.utils.clip_grad_norm_, foreach=True) if one_rank
                 else partial(clip_grad_norm_, mpu=engine.mpu))

    def clip_and_record() -> None:
        record.last = float(clip(engine.module.parameters(), engine.gradient_clipping()))

    engine.clip_fp32_gradients = clip_and_record
    return record
