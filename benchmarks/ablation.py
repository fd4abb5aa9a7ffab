"""Staleness x off-policy correction ablation, in fp32 and bf16 generation (docs/design.md).

The grid: staleness {0, 1, 2, 4, 8} x correction {none, tis, icepop,
seq-mask-tis} x generation dtype {float32, bfloat16} (``--rollout.dtype``;
bf16 generation against an fp32 trainer gives a realistic generator/trainer
mismatch on CPU). Every cell runs the real pipeline (Ray, vLLM, DeepSpeed,
ZeroMQ) from the same model folder, with the same seed and the same budget
(``--steps`` optimizer steps); one local Ray serves the whole grid.

Outputs, under ``--out`` (default ``runs/bench_ablation``):

- ``cells/<dtype>_s<k>_<correction>/``: each cell's ``metrics.jsonl`` and
  ``cell.json`` (written last: a cell with a ``cell.json`` whose settings
  match is finished and skipped on a rerun, so an interrupted grid resumes
  cell by cell; a failed cell records its error and is retried on a rerun);
- ``ablation.json``: hardware, settings and, per cell, the final table's
  figures plus its curves (reward, mismatch KL, masked fractions against
  step and wall time);
- ``ablation.md``: the final table per dtype and a staleness x correction
  pivot of the final reward;
- ``ablation_<dtype>.png``: reward vs step, reward vs wall time, mismatch KL
  (k3) and masked token fraction vs step, one column per correction, one
  line per staleness; ``ablation_final.png``: final-reward heat maps.

Definitions (all rewards are batch means; ``k = max(1, steps // 5)``,
``w = max(1, steps // 10)``): start reward = mean of the first ``k`` steps;
final reward = mean of the last ``k``; peak = highest ``w``-step trailing mean
(full windows only); trough = lowest such mean (a dip the run may have
recovered from); steps to threshold = first step whose ``w``-step trailing
mean reaches ``--threshold`` (default: half-way from
the grid's mean start reward to its best final reward, recorded in the JSON;
none when no cell gained 0.02 over the start);
**collapse** = the final reward fell below ``max(0.5 * peak, start - tol)``
(``--collapse-tol``, default 0.05), or a loss went non-finite.

``--quick`` (the smoke grid for a 2-core CPU machine, <= 20 minutes):
staleness {0, 2, 8} x all four corrections, bfloat16 generation only,
100 steps each of the pipeline's default configuration (12 cells; each cell
costs ~30 s of start-up plus its steps). Without ``--quick`` the full grid
(40 cells, 200 steps each, about an hour on 2 cores) runs unattended.

The grid runs in a child process that the script restarts (``--max-restarts``,
finished cells kept) if it dies: Ray ends its driver process when its node goes
away, which no ``except`` can catch.

Usage: ``python benchmarks/ablation.py [--quick] [--staleness 0,2] [--corrections tis,icepop]
[--dtypes bfloat16] [--steps N] [--json PATH] [-- extra pipeline flags]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import config, hardware, run_pipeline, start_ray, stop_ray  # noqa: E402

STALENESS = (0, 1, 2, 4, 8)
CORRECTIONS = ("none", "tis", "icepop", "seq-mask-tis")
DTYPES = ("float32", "bfloat16")
SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}
DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}

QUICK_STALENESS = (0, 2, 8)
QUICK_DTYPES = ("bfloat16",)
QUICK_STEPS = 100
FULL_STEPS = 200
#: Pipeline flags --quick adds (none: the built-in default model, task and batch).
QUICK_FLAGS: tuple[str, ...] = ()
#: Smallest gain of the best cell over the mean start reward for which an automatic threshold is set.
MIN_GAIN = 0.02
#: Curves stored per cell (metrics.jsonl key -> JSON key).
CURVE_KEYS = {"step": "step", "time_s": "time_s", "reward_mean": "reward", "mismatch_kl": "mismatch_kl_k1",
              "mismatch_kl_k3": "mismatch_kl_k3", "masked_frac": "masked_token_frac",
              "masked_seq_frac": "masked_seq_frac", "lag_mean": "lag_mean", "loss": "loss"}


CellStatus = Literal["done", "failed"]


class AblationError(ValueError):
    """A bad flag value (one line, names the flag)."""


@dataclass(frozen=True, slots=True)
class Cell:
    """One point of the grid."""

    dtype: str
    staleness: int
    correction: str

    @property
    def name(self) -> str:
        return f"{SHORT_DTYPE[self.dtype]}_s{self.staleness}_{self.correction}"

    def flags(self) -> tuple[str, ...]:
        return ("--staleness", str(self.staleness), "--correction.type", self.correction,
                "--rollout.dtype", self.dtype)


@dataclass(frozen=True, slots=True)
class GridSettings:
    """What every cell shares; a finished cell is reused only when these match."""

    steps: int
    seed: int
    model_dir: str
    flags: tuple[str, ...]

    def key(self) -> str:
        blob = json.dumps([self.steps, self.seed, self.model_dir, list(self.flags)])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(slots=True)
class CellResult:
    """A cell's record (``cell.json``): its status, wall time and metrics rows."""

    cell: Cell
    settings_key: str
    status: CellStatus
    wall_s: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True, slots=True)
