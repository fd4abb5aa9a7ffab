"""An exponential moving average of the trained weights (``--trainer.ema_decay``).

Kept on the trainer's rank 0 only, in float32 on the trainer's device, one tensor per trained
parameter, and updated after every optimizer step::

    ema_0 = theta_0 (the weights the run starts from);  ema_t = d * ema_{t-1} + (1 - d) * theta_t

(``theta`` the module's parameters as the engine holds them; bf16 parameters are averaged into
the float32 copy). Nothing of it reaches the rollout workers: they keep getting the live
weights. Under ZeRO 0-2 every rank holds the whole parameters, so rank 0 alone keeps it
(ZeRO-3 partitions them: refused at start-up).

Saved in each checkpoint as ``ema/``, a folder that loads as it is, in the format of the
checkpoint itself, float32, with the tokenizer files:

- full fine-tuning: a Hugging Face model folder (``save_pretrained`` of the model with the
  averaged weights; its ``config.json`` says float32);
- LoRA: a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``: the
  averaged adapter under PEFT's saved names, ``training.lora``), which
  ``peft.PeftModel.from_pretrained`` puts on the base model the config names.

Invariant: :meth:`EmaWeights.load` of a folder :meth:`EmaWeights.save` wrote gives back the
averages bit for bit (each parameter is looked up under the name it is saved under,
:meth:`EmaWeights.saved_name`). A save runs on the checkpoint writer's thread while training
goes on: it reads the live module (its config, PEFT's adapter config) and changes nothing of it.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch

from pipeline_rl.training.checkpoint import CheckpointError, copy_tokenizer_files
from pipeline_rl.training.lora import ADAPTER_NAME, wire_name, write_adapter

log = logging.getLogger(__name__)

#: The EMA's folder inside a checkpoint.
EMA_DIR = "ema"


class EmaWeights:
    """The average of ``module``'s trainable parameters (module docstring); ``module`` a PEFT
    model (LoRA: the adapter's parameters are the trainable ones) or a plain Hugging Face one."""

    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"trainer.ema_decay: must be in (0, 1), got {decay}")
        self.module, self.decay = module, decay
        self.adapter = hasattr(module, "peft_config")   # LoRA: saved as PEFT's adapter folder
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.avg = {n: p.detach().float().clone() for n, p in self.params.items()}

    def saved_name(self, name: str) -> str:
        """The name parameter ``name``'s average is saved under (LoRA: PEFT's saved name, the
        adapter's name dropped; full fine-tuning: the parameter's own)."""
        return wire_name(name) if self.adapter else name

    @torch.no_grad()
    def update(self) -> None:
        """One optimizer step's update: ``ema = d * ema + (1 - d) * theta``."""
        names = list(self.avg)
        avgs = [self.avg[n] for n in names]
        torch._foreach_lerp_(avgs, [self.params[n].detach().float() for n in names], 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What :meth:`save` writes: LoRA, the adapter's averages by saved name; full
        fine-tuning, the module's full state dict with the trained parameters replaced by their
        averages (float32; frozen parameters and buffers as they are)."""
        if self.adapter:
            return {self.saved_name(n): a for n, a in self.avg.items()}
        by_id = {id(p): n for n, p in self.params.items()}
        state = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            name = by_id.get(id(value))   # a tied weight (lm_head = embeddings) maps to its average too
            state[key] = self.avg[name] if name is not None else value.detach().float()
        return state

    def save(self, out: Path, model_dir: Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """``out`` as a folder that loads as it is (module docstring); ``state``: a copy of
        :meth:`state_dict` taken earlier (a background write), else the current one."""
        state = self.state_dict() if state is None else state
        out.mkdir(parents=True, exist_ok=True)
        module: Any = self.module
        if self.adapter:
            write_adapter(out, state, module.peft_config[ADAPTER_NAME])
        else:
            module.save_pretrained(str(out), state_dict=state)
            config = copy.deepcopy(module.config)   # the folder holds float32: its config says so,
            config.dtype = torch.float32            # the live module's is left as it is
            config.save_pretrained(str(out))
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
        missing = [self.saved_name(n) for n in self.avg if self.saved_name(n) not in loaded]
        if missing:
            raise CheckpointError(f"checkpoint {ckpt_dir}: {EMA_DIR}/ lacks {len(missing)} parameter(s), "
                                  f"e.g. {missing[0]}")
        wrong = [n for n, a in self.avg.items() if loaded[self.saved_name(n)].shape != a.shape]
        if wrong:
            raise CheckpointError(f"checkpoint {ckpt_dir}: {EMA_DIR}/ holds {self.saved_name(wrong[0])} of shape "
                                  f"{tuple(loaded[self.saved_name(wrong[0])].shape)}, the model's is "
                                  f"{tuple(self.avg[wrong[0]].shape)}")
        self.avg = {n: loaded[self.saved_name(n)].to(device=a.device, dtype=torch.float32)
                    for n, a in self.avg.items()}
