"""Choosing and starting a rollout worker's engine (``pipeline_rl.rollout.worker``): the
async engine or the in-process one, on the machine's device."""

from __future__ import annotations

from typing import Literal

from pipeline_rl.config import Config
from pipeline_rl.rollout.engines.engine import GenerationEngine, engine_config
from pipeline_rl.weight_sync.receive.lora_update import LoraServing


def build_engine(cfg: Config, model_dir: str, *, seed: int = 0, gpu_memory: float | None = None,
                 rendezvous_secret: bytes = b"") -> GenerationEngine:
    """Start the engine ``cfg.rollout.engine`` names on this machine's device: the
    ``AsyncLLM`` engine on CUDA (present, or asked for), the in-process one on CPU
    unless the async one is asked for. ``gpu_memory``: the share of a GPU shared with
    other actors that vLLM may take; ``rendezvous_secret``: the run key's, proved to the
    trainer's weight channels."""
    device = resolve_device(cfg.model.device)
    ecfg = engine_config(cfg.rollout, model_dir, seed=seed, device=device, gpu_memory=gpu_memory,
                         fault=cfg.fault, rendezvous_secret=rendezvous_secret,
                         lora=LoraServing.of_run(cfg.lora, device))
    if device == "cuda" and cfg.rollout.engine == "inprocess":
        raise ValueError("--rollout.engine inprocess runs on CPU only; use async (or auto) on CUDA")
    if device == "cuda" or cfg.rollout.engine == "async":
        from pipeline_rl.rollout.engines.engine_async import AsyncEngine

        return AsyncEngine(ecfg)
    from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine

    return InprocessEngine(ecfg)


def resolve_device(device: Literal["auto", "cpu", "cuda"]) -> Literal["cpu", "cuda"]:
    """``auto``: CUDA when this process sees a GPU, else CPU."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