class CellSummary:
    """One row of the final table."""

    name: str
    dtype: str
    staleness: int
    correction: str
    status: CellStatus
    steps: int
    wall_s: float
    start_reward: float
    final_reward: float
    peak_reward: float
    trough_reward: float
    steps_to_threshold: int | None
    time_to_threshold_s: float | None
    collapsed: bool
    mismatch_kl_k3_mean: float
    masked_token_frac_mean: float
    masked_seq_frac_mean: float
    lag_mean: float
    error: str | None


# ---------------------------------------------------------------------------- grid

def parse_list(flag: str, text: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise AblationError(f"{flag}: give a comma-separated list (got {text!r})")
    if allowed is not None:
        bad = [x for x in items if x not in allowed]
        if bad:
            raise AblationError(f"{flag}: unknown value(s) {', '.join(bad)} (allowed: {', '.join(allowed)})")
    return items


def grid(staleness: str, corrections: str, dtypes: str) -> list[Cell]:
    """The cells, dtype-major then staleness then correction."""
    try:
        ks = [int(x) for x in parse_list("--staleness", staleness)]
    except ValueError:
        raise AblationError(f"--staleness: give non-negative integers (got {staleness!r})") from None
    if any(k < 0 for k in ks):
        raise AblationError(f"--staleness: give non-negative integers (got {staleness!r})")
    corrs = parse_list("--corrections", corrections, CORRECTIONS)
    dts = [DTYPE_ALIASES[d] for d in parse_list("--dtypes", dtypes, tuple(DTYPE_ALIASES))]
    return [Cell(d, k, c) for d in dict.fromkeys(dts) for k in dict.fromkeys(ks) for c in dict.fromkeys(corrs)]


def load_finished(path: Path, settings_key: str) -> CellResult | None:
    """The cell's record when it finished under the same settings, else None."""
    record = path / "cell.json"
    if not record.is_file():
        return None
    try:
        data = json.loads(record.read_text())
    except json.JSONDecodeError:
        return None
    if data.get("status") != "done" or data.get("settings_key") != settings_key:
        return None
    return CellResult(Cell(**data["cell"]), settings_key, "done", data["wall_s"], data["rows"])


def save_record(path: Path, res: CellResult) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "cell.json.tmp"
    tmp.write_text(json.dumps({"cell": asdict(res.cell), "settings_key": res.settings_key,
                               "status": res.status, "wall_s": res.wall_s, "error": res.error,
                               "rows": res.rows}))
    tmp.replace(path / "cell.json")


def run_cell(cell: Cell, settings: GridSettings, out: Path, keep_checkpoints: bool) -> CellResult:
    """Run one cell through the real pipeline; a failure is recorded, not raised (the grid goes on)."""
    path = out / "cells" / cell.name
    (path / "cell.json").unlink(missing_ok=True)
    cfg = config(["--model.path", settings.model_dir, *settings.flags, *cell.flags(),
                  "--seed", str(settings.seed), "--max-steps", str(settings.steps),
                  "--out-dir", str(path), "--trainer.checkpoint_every", "0"])
    t0 = time.perf_counter()
    status: CellStatus = "failed"
    error: str | None = None
    try:
        rows = run_pipeline(cfg)
        if len(rows) == settings.steps:
            status = "done"
        else:
            error = f"stopped after {len(rows)} of {settings.steps} steps"
    except Exception as e:  # noqa: BLE001 - an unattended grid records the failure and goes on
        traceback.print_exc()
        rows, error = [], f"{type(e).__name__}: {e}".splitlines()[0]
    res = CellResult(cell, settings.key(), status, time.perf_counter() - t0, rows, error)
    if not keep_checkpoints:
        shutil.rmtree(path / "checkpoints", ignore_errors=True)
    save_record(path, res)
    return res


# ---------------------------------------------------------------------------- figures

def trailing_mean(values: list[float], k: int) -> list[float]:
    out = []
    for i in range(len(values)):
        window = values[max(0, i - k + 1): i + 1]
        out.append(sum(window) / len(window))
    return out


def _window(steps: int) -> int:
    """k: steps averaged for the start and final reward."""
    return max(1, steps // 5)


def _smooth_window(steps: int) -> int:
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
        k = _window(len(rewards))
        starts.append(statistics.fmean(rewards[:k]))
        finals.append(statistics.fmean(rewards[-k:]))
    start = statistics.fmean(starts)
    if max(finals) - start < MIN_GAIN:
        return None
    return start + 0.5 * (max(finals) - start)


def summarize_cell(res: CellResult, threshold: float | None, collapse_tol: float) -> CellSummary:
    rows = res.rows
    c = res.cell
    if not rows:
        nan = float("nan")
        return CellSummary(c.name, c.dtype, c.staleness, c.correction, res.status, 0, res.wall_s, nan, nan,
                           nan, nan, None, None, False, nan, nan, nan, nan, res.error)
    rewards = [r["reward_mean"] for r in rows]
    k, w = _window(len(rewards)), _smooth_window(len(rewards))
    smooth = trailing_mean(rewards, w)[w - 1:]  # full windows only: smooth[j] ends at step index j + w - 1
    start, final, peak = statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:]), max(smooth)
    hit = next((j + w - 1 for j, v in enumerate(smooth) if threshold is not None and v >= threshold), None)
    finite = all(math.isfinite(r["loss"]) for r in rows)
    collapsed = (not finite) or final < max(0.5 * peak, start - collapse_tol)
    return CellSummary(
        c.name, c.dtype, c.staleness, c.correction, res.status, len(rows), res.wall_s, start, final, peak,
        min(smooth),
        rows[hit]["step"] if hit is not None else None, rows[hit]["time_s"] if hit is not None else None,
        collapsed, statistics.fmean(r.get("mismatch_kl_k3", 0.0) for r in rows),
        statistics.fmean(r["masked_frac"] for r in rows),
        statistics.fmean(r.get("masked_seq_frac", 0.0) for r in rows),
        statistics.fmean(r["lag_mean"] for r in rows), res.error)


