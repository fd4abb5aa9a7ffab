"""The figures and tables of ``benchmarks/ablation.py`` (from the records of
``benchmarks/ablation_cells.py``): per cell (one seed),
per arm (over seeds, mean and 95% t interval), and each arm against ``none``.

Per cell (all rewards are batch means; ``k = max(1, steps // 5)``,
``w = max(1, steps // 10)``): start reward = mean of the first ``k`` steps;
final reward = mean of the last ``k``; reward AUC = mean reward over all steps
(the area under the reward-per-step curve over the number of steps); peak =
highest ``w``-step trailing mean (full windows only); trough = lowest such mean;
steps to threshold = first step whose ``w``-step trailing mean reaches the
threshold (``--threshold``, default half-way from the grid's mean start reward to
its best final reward; none when no cell gained 0.02 over the start);
**collapse** = final < ``max(0.5 * peak, start - tol)`` or a non-finite loss;
mismatch KL (k3), ESS (effective sample size of the correction weights, a
fraction), masked token and sequence fractions, lag: means over steps.

Per arm: for each figure, the mean over seeds with a two-sided 95% Student t
interval (``benchmarks/stats.py``); steps to threshold over the seeds that
reached it (``reached`` says how many); collapses counted.

Against ``none``: for every arm with another correction, Welch's t-test of its
final reward (and, separately, of its reward AUC) against the ``none`` arm of
the same dtype and staleness, over seeds; the p-values of each family (final
reward, AUC) are Holm-corrected over all its comparisons in the grid. A
difference is marked significant (``+`` higher, ``-`` lower than ``none``) when
its corrected p is below ``--alpha``.

Against staleness 0: the same tests for every arm with staleness above 0 against the
arm of the same dtype and correction at staleness 0 (what lag costs each correction),
Holm-corrected per figure over those comparisons.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.ablation_cells import Arm, CellResult, GridSettings, treatment
from benchmarks.common import hardware
from benchmarks.stats import holm, mean_interval, trailing_mean, welch_t_test

#: Smallest gain of the best cell over the mean start reward for which an automatic threshold is set.
MIN_GAIN = 0.02
#: Curves stored per cell (metrics.jsonl key -> JSON key).
CURVE_KEYS = {"step": "step", "time_s": "time_s", "reward_mean": "reward", "mismatch_kl": "mismatch_kl_k1",
              "mismatch_kl_k3": "mismatch_kl_k3", "masked_frac": "masked_token_frac",
              "masked_seq_frac": "masked_seq_frac", "lag_mean": "lag_mean", "loss": "loss", "ess": "ess"}
#: Per-seed figures summarised over seeds per arm.
ARM_FIGURES = ("final_reward", "reward_auc", "start_reward", "peak_reward", "steps_to_threshold",
               "mismatch_kl_k3_mean", "ess_mean", "masked_token_frac_mean", "masked_seq_frac_mean", "lag_mean")
TESTED = ("final_reward", "reward_auc")


@dataclass(frozen=True, slots=True)
class CellSummary:
    """One cell's figures (see the module docstring); NaN where a failed cell has none."""

    name: str
    arm: str
    seed: int
    status: str
    steps: int
    wall_s: float
    node: str | None
    start_reward: float
    final_reward: float
    reward_auc: float
    peak_reward: float
    trough_reward: float
    steps_to_threshold: int | None
    time_to_threshold_s: float | None
    collapsed: bool
    mismatch_kl_k3_mean: float
    ess_mean: float
    masked_token_frac_mean: float
    masked_seq_frac_mean: float
    lag_mean: float
    error: str | None


@dataclass(frozen=True, slots=True)
class Comparison:
    """One arm against ``none`` on one figure: the Welch test and its Holm-corrected p."""

    diff: float
    p: float
    p_holm: float
    significant: bool

    @property
    def mark(self) -> str:
        return ("+" if self.diff > 0 else "-") if self.significant else ""


# ---------------------------------------------------------------------------- per cell

