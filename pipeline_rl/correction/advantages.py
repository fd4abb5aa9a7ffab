"""Advantages (docs/design.md section 4), one small function per estimator.

``rewards`` is ``[G, n]``: ``G`` groups (prompts) of ``n >= 2`` completions each;
``lengths`` ``[G, n]`` the trained (model) tokens of each completion.

==========================  ===========================================================
``grpo``                    ``(r - mean_g) / (std_g + eps)``, unbiased (Bessel) group std,
                            as in DeepSeekMath / TRL / verl
``dr_grpo``                 ``r - mean_g`` (Dr. GRPO drops the std division)
``rloo``                    ``r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_g)``
``reinforce++``             ``(r - mu) / sigma`` over the batch's tokens (OpenRLHF's
                            ``reinforce``)
``reinforce++-baseline``    ``a = r - mean_g``, then ``(a - mu) / sigma`` over the batch's
                            tokens (OpenRLHF's ``reinforce_baseline``)
==========================  ===========================================================

The two REINFORCE++ estimators whiten over the batch, weighting each completion by its
trained tokens, as OpenRLHF whitens its per-token advantages (a sequence's advantage is the
same on each of its tokens: our KL penalty is a loss term, not a per-token reward):
``mu = Σ L_i a_i / Σ L_i``, ``sigma = sqrt(max(Σ L_i (a_i - mu)² / Σ L_i, 1e-8))``. The batch
is the whole step's, over every trainer rank: ``group_advantages``' ``reduce`` sums the
statistics over the ranks (two all-reduces, of ``[Σ L_i, Σ L_i a_i, ...]`` then of
``Σ L_i (a_i - mu)²``, as OpenRLHF's data-parallel whitening), so how the groups are split
over ranks does not change an advantage (ZeRO-0 on one rank == ZeRO-2 on two).

A group estimator (the first three) gives a group whose rewards are all equal exactly 0
(never NaN, never an ``eps``-amplified rounding residue): it carries no signal. The batch
estimators compare across groups, so there such a group gets ``-mu / sigma`` like any other
completion with that value (``reinforce++-baseline``: 0 before whitening). Arithmetic is
float64, returned as float32.

Adding an estimator: write ``fn(rewards [G, n] float64) -> [G, n]``, add one line to
:data:`ADVANTAGES` (``batch_whitened=True`` to whiten its output over the batch) and its name
to ``AdvantageName`` in ``algorithm_config.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pipeline_rl.config import AdvantageName
from pipeline_rl.samples import Group

#: Added to the group std in ``grpo`` (only matters for nearly-equal rewards).
GRPO_STD_EPS = 1e-6
#: The floor of the batch variance in the REINFORCE++ whitening (OpenRLHF's).
WHITEN_VAR_FLOOR = 1e-8


def grpo(r: Tensor) -> Tensor:
    """``(r - mean_g) / (std_g + eps)`` [G, n]."""
    return (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + GRPO_STD_EPS)


def dr_grpo(r: Tensor) -> Tensor:
    """``r - mean_g`` [G, n] (also REINFORCE++-baseline's group stage)."""
    return r - r.mean(dim=1, keepdim=True)


def rloo(r: Tensor) -> Tensor:
    """Leave-one-out baseline ``n / (n - 1) * (r - mean_g)`` [G, n]."""
    n = r.shape[1]
    return (r - r.mean(dim=1, keepdim=True)) * (n / (n - 1))


def raw_reward(r: Tensor) -> Tensor:
    """The reward itself [G, n] (REINFORCE++'s return with gamma 1 and no per-token KL)."""
    return r.clone()


@dataclass(frozen=True)
class Estimator:
    """An estimator: its per-group stage, and whether the batch whitening follows."""

    per_group: Callable[[Tensor], Tensor]
    batch_whitened: bool = False


#: Name -> estimator. The names are ``AdvantageName`` in algorithm_config.py.
ADVANTAGES: dict[str, Estimator] = {
    "grpo": Estimator(grpo),
    "dr_grpo": Estimator(dr_grpo),
    "rloo": Estimator(rloo),
    "reinforce++": Estimator(raw_reward, batch_whitened=True),
    "reinforce++-baseline": Estimator(dr_grpo, batch_whitened=True),
}


#: Sums a float64 vector elementwise over the trainer ranks (an all-reduce: every rank calls
#: it, with the same shape); the identity on one rank.
Reduce = Callable[[np.ndarray], np.ndarray]


def whiten(a: Tensor, lengths: Tensor, reduce: Reduce | None = None) -> Tensor:
    """``(a - mu) / sigma`` with token-weighted ``mu`` and ``sigma`` (module docstring): any
    shape, ``lengths`` the same shape (tokens per entry, >= 0). ``mu`` and ``sigma`` are those
    of the global batch, ``reduce`` summing each rank's sums (None: this is all of it); no
    tokens in the whole batch: each entry weighs 1."""
    w = lengths.to(a.dtype)
    s = _summed(reduce, [w.sum(), (a * w).sum(), a.numel(), a.sum()])  # [Σw, Σwa, count, Σa]
    if s[0] <= 0:
        w, s = torch.ones_like(a), s[2:]
    mu = float(s[1] / s[0])
    var = float(_summed(reduce, [((a - mu) ** 2 * w).sum()])[0] / s[0])
    return (a - mu) * torch.tensor(var, dtype=a.dtype).clamp(min=WHITEN_VAR_FLOOR).rsqrt()


def _summed(reduce: Reduce | None, parts: Sequence[Tensor | float]) -> np.ndarray:
    """``parts`` as float64, summed over the ranks by ``reduce``."""
    local = np.array([float(x) for x in parts], dtype=np.float64)
    if reduce is None:
        return local
    out = np.asarray(reduce(local), dtype=np.float64)
    if out.shape != local.shape or not np.isfinite(out).all():
        raise ValueError(f"advantages: the rank sum gave {out!r} for {local!r} (shape or non-finite)")
    return out


def _estimator(name: str) -> Estimator:
    if name not in ADVANTAGES:
        raise ValueError(f"algorithm.advantage: unknown estimator {name!r} (known: {', '.join(ADVANTAGES)})")
    return ADVANTAGES[name]


def _checked(rewards: Tensor) -> Tensor:
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"advantages: rewards must be [groups, n] with n >= 2, got {tuple(rewards.shape)}")
    r = rewards.detach().to(torch.float64)                         # [G, n]
    if not bool(torch.isfinite(r).all()):
        raise ValueError("advantages: rewards must be finite")
    return r


