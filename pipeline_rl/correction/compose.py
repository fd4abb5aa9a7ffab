"""Off-policy corrections as a composition (docs/objectives.md), each piece a pure function.

Shapes: ``B`` sequences padded to ``T`` tokens. Per token: ``r_t = log π_t − log μ_t``
(``LogRatio.r``: detached, 0 off valid), ``valid`` (in the mask, both log-probs usable).
Every band is inclusive and tested in log space (no overflow): a ratio exactly on a bound
is kept, a cap exactly reached is not counted as clipped.

A :class:`Composition` runs, on the valid tokens, in this order:

1. rejection ``reject`` with bounds ``[lo, hi]``: ``token`` drops a token whose ``exp(r_t)``
   is outside; ``sequence`` drops a sequence whose ``exp(Σ_t r_t)`` is outside; ``geometric``
   one whose ``exp(mean_t r_t)`` is outside (verl's ``rollout_rs``; Seq-Mask-TIS's test);
2. ``veto``: drops a sequence with a token of ``exp(r_t) < veto`` (verl's
   ``rollout_token_veto_threshold``);
3. ``m2po_tau``: M2PO's second-moment mask over the kept tokens (:func:`m2po_mask`);
4. importance weight ``weight`` on the kept tokens: ``none`` 1; ``token`` ``min(exp(r_t), C)``;
   ``sequence`` ``min(exp(Σ_t r_t), C)`` on every token of the sequence (verl's ``rollout_is``,
   TRL's ``*_truncate``); ``C = cap`` (``inf``: uncapped, the ratio clamped to ``exp(±50)``).

A sequence-level step (sequence or geometric rejection, veto) rejects a sequence with a
masked-in token whose log-prob is not usable (``-inf``/``nan``): such a catastrophic token is
what they exist to catch, not one to average past. The presets are compositions:

=================  =============================================================
``none``           weight none
``tis``            weight token, ``C = tis_cap``
``icepop``         reject token ``[icepop_alpha, icepop_beta]``, weight token uncapped
``seq-mask-tis``   reject geometric ``[seq_lo, seq_hi]``, weight token ``C = seq_cap``
``m2po``           M2PO mask ``τ = m2po_tau``, weight token uncapped
=================  =============================================================

``custom`` (its own choice, ``CustomCorrection``) takes ``--correction.weight/weight_cap/reject/reject_lo/reject_hi``;
``--correction.veto`` and ``--correction.m2po`` add to any type. The first four presets give
the numbers the per-method functions gave before this module (tests/test_compose.py pins
them) and keep the fused kernel (``fused.py``); every other composition runs here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import get_args

import torch
from torch import Tensor

from pipeline_rl.config import CorrectionConfig, CorrectionName, CustomCorrection, PresetCorrection
from pipeline_rl.correction.weights import RATIO_LOG_CLAMP, CorrectionWeights, LogRatio

#: Every ``--correction.type``; the presets are all but ``custom``.
KNOWN: tuple[str, ...] = get_args(CorrectionName)
PRESETS: tuple[str, ...] = tuple(n for n in KNOWN if n != "custom")


@dataclass(frozen=True)
class Composition:
    """One correction: ``weight`` ``none|token|sequence`` capped at ``cap``; ``reject``
    ``none|token|sequence|geometric`` with bounds ``[lo, hi]``; ``veto`` (None = off);
    ``m2po_tau`` (None = off). Invariants: ``0 <= lo < hi``, ``cap > 0``."""

    weight: str = "none"
    cap: float = math.inf
    reject: str = "none"
    lo: float = 0.0
    hi: float = math.inf
    veto: float | None = None
    m2po_tau: float | None = None


def _preset(cfg: PresetCorrection, t: str) -> Composition:
    """Preset ``t``'s composition with ``cfg``'s knobs (add-ons aside)."""
    if t == "tis":
        return Composition("token", cfg.tis_cap)
    if t == "icepop":
        return Composition("token", math.inf, "token", cfg.icepop_alpha, cfg.icepop_beta)
    if t == "seq-mask-tis":
        return Composition("token", cfg.seq_cap, "geometric", cfg.seq_lo, cfg.seq_hi)
    if t == "m2po":
        return Composition("token")
    return Composition()


def _custom(cfg: CustomCorrection) -> Composition:
    """custom's composition, from its own parameters (add-ons aside)."""
    lo, hi = cfg.reject_bounds()
    return Composition(cfg.weight, cfg.weight_cap or math.inf, cfg.reject, lo, hi)


