"""The policy objective: corrected REINFORCE (default) or a ratio objective, with diagnostics.

Shapes: ``B`` sequences (completions) padded to ``T`` tokens. Per token ``t`` of
sequence ``b``: ``m`` mask (1 on completion tokens), ``w`` correction weight
(``weights.py``, detached), ``A_b`` the sequence's advantage, ``s_b`` the row
scale of the normalisation, ``N`` the normaliser.

- ``reinforce``: ``L = -Σ m·w·A·s·logπ / N``.
- ``ppo`` (AReaL's decoupled objective): ``ρ = π_θ / π_prox``,
  ``L = -Σ m·w·s·min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A) / N``, where the correction weight
  ``w`` is computed from ``π_prox / μ`` (the proximal policy against the
  behaviour policy), so it is constant across PPO epochs. ``prox_logp=None``
  means ``π_prox = π_θ`` detached (first epoch: ratio 1).
- ``gspo``, ``gspo-token``, ``cispo``: the same, with the per-token terms of
  ``objectives.py`` (GSPO's sequence ratio, GSPO-token, CISPO's clipped weight).
- ``algorithm.ratio_reference behaviour``: the ratio is ``π_θ / μ`` instead; it is then the
  importance weight itself, so the correction keeps its rejection, veto and mask (``w`` becomes
  1 on its kept tokens, as verl's bypass mode), not its weight.
- The correction (``compose.py``) runs on ``π_prox / μ`` (``π_θ / μ`` for ``reinforce``); M2PO's
  trust region reads the advantages' signs. Its batch is the (micro-)batch of this call: split
  into micro-batches, each meets M2PO's bound, so the whole batch does too (a weighted mean of
  values ``<= τ``), at the price of a few more masked tokens than one pass would mask.
- Normalisation (``algorithm.normalization``): ``token``: ``s = 1``, ``N`` = mask
  tokens in the *full* batch; ``sequence``: ``s_b = 1 / T_b`` (the sequence's
  mask tokens), ``N`` = non-empty sequences in the full batch; ``constant``
  (Dr. GRPO): ``s = 1``, ``N`` = sequences × ``constant_length``.
- KL penalty (``kl_coef > 0``, needs ``ref_logp``): ``+ kl_coef · Σ m·s·kl / N``
  with ``kl = logπ - log π_ref`` (k1) or ``exp(d) - d - 1``, ``d = log π_ref - logπ``
  clamped to ±20 (k3, as verl). It is not importance-weighted.
- Entropy bonus (``entropy_coef > 0``, needs ``entropy``): ``- entropy_coef · Σ v·s·H / N``
  with ``H_t = -Σ_v p_v log p_v`` the policy's entropy at token ``t`` (full distribution at
  the sampling temperature, differentiable) and ``v`` the valid tokens (in the mask, finite
  log-probs: the trained tokens). Neither weighted nor advantage-scaled; added on either path
  (the fused kernel's gradient covers the policy term, autograd this one).

Gradient accumulation: compute ``N = loss_normalizer(full_mask, algo)`` once for
the optimizer step and pass it as ``normalizer=`` to every micro-batch's
``policy_loss``; the micro-batch losses then sum to the full-batch loss (and
their gradients to its gradient), whatever the split.

Safety: tokens with a non-finite log-prob (``-inf``, ``nan``; see ``weights.usable``) are dropped (weight 0,
counted in ``nonfinite_tokens``; they still count in ``N``); an all-masked batch
gives a zero loss with a zero (not missing) gradient and ``all_masked=True``.
Arithmetic is float32 for float32/bf16/fp16 input (bf16 inputs get bf16 gradients) and
float64 for float64 input on the reference path (gradient checks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline_rl.reports import LossMetrics
from pipeline_rl.config import AlgorithmConfig, CorrectionConfig
from pipeline_rl.correction import fused
from pipeline_rl.correction.compose import KNOWN, correct
from pipeline_rl.correction.objectives import OBJECTIVES, PPO_LOG_CLAMP, clip_range
from pipeline_rl.correction.weights import RATIO_LOG_CLAMP, CorrectionWeights, LogRatio, usable


@dataclass
class PolicyBatch:
    """One (micro-)batch for the loss.

    Invariants: every ``[B, T]`` tensor has the same shape; ``logp`` is the trainer's
    log-prob of each sampled token (requires grad); ``behav_logp`` the generator's
    (after temperature); ``mask`` bool or 0/1 float, 1 on completion tokens;
    ``advantages`` ``[B]``, finite; ``prox_logp`` (PPO) and ``ref_logp`` (KL
    penalty) optional, detached.
    """

    logp: Tensor                     # [B, T] trainer log-probs, requires grad
    behav_logp: Tensor               # [B, T] behaviour (vLLM) log-probs
    mask: Tensor                     # [B, T] bool / {0,1} float
    advantages: Tensor               # [B]
    prox_logp: Tensor | None = None  # [B, T] π_prox (PPO); None = logp detached
    ref_logp: Tensor | None = None   # [B, T] reference policy (KL penalty)
    entropy: Tensor | None = None    # [B, T] policy entropy per token (entropy bonus), requires grad


def loss_normalizer(mask: Tensor, algo: AlgorithmConfig) -> float:
    """``N`` for the full batch ``mask`` [B, T]: mask tokens (``token``), non-empty
    sequences (``sequence``) or ``B · constant_length`` (``constant``). May be 0
    (an all-masked batch); policy_loss then returns a zero loss."""
    if mask.dim() != 2:
        raise ValueError(f"loss_normalizer: mask must be [B, T], got {tuple(mask.shape)}")
    if algo.normalization == "token":
        return float(torch.count_nonzero(mask))
    if algo.normalization == "sequence":
        return float(torch.count_nonzero(torch.count_nonzero(mask, dim=1)))
    return float(mask.shape[0] * algo.constant_length)


def fusable(algo: AlgorithmConfig, corr: CorrectionConfig, device_type: str) -> bool:
    """Whether :func:`policy_loss` can take the fused CPU kernel (numba aside)."""
    return (algo.loss == "reinforce" and algo.kl_coef == 0.0 and corr.type in fused.MODES
            and corr.veto is None and not corr.m2po and device_type == "cpu")


def warm_up(algo: AlgorithmConfig, corr: CorrectionConfig, device_type: str) -> None:
    """Pay the loss's one-time costs now (the fused kernel's load) when the loss will
    take that path: a trainer calls it while it waits for its first batch."""
    if fusable(algo, corr, device_type):
        fused.warm_up()


def policy_loss(batch: PolicyBatch, algo: AlgorithmConfig, corr: CorrectionConfig, *,
                normalizer: float | None = None, use_fused: bool | None = None
                ) -> tuple[Tensor, LossMetrics]:
    """Scalar loss (differentiable in ``batch.logp``) and its diagnostics.

    ``normalizer``: the full-batch ``N`` from :func:`loss_normalizer` when the batch
    is one of several micro-batches; ``None`` computes it from this batch.
    ``use_fused``: ``None`` picks the fused CPU kernel when it applies (``fused.py``),
    ``False`` forces the reference torch path, ``True`` requires the kernel.
    """
    _check(batch, algo, corr)
    n = loss_normalizer(batch.mask, algo) if normalizer is None else float(normalizer)
    if not math.isfinite(n) or n < 0:
        raise ValueError(f"policy_loss: normalizer must be finite and >= 0, got {n}")
    can_fuse = fusable(algo, corr, batch.logp.device.type)
    if use_fused is None:
        use_fused = can_fuse and fused.available()
    elif use_fused and not (can_fuse and fused.available()):
        raise ValueError("policy_loss: the fused kernel needs numba, CPU tensors, algorithm.loss=reinforce, "
                         "algorithm.kl_coef=0 and a correction preset other than m2po, with no veto or mask")
    loss, metrics = _fused_loss(batch, algo, corr, n) if use_fused else _reference_loss(batch, algo, corr, n)
    if algo.entropy_coef > 0:
        return _with_entropy_bonus(batch, algo, loss, metrics, n)
    return loss, metrics


def _with_entropy_bonus(batch: PolicyBatch, algo: AlgorithmConfig, loss: Tensor, metrics: LossMetrics,
                        n: float) -> tuple[Tensor, LossMetrics]:
    """``loss - entropy_coef · Σ v·s·H / N`` (module docstring); ``metrics`` gain the term."""
    assert batch.entropy is not None
    ent = batch.entropy.to(loss.dtype if loss.dtype == torch.float64 else torch.float32)   # [B, T]
    valid = (batch.mask.bool() & usable(batch.logp.detach()) & usable(batch.behav_logp)
             & torch.isfinite(ent.detach()))                                                 # [B, T]
    scale = torch.ones(ent.shape[0], dtype=ent.dtype, device=ent.device)                      # [B]
    if algo.normalization == "sequence":
        scale = scale / torch.count_nonzero(batch.mask, dim=1).to(ent.dtype).clamp(min=1.0)
    term = (torch.where(valid, ent, 0.0) * scale[:, None]).sum() / (n if n > 0 else 1.0)
    total = loss - algo.entropy_coef * term
    bonus = float(term.detach())
    return total, replace(metrics, loss=float(total.detach()), entropy_bonus=bonus)


def _check(batch: PolicyBatch, algo: AlgorithmConfig, corr: CorrectionConfig) -> None:
    """One-line errors for malformed input."""
    shape = tuple(batch.logp.shape)
    if len(shape) != 2:
        raise ValueError(f"policy_loss: logp must be [B, T], got {shape}")
    for name in ("behav_logp", "mask", "prox_logp", "ref_logp"):
        t = getattr(batch, name)
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"policy_loss: {name} has shape {tuple(t.shape)}, logp has {shape}")
    if tuple(batch.advantages.shape) != shape[:1]:
        raise ValueError(f"policy_loss: advantages must be [B]={shape[:1]}, "
                         f"got {tuple(batch.advantages.shape)}")
    if not bool(torch.isfinite(batch.advantages).all()):
        raise ValueError("policy_loss: advantages must be finite")
    if corr.type not in KNOWN:
        raise ValueError(f"correction.type: unknown correction {corr.type!r}")
    if algo.kl_coef > 0 and batch.ref_logp is None:
        raise ValueError("algorithm.kl_coef > 0 needs PolicyBatch.ref_logp")
    if algo.entropy_coef > 0 and (batch.entropy is None or tuple(batch.entropy.shape) != shape):
        raise ValueError(f"algorithm.entropy_coef > 0 needs PolicyBatch.entropy of shape {shape}")


def _row_coef(batch: PolicyBatch, algo: AlgorithmConfig) -> Tensor:
    """``A_b · s_b`` [B] float32: the advantage times the normalisation's row scale."""
    adv = batch.advantages.detach().to(torch.float32)            # [B]
    if algo.normalization != "sequence":
        return adv
    t_b = torch.count_nonzero(batch.mask, dim=1).to(torch.float32)  # [B] mask tokens per row
    return adv / t_b.clamp(min=1.0)


