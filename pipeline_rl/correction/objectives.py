"""The policy objectives' per-token terms (``--algorithm.loss``; docs/objectives.md), pure functions.

Shapes: ``B`` sequences padded to ``T`` tokens. Every function takes

- ``lp`` ``[B, T]``: the trainer's log-probs ``logπ_θ`` (differentiable), 0 off ``valid``;
- ``ref`` ``[B, T]``: the ratio's reference log-probs (detached), 0 off ``valid``:
  the proximal policy (the trainer at the start of the step, AReaL's decoupled PPO) or the
  behaviour policy (``--algorithm.ratio_reference``);
- ``valid`` ``[B, T]`` bool: the tokens that count (in the mask, usable log-probs);
- ``coef`` ``[B, T]`` (detached): ``w_t · A_b · s_b``, the correction weight times the
  advantage times the normalisation's row scale, 0 off the kept tokens;
- ``lo, hi``: the clip interval ``[1 − ε_low, 1 + ε_high]`` (:func:`clip_range`);

and returns ``(term, clipped)``, both ``[B, T]``: the loss is ``L = −Σ term / N``; ``clipped``
marks the valid tokens on a clipped branch (``ppo_clipped_frac``). Log-ratios are clamped to
±20 before ``exp`` (as verl), so nothing overflows. With ``ρ = exp(lp − ref)``:

- ``reinforce``: ``term = coef · logπ``.
- ``ppo``: ``term = min(ρ·coef, clip(ρ, lo, hi)·coef)`` (Schulman et al. 2017; DAPO's
  decoupled ``ε_low``/``ε_high``, arXiv 2503.14476).
- ``gspo`` (GSPO, Zheng et al., arXiv 2507.18071): the sequence ratio
  ``s_b = exp(mean_{t valid} (logπ − ref))``, the geometric mean of the token ratios;
  ``term = min(s_b·coef, clip(s_b, lo, hi)·coef)`` on every token of the sequence: with
  ``--algorithm.normalization sequence`` and no correction it is the paper's
  ``−1/G Σ_b min(s_b A_b, clip(s_b) A_b)`` exactly; its gradient
  ``s_b A_b / |y_b| · Σ_t ∇logπ_t`` on the unclipped branch, 0 on the clipped one.
- ``gspo-token`` (GSPO-token, same paper): ``s_t = sg[s_b] · π_t / sg[π_t]``, the same value
  as ``s_b``; ``term = min(s_t·coef, clip(s_t, lo, hi)·coef)``: each token's gradient is
  ``s_b · coef_t · ∇logπ_t`` (its own advantage), 0 where the sequence is clipped.
- ``cispo`` (CISPO, MiniMax-M1, arXiv 2506.13585): ``term = sg(clip(ρ, lo, hi)) · coef · logπ``:
  the clipped ratio is a constant weight, so no token loses its gradient.

The clip interval is inclusive: a ratio exactly on a bound takes the unclipped gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from pipeline_rl.config import AlgorithmConfig

#: Log-ratios of the ratio objectives (and the KL) are clamped to ±20 before exp (as verl).
PPO_LOG_CLAMP = 20.0

Term = Callable[[Tensor, Tensor, Tensor, Tensor, float, float], tuple[Tensor, Tensor]]


def clip_range(algo: AlgorithmConfig) -> tuple[float, float]:
    """``(1 − ε_low, 1 + ε_high)``: each side ``ppo_clip`` unless ``ppo_clip_low`` /
    ``ppo_clip_high`` sets it."""
    low = algo.ppo_clip if algo.ppo_clip_low is None else algo.ppo_clip_low
    high = algo.ppo_clip if algo.ppo_clip_high is None else algo.ppo_clip_high
    return 1.0 - low, 1.0 + high


def reinforce(lp: Tensor, ref: Tensor, valid: Tensor, coef: Tensor, lo: float, hi: float
              ) -> tuple[Tensor, Tensor]:
    """``coef · logπ`` [B, T] (no ratio, nothing clipped)."""
    return coef * lp, torch.zeros_like(valid)


def ppo(lp: Tensor, ref: Tensor, valid: Tensor, coef: Tensor, lo: float, hi: float
        ) -> tuple[Tensor, Tensor]:
    """Token-ratio PPO: ``min(ρ·coef, clip(ρ, lo, hi)·coef)`` [B, T]."""
    rho = torch.exp((lp - ref).clamp(-PPO_LOG_CLAMP, PPO_LOG_CLAMP))           # [B, T]
    rho_c = rho.clamp(lo, hi)
    return torch.minimum(rho * coef, rho_c * coef), valid & (rho_c * coef < rho * coef)


def sequence_ratio(lp: Tensor, ref: Tensor, valid: Tensor) -> Tensor:
    """GSPO's ``s_b = exp(Σ_t v_t (logπ − ref) / Σ_t v_t)`` [B] (1 for a sequence with no valid
    token), differentiable in ``lp``."""
    n = valid.sum(dim=1).clamp(min=1).to(lp.dtype)                               # [B]
    mean = torch.where(valid, lp - ref, 0.0).sum(dim=1) / n                      # [B]
    return torch.exp(mean.clamp(-PPO_LOG_CLAMP, PPO_LOG_CLAMP))


def gspo(lp: Tensor, ref: Tensor, valid: Tensor, coef: Tensor, lo: float, hi: float
         ) -> tuple[Tensor, Tensor]:
    """GSPO: the sequence's clipped term on each of its tokens, ``[B, T]``."""
    s = sequence_ratio(lp, ref, valid)[:, None]                                  # [B, 1]
    s_c = s.clamp(lo, hi)
    return torch.minimum(s * coef, s_c * coef), valid & (s_c * coef < s * coef)


def gspo_token(lp: Tensor, ref: Tensor, valid: Tensor, coef: Tensor, lo: float, hi: float
               ) -> tuple[Tensor, Tensor]:
    """GSPO-token: ``s_t = sg[s_b] · π_t / sg[π_t]`` (value ``s_b``), clipped per token, ``[B, T]``."""
    s = sequence_ratio(lp, ref, valid).detach()[:, None]                         # [B, 1] sg[s_b]
    s_t = s * torch.exp(lp - lp.detach())                                        # [B, T] value s_b
    s_c = s_t.clamp(lo, hi)
    return torch.minimum(s_t * coef, s_c * coef), valid & (s_c * coef < s_t * coef)


def cispo(lp: Tensor, ref: Tensor, valid: Tensor, coef: Tensor, lo: float, hi: float
          ) -> tuple[Tensor, Tensor]:
    """CISPO: ``sg(clip(ρ, lo, hi)) · coef · logπ`` [B, T]; ``clipped`` where the weight was cut."""
    rho = torch.exp((lp - ref).detach().clamp(-PPO_LOG_CLAMP, PPO_LOG_CLAMP))  # [B, T], constant
    rho_c = rho.clamp(lo, hi)
    return rho_c * coef * lp, valid & (rho_c != rho)


#: ``--algorithm.loss`` -> its per-token term.
OBJECTIVES: dict[str, Term] = {"reinforce": reinforce, "ppo": ppo, "gspo": gspo, "gspo-token": gspo_token,
                               "cispo": cispo}
