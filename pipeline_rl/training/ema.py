"""An exponential moving average of the trained weights (``--trainer.ema_decay``).

Kept on the trainer's rank 0 only, in float32 on the trainer's device, one tensor per trained
parameter, and updated after every optimizer step::

    ema_0 = theta_0 (the weights the run starts from);  ema_t = d * ema_{t-1} + (1 - d) * theta_t

(``theta`` the module's parameters as the engine holds them; bf16 parameters are averaged into
the float32 copy). Nothing of it reaches the rollout workers: they keep getting the live
weights. Saved in each checkpoint as ``ema/``: a Hugging Face folder (``save_pretrained`` of the
model with the averaged weights, float32, plus the tokenizer files) that loads as it is; a resume
reads it back. Under ZeRO 0-2 every rank holds the whole parameters, so rank 0 alone keeps it
(ZeRO-3 partitions them: refused at start-up).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from pipeline_rl.training.checkpoint import CheckpointError, copy_tokenizer_files

log = logging.getLogger(__name__)

#: The EMA's folder inside a checkpoint.
EMA_DIR = "ema"


class EmaWeights:
    """The average of ``module``'s trainable parameters (module docstring)."""

    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"trainer.ema_decay: must be in (0, 1), got {decay}")
        self.module, self.decay = module, decay
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.avg = {n: p.detach().float().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self) -> None:
        """One optimizer step's update: ``ema = d * ema + (1 - d) * theta``."""
        names = list(self.avg)
        avgs = [self.avg[n] for n in names]
        torch._foreach_lerp_(avgs, [self.params[n].detach().float() for n in names], 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The module's full state dict with the trained parameters replaced by their averages
        (float32; frozen parameters and buffers as they are)."""
        by_id = {id(p): n for n, p in self.params.items()}
        state = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            name = by_id.get(id(value))   # a tied weight (lm_head = embeddings) maps to its average too
            state[key] = self.avg[name] if name is not None else value.detach().float()
        return state

    def save(self, out: Path, model_dir: Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """``out`` as a Hugging Face folder of the averaged model (loads as it is); ``state``:
        a copy of :meth:`state_dict` taken earlier (a background write), else the current one."""
        out.mkdir(parents=True, exist_ok=True)
        config: Any = self.module.config
        dtype = config.dtype
        config.dtype = torch.float32   # what the folder holds, so it loads as float32
        try:
            getattr(self.module, "save_pretrained")(str(out), state_dict=self.state_dict() if state is None else state)
        finally:
            config.dtype = dtype
        copy_tokenizer_files(model_dir, out)

    def load(self, ckpt_dir: Path) -> None:
        """The averages saved in checkpoint ``ckpt_dir``; a checkpoint saved without an EMA
        starts it from the loaded weights (one log line)."""
        d = ckpt_dir / EMA_DIR
        files = sorted(d.glob("*.safetensors"))
        if not files:
            log.warning("trainer: checkpoint %s has no %s/; the moving average starts from its weights",
                        ckpt_dir, EMA_DIR)
            self.avg = {n: p.detach().float().clone() for n, p in self.params.items()}
            return
        from safetensors.torch import load_file

        loaded: dict[str, torch.Tensor] = {}
        for f in files:
            loaded.update(load_file(str(f)))
        missing = [n for n in self.avg if n not in loaded]
        if missing:
            raise CheckpointError(f"checkpoint {ckpt_dir}: {EMA_DIR}/ lacks {len(missing)} parameter(s), "
                                  f"e.g. {missing[0]}")
        self.avg = {n: loaded[n].to(device=a.device, dtype=torch.float32) for n, a in self.avg.items()}
