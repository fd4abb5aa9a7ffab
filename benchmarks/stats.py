"""Small-sample statistics for benchmarks that repeat a measurement over seeds.

Trailing means of a curve, Student's t distribution (its CDF through the regularised incomplete beta
function, its quantile by bisection), the mean with a two-sided t interval,
Welch's unequal-variance t-test, and Holm's step-down correction for several
comparisons. Pure Python (no SciPy in the project's environment); checked
against tabulated values in ``tests/test_ablation_stats.py``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def trailing_mean(values: Sequence[float], k: int) -> list[float]:
    """Mean of the last ``k`` values at each position (fewer at the start: element ``i``
    averages ``values[max(0, i - k + 1): i + 1]``); ``out[k - 1:]`` are the full windows."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= k:
            total -= values[i - k]
        out.append(total / min(i + 1, k))
    return out


def median_range(values: Sequence[float | None]) -> dict[str, Any]:
    """Median, min, max and count of the finite values (None where there is none)."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    ln_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(ln_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(ln_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` (> 0, not necessarily whole) degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_ppf(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom (0 < q < 1)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile must be in (0, 1), got {q}")
    if q < 0.5:
        return -t_ppf(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


@dataclass(frozen=True, slots=True)
class Interval:
    """A sample's mean with a two-sided ``level`` t interval (``lo == hi == mean`` for
    one value: no spread can be estimated; NaN for none)."""

    n: int
    mean: float
    lo: float
    hi: float
    level: float = 0.95

    @property
    def half_width(self) -> float:
        return 0.5 * (self.hi - self.lo)


def mean_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """Mean and two-sided t interval of the finite ``values`` (NaN and None left out)."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not xs:
        nan = float("nan")
        return Interval(0, nan, nan, nan, level)
    mean = statistics.fmean(xs)
    if len(xs) == 1:
        return Interval(1, mean, mean, mean, level)
    half = t_ppf(0.5 + level / 2.0, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return Interval(len(xs), mean, mean - half, mean + half, level)


@dataclass(frozen=True, slots=True)
class TTest:
    """Welch's t-test of mean(a) - mean(b): the difference, t, its degrees of freedom
    and the two-sided p-value (NaN when either side has fewer than 2 values)."""

    diff: float
    t: float
    df: float
    p: float


def welch_t_test(a: Sequence[float], b: Sequence[float]) -> TTest:
    """Two-sided Welch test. Two samples without spread give p = 1 when their means are
    equal and p = 0 otherwise (the difference is exact)."""
    xa = [float(v) for v in a if v is not None and math.isfinite(v)]
    xb = [float(v) for v in b if v is not None and math.isfinite(v)]
    nan = float("nan")
    if len(xa) < 2 or len(xb) < 2:
        return TTest(nan, nan, nan, nan)
    diff = statistics.fmean(xa) - statistics.fmean(xb)
    va, vb = statistics.variance(xa) / len(xa), statistics.variance(xb) / len(xb)
    se2 = va + vb
    if se2 == 0.0:
        return TTest(diff, nan, nan, 1.0 if diff == 0.0 else 0.0)
    t = diff / math.sqrt(se2)
    df = se2 * se2 / (va * va / (len(xa) - 1) + vb * vb / (len(xb) - 1))
    return TTest(diff, t, df, 2.0 * t_cdf(-abs(t), df))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error rate), in the input order;
    NaN p-values are left NaN and do not count as comparisons."""
    finite = sorted((p, i) for i, p in enumerate(p_values) if math.isfinite(p))
    m = len(finite)
    out = [float("nan")] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(finite):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out