def window(steps: int) -> int:
    """k: steps averaged for the start and final reward."""
    return max(1, steps // 5)


def smooth_window(steps: int) -> int:
    """w: the trailing-mean window of the peak, the threshold and the plotted reward."""
    return max(1, steps // 10)


def auto_threshold(results: list[CellResult]) -> float | None:
    """Half-way from the grid's mean start reward to its best final reward (None: no finished
    cell, or no cell gained :data:`MIN_GAIN` over the start, so no threshold means anything)."""
    done = [r for r in results if r.status == "done" and r.rows]
    if not done:
        return None
    starts, finals = [], []
    for r in done:
        rewards = [row["reward_mean"] for row in r.rows]
        k = window(len(rewards))
        starts.append(statistics.fmean(rewards[:k]))
        finals.append(statistics.fmean(rewards[-k:]))
    start = statistics.fmean(starts)
    if max(finals) - start < MIN_GAIN:
        return None
    return start + 0.5 * (max(finals) - start)


def summarize_cell(res: CellResult, threshold: float | None, collapse_tol: float) -> CellSummary:
    rows, c = res.rows, res.cell
    if not rows:
        nan = float("nan")
        return CellSummary(c.name, c.arm.name, c.seed, res.status, 0, res.wall_s, res.node, nan, nan, nan, nan,
                           nan, None, None, False, nan, nan, nan, nan, nan, res.error)
    rewards = [r["reward_mean"] for r in rows]
    k, w = window(len(rewards)), smooth_window(len(rewards))
    smooth = trailing_mean(rewards, w)[w - 1:]  # full windows only: smooth[j] ends at step index j + w - 1
    start, final, peak = statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:]), max(smooth)
    hit = next((j + w - 1 for j, v in enumerate(smooth) if threshold is not None and v >= threshold), None)
    finite = all(math.isfinite(r["loss"]) for r in rows)
    collapsed = (not finite) or final < max(0.5 * peak, start - collapse_tol)
    return CellSummary(
        c.name, c.arm.name, c.seed, res.status, len(rows), res.wall_s, res.node, start, final,
        statistics.fmean(rewards), peak, min(smooth),
        rows[hit]["step"] if hit is not None else None, rows[hit]["time_s"] if hit is not None else None,
        collapsed, statistics.fmean(r.get("mismatch_kl_k3", 0.0) for r in rows),
        statistics.fmean(r.get("ess", 1.0) for r in rows), statistics.fmean(r["masked_frac"] for r in rows),
        statistics.fmean(r.get("masked_seq_frac", 0.0) for r in rows),
        statistics.fmean(r["lag_mean"] for r in rows), res.error)


