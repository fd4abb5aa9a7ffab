"""Group-relative advantages (docs/design.md section 4).

``rewards`` is ``[G, n]``: ``G`` groups (prompts) of ``n >= 2`` completions each.

- ``grpo``:    ``(r - mean_g) / (std_g + eps)`` with the unbiased (Bessel) group std,
  as in DeepSeekMath / TRL / verl.
- ``dr_grpo``: ``r - mean_g`` (Dr. GRPO drops the std division).
- ``rloo``:    ``r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_g)``.

A group whose rewards are all equal carries no signal: its advantages are
exactly 0 (never NaN, never an ``eps``-amplified rounding residue). Arithmetic is
done in float64 and returned as float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from pipeline_rl.config import AdvantageName
from pipeline_rl.samples import Group

#: Added to the group std in ``grpo`` (only matters for nearly-equal rewards).
GRPO_STD_EPS = 1e-6

ADVANTAGES: tuple[AdvantageName, ...] = ("grpo", "dr_grpo", "rloo")


def compute_advantages(name: AdvantageName, rewards: Tensor) -> Tensor:
    """Advantages ``[G, n]`` float32 for rewards ``[G, n]``; see the module docstring."""
    if name not in ADVANTAGES:
        raise ValueError(f"algorithm.advantage: unknown estimator {name!r} (known: {', '.join(ADVANTAGES)})")
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"advantages: rewards must be [groups, n] with n >= 2, got {tuple(rewards.shape)}")
    r = rewards.detach().to(torch.float64)                         # [G, n]
    if not bool(torch.isfinite(r).all()):
        raise ValueError("advantages: rewards must be finite")
    n = r.shape[1]
    centred = r - r.mean(dim=1, keepdim=True)                      # [G, n]
    if name == "grpo":
        adv = centred / (r.std(dim=1, keepdim=True) + GRPO_STD_EPS)
    elif name == "rloo":
        adv = centred * (n / (n - 1))
    else:
        adv = centred
    flat = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True))   # [G, 1]
    return torch.where(flat, 0.0, adv).to(torch.float32)


def group_advantages(name: AdvantageName, groups: Sequence[Group]) -> list[np.ndarray]:
    """Per-group advantages; groups of equal size are computed together ([G, n])."""
    out: list[np.ndarray | None] = [None] * len(groups)
    by_size: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        by_size.setdefault(len(g.completions), []).append(i)
    for idx in by_size.values():
        rewards = torch.tensor([groups[i].rewards for i in idx], dtype=torch.float32)  # [G, n]
        adv = compute_advantages(name, rewards)                                         # [G, n]
        for row, i in enumerate(idx):
            out[i] = adv[row].detach().cpu().numpy()
    return [a for a in out if a is not None]
