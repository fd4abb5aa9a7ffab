"""``--trainer.*``: the DeepSpeed trainer ranks (batching, learning rate and its schedule, the
optimizer, checkpoints). A section of :class:`pipeline_rl.config.Config`, in a module of its own like
``lora_config.py``; the optimizer choice is ``optimizer_config.py``'s. It imports no torch, DeepSpeed,
vLLM or Ray.

Invariants: the checks that need another section (the batch a multiple of ``rollout.n`` and split
evenly over the ranks, warm-up below ``max_steps``, no moving average under ZeRO-3) are
``Config``'s (``pipeline_rl/config/tree.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from pipeline_rl.config_section import Section
from pipeline_rl.config.optimizer_config import AdamWConfig, OptimizerConfig, optimizer_table

LRScheduleName = Literal["constant", "linear", "cosine"]


class TrainerConfig(Section):
    """DeepSpeed trainers."""

    num_ranks: int = Field(1, ge=1, le=4096, description="Data-parallel trainer ranks.")
    batch_size: int = Field(32, ge=2, description="Sequences per optimizer step (multiple of "
                            "rollout.n).")
    micro_batch_size: int = Field(32, ge=1, description="Sequences per forward/backward pass (at most).")
    micro_batch_tokens: int = Field(4096, ge=0, description="Padded tokens per forward/backward "
                                    "pass (at most; rows x longest row, sequences sorted by "
                                    "length): with heavy-tailed lengths the few long sequences "
                                    "share a narrow pass instead of padding every row to their "
                                    "length. 0 = rows only (always so under ZeRO-3).")
    pass_cost_tokens: int = Field(96, ge=0, description="What one more forward/backward pass "
                                  "costs, in padded token slots: micro-batches are cut where a "
                                  "narrow pass for the few longest rows saves more padding than "
                                  "that (measured on the built-in model: about 100). 0 = fill "
                                  "each pass up to the row and token limits. Ignored under ZeRO-3.")
    share_prompts: bool = Field(True, description="Run each group's prompt once per forward "
                                "pass and its completions on top of the prompt's KV cache, "
                                "instead of the prompt again in every row: the same log-probs "
                                "and gradients from fewer tokens (rows of 10 prompt + 5 "
                                "completion tokens: about half the step). Off under ZeRO-3 and "
                                "for models whose cache is not a plain KV cache (checked at "
                                "start-up; one warning line).")
    lr: float = Field(2e-4, gt=0.0, le=1.0, description="Learning rate (AdamW's; with --trainer.optimizer "
                      "muon, that of the parameters Muon leaves to AdamW), before the schedule.")
    lr_schedule: LRScheduleName = Field("constant", description="Learning rate by step: constant, or a "
                                        "linear or cosine decay to 0 at --max-steps, after the warm-up.")
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warm-up to the full rate (step s of "
                              "the first N uses (s+1)/N of it), before the schedule (0 = none).")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="Decoupled weight decay (AdamW's and Muon's).")
    optimizer: OptimizerConfig = Field(default_factory=lambda: AdamWConfig(), description="adamw "
                                       "(torch's fused AdamW), or muon (DeepSpeed's Muon for the 2-D hidden "
                                       "matrices, AdamW for the embeddings, head, norms and biases, as "
                                       "DeepSpeed splits them), with its own --trainer.optimizer.lr and .momentum.")

    @field_validator("optimizer", mode="before")
    @classmethod
    def _optimizer_table(cls, v: object) -> object:   # "muon" is {type = "muon"} (optimizer_config.py)
        return optimizer_table(v)
    gradient_checkpointing: bool = Field(False, description="Recompute each decoder layer's activations "
                                         "in the backward pass instead of keeping them (Hugging Face "
                                         "models; any ZeRO stage): less memory for long completions, "
                                         "about one more forward pass of time. Turns prompt sharing off.")
    ema_decay: float = Field(0.0, ge=0.0, lt=1.0, description="Keep an exponential moving average of the "
                             "trained weights with this decay per optimizer step (0 = off), saved as a "
                             "Hugging Face folder ema/ in each checkpoint; the rollout workers keep the "
                             "live weights. Not with ZeRO-3.")
    grad_clip: float = Field(1.0, ge=0.0, description="Gradient norm clip (0 = off).")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    checkpoint_every: int = Field(0, ge=0, description="Checkpoint every N steps (0 = by time "
                                  "and at the end only).")
    checkpoint_every_s: float = Field(300.0, ge=0.0, description="Also checkpoint when this many "
                                      "seconds passed since the last checkpoint (0 = off), so a "
                                      "crash loses minutes, not the run.")
    batch_timeout_s: float = Field(600.0, gt=0.0, description="Give up when no batch arrives this long.")
    keep_checkpoints: int = Field(0, ge=0, le=1_000_000, description="Keep the newest K checkpoints, plus "
                                  "the best by held-out greedy accuracy when evaluation runs (the "
                                  "checkpoints/best link); older ones are deleted (0 = keep all).")
