"""Forward, loss and backward over a step's micro-batches, gradients accumulating (no
optimizer step): what :class:`pipeline_rl.training.trainer.Trainer` runs once per PPO epoch.

Shared-prompt micro-batches come in blocks (``pipeline_rl.training.batching``): a block's
prompts run once (:func:`pipeline_rl.training.logprobs.run_prompts`), each of its
micro-batches continues from them and backpropagates to them, and one more backward, after
the block's last micro-batch, carries what they gathered through the prompt pass
(:meth:`PromptPass.surrogate`). Padded micro-batches run alone.

Invariant: the summed gradient equals running every micro-batch on its own (each with its
own prompt pass), to float rounding (tested): only the number of prompt passes changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline_rl.config import Config
from pipeline_rl.correction.loss import PolicyBatch, policy_loss
from pipeline_rl.reports import LossMetrics
from pipeline_rl.training.batching import AnyMicroBatch, SharedPromptBatch
from pipeline_rl.training.logprobs import PromptPass, micro_batch_logp, micro_batch_logp_entropy, run_prompts


@dataclass(slots=True)
class Accumulated:
    """What one pass over the micro-batches leaves: the summed loss, each micro-batch's
    detached log-probs (laid out like its ``mask``) and loss metrics, in micro-batch order."""

    loss_sum: float = 0.0
    logps: list[torch.Tensor] = field(default_factory=list)
    parts: list[LossMetrics] = field(default_factory=list)


def accumulate(engine: Any, cfg: Config, mbs: Sequence[AnyMicroBatch], norm: float,
               prox: Sequence[torch.Tensor] | None, ref: Sequence[torch.Tensor] | None) -> Accumulated:
    """Forward + loss + backward of every micro-batch through ``engine`` (a DeepSpeed engine:
    ``engine.backward``), the loss normalised by ``norm``; ``prox``/``ref``: per micro-batch
    proximal and reference log-probs, or None."""
    out = Accumulated()
    prompts: PromptPass | None = None
    for i, mb in enumerate(mbs):
        if isinstance(mb, SharedPromptBatch) and mb.runs_prompts:
            _close(engine, prompts)
            prompts = run_prompts(engine, mb)
        shared = prompts if isinstance(mb, SharedPromptBatch) else None
        ent = None
        if cfg.algorithm.entropy_coef > 0:   # the entropy bonus needs the whole distribution
            logp, ent = micro_batch_logp_entropy(engine, mb, cfg.rollout.temperature, shared)
        else:
            logp = micro_batch_logp(engine, mb, cfg.rollout.temperature, shared)         # like mb.mask
        batch = PolicyBatch(logp=logp, behav_logp=mb.behav_logp, mask=mb.mask, advantages=mb.advantages,
                            prox_logp=prox[i] if prox else None, ref_logp=ref[i] if ref else None)
        batch.entropy = ent
        loss, metrics = policy_loss(batch, cfg.algorithm, cfg.correction, normalizer=norm)
        engine.backward(loss, scale_wrt_gas=False)
        out.loss_sum += float(loss.detach())
        out.logps.append(logp.detach())
        out.parts.append(metrics)
    _close(engine, prompts)
    return out


def _close(engine: Any, prompts: PromptPass | None) -> None:
    """Backpropagate what a block's micro-batches gathered at its prompts' outputs."""
    if prompts is None:
        return
    surrogate = prompts.surrogate()
    if surrogate is not None:
        engine.backward(surrogate, scale_wrt_gas=False)