def _group_stage(est: Estimator, r: Tensor) -> Tensor:
    """The per-group stage [G, n]; a group estimator's flat groups exactly 0."""
    adv = est.per_group(r)                                          # [G, n]
    if est.batch_whitened:
        return adv
    flat = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True))   # [G, 1]
    return torch.where(flat, 0.0, adv)


def compute_advantages(name: AdvantageName, rewards: Tensor, lengths: Tensor | None = None) -> Tensor:
    """Advantages ``[G, n]`` float32 for rewards ``[G, n]``; ``lengths`` ``[G, n]`` weight the
    batch whitening (None: every completion weighs 1). See the module docstring."""
    est = _estimator(name)
    r = _checked(rewards)
    adv = _group_stage(est, r)
    if est.batch_whitened:
        adv = whiten(adv, torch.ones_like(r) if lengths is None else lengths.to(torch.float64))
    return adv.to(torch.float32)


def _model_tokens(group: Group) -> list[float]:
    return [float(len(c.model_versions)) for c in group.completions]


def group_advantages(name: AdvantageName, groups: Sequence[Group],
                     reduce: Reduce | None = None) -> list[np.ndarray]:
    """Per-group advantages of a batch: groups of equal size are computed together ([G, n]),
    then a batch estimator whitens all of them together, with the mean and std of the global
    batch when ``groups`` is this rank's share (``reduce``: the sum over the ranks, see
    :data:`Reduce`; None: one rank). A batch estimator calls ``reduce`` twice on every rank;
    a group estimator never."""
    est = _estimator(name)
    out: list[Tensor | None] = [None] * len(groups)
    by_size: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        by_size.setdefault(len(g.completions), []).append(i)
    for idx in by_size.values():
        r = _checked(torch.tensor([groups[i].rewards for i in idx], dtype=torch.float64))   # [G, n]
        adv = _group_stage(est, r)                                                        # [G, n]
        for row, i in enumerate(idx):
            out[i] = adv[row]
    parts = [a for a in out if a is not None]
    if est.batch_whitened:
        flat = whiten(torch.cat(parts), torch.tensor([t for g in groups for t in _model_tokens(g)],
                                                     dtype=torch.float64), reduce)
        parts = list(torch.split(flat, [len(g.completions) for g in groups]))
    return [a.to(torch.float32).cpu().numpy() for a in parts]
