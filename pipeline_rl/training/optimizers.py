"""The trainer's optimizer (``--trainer.optimizer``): torch's fused AdamW, or DeepSpeed's own Muon.

- ``adamw``: torch's AdamW with its fused kernel (one call updates every tensor, instead of a
  dozen element-wise ops per tensor): on the built-in model's 21 tensors, 0.28 ms a step against
  1.0 ms for the per-tensor loop DeepSpeed's ``torch_adam`` option builds on CPU. DeepSpeed
  takes it as its client optimizer (ZeRO wraps it like its own AdamW).
- ``muon``: named in the DeepSpeed config (``"optimizer": {"type": "Muon"}``), so DeepSpeed
  builds it (``MuonWithAuxAdam``) and splits the parameters itself: every parameter whose layer
  shape is 2-D or more and whose name holds neither ``embed`` nor ``lm_head`` gets Muon
  (momentum, Newton-Schulz orthogonalisation, ``--trainer.optimizer.lr``); the rest (embeddings,
  head, norms, biases) get AdamW at ``--trainer.lr``. Its state (Muon's momentum buffers,
  AdamW's moments) is part of DeepSpeed's checkpoint like AdamW's. Under ZeRO 1-2 DeepSpeed
  orthogonalises the gathered full gradient of each matrix; under ZeRO-3 it needs
  ``reduce_scatter`` off (it refuses the two together), which :func:`muon_config` sets. The
  auxiliary AdamW is torch's (``torch_adam``): DeepSpeed's FusedAdam would be a JIT-compiled
  extension.

DeepSpeed compiles Muon's update with ``torch.compile``; on a CPU that is a C++ build of
tens of seconds per matrix shape (48 s on the first step of a 2-layer model, measured), so a
CPU trainer runs the optimizer step under ``torch.compiler.set_stance("force_eager")``
(:func:`step_context`, torch's public switch, scoped to the step): the same arithmetic, eagerly.

A DeepSpeed without Muon (before 0.18.2) is refused while the command line is validated
(``optimizer_config.muon_refusal``), before anything starts.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from pipeline_rl.config.optimizer_config import MuonConfig

if TYPE_CHECKING:
    import torch

    from pipeline_rl.config import Config

def make_optimizer(cfg: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer | None:
    """The client optimizer for ``deepspeed.initialize``: torch's fused AdamW, or None for
    Muon (DeepSpeed builds it from :func:`muon_config`)."""
    import torch

    t = cfg.trainer
    if isinstance(t.optimizer, MuonConfig):
        return None
    return torch.optim.AdamW(params, lr=t.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=t.weight_decay,
                             fused=True)


def muon_config(cfg: Config) -> dict[str, Any]:
    """What the DeepSpeed config dict gets for Muon (merged into it by the caller): the
    optimizer section and, under ZeRO-3, ``reduce_scatter`` off. Empty for AdamW."""
    t, muon = cfg.trainer, cfg.trainer.optimizer
    if not isinstance(muon, MuonConfig):
        return {}
    params = {"lr": t.lr, "muon_lr": muon.lr or t.lr, "adam_lr": t.lr, "momentum": muon.momentum,
              "weight_decay": t.weight_decay, "betas": [0.9, 0.999], "eps": 1e-8, "torch_adam": True}
    out: dict[str, Any] = {"optimizer": {"type": "Muon", "params": params}}
    if t.zero_stage == 3:
        out["zero_optimization"] = {"stage": 3, "reduce_scatter": False}
    return out


def step_context(cfg: Config, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Around ``engine.step()``: Muon's compiled update run eagerly on a CPU (module docstring)."""
    if isinstance(cfg.trainer.optimizer, MuonConfig) and device_type == "cpu":
        import torch

        return torch.compiler.set_stance("force_eager")
    return contextlib.nullcontext()


def optimizer_kind(optimizer: Any) -> str:
    """The class name of the optimizer under DeepSpeed's wrappers (ZeRO, bf16), for tests and
    the start-up log: ``AdamW`` or ``MuonWithAuxAdam``."""
    inner = optimizer
    for _ in range(4):
        nested = getattr(inner, "optimizer", None)
        if nested is None:
            break
        inner = nested
    return type(inner).__name__