def _adv_stats(adv: Tensor) -> tuple[float, float]:
    a = adv.detach().to(torch.float64)
    if a.numel() == 0:
        return 0.0, 0.0
    return float(a.mean()), float(a.std(unbiased=False))


def _exp_capped(x: float) -> float:
    """exp for reporting: finite for any float (inf in, 1e300 out)."""
    return math.exp(max(min(x, 690.0), -745.0))


def _metrics(s: np.ndarray, *, pg: float, kl: float, loss: float, ppo_clip: float,
             rows: int, adv: Tensor, n: float) -> LossMetrics:
    """LossMetrics from the statistics vector (layout ``fused.S_*``, float64)."""
    valid, mask = s[fused.S_VALID], s[fused.S_MASK]
    empty = valid == 0
    adv_mean, adv_std = _adv_stats(adv)
    return LossMetrics(
        loss=loss, pg_loss=pg, kl_ref=kl,
        mismatch_kl_k1=0.0 if empty else -s[fused.S_R] / valid,
        mismatch_kl_k3=0.0 if empty else s[fused.S_K3] / valid,
        masked_token_frac=(mask - s[fused.S_KEPT]) / mask if mask else 0.0,
        masked_seq_frac=s[fused.S_SEQ_DROP] / s[fused.S_SEQ] if s[fused.S_SEQ] else 0.0,
        clipped_frac=0.0 if empty else s[fused.S_CLIP] / valid,
        ppo_clipped_frac=0.0 if empty else ppo_clip / valid,
        ess=s[fused.S_W] ** 2 / (valid * s[fused.S_W2]) if s[fused.S_W2] > 0 else 0.0,
        ratio_mean=1.0 if empty else 1.0 + s[fused.S_EM1] / valid,
        ratio_max=1.0 if empty else _exp_capped(s[fused.S_RMAX]),
        ratio_min=1.0 if empty else _exp_capped(s[fused.S_RMIN]),
        adv_mean=adv_mean, adv_std=adv_std,
        num_tokens=mask, num_valid_tokens=valid, nonfinite_tokens=mask - valid,
        num_seqs=s[fused.S_SEQ], num_rows=float(rows),
        weight_sum=s[fused.S_W], weight_sq_sum=s[fused.S_W2], normalizer=n,
        all_masked=bool(empty))


