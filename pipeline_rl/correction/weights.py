"""Off-policy correction weights (docs/design.md section 4), one small function per method.

Notation per completion token ``t``: ``logμ_t`` the behaviour log-prob from the
generator, ``logπ_t`` the trainer's log-prob, ``r_t = logπ_t - logμ_t`` (always
detached here: the weights are constants of the objective), mask ``m_t``.

=================  ==========================================================
``none``           ``w = 1``
``tis``            ``w = min(exp(r), C)``
``icepop``         ``w = exp(r)`` if ``α <= exp(r) <= β``, else 0
``seq-mask-tis``   every token of a sequence whose geometric-mean ratio
                   ``exp(Σ m r / Σ m)`` lies outside ``[lo, hi]`` gets 0; the
                   kept sequences get ``min(exp(r), C)``
=================  ==========================================================

Numerical rules shared by every method (and by the fused CPU kernel in
``fused.py``, which must agree with these functions):

- A token is *valid* when it is in the mask and both log-probs are *usable*:
  ``|x| < LOGP_LIMIT`` (1e20; false for ``±inf`` and ``nan``; no real log-prob is
  anywhere near, so larger values are sentinels). Invalid tokens get weight 0 and
  never reach a sum: a ``-inf`` / ``nan`` log-prob cannot poison the loss.
- Ratios are formed as ``exp(clamp(r, -R, R))`` with ``R = RATIO_LOG_CLAMP``
  (50, ratio ≈ 5e21): a ratio of 1e30 saturates instead of overflowing. Every
  cap and band in the table lies far inside that range, so the clamp never
  changes a kept weight by more than ``e^-50``; comparisons against the bands
  use the unclamped ``r`` (in log space, so no overflow either).

Adding a method: write ``fn(lr: LogRatio, cfg: CorrectionConfig) -> CorrectionWeights``
and add one line to :data:`CORRECTIONS` (and its name to ``CorrectionName`` in
``config.py``). It then runs on the reference path; the fused kernel covers
the four built-in names only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from pipeline_rl.config import CorrectionConfig

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


CorrectionFn = Callable[[LogRatio, CorrectionConfig], CorrectionWeights]


def _capped(lr: LogRatio, cap: float, keep: Tensor) -> CorrectionWeights:
    """``min(exp(r), cap)`` on ``keep`` tokens, 0 elsewhere."""
    log_cap = math.log(cap)
    w = torch.exp(lr.r.clamp(-RATIO_LOG_CLAMP, log_cap))      # [B, T] = min(exp(r), C)
    return CorrectionWeights(weights=torch.where(keep, w, 0.0), kept=keep,
                             clipped=keep & (lr.r > log_cap))


def no_correction(lr: LogRatio, cfg: CorrectionConfig) -> CorrectionWeights:
    """``w = 1`` on every valid token (plain on-policy REINFORCE)."""
    return CorrectionWeights(weights=lr.valid.to(lr.r.dtype), kept=lr.valid,
                             clipped=torch.zeros_like(lr.valid))


def tis(lr: LogRatio, cfg: CorrectionConfig) -> CorrectionWeights:
    """Truncated importance sampling (Yao et al. 2025): ``w = min(exp(r), C)``, ``C = tis_cap``."""
    return _capped(lr, cfg.tis_cap, lr.valid)


def icepop(lr: LogRatio, cfg: CorrectionConfig) -> CorrectionWeights:
    """IcePop (Ring-1T): ``w = exp(r)`` inside ``[α, β]``, 0 outside (token masking, no cap)."""
    keep = lr.valid & (lr.r >= math.log(cfg.icepop_alpha)) & (lr.r <= math.log(cfg.icepop_beta))
    return CorrectionWeights(weights=torch.where(keep, lr.ratio(), 0.0), kept=keep,
                             clipped=torch.zeros_like(keep))


def seq_log_ratio(lr: LogRatio) -> tuple[Tensor, Tensor]:
    """Per sequence: mean log-ratio over valid tokens ``[B]`` and whether it has any ``[B]``."""
    n = lr.valid.sum(dim=1)                                   # [B]
    return lr.r.sum(dim=1) / n.clamp(min=1), n > 0


def seq_mask_tis(lr: LogRatio, cfg: CorrectionConfig) -> CorrectionWeights:
    """Sequence masking (Geo-RS) then per-token TIS: a sequence whose geometric-mean ratio
    ``exp(mean_t r)`` lies outside ``[seq_lo, seq_hi]`` is dropped whole; the kept ones get
    ``min(exp(r), seq_cap)``. The test is done in log space (no overflow)."""
    mean_r, nonempty = seq_log_ratio(lr)                      # [B], [B]
    # A row with a masked-in token whose log-prob is -inf/nan is rejected whole: such a
    # catastrophic token is what this method exists to catch, not one to average past.
    ok = nonempty & lr.complete & (mean_r >= math.log(cfg.seq_lo)) & (mean_r <= math.log(cfg.seq_hi))
    return _capped(lr, cfg.seq_cap, lr.valid & ok[:, None])


#: Name -> method. The names are ``CorrectionName`` in config.py.
CORRECTIONS: dict[str, CorrectionFn] = {
    "none": no_correction,
    "tis": tis,
    "icepop": icepop,
    "seq-mask-tis": seq_mask_tis,
}


def correction_weights(name: str, logp_train: Tensor, logp_behav: Tensor, mask: Tensor,
                       cfg: CorrectionConfig) -> CorrectionWeights:
    """Weights of method ``name`` for ``[B, T]`` trainer/behaviour log-probs and mask."""
    if name not in CORRECTIONS:
        raise ValueError(f"correction.type: unknown correction {name!r} "
                         f"(known: {', '.join(CORRECTIONS)})")
    return CORRECTIONS[name](LogRatio.build(logp_train, logp_behav, mask), cfg)
