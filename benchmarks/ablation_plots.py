"""The plots of ``benchmarks/ablation.py``, from the result :mod:`benchmarks.ablation_report`
builds: reward, mismatch KL and masked-token curves per dtype (mean over seeds, 95% band) and
a final-reward heat map."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.ablation_cells import SHORT_DTYPE, treatment
from benchmarks.ablation_report import _mark, smooth_window
from benchmarks.common import pyplot
from benchmarks.stats import Interval, mean_interval, trailing_mean


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    """One curves figure per dtype (mean over seeds with a 95% band) and one final-reward
    heat map figure; returns the files."""
    plt = pyplot()
    written = []
    dtypes = list(dict.fromkeys(a["arm"]["dtype"] for a in result["arms"].values()))
    for dtype in dtypes:
        cells = [c for c in result["cells"] if c["arm"].startswith(SHORT_DTYPE[dtype] + "_") and c["curves"]["step"]]
        if not cells:
            continue
        path = out / f"ablation_{SHORT_DTYPE[dtype]}.png"
        _plot_curves(plt, result, cells, dtype, path)
        written.append(path)
    path = out / "ablation_final.png"
    _plot_heatmaps(plt, result, dtypes, path)
    written.append(path)
    return written


def _band(series: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    """Pointwise mean and 95% interval of equal-length series (NaN-safe)."""
    n = min(len(s) for s in series)
    ivs: list[Interval] = [mean_interval([s[i] for s in series]) for i in range(n)]
    return [iv.mean for iv in ivs], [iv.lo for iv in ivs], [iv.hi for iv in ivs]


def _plot_curves(plt: Any, result: dict[str, Any], cells: list[dict[str, Any]], dtype: str, path: Path) -> None:
    arms = {n: a for n, a in result["arms"].items() if a["arm"]["dtype"] == dtype}
    corrs = list(dict.fromkeys(treatment(a["arm"]) for a in arms.values()))
    ks = sorted(dict.fromkeys(a["arm"]["staleness"] for a in arms.values()))
    cmap = plt.get_cmap("viridis")
    colors = {k: cmap(i / max(1, len(ks) - 1)) for i, k in enumerate(ks)}
    panels = (("step", "reward", "reward (trailing mean)"), ("time_s", "reward", "reward vs wall time (s)"),
              ("step", "mismatch_kl_k3", "mismatch KL (k3)"), ("step", "masked_token_frac", "masked token frac"))
    fig, axes = plt.subplots(len(panels), len(corrs), figsize=(max(6, 4 * len(corrs)), 3 * len(panels)),
                             squeeze=False, sharey="row")
    for col, corr in enumerate(corrs):
        for name, a in arms.items():
            if treatment(a["arm"]) != corr:
                continue
            mine = [c["curves"] for c in cells if c["arm"] == name]
            if not mine:
                continue
            w = smooth_window(min(len(cv["step"]) for cv in mine))
            k = a["arm"]["staleness"]
            for row, (x, y, _) in enumerate(panels):
                ys = [trailing_mean([_num(v) for v in cv[y]], w) if y == "reward" else
                      [max(_num(v), 1e-9) for v in cv[y]] if y == "mismatch_kl_k3" else
                      [_num(v) for v in cv[y]] for cv in mine]
                mean, lo, hi = _band(ys)
                xs = _band([[_num(v) for v in cv[x]] for cv in mine])[0]
                ax = axes[row][col]
                ax.plot(xs, mean, color=colors[k], lw=1.3, label=f"staleness {k}")
                if len(mine) > 1 and y != "mismatch_kl_k3":  # a t band is meaningless on a log axis
                    ax.fill_between(xs, [min(1.0, max(0.0, v)) for v in lo], [min(1.0, max(0.0, v)) for v in hi],
                                    color=colors[k], alpha=0.2, lw=0)
        for row, (x, _, label) in enumerate(panels):
            ax = axes[row][col]
            ax.set_xlabel("wall time (s)" if x == "time_s" else "step")
            if col == 0:
                ax.set_ylabel(label)
            if panels[row][1] == "mismatch_kl_k3":
                ax.set_yscale("log")
        axes[0][col].set_title(f"correction: {corr}")
    axes[0][0].legend(fontsize=7)
    hw, st = result["hardware"], result["settings"]
    fig.suptitle(f"{dtype} generation, float32 trainer\n{st['steps']} steps, {len(st['seeds'])} seed(s): "
                 f"mean over seeds, band = 95% t interval of the mean (clipped to [0, 1]; none for the KL); "
                 f"{hw['cores']} CPU cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _num(x: float | None) -> float:
    return float("nan") if x is None else x


def _plot_heatmaps(plt: Any, result: dict[str, Any], dtypes: list[str], path: Path) -> None:
    fig, axes = plt.subplots(1, max(1, len(dtypes)), figsize=(5 * max(1, len(dtypes)), 3.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        arms = [a for a in result["arms"].values() if a["arm"]["dtype"] == dtype]
        ks = sorted(dict.fromkeys(a["arm"]["staleness"] for a in arms))
        corrs = list(dict.fromkeys(treatment(a["arm"]) for a in arms))
        by = {(a["arm"]["staleness"], treatment(a["arm"])): a for a in arms}
        grid_vals = [[_num(by[(k, c)]["final_reward"]["mean"]) if (k, c) in by else float("nan")
                      for c in corrs] for k in ks]
        top = max([v for row in grid_vals for v in row if not math.isnan(v)] + [0.05])
        im = ax.imshow(grid_vals, cmap="magma", aspect="auto", vmin=0.0, vmax=top)
        for i, k in enumerate(ks):
            for j, c in enumerate(corrs):
                a = by.get((k, c))
                if a is not None and a["final_reward"]["mean"] is not None:
                    v = a["final_reward"]["mean"]
                    ax.text(j, i, f"{v:.2f}{_mark(a, 'final_reward').replace('*', '')}", ha="center",
                            va="center", color="white" if v < 0.6 * top else "black", fontsize=8)
        ax.set_xticks(range(len(corrs)), corrs)
        ax.set_yticks(range(len(ks)), [str(k) for k in ks])
        ax.set_xlabel("correction")
        ax.set_ylabel("staleness")
        ax.set_title(f"final reward (mean over seeds), {dtype}")
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