class _FusedReinforce(torch.autograd.Function):
    """loss = Σ grad·logπ with the gradient precomputed by the kernel."""

    @staticmethod
    def forward(ctx: Any, logp: Tensor, value: Tensor, grad: Tensor) -> Tensor:
        ctx.save_for_backward(grad)
        ctx.in_dtype = logp.dtype
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None]:
        (grad,) = ctx.saved_tensors
        if grad_out.numel() == 1 and float(grad_out) == 1.0:   # plain loss.backward(): no copy
            return grad.to(ctx.in_dtype), None, None
        return (grad * grad_out).to(ctx.in_dtype), None, None


def _fused_loss(batch: PolicyBatch, algo: AlgorithmConfig, corr: CorrectionConfig,
                n: float) -> tuple[Tensor, LossMetrics]:
    row = _row_coef(batch, algo) * (-1.0 / (n if n > 0 else 1.0))        # [B]
    grad, s = fused.reinforce_grad(batch.logp, batch.behav_logp, batch.mask, row, corr)
    value = torch.tensor(float(s[fused.S_LOSS]), dtype=torch.float32)
    loss = _FusedReinforce.apply(batch.logp, value, grad)
    pg = float(value)
    return loss, _metrics(s, pg=pg, kl=0.0, loss=pg, ppo_clip=0.0, rows=batch.logp.shape[0],
                          adv=batch.advantages, n=n)


