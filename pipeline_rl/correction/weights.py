"""What every off-policy correction shares (docs/design.md section 4): the log-ratio and the weights.

Notation per completion token ``t``: ``logμ_t`` the behaviour log-prob from the
generator, ``logπ_t`` the trainer's log-prob, ``r_t = logπ_t - logμ_t`` (always
detached here: the weights are constants of the objective), mask ``m_t``. The
corrections themselves (presets ``none`` / ``tis`` / ``icepop`` / ``seq-mask-tis`` / ``m2po``
and any composition) are ``compose.py``.

Numerical rules shared by every method (and by the fused CPU kernel in
``fused.py``, which must agree with ``compose.py``):

- A token is *valid* when it is in the mask and both log-probs are *usable*:
  ``|x| < LOGP_LIMIT`` (1e20; false for ``±inf`` and ``nan``; no real log-prob is
  anywhere near, so larger values are sentinels). Invalid tokens get weight 0 and
  never reach a sum: a ``-inf`` / ``nan`` log-prob cannot poison the loss.
- Ratios are formed as ``exp(clamp(r, -R, R))`` with ``R = RATIO_LOG_CLAMP``
  (50, ratio ≈ 5e21): a ratio of 1e30 saturates instead of overflowing. Every
  cap and band of the presets lies far inside that range, so the clamp never
  changes a kept weight by more than ``e^-50``; comparisons against the bands
  use the unclamped ``r`` (in log space, so no overflow either).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


#: Log-ratios are clamped to ``[-R, R]`` before ``exp`` (weights and statistics).
RATIO_LOG_CLAMP = 50.0
#: A log-prob is usable when its magnitude is below this (finite, not a sentinel).
LOGP_LIMIT = 1e20


def usable(logp: Tensor) -> Tensor:
    """``|logp| < LOGP_LIMIT`` elementwise (False for inf and nan)."""
    return logp.abs() < LOGP_LIMIT


@dataclass(frozen=True)
class LogRatio:
    """Per-token log importance ratio, prepared once and shared by every method.

    Invariants: ``r``, ``valid`` are ``[B, T]``; ``r`` is float32 (float64 for float64
    input, for gradient checks), detached, finite,
    and 0 wherever ``valid`` is False; ``valid`` implies mask.
    """

    r: Tensor      # [B, T] float32, log(π/μ), 0 off valid
    valid: Tensor  # [B, T] bool, mask & finite log-probs
    complete: Tensor  # [B] bool, every masked-in token of the row is valid

    @staticmethod
    def build(logp_train: Tensor, logp_behav: Tensor, mask: Tensor,
              also_usable: Tensor | None = None) -> "LogRatio":
        """From raw ``[B, T]`` log-probs (any float dtype, may hold -inf/nan) and a mask;
        ``also_usable`` (``[B, T]`` bool) marks further tokens as unusable (PPO: the current
        log-probs, when the ratio is taken against the proximal ones)."""
        if logp_train.shape != logp_behav.shape or logp_train.shape != mask.shape or logp_train.dim() != 2:
            raise ValueError(f"correction: logp_train {tuple(logp_train.shape)}, logp_behav "
                             f"{tuple(logp_behav.shape)} and mask {tuple(mask.shape)} must be equal [B, T]")
        dt = torch.float64 if logp_train.dtype == torch.float64 else torch.float32
        lp, bl = logp_train.detach().to(dt), logp_behav.detach().to(dt)    # [B, T]
        valid = mask.bool() & usable(lp) & usable(bl)                    # [B, T]
        if also_usable is not None:
            valid &= also_usable
        complete = valid.sum(dim=1) == mask.bool().sum(dim=1)             # [B]
        return LogRatio(r=torch.where(valid, lp - bl, 0.0), valid=valid, complete=complete)

    def ratio(self) -> Tensor:
        """``exp(clamp(r, ±R))`` [B, T]; 1 off valid (callers multiply by ``valid``)."""
        return torch.exp(self.r.clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP))


@dataclass(frozen=True)
class CorrectionWeights:
    """What a correction method returns.

    Invariants: all ``[B, T]``; ``weights`` is float32, detached, finite, ``>= 0``
    and 0 off ``kept``; ``kept`` implies valid (a valid token not kept was masked
    by the method); ``clipped`` implies kept (its weight was truncated by a cap).
    """

    weights: Tensor  # [B, T] float32 (float64 for float64 input)
    kept: Tensor     # [B, T] bool
    clipped: Tensor  # [B, T] bool
