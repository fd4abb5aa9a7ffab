"""Off-policy correction, advantages and the policy objective (docs/design.md section 4,
docs/objectives.md).

- ``weights.py``: the log-ratio and the weights every correction shares.
- ``compose.py``: the corrections: presets ``none`` / ``tis`` / ``icepop`` / ``seq-mask-tis`` /
  ``m2po`` and any composition (importance weight x rejection x veto x M2PO's mask).
- ``advantages.py``: ``grpo`` / ``dr_grpo`` / ``rloo`` group advantages.
- ``objectives.py``: the per-token terms of ``reinforce`` / ``ppo`` / ``gspo`` / ``gspo-token`` /
  ``cispo``.
- ``loss.py``: :func:`policy_loss` (objective, normalisation, KL penalty, diagnostics) and
  :func:`loss_normalizer` for gradient accumulation.
- ``fused.py``: the one-pass CPU kernel behind the default objective.

Trainer usage per optimizer step::

    n = loss_normalizer(full_mask, cfg.algorithm)
    for mb in micro_batches:
        loss, metrics = policy_loss(mb, cfg.algorithm, cfg.correction, normalizer=n)
        loss.backward()            # gradients add up to the full-batch gradient
"""

from pipeline_rl.correction.advantages import compute_advantages
from pipeline_rl.correction.compose import CORRECTIONS, PRESETS, Composition, composition, correction_weights
from pipeline_rl.correction.loss import LossMetrics, PolicyBatch, loss_normalizer, policy_loss
from pipeline_rl.correction.objectives import OBJECTIVES
from pipeline_rl.correction.weights import CorrectionWeights, LogRatio

__all__ = ["CORRECTIONS", "OBJECTIVES", "PRESETS", "Composition", "CorrectionWeights", "LogRatio",
           "LossMetrics", "PolicyBatch", "composition", "compute_advantages", "correction_weights",
           "loss_normalizer", "policy_loss"]