def composition(cfg: CorrectionConfig, name: str | None = None) -> Composition:
    """The composition of ``cfg`` (its ``type``, or ``name`` when given: a preset read with the
    knobs of ``cfg``, itself a preset), add-ons included."""
    t = cfg.type if name is None else name
    if t not in KNOWN:
        raise ValueError(f"correction.type: unknown correction {t!r} (known: {', '.join(KNOWN)})")
    if isinstance(cfg, CustomCorrection) and t == "custom":
        c = _custom(cfg)
    elif isinstance(cfg, PresetCorrection) and t != "custom":
        c = _preset(cfg, t)
    else:
        raise ValueError(f"correction.type: {t} is not read from a --correction.type {cfg.type} configuration")
    return replace(c, veto=cfg.veto, m2po_tau=cfg.m2po_tau if (cfg.m2po or t == "m2po") else None)


def _log(x: float) -> float:
    """``log x`` with ``log 0 = -inf`` and ``log inf = inf`` (open bounds)."""
    return -math.inf if x <= 0.0 else math.log(x)


def sequence_log_ratio(lr: LogRatio) -> tuple[Tensor, Tensor]:
    """Per sequence: ``Σ_t r_t`` over valid tokens ``[B]`` (the log of the product of the
    token ratios) and the number of valid tokens ``[B]``."""
    return lr.r.sum(dim=1), lr.valid.sum(dim=1)


def reject_tokens(lr: LogRatio, lo: float, hi: float) -> Tensor:
    """Token rejection: ``[B, T]`` bool, valid and ``lo <= exp(r_t) <= hi`` (verl's
    ``rollout_rs=token``; IcePop's band, Ring-1T)."""
    return lr.valid & (lr.r >= _log(lo)) & (lr.r <= _log(hi))


def reject_sequences(lr: LogRatio, lo: float, hi: float, *, geometric: bool) -> Tensor:
    """Sequence rejection: ``[B]`` bool, the sequences kept: non-empty, complete, and
    ``lo <= exp(Σ_t r_t) <= hi`` (``geometric``: ``exp(Σ_t r_t / n)``, the geometric mean of
    the token ratios, as Seq-Mask-TIS and verl's ``rollout_rs=geometric``)."""
    total, n = sequence_log_ratio(lr)                             # [B], [B]
    stat = total / n.clamp(min=1) if geometric else total         # [B]
    return (n > 0) & lr.complete & (stat >= _log(lo)) & (stat <= _log(hi))


def veto_sequences(lr: LogRatio, threshold: float) -> Tensor:
    """Per-token veto: ``[B]`` bool, the sequences kept: complete and no valid token with
    ``exp(r_t) < threshold`` (verl's ``rollout_token_veto_threshold``; a ratio exactly at the
    threshold passes)."""
    return lr.complete & ~(lr.valid & (lr.r < _log(threshold))).any(dim=1)


def m2po_mask(r: Tensor, keep: Tensor, tau: float, adv: Tensor | None = None) -> Tensor:
    """M2PO (Zheng et al., arXiv 2510.01161, Algorithm 1): ``[B, T]`` bool, ``keep`` less the
    tokens it masks. Candidates: the ``keep`` tokens in PPO's trust region (``A > 0`` and
    ``r > 0``, or ``A < 0`` and ``r < 0``; every ``keep`` token when ``adv`` [B] is None);
    the candidate with the largest ``M2_t = r_t²`` is masked while the candidates' mean
    ``M2`` exceeds ``tau``. Equivalently: sorted ascending, the longest prefix whose mean is
    ``<= tau`` stays (a mean exactly ``tau`` is under the bound). ``r`` [B, T] detached."""
    cand = keep
    if adv is not None:
        a = adv.detach().to(r.dtype)[:, None]                     # [B, 1]
        cand = keep & (((a > 0) & (r > 0)) | ((a < 0) & (r < 0)))
    m2 = (r.to(torch.float64) ** 2)[cand]                         # [K], row-major order
    if m2.numel() == 0 or float(m2.mean()) <= tau:
        return keep
    values, order = torch.sort(m2, stable=True)                   # [K] ascending
    prefix = torch.cumsum(values, 0) / torch.arange(1, values.numel() + 1, dtype=values.dtype)
    stay = int((prefix <= tau).sum())                             # prefix means are non-decreasing
    drop = torch.zeros_like(m2, dtype=torch.bool)
    drop[order[stay:]] = True
    out = keep.clone()
    out[cand] = ~drop
    return out


