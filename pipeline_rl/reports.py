"""What a trainer rank reports about a step: plain-number messages, torch-free.

The driver unpickles these from the trainer actors' answers, so their module must not
import torch (the driver never imports it: a second of a core during start-up); the
trainer, the loss and the micro-batch code build them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass
class LossMetrics:
    """Diagnostics of one policy_loss call (plain Python numbers; see ``as_dict``).

    Token statistics run over *valid* tokens (in the mask, finite log-probs);
    ratios are ``π/μ`` (``π_prox/μ`` for PPO). ``ess = (Σw)² / (n Σw²)`` over valid
    tokens (1 = uniform weights, 0 = no weight left).
    """

    loss: float                # total loss value (policy + KL penalty)
    pg_loss: float             # policy-gradient term
    kl_ref: float              # KL-to-reference term, before kl_coef (0 when off)
    mismatch_kl_k1: float      # mean(logμ - logπ)
    mismatch_kl_k3: float      # mean(ρ - 1 - log ρ), ρ = π/μ
    masked_token_frac: float   # mask tokens given weight 0 (by the method or non-finite)
    masked_seq_frac: float     # non-empty sequences with no token left
    clipped_frac: float        # valid tokens whose weight hit the cap (tis, seq-mask-tis)
    ppo_clipped_frac: float    # valid tokens on the clipped PPO branch (0 for reinforce)
    ess: float
    ratio_mean: float
    ratio_max: float
    ratio_min: float
    adv_mean: float
    adv_std: float
    num_tokens: float          # mask tokens
    num_valid_tokens: float
    nonfinite_tokens: float    # mask tokens dropped for a non-finite log-prob
    num_seqs: float            # non-empty sequences
    num_rows: float            # B
    weight_sum: float          # Σw (for merging micro-batches)
    weight_sq_sum: float       # Σw²
    normalizer: float          # N used
    all_masked: bool           # no valid token: loss 0, gradient 0
    entropy_bonus: float = 0.0  # Σ v·s·H / N, before entropy_coef (0 when off)

    def as_dict(self) -> dict[str, float]:
        """Flat ``name -> float`` for logging (``all_masked`` as 0/1)."""
        return {k: float(v) for k, v in asdict(self).items()}

    @staticmethod
    def merge(parts: Sequence["LossMetrics"]) -> "LossMetrics":
        """Combine the metrics of the micro-batches of one step (losses add up when they
        shared the full-batch normaliser; means are re-weighted by their counts)."""
        if not parts:
            raise ValueError("LossMetrics.merge: no parts")

        def wmean(field: str, by: str) -> float:
            tot = sum(getattr(p, by) for p in parts)
            return sum(getattr(p, field) * getattr(p, by) for p in parts) / tot if tot else 0.0

        valid = sum(p.num_valid_tokens for p in parts)
        rows = sum(p.num_rows for p in parts)
        adv_mean = wmean("adv_mean", "num_rows")
        adv_sq = sum((p.adv_std ** 2 + p.adv_mean ** 2) * p.num_rows for p in parts) / max(rows, 1.0)
        w_sum = sum(p.weight_sum for p in parts)
        w_sq = sum(p.weight_sq_sum for p in parts)
        return LossMetrics(
            loss=sum(p.loss for p in parts), pg_loss=sum(p.pg_loss for p in parts),
            kl_ref=sum(p.kl_ref for p in parts),
            mismatch_kl_k1=wmean("mismatch_kl_k1", "num_valid_tokens"),
            mismatch_kl_k3=wmean("mismatch_kl_k3", "num_valid_tokens"),
            masked_token_frac=wmean("masked_token_frac", "num_tokens"),
            masked_seq_frac=wmean("masked_seq_frac", "num_seqs"),
            clipped_frac=wmean("clipped_frac", "num_valid_tokens"),
            ppo_clipped_frac=wmean("ppo_clipped_frac", "num_valid_tokens"),
            ess=w_sum * w_sum / (valid * w_sq) if w_sq > 0 else 0.0,
            ratio_mean=wmean("ratio_mean", "num_valid_tokens") if valid else 1.0,
            ratio_max=max(p.ratio_max for p in parts), ratio_min=min(p.ratio_min for p in parts),
            adv_mean=adv_mean, adv_std=math.sqrt(max(adv_sq - adv_mean ** 2, 0.0)),
            num_tokens=sum(p.num_tokens for p in parts), num_valid_tokens=valid,
            nonfinite_tokens=sum(p.nonfinite_tokens for p in parts),
            num_seqs=sum(p.num_seqs for p in parts), num_rows=rows,
            weight_sum=w_sum, weight_sq_sum=w_sq, normalizer=parts[0].normalizer,
            all_masked=all(p.all_masked for p in parts),
            entropy_bonus=sum(p.entropy_bonus for p in parts))


@dataclass(frozen=True, slots=True)
class LagStats:
    """Staleness of a batch when the trainer takes it (docs/design.md section 2).

    Per completion: lag = trainer version - oldest token version (completions without tokens are
    left out). ``hist[k]`` counts completions with lag ``k``. ``mixed_version_frac``: fraction of
    completions whose tokens came from more than one policy version (spanned an in-flight update).
    """

    mean: float
    max: int
    hist: tuple[int, ...]
    mixed_version_frac: float


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one :meth:`Trainer.step` did (this rank's view; ``loss`` is the global batch loss).

    ``version``: policy version after the step; ``num_tokens``: completion tokens in this rank's
    share; ``lag``: staleness of the batch measured against the version that consumed it;
    ``pad_frac``: padding share of the micro-batch inputs; ``grad_norm``: before clipping
    (None when DeepSpeed does not report it); ``entropy``: mean of ``-log π`` over this
    rank's completion tokens under the policy at the start of the step (the Monte Carlo
    estimate of the policy's per-token entropy on what it sampled, in nats).
    """

    version: int
    loss: float
    metrics: LossMetrics
    step_time_s: float
    num_tokens: int
    num_seqs: int
    num_groups: int
    num_micro_batches: int
    lag: LagStats
    mixed_version_frac: float
    reward_mean: float
    pad_frac: float
    grad_norm: float | None
    entropy: float = 0.0
    lr: float = 0.0


@dataclass(frozen=True, slots=True)
class RankStepReport:
    """What one rank did in one pipeline step.

    ``wait_s``: blocked waiting for the batch (the trainer's idle time); ``publish_s``:
    copying the weights out and handing them to the publisher (on the training thread);
    ``wall_s``: the whole step, wait included, so ``sum(wait_s) / sum(wall_s)`` is the
    idle fraction of any window; ``step_end_at``: when the optimizer step ended, before
    its weights were copied out (``time.time()``: the start of a weight sync).
    """

    result: StepResult
    wait_s: float
    publish_s: float
    wall_s: float
    step_end_at: float = 0.0
