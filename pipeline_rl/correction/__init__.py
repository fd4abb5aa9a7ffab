"""Off-policy correction, advantages and the policy objective (docs/design.md section 4).

- ``weights.py``: correction weights ``none`` / ``tis`` / ``icepop`` / ``seq-mask-tis``
  (registry :data:`CORRECTIONS`).
- ``advantages.py``: ``grpo`` / ``dr_grpo`` / ``rloo`` group advantages.
- ``loss.py``: :func:`policy_loss` (reinforce / decoupled PPO, normalisation, KL
  penalty, diagnostics) and :func:`loss_normalizer` for gradient accumulation.
- ``fused.py``: the one-pass CPU kernel behind the default objective.

Trainer usage per optimizer step::

    n = loss_normalizer(full_mask, cfg.algorithm)
    for mb in micro_batches:
        loss, metrics = policy_loss(mb, cfg.algorithm, cfg.correction, normalizer=n)
        loss.backward()            # gradients add up to the full-batch gradient
"""

from pipeline_rl.correction.advantages import compute_advantages
from pipeline_rl.correction.loss import LossMetrics, PolicyBatch, loss_normalizer, policy_loss
from pipeline_rl.correction.weights import (CORRECTIONS, CorrectionWeights, LogRatio,
                                            correction_weights)

__all__ = ["CORRECTIONS", "CorrectionWeights", "LogRatio", "LossMetrics", "PolicyBatch",
           "compute_advantages", "correction_weights", "loss_normalizer", "policy_loss"]
