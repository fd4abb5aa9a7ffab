"""The numba kernel behind ``fused.py`` (imported lazily: importing numba costs ~0.5 s).

Module-level functions so numba's on-disk cache (``cache=True``) can reload the
compiled kernel in later processes instead of compiling it again (~8 s).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from pipeline_rl.correction.fused_layout import (NUM_STATS, S_CLIP, S_EM1, S_K3, S_KEPT, S_LOSS,
                                                 S_MASK, S_R, S_RMAX, S_RMIN, S_SEQ, S_SEQ_DROP,
                                                 S_VALID, S_W, S_W2)
from pipeline_rl.correction.weights import LOGP_LIMIT, RATIO_LOG_CLAMP


@intrinsic
def _i32_as_f32(typingctx: Any, x: Any) -> Any:   # reinterpret int32 bits as float32
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def _f32_bits(typingctx: Any, x: Any) -> Any:     # float32 bits as int32
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


f32 = np.float32
i32 = np.int32
limit_bits = i32(np.array(LOGP_LIMIT, dtype=np.float32).view(np.int32))
# Full fast-math is safe because validity is decided on the *bits* of the inputs
# (integer ops, untouched by fast-math) and only finite values reach float code.


@njit(inline="always", fastmath=True)
def _usable(x: float) -> bool:
    """|x| < LOGP_LIMIT (false for inf and nan), from the bit pattern."""
    return (_f32_bits(x) & i32(0x7FFFFFFF)) < limit_bits


@njit(inline="always", fastmath=True)
def _exp_em1(x: float) -> tuple[float, float]:
    """(exp(x), expm1(x)) for |x| <= R (Cephes expf); expm1 accurate near 0."""
    k = np.floor(x * f32(1.4426950408889634) + f32(0.5))
    f = x - k * f32(0.693359375) + k * f32(2.12194440e-4)
    q = f32(1.9875691500e-4)
    q = q * f + f32(1.3981999507e-3)
    q = q * f + f32(8.3334519073e-3)
    q = q * f + f32(4.1665795894e-2)
    q = q * f + f32(1.6666665459e-1)
    q = q * f + f32(5.0000001201e-1)
    pm1 = f + f * f * q                                   # exp(f) - 1
    e = (pm1 + f32(1.0)) * _i32_as_f32((i32(k) + i32(127)) << i32(23))
    em1 = pm1 if k == f32(0.0) else e - f32(1.0)
    return e, em1


@njit(inline="always", fastmath=True)
def _order_key(x: float) -> Any:
    """int32 key with the order of the float ``x`` (integer max/min reductions vectorise;
    float ones do not here)."""
    b = _f32_bits(x)
    return b ^ ((b >> i32(31)) & i32(0x7FFFFFFF))


@njit(inline="always", fastmath=True)
def _order_key_inv(k: int) -> Any:
    """Bits of the float whose ``_order_key`` is ``k``."""
    return k ^ ((k >> i32(31)) & i32(0x7FFFFFFF))


@njit(inline="always", fastmath=True)
def _row(lp: Any, bl: Any, m: Any, mrow: Any, grad: Any, o: int, T: int, c: float, mode: int,
         cap: float, lcap: float, lo: float, hi: float) -> Any:
    """One row: writes grad[o:o+T], returns its partial sums (float32; max/min as keys).

    seq-mask-tis runs as tis and, when the row's mean log-ratio falls outside
    [lo, hi] (or a masked-in token has an unusable log-prob), zeroes the row afterwards (the
    row is still in cache): no second pass."""
    for j in range(T):                                    # mask -> float32 row buffer: byte
        mrow[j] = f32(1.0) if m[o + j] != 0 else f32(0.0)  # loads in the main loop are slow
    rclamp = f32(RATIO_LOG_CLAMP)
    a_mask = a_valid = a_r = a_ru = a_k3 = a_em1 = f32(0.0)
    a_w = a_w2 = a_clip = a_kept = a_loss = f32(0.0)
    k_max = i32(-2147483647)
    k_min = i32(2147483647)
    for j in range(T):
        t = o + j
        inm = mrow[j] != f32(0.0)
        x0 = lp[t]
        y0 = bl[t]
        v = inm & _usable(x0) & _usable(y0)                # valid: in mask, usable log-probs
        x = x0 if v else f32(0.0)
        r = x - (y0 if v else f32(0.0))                   # 0 off valid
        rc = min(max(r, -rclamp), rclamp)
        e, em1 = _exp_em1(rc)
        fv = f32(1.0) if v else f32(0.0)
        if mode == 0:
            keep = v
            w = fv
            clip = False
        elif mode == 2:
            keep = v & (r >= lo) & (r <= hi)
            w = e if keep else f32(0.0)
            clip = False
        else:                                             # tis, seq-mask-tis
            keep = v
            w = min(e, cap) * fv
            clip = v & (r > lcap)
        g = c * w
        grad[t] = g
        a_loss += g * x
        a_mask += mrow[j]
        a_valid += fv
        a_r += rc
        a_ru += r
        a_k3 += (em1 - rc) * fv
        a_em1 += em1 * fv
        key = _order_key(r)
        kx = key if v else i32(-2147483647)
        kn = key if v else i32(2147483647)
        k_max = kx if kx > k_max else k_max
        k_min = kn if kn < k_min else k_min
        a_w += w
        a_w2 += w * w
        a_clip += f32(1.0) if clip else f32(0.0)
        a_kept += f32(1.0) if keep else f32(0.0)
    if mode == 3 and not (a_valid > 0 and a_valid == a_mask and a_ru >= lo * a_valid
                          and a_ru <= hi * a_valid):
        for t in range(o, o + T):                         # sequence rejected: drop it whole
            grad[t] = f32(0.0)
        a_w = a_w2 = a_clip = a_kept = a_loss = f32(0.0)
    return (a_mask, a_valid, a_r, a_k3, a_em1, k_max, k_min, a_w, a_w2, a_clip, a_kept,
            a_loss)


@njit(cache=True, nogil=True, fastmath=True, error_model="numpy", boundscheck=False)
def kernel(lp: Any, bl: Any, m: Any, rowc: Any, T: int, mode: int, log_cap: float,
           log_lo: float, log_hi: float, grad: Any, stats: Any) -> None:
    """Flattened ``[B*T]`` log-probs and mask, ``rowc`` [B]; fills ``grad`` and ``stats``."""
    cap = f32(math.exp(log_cap))
    lcap = f32(log_cap)
    lo = f32(log_lo)
    hi = f32(log_hi)
    for s in range(NUM_STATS):
        stats[s] = 0.0
    k_max = i32(-2147483647)
    k_min = i32(2147483647)
    mrow = np.empty(max(T, 1), dtype=np.float32)
    for b in range(lp.size // T if T > 0 else 0):
        o = b * T
        c = f32(rowc[b])
        # One inlined copy of the row loop per mode: the mode is a constant in each,
        # so LLVM folds the branch and vectorises the loop.
        if mode == 0:
            acc = _row(lp, bl, m, mrow, grad, o, T, c, 0, cap, lcap, lo, hi)
        elif mode == 1:
            acc = _row(lp, bl, m, mrow, grad, o, T, c, 1, cap, lcap, lo, hi)
        elif mode == 2:
            acc = _row(lp, bl, m, mrow, grad, o, T, c, 2, cap, lcap, lo, hi)
        else:
            acc = _row(lp, bl, m, mrow, grad, o, T, c, 3, cap, lcap, lo, hi)
        (a_mask, a_valid, a_r, a_k3, a_em1, a_kmax, a_kmin, a_w, a_w2, a_clip, a_kept,
         a_loss) = acc
        stats[S_MASK] += a_mask
        stats[S_VALID] += a_valid
        stats[S_R] += a_r
        stats[S_K3] += a_k3
        stats[S_EM1] += a_em1
        k_max = max(k_max, a_kmax)
        k_min = min(k_min, a_kmin)
        stats[S_W] += a_w
        stats[S_W2] += a_w2
        stats[S_CLIP] += a_clip
        stats[S_KEPT] += a_kept
        stats[S_LOSS] += a_loss
        if a_mask > 0:
            stats[S_SEQ] += 1.0
            if a_kept == 0:
                stats[S_SEQ_DROP] += 1.0
    if stats[S_VALID] == 0:
        stats[S_RMAX] = -np.inf
        stats[S_RMIN] = np.inf
    else:                                                 # keys back to floats
        stats[S_RMAX] = _i32_as_f32(_order_key_inv(k_max))
        stats[S_RMIN] = _i32_as_f32(_order_key_inv(k_min))
