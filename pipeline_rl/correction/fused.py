"""Fused CPU kernel for the default objective: REINFORCE with any of the four corrections.

Why: on a CPU the loss is a dozen elementwise passes over ``[B, T]`` in eager
torch, each one allocating and streaming a full tensor, and the corrections add
four to six more (caps, bands, counts, ESS sums): +9-22% over ``none`` on the
``[256, 4096]`` benchmark, against a budget of 10%. This kernel does everything
in one pass per row while the row sits in cache: validity, ratio, weight, the
gradient coefficient, the loss value and every diagnostic sum. A correction
then costs a few flops per token (measured +0-8% over ``none``), the whole
forward is ~10x faster than the eager path, and the backward pass is free (the
gradient is the coefficient array the kernel wrote).

Implementation notes (``_kernel.py``): numba, ``cache=True`` (~6-8 s to compile
once per machine, then ~0.3 s to load from ``__pycache__``), one compiled
signature (float32 log-probs, bool mask); the loop is vectorised by LLVM, which
needs (1) a polynomial ``exp`` (numba's ``math.exp`` is a scalar libm call),
(2) max/min of the log-ratio tracked as order-preserving int32 keys (float
max/min reductions do not vectorise), (3) the mask bytes widened to a float32
row buffer first (byte loads in the main loop halve its speed), and (4)
validity decided on the input bits, so full fast-math never sees a NaN/inf.
It must agree with the reference path (``weights.py``, ``loss._reference_loss``)
to float32 rounding; tests/test_loss.py checks that on every correction and
normalisation. Used only when numba imports, tensors are on the CPU, the loss
is ``reinforce`` and there is no KL penalty; everything else (PPO, KL, CUDA)
takes the reference path.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline_rl.config import CorrectionConfig, PresetCorrection
from pipeline_rl.correction.fused_layout import (NUM_STATS, S_CLIP, S_EM1, S_K3,  # noqa: F401
                                                 S_KEPT, S_LOSS, S_MASK, S_R, S_RMAX, S_RMIN,
                                                 S_SEQ, S_SEQ_DROP, S_VALID, S_W, S_W2)

MODES: dict[str, int] = {"none": 0, "tis": 1, "icepop": 2, "seq-mask-tis": 3}

_compiled: Any = None
_failed = False


def _build() -> Any:
    """Load the kernel (compiled once per machine, then from numba's cache)."""
    from pipeline_rl.correction import _kernel
    return _kernel.kernel


def available() -> bool:
    """True when the kernel can run (numba imports). It compiles on its first call."""
    global _compiled, _failed
    if _compiled is None and not _failed:
        try:
            _compiled = _build()
        except ImportError:   # numba missing: the reference path is always there
            _failed = True
    return _compiled is not None


def warm_up() -> None:
    """Load the kernel and run it once on a one-token row: its first call loads the
    machine code from numba's cache and fills numba's type registries (~0.4 s on one
    core, measured), which would otherwise land on a run's first training step. A
    no-op without numba."""
    if not available():
        return
    one = torch.zeros(1, 1)
    reinforce_grad(one, one, torch.ones(1, 1, dtype=torch.bool), torch.zeros(1), CorrectionConfig())


def mode_params(corr: CorrectionConfig) -> tuple[int, float, float, float]:
    """(mode, log cap, log lower band, log upper band) for the kernel (a preset's; 0 otherwise)."""
    if not isinstance(corr, PresetCorrection):
        return 0, 0.0, 0.0, 0.0
    if corr.type == "tis":
        return 1, math.log(corr.tis_cap), 0.0, 0.0
    if corr.type == "icepop":
        return 2, 0.0, math.log(corr.icepop_alpha), math.log(corr.icepop_beta)
    if corr.type == "seq-mask-tis":
        return 3, math.log(corr.seq_cap), math.log(corr.seq_lo), math.log(corr.seq_hi)
    return 0, 0.0, 0.0, 0.0


def reinforce_grad(logp: Tensor, behav: Tensor, mask: Tensor, row_coef: Tensor,
                   corr: CorrectionConfig) -> tuple[Tensor, np.ndarray]:
    """One fused pass. ``row_coef`` [B] is ``-A_b * s_b / N`` (advantage, row scale,
    normaliser). Returns ``grad`` [B, T] float32 (dL/dlogπ, so the loss value is
    ``stats[S_LOSS] = Σ grad·logπ`` over valid tokens) and the statistics vector."""
    lp = logp.detach().to(torch.float32).contiguous()           # [B, T]
    bl = behav.detach().to(torch.float32).contiguous()          # [B, T]
    mk = (mask if mask.dtype == torch.bool else mask != 0).contiguous()  # [B, T] bool
    rc = row_coef.detach().to(torch.float32).contiguous()       # [B]
    grad = torch.empty_like(lp)                                  # [B, T]
    stats = np.empty(NUM_STATS, dtype=np.float64)
    mode, log_cap, log_lo, log_hi = mode_params(corr)
    _compiled(lp.view(-1).numpy(), bl.view(-1).numpy(), mk.view(-1).numpy(), rc.numpy(),
            lp.shape[1], mode, log_cap, log_lo, log_hi, grad.view(-1).numpy(), stats)
    return grad, stats