def _reference_stats(lr: LogRatio, kept: Tensor, clipped: Tensor, w: Tensor,
                     mask: Tensor) -> np.ndarray:
    """The statistics vector of ``fused.py``, computed with plain torch ops (one transfer)."""
    v = lr.valid
    rc = lr.r.clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)                    # [B, T], 0 off valid
    em1 = torch.expm1(rc)                                                 # [B, T], 0 off valid
    rows_nonempty = mask.any(dim=1)                                       # [B]
    neg_inf = torch.tensor(-math.inf, dtype=lr.r.dtype, device=lr.r.device)
    slots = {
        fused.S_MASK: mask.sum(), fused.S_VALID: v.sum(), fused.S_R: rc.sum(),
        fused.S_K3: (em1 - rc).sum(), fused.S_EM1: em1.sum(),
        fused.S_RMAX: torch.where(v, lr.r, -math.inf).amax() if v.numel() else neg_inf,
        fused.S_RMIN: torch.where(v, lr.r, math.inf).amin() if v.numel() else -neg_inf,
        fused.S_W: w.sum(), fused.S_W2: (w * w).sum(), fused.S_CLIP: clipped.sum(),
        fused.S_KEPT: kept.sum(), fused.S_SEQ: rows_nonempty.sum(),
        fused.S_SEQ_DROP: (rows_nonempty & ~kept.any(dim=1)).sum(),
    }
    vec = torch.stack([slots[i].to(torch.float64) for i in sorted(slots)])
    s = np.zeros(fused.NUM_STATS, dtype=np.float64)
    s[sorted(slots)] = vec.cpu().numpy()
    return s