def curves(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    return {out: [float(r.get(key, float("nan"))) for r in rows] for key, out in CURVE_KEYS.items()}


def build_result(results: list[CellResult], settings: GridSettings, threshold: float | None,
                 collapse_tol: float, wall_s: float) -> dict[str, Any]:
    thr = threshold if threshold is not None else auto_threshold(results)
    cells = []
    for res in results:
        s = summarize_cell(res, thr, collapse_tol)
        cells.append({**asdict(s), "curves": curves(res.rows)})
    return _finite({"hardware": hardware(),
            "settings": {"steps": settings.steps, "seed": settings.seed, "model_dir": settings.model_dir,
                         "flags": list(settings.flags), "threshold": thr,
                         "threshold_source": "flag" if threshold is not None else "auto",
                         "collapse_rule": f"final < max(0.5 * peak, start - {collapse_tol}) or non-finite loss",
                         "window": "start/final: mean of the first/last max(1, steps // 5) steps; "
                                   "peak and threshold: max(1, steps // 10)-step trailing mean"},
            "wall_s": wall_s, "cells_wall_s": sum(r.wall_s for r in results), "cells": cells})


def _finite(x: Any) -> Any:
    """NaN/inf -> None, so the JSON is standard (a failed cell has no figures)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def _fmt(x: float | None, spec: str = ".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def markdown(result: dict[str, Any]) -> str:
    hw, st = result["hardware"], result["settings"]
    lines = [f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB, no GPU. "
             f"{st['steps']} steps per cell, seed {st['seed']}; wall time of the cells "
             f"{result['cells_wall_s'] / 60:.1f} min (this invocation {result['wall_s'] / 60:.1f} min).",
             f"Reward threshold {_threshold_text(st)}; collapse: "
             f"{st['collapse_rule']}; {st['window']}.", ""]
    for dtype in dict.fromkeys(c["dtype"] for c in result["cells"]):
        cells = [c for c in result["cells"] if c["dtype"] == dtype]
        lines += [f"### Generation dtype {dtype} (trainer float32)", "",
                  "| staleness | correction | final reward | start | peak | trough | steps to thr. | collapse | "
                  "mismatch KL k3 | masked tok. | masked seq. | lag | wall (s) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in cells:
            if c["status"] != "done" and not c["steps"]:
                lines.append(f"| {c['staleness']} | {c['correction']} | failed: {c['error']} |"
                             + " |" * 10)
                continue
            lines.append(
                f"| {c['staleness']} | {c['correction']} | {_fmt(c['final_reward'])} | "
                f"{_fmt(c['start_reward'])} | {_fmt(c['peak_reward'])} | {_fmt(c['trough_reward'])} | "
                f"{_steps_to(c['steps_to_threshold'], st['threshold'])} | "
                f"{'**yes**' if c['collapsed'] else 'no'} | {_fmt(c['mismatch_kl_k3_mean'], '.2e')} | "
                f"{_fmt(c['masked_token_frac_mean'])} | {_fmt(c['masked_seq_frac_mean'])} | "
                f"{_fmt(c['lag_mean'], '.2f')} | {c['wall_s']:.0f} |")
        lines += ["", *pivot(cells), ""]
    return "\n".join(lines)


def _steps_to(step: int | None, threshold: float | None) -> str:
    if threshold is None:
        return "-"
    return "never" if step is None else str(step)


def _threshold_text(st: dict[str, Any]) -> str:
    if st["threshold"] is None:
        return f"none (no cell gained {MIN_GAIN} over the mean start reward)"
    return f"{st['threshold']:.3f} ({st['threshold_source']})"


def pivot(cells: list[dict[str, Any]]) -> list[str]:
    """Final reward, staleness (rows) x correction (columns)."""
    ks = list(dict.fromkeys(c["staleness"] for c in cells))
    corrs = list(dict.fromkeys(c["correction"] for c in cells))
    by = {(c["staleness"], c["correction"]): c for c in cells}
    lines = ["Final reward (staleness x correction; * = collapsed):", "",
             "| staleness | " + " | ".join(corrs) + " |", "|---" * (len(corrs) + 1) + "|"]
    for k in ks:
        vals = []
        for corr in corrs:
            c = by.get((k, corr))
            vals.append("-" if c is None else _fmt(c["final_reward"]) + ("*" if c["collapsed"] else ""))
        lines.append(f"| {k} | " + " | ".join(vals) + " |")
    return lines


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    """One curves figure per dtype and one final-reward heat map figure; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    dtypes = list(dict.fromkeys(c["dtype"] for c in result["cells"]))
    for dtype in dtypes:
        cells = [c for c in result["cells"] if c["dtype"] == dtype and c["curves"]["step"]]
        if not cells:
            continue
        path = out / f"ablation_{SHORT_DTYPE[dtype]}.png"
        _plot_curves(plt, cells, dtype, result, path)
        written.append(path)
    path = out / "ablation_final.png"
    _plot_heatmaps(plt, result, dtypes, path)
    written.append(path)
    return written


def _plot_curves(plt: Any, cells: list[dict[str, Any]], dtype: str, result: dict[str, Any], path: Path) -> None:
    corrs = list(dict.fromkeys(c["correction"] for c in cells))
    ks = sorted(dict.fromkeys(c["staleness"] for c in cells))
    cmap = plt.get_cmap("viridis")
    colors = {k: cmap(i / max(1, len(ks) - 1)) for i, k in enumerate(ks)}
    panels = (("step", "reward", "reward (trailing mean)"), ("time_s", "reward", "reward vs wall time (s)"),
              ("step", "mismatch_kl_k3", "mismatch KL (k3)"), ("step", "masked_token_frac", "masked token frac"))
    fig, axes = plt.subplots(len(panels), len(corrs), figsize=(max(6, 4 * len(corrs)), 3 * len(panels)),
                             squeeze=False, sharey="row")
    for col, corr in enumerate(corrs):
        for c in (c for c in cells if c["correction"] == corr):
            cv = c["curves"]
            k = _smooth_window(len(cv["step"]))
            for row, (x, y, label) in enumerate(panels):
                vals = [_num(v) for v in cv[y]]
                ys = trailing_mean(vals, k) if y == "reward" else \
                    [max(v, 1e-9) for v in vals] if y == "mismatch_kl_k3" else vals
                axes[row][col].plot(cv[x], ys, color=colors[c["staleness"]], lw=1.3,
                                    ls="--" if c["collapsed"] else "-", label=f"staleness {c['staleness']}")
        for row, (x, _, label) in enumerate(panels):
            ax = axes[row][col]
            ax.set_xlabel("wall time (s)" if x == "time_s" else "step")
            if col == 0:
                ax.set_ylabel(label)
            if panels[row][1] == "mismatch_kl_k3":
                ax.set_yscale("log")
        axes[0][col].set_title(f"correction: {corr}")
    axes[0][0].legend(fontsize=7)
    hw = result["hardware"]
    fig.suptitle(f"{dtype} generation, float32 trainer\n{result['settings']['steps']} steps, seed "
                 f"{result['settings']['seed']}, {hw['cores']} CPU cores; dashed = collapsed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _num(x: float | None) -> float:
    return float("nan") if x is None else x


def _plot_heatmaps(plt: Any, result: dict[str, Any], dtypes: list[str], path: Path) -> None:
    fig, axes = plt.subplots(1, max(1, len(dtypes)), figsize=(5 * max(1, len(dtypes)), 3.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        cells = [c for c in result["cells"] if c["dtype"] == dtype]
        ks = sorted(dict.fromkeys(c["staleness"] for c in cells))
        corrs = list(dict.fromkeys(c["correction"] for c in cells))
        by = {(c["staleness"], c["correction"]): c for c in cells}
        grid_vals = [[_num(by[(k, corr)]["final_reward"]) if (k, corr) in by else float("nan")
                      for corr in corrs] for k in ks]
        top = max([v for row in grid_vals for v in row if not math.isnan(v)] + [0.05])
        im = ax.imshow(grid_vals, cmap="magma", aspect="auto", vmin=0.0, vmax=top)
        for i, k in enumerate(ks):
            for j, corr in enumerate(corrs):
                c = by.get((k, corr))
                if c is not None and c["final_reward"] is not None:
                    ax.text(j, i, f"{c['final_reward']:.2f}{'*' if c['collapsed'] else ''}", ha="center",
                            va="center", color="white" if c["final_reward"] < 0.6 * top else "black", fontsize=8)
        ax.set_xticks(range(len(corrs)), corrs)
        ax.set_yticks(range(len(ks)), [str(k) for k in ks])
        ax.set_xlabel("correction")
        ax.set_ylabel("staleness")
        ax.set_title(f"final reward, {dtype} generation")
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Staleness x off-policy correction ablation (fp32 and bf16 generation), resumable "
                    "cell by cell. Extra pipeline flags go after '--' (e.g. -- --trainer.lr 5e-4).",
        epilog=f"--quick: staleness {','.join(map(str, QUICK_STALENESS))} x all corrections, "
               f"{','.join(QUICK_DTYPES)} generation only, {QUICK_STEPS} steps per cell of the default "
               f"model, task and batch; sized for <= 20 minutes on 2 CPU cores. Explicit "
               "--staleness/--corrections/--dtypes/--steps override it. Without --quick: the full "
               f"grid, {len(STALENESS) * len(CORRECTIONS) * len(DTYPES)} cells x {FULL_STEPS} steps.")
    p.add_argument("--quick", action="store_true", help="The 2-core smoke grid (see below).")
    p.add_argument("--staleness", default=None, help="Comma list (default 0,1,2,4,8).")
    p.add_argument("--corrections", default=None, help=f"Comma list (default {','.join(CORRECTIONS)}).")
    p.add_argument("--dtypes", default=None, help="Comma list of generation dtypes: float32/fp32, "
                   "bfloat16/bf16 (default both).")
    p.add_argument("--steps", type=int, default=None, help=f"Optimizer steps per cell (default {FULL_STEPS}; "
                   f"--quick: {QUICK_STEPS}).")
    p.add_argument("--seed", type=int, default=0, help="Seed of every cell (default 0).")
    p.add_argument("--model", default=None, help="Model folder (default: the built-in model).")
    p.add_argument("--threshold", type=float, default=None, help="Reward threshold for 'steps to "
                   "threshold' (default: half-way from the mean start reward to the best final reward).")
    p.add_argument("--collapse-tol", type=float, default=0.05, help="Collapse tolerance below the start "
                   "reward (default 0.05).")
    p.add_argument("--rerun", action="store_true", help="Rerun finished cells too.")
    p.add_argument("--max-restarts", type=int, default=2, help="Restarts of the grid process when it "
                   "dies (e.g. Ray's node went away); finished cells are kept (default 2).")
    p.add_argument("--in-process", action="store_true", help="Run the grid in this process, no restarts.")
    p.add_argument("--keep-checkpoints", action="store_true", help="Keep each cell's final checkpoint.")
    p.add_argument("--out", type=Path, default=Path("runs/bench_ablation"), help="Output folder.")
    p.add_argument("--json", type=Path, default=None, help="Also write the JSON result here.")
    return p


def resolve_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[Cell], GridSettings]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = build_parser()
    args = p.parse_args(argv)
    quick = args.quick
    steps = args.steps if args.steps is not None else (QUICK_STEPS if quick else FULL_STEPS)
    if steps < 1:
        p.error("--steps: must be >= 1")
    try:
        cells = grid(args.staleness or ",".join(map(str, QUICK_STALENESS if quick else STALENESS)),
                     args.corrections or ",".join(CORRECTIONS),
                     args.dtypes or ",".join(QUICK_DTYPES if quick else DTYPES))
    except AblationError as e:
        p.error(str(e))
    flags = (*(QUICK_FLAGS if quick else ()), *extra)
    # Validate the shared flags once, before anything starts (a bad flag fails in a second, not per cell).
    from pipeline_rl.cli import UsageError
    from pipeline_rl.driver import resolve_model_dir

    try:
        base = config([*(["--model.path", args.model] if args.model else []), *flags])
    except UsageError as e:
        p.error(str(e))
    model_dir = str(Path(resolve_model_dir(base)).resolve())
    return args, cells, GridSettings(steps, args.seed, model_dir, tuple(flags))


#: Exit status of a grid process some of whose cells failed (a crash of the process is any other).
CELLS_FAILED = 3


def main(argv: list[str] | None = None) -> int:
    """Run the grid in a child process and restart it (finished cells kept) when it dies:
    Ray ends its driver process when its node goes away, which no ``except`` can catch."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, cells, settings = resolve_args(argv)
    if args.in_process:
        return run_grid(args, cells, settings)
    if args.rerun:  # forget finished cells here, once, so a restarted child keeps what it finished
        for cell in cells:
            (args.out / "cells" / cell.name / "cell.json").unlink(missing_ok=True)
    child = [sys.executable, str(Path(__file__).resolve()), "--in-process",
             *[a for a in argv if a != "--rerun"]]
    code = -1
    for attempt in range(args.max_restarts + 1):
        code = subprocess.run(child, check=False).returncode
        if code in (0, CELLS_FAILED):
            return 0 if code == 0 else 1
        print(f"ablation: the grid process died (exit status {code}); "
              + ("restarting it, finished cells are kept" if attempt < args.max_restarts else "giving up"),
              file=sys.stderr, flush=True)
    report(collect(cells, settings, args.out), args, settings, wall_s=0.0)
    return 1


def collect(cells: list[Cell], settings: GridSettings, out: Path) -> list[CellResult]:
    """The finished cells' records; a cell not finished is a failed placeholder."""
    return [load_finished(out / "cells" / c.name, settings.key())
            or CellResult(c, settings.key(), "failed", 0.0, [], "not finished") for c in cells]


def run_grid(args: argparse.Namespace, cells: list[Cell], settings: GridSettings) -> int:
    """Run every unfinished cell on one local Ray, then write the report."""
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    results: list[CellResult] = []
    t0 = time.perf_counter()
    todo = [c for c in cells if args.rerun or load_finished(out / "cells" / c.name, settings.key()) is None]
    print(f"ablation: {len(cells)} cells, {len(cells) - len(todo)} already finished, {len(todo)} to run "
          f"({settings.steps} steps each) -> {out}", flush=True)
    if todo:
        start_ray()
    try:
        for i, cell in enumerate(cells):
            done = None if cell in todo else load_finished(out / "cells" / cell.name, settings.key())
            if done is None:
                print(f"[{i + 1}/{len(cells)}] {cell.name}", flush=True)
                done = run_cell(cell, settings, out, args.keep_checkpoints)
                print(f"[{i + 1}/{len(cells)}] {cell.name}: {done.status} in {done.wall_s:.0f} s"
                      + (f" ({done.error})" if done.error else ""), flush=True)
            results.append(done)
    finally:
        if todo:
            stop_ray()
    report(results, args, settings, time.perf_counter() - t0)
    return 0 if all(r.status == "done" for r in results) else CELLS_FAILED


def report(results: list[CellResult], args: argparse.Namespace, settings: GridSettings, wall_s: float) -> None:
    result = build_result(results, settings, args.threshold, args.collapse_tol, wall_s)
    write_outputs(result, args.out, args.json)


def write_outputs(result: dict[str, Any], out: Path, json_path: Path | None) -> None:
    text = json.dumps(result, indent=1, allow_nan=False)
    (out / "ablation.json").write_text(text)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(text)
    md = markdown(result)
    (out / "ablation.md").write_text(md + "\n")
    plot(result, out)
    print(md, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