def token_weight(lr: LogRatio, keep: Tensor, cap: float) -> CorrectionWeights:
    """``w_t = min(exp(r_t), cap)`` on ``keep`` tokens, 0 elsewhere (TIS, Yao et al. 2025; TRL's
    ``token_truncate``); ``clipped`` where ``exp(r_t) > cap``. All ``[B, T]``."""
    log_cap = _log(cap)
    w = torch.exp(lr.r.clamp(-RATIO_LOG_CLAMP, min(log_cap, RATIO_LOG_CLAMP)))   # [B, T]
    return CorrectionWeights(weights=torch.where(keep, w, 0.0), kept=keep, clipped=keep & (lr.r > log_cap))


def sequence_weight(lr: LogRatio, keep: Tensor, cap: float) -> CorrectionWeights:
    """``w_b = min(exp(Σ_t r_t), cap)`` on every ``keep`` token of sequence ``b`` (verl's
    ``rollout_is=sequence``, TRL's ``sequence_truncate``); ``[B, T]``."""
    log_cap = _log(cap)
    total, _ = sequence_log_ratio(lr)                                            # [B]
    w = torch.exp(total.clamp(-RATIO_LOG_CLAMP, min(log_cap, RATIO_LOG_CLAMP)))  # [B]
    return CorrectionWeights(weights=torch.where(keep, w[:, None], 0.0), kept=keep,
                             clipped=keep & (total > log_cap)[:, None])


def compose(lr: LogRatio, c: Composition, adv: Tensor | None = None) -> CorrectionWeights:
    """The weights of composition ``c`` (module docstring, in its order); ``adv`` [B] places
    M2PO's candidates in the trust region."""
    keep = lr.valid                                                             # [B, T]
    if c.reject == "token":
        keep = reject_tokens(lr, c.lo, c.hi)
    elif c.reject in ("sequence", "geometric"):
        keep = keep & reject_sequences(lr, c.lo, c.hi, geometric=c.reject == "geometric")[:, None]
    if c.veto is not None:
        keep = keep & veto_sequences(lr, c.veto)[:, None]
    if c.m2po_tau is not None:
        keep = m2po_mask(lr.r, keep, c.m2po_tau, adv)
    if c.weight == "token":
        return token_weight(lr, keep, c.cap)
    if c.weight == "sequence":
        return sequence_weight(lr, keep, c.cap)
    return CorrectionWeights(weights=keep.to(lr.r.dtype), kept=keep, clipped=torch.zeros_like(keep))


def correct(lr: LogRatio, cfg: CorrectionConfig, adv: Tensor | None = None) -> CorrectionWeights:
    """The correction ``cfg`` names, on ``lr`` (``adv`` [B]: see :func:`compose`)."""
    return compose(lr, composition(cfg), adv)


CorrectionFn = Callable[[LogRatio, CorrectionConfig], CorrectionWeights]


def _preset_fn(name: str) -> CorrectionFn:
    def fn(lr: LogRatio, cfg: CorrectionConfig) -> CorrectionWeights:
        return compose(lr, composition(cfg, name))
    fn.__name__ = name.replace("-", "_")
    return fn


#: The presets the fused CPU kernel also serves (``fused.MODES``), name -> method.
CORRECTIONS: dict[str, CorrectionFn] = {n: _preset_fn(n) for n in ("none", "tis", "icepop", "seq-mask-tis")}


def correction_weights(name: str, logp_train: Tensor, logp_behav: Tensor, mask: Tensor,
                       cfg: CorrectionConfig, adv: Tensor | None = None) -> CorrectionWeights:
    """Weights of correction ``name`` (any ``--correction.type``; ``custom`` reads ``cfg``'s
    composition) for ``[B, T]`` trainer/behaviour log-probs and mask, ``adv`` [B] optional."""
    return compose(LogRatio.build(logp_train, logp_behav, mask), composition(cfg, name), adv)