def _reference_loss(batch: PolicyBatch, algo: AlgorithmConfig, corr: CorrectionConfig,
                    n: float) -> tuple[Tensor, LossMetrics]:
    """The objective in plain differentiable torch (any device; the test oracle)."""
    dt = torch.float64 if batch.logp.dtype == torch.float64 else torch.float32
    mask = batch.mask.bool()                                              # [B, T]
    logp = batch.logp.to(dt)                                              # [B, T], grad
    lp_d = logp.detach()
    ratio = algo.loss != "reinforce"
    prox = batch.prox_logp.detach().to(dt) if ratio and batch.prox_logp is not None else lp_d
    lr = LogRatio.build(prox, batch.behav_logp, mask, usable(lp_d))   # π_prox/μ or π/μ
    cw = correct(lr, corr, batch.advantages)
    ref = prox
    if ratio and algo.ratio_reference == "behaviour":                     # ρ = π_θ/μ: masks only
        cw = CorrectionWeights(weights=cw.kept.to(dt), kept=cw.kept, clipped=torch.zeros_like(cw.kept))
        ref = batch.behav_logp.detach().to(dt)
    coef = cw.weights * _row_coef(batch, algo).to(dt)[:, None]            # [B, T] w·A·s
    lp = torch.where(lr.valid, logp, 0.0)                                 # [B, T] finite
    inv_n = 1.0 / (n if n > 0 else 1.0)
    lo, hi = clip_range(algo)
    term, on_clip = OBJECTIVES[algo.loss](lp, torch.where(lr.valid, ref, 0.0), lr.valid, coef, lo, hi)
    pg = -term.sum() * inv_n
    ppo_clip = float(on_clip.sum()) if ratio else 0.0
    kl = torch.zeros((), dtype=dt)
    if algo.kl_coef > 0 and batch.ref_logp is not None:
        kl = _kl_penalty(batch, algo, lp, lr.valid) * inv_n
    loss = pg + algo.kl_coef * kl
    s = _reference_stats(lr, cw.kept, cw.clipped, cw.weights, mask)
    return loss, _metrics(s, pg=float(pg.detach()), kl=float(kl.detach()),
                          loss=float(loss.detach()), ppo_clip=ppo_clip,
                          rows=mask.shape[0], adv=batch.advantages, n=n)


def _kl_penalty(batch: PolicyBatch, algo: AlgorithmConfig, lp: Tensor, valid: Tensor) -> Tensor:
    """``Σ m·s·kl`` (not yet divided by N) of π_θ to the reference policy."""
    assert batch.ref_logp is not None
    ref = batch.ref_logp.detach().to(lp.dtype)                            # [B, T]
    ok = valid & usable(ref)                                      # [B, T]
    d = torch.where(ok, ref - lp, 0.0).clamp(-PPO_LOG_CLAMP, PPO_LOG_CLAMP)  # log π_ref/π
    kl = -d if algo.kl_estimator == "k1" else torch.expm1(d) - d          # [B, T]
    scale = torch.ones_like(batch.advantages, dtype=lp.dtype)
    if algo.normalization == "sequence":
        scale = scale / torch.count_nonzero(batch.mask, dim=1).to(lp.dtype).clamp(min=1.0)
    return (torch.where(ok, kl, 0.0) * scale[:, None]).sum()