def curves(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    return {out: [float(r.get(key, float("nan"))) for r in rows] for key, out in CURVE_KEYS.items()}


# ---------------------------------------------------------------------------- per arm

def summarize_arm(cells: list[CellSummary]) -> dict[str, Any]:
    """Mean and 95% interval over seeds of every figure in :data:`ARM_FIGURES`."""
    done = [c for c in cells if c.status == "done"]
    out: dict[str, Any] = {"seeds": len(cells), "done": len(done),
                           "collapsed": sum(c.collapsed for c in done),
                           "reached": sum(c.steps_to_threshold is not None for c in done)}
    for name in ARM_FIGURES:
        values = [getattr(c, name) for c in done]
        out[name] = asdict(mean_interval([float(v) for v in values if v is not None]))
    return out


def compare(arms: dict[str, dict[str, Any]], per_arm: dict[str, list[CellSummary]], alpha: float,
            against: str) -> dict[str, dict[str, dict[str, Any]]]:
    """arm name -> figure -> :class:`Comparison` (as a dict), Holm-corrected per figure over
    the grid. ``against="none"``: each corrected arm against ``none`` at the same dtype and
    staleness; ``against="sync"``: each arm at staleness > 0 against the same dtype and
    correction at staleness 0."""
    def base_key(arm: dict[str, Any]) -> tuple[str, int, str]:
        if against == "none":
            return arm["dtype"], arm["staleness"], "none"
        return arm["dtype"], 0, treatment(arm)

    by_key = {(a["arm"]["dtype"], a["arm"]["staleness"], treatment(a["arm"])): n for n, a in arms.items()}
    pairs = [(name, by_key.get(base_key(a["arm"]))) for name, a in arms.items()
             if (treatment(a["arm"]) != "none" if against == "none" else a["arm"]["staleness"] > 0)]
    out: dict[str, dict[str, dict[str, Any]]] = {name: {} for name, _ in pairs}
    for figure in TESTED:
        tests = []
        for name, base in pairs:
            values = [[getattr(c, figure) for c in per_arm[n] if c.status == "done"] for n in (name, base)] \
                if base else [[], []]
            tests.append(welch_t_test(values[0], values[1]))
        adjusted = holm([t.p for t in tests])
        for (name, _), t, p_holm in zip(pairs, tests, adjusted):
            out[name][figure] = asdict(Comparison(t.diff, t.p, p_holm, math.isfinite(p_holm) and p_holm < alpha))
    return out


def build_result(results: list[CellResult], settings: GridSettings, threshold: float | None,
                 collapse_tol: float, alpha: float, wall_s: float) -> dict[str, Any]:
    thr = threshold if threshold is not None else auto_threshold(results)
    cells: list[dict[str, Any]] = []
    per_arm: dict[str, list[CellSummary]] = {}
    arm_of: dict[str, Arm] = {}
    for res in results:
        s = summarize_cell(res, thr, collapse_tol)
        cells.append({**asdict(s), "curves": curves(res.rows)})
        per_arm.setdefault(s.arm, []).append(s)
        arm_of[s.arm] = res.cell.arm
    arms = {name: {"arm": asdict(arm_of[name]), **summarize_arm(per_arm[name])} for name in per_arm}
    for key, against in (("vs_none", "none"), ("vs_sync", "sync")):
        for name, figs in compare(arms, per_arm, alpha, against).items():
            arms[name][key] = figs
    nodes = sorted({r.node for r in results if r.node})
    seeds = sorted({r.cell.seed for r in results})
    return _finite({
        "hardware": hardware(),
        "settings": {"steps": settings.steps, "seeds": seeds, "model_dir": settings.model_dir,
                     "flags": list(settings.flags), "threshold": thr,
                     "threshold_source": "flag" if threshold is not None else "auto", "alpha": alpha,
                     "test": "Welch t-test against 'none' at the same dtype and staleness, two-sided, "
                             "Holm-corrected per figure over the grid",
                     "test_sync": "Welch t-test against the same correction at staleness 0, two-sided, "
                                  "Holm-corrected per figure over those comparisons",
                     "interval": "mean over seeds with a two-sided 95% Student t interval",
                     "collapse_rule": f"final < max(0.5 * peak, start - {collapse_tol}) or non-finite loss",
                     "window": "start/final: mean of the first/last max(1, steps // 5) steps; AUC: mean "
                               "over all steps; peak and threshold: max(1, steps // 10)-step trailing mean"},
        "wall_s": wall_s, "cells_wall_s": sum(r.wall_s for r in results), "nodes": nodes,
        "arms": arms, "cells": cells})


def _finite(x: Any) -> Any:
    """NaN/inf -> None, so the JSON is standard (a failed cell has no figures)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


# ---------------------------------------------------------------------------- Markdown

def _fmt(x: float | None, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def _ci(iv: dict[str, Any], spec: str = ".3f") -> str:
    """``mean [lo, hi]``, or the mean alone for one seed."""
    if iv["mean"] is None:
        return "-"
    if iv["n"] < 2:
        return _fmt(iv["mean"], spec)
    return f"{_fmt(iv['mean'], spec)} [{_fmt(iv['lo'], spec)}, {_fmt(iv['hi'], spec)}]"


def _mark(arm: dict[str, Any], figure: str) -> str:
    comp = arm.get("vs_none", {}).get(figure)
    if not comp or not comp["significant"]:
        return ""
    return " **+**" if comp["diff"] > 0 else " **-**"


def markdown(result: dict[str, Any]) -> str:
    hw, st = result["hardware"], result["settings"]
    nodes = result.get("nodes", [])
    lines = [f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB, no GPU. "
             f"{st['steps']} steps per cell, seeds {', '.join(map(str, st['seeds']))}; wall time of the cells "
             f"{result['cells_wall_s'] / 60:.1f} min, this invocation {result['wall_s'] / 60:.1f} min, "
             f"on {len(nodes)} Ray node(s).",
             f"Per arm: {st['interval']}. Marks: **+**/**-** = significantly higher/lower than `none` at "
             f"the same staleness ({st['test']}, family-wise alpha {st['alpha']}). Reward threshold "
             f"{_threshold_text(st)}; collapse: {st['collapse_rule']}; {st['window']}.", ""]
    arms = result["arms"]
    for dtype in dict.fromkeys(a["arm"]["dtype"] for a in arms.values()):
        mine = [a for a in arms.values() if a["arm"]["dtype"] == dtype]
        lines += [f"### Generation dtype {dtype} (trainer float32)", "",
                  "| staleness | correction | final reward | reward AUC | steps to thr. (reached) | collapsed | "
                  "mismatch KL k3 | ESS | masked tok. | masked seq. | lag |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for a in mine:
            arm = a["arm"]
            if not a["done"]:
                lines.append(f"| {arm['staleness']} | {treatment(arm)} | no seed finished |" + " |" * 8)
                continue
            lines.append(
                f"| {arm['staleness']} | {treatment(arm)} | {_ci(a['final_reward'])}{_mark(a, 'final_reward')} | "
                f"{_ci(a['reward_auc'])}{_mark(a, 'reward_auc')} | "
                f"{_ci(a['steps_to_threshold'], '.0f')} ({a['reached']}/{a['done']}) | "
                f"{a['collapsed']}/{a['done']} | {_fmt(a['mismatch_kl_k3_mean']['mean'], '.2e')} | "
                f"{_fmt(a['ess_mean']['mean'])} | {_fmt(a['masked_token_frac_mean']['mean'])} | "
                f"{_fmt(a['masked_seq_frac_mean']['mean'])} | {_fmt(a['lag_mean']['mean'], '.2f')} |")
        lines += ["", *pivot(mine), "", *comparison_table(mine, "vs_none"), "",
                  *comparison_table(mine, "vs_sync"), ""]
    return "\n".join(lines)


def _threshold_text(st: dict[str, Any]) -> str:
    if st["threshold"] is None:
        return f"none (no cell gained {MIN_GAIN} over the mean start reward)"
    return f"{st['threshold']:.3f} ({st['threshold_source']})"


def pivot(arms: list[dict[str, Any]]) -> list[str]:
    """Final reward (mean +- interval half-width), staleness (rows) x correction (columns)."""
    ks = list(dict.fromkeys(a["arm"]["staleness"] for a in arms))
    corrs = list(dict.fromkeys(treatment(a["arm"]) for a in arms))
    by = {(a["arm"]["staleness"], treatment(a["arm"])): a for a in arms}
    lines = ["Final reward, mean ± 95% half-width over seeds (staleness x correction):", "",
             "| staleness | " + " | ".join(corrs) + " |", "|---" * (len(corrs) + 1) + "|"]
    for k in ks:
        vals = []
        for corr in corrs:
            a = by.get((k, corr))
            iv = a["final_reward"] if a else None
            if a is None or iv is None or iv["mean"] is None:
                vals.append("-")
                continue
            half = f" ± {_fmt((iv['hi'] - iv['lo']) / 2, '.3f')}" if iv["n"] > 1 else ""
            vals.append(f"{_fmt(iv['mean'])}{half}{_mark(a, 'final_reward')}")
        lines.append(f"| {k} | " + " | ".join(vals) + " |")
    return lines


def comparison_table(arms: list[dict[str, Any]], key: str = "vs_none") -> list[str]:
    """Every comparison of one family: difference, raw and Holm-corrected p (``*``: significant)."""
    rows = [a for a in arms if key in a]
    if not rows:
        return []
    title = ("Against `none` at the same staleness" if key == "vs_none"
             else "Against the same correction at staleness 0 (what lag costs)")
    lines = [f"{title} (difference of means; p raw / Holm):", "",
             "| staleness | correction | final reward diff | p | p (Holm) | AUC diff | p | p (Holm) |",
             "|---|---|---|---|---|---|---|---|"]
    for a in rows:
        f, u = a[key]["final_reward"], a[key]["reward_auc"]
        lines.append(f"| {a['arm']['staleness']} | {treatment(a['arm'])} | {_fmt(f['diff'], '+.3f')} | "
                     f"{_fmt(f['p'])} | {_fmt(f['p_holm'])}{' *' if f['significant'] else ''} | "
                     f"{_fmt(u['diff'], '+.3f')} | {_fmt(u['p'])} | "
                     f"{_fmt(u['p_holm'])}{' *' if u['significant'] else ''} |")
    return lines
