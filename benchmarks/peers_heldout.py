"""Held-out evaluations in ``benchmarks.peers``: both sides evaluated on the same held-out
prompts, and each timed to a held-out greedy accuracy (``--heldout-target``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class HeldOut:
    """One held-out greedy evaluation of a run: after ``step``, at ``train_s`` seconds of
    training and wall clock ``unix_time_s`` (the project: the step's end, the evaluation runs
    beside training; TRL: evaluation time left out of both)."""

    step: int
    train_s: float
    unix_time_s: float
    greedy: float


def read_held_out(path: Path, rows: list[dict[str, Any]]) -> list[HeldOut]:
    """A run's held-out evaluations: TRL's rows carry their training time and wall clock;
    the project's are placed at the end of the step they were launched after (step 0: the
    first step's start)."""
    from pipeline_rl.metrics import read_metrics

    if not path.is_file():
        return []
    by_step = {int(r["step"]): r for r in rows}
    start = float(rows[0]["unix_time_s"]) - float(rows[0]["time_s"])
    out = []
    for e in read_metrics(path):
        if "unix_time_s" in e:   # TRL's
            out.append(HeldOut(int(e["step"]), float(e["time_s"]), float(e["unix_time_s"]),
                               float(e["greedy_accuracy"])))
            continue
        row = by_step.get(int(e["step"]))
        train_s = float(row["time_s"]) if row else 0.0
        out.append(HeldOut(int(e["step"]), train_s, float(row["unix_time_s"]) if row else start,
                           float(e["greedy_accuracy"])))
    return out


def fmt(x: float | None, spec: str = ".2f") -> str:
    """A figure, or - for none."""
    return "-" if x is None else format(x, spec)


def fmt_range(d: dict[str, Any], spec: str = ".1f") -> str:
    """A median with its range (``median_range``'s dict), or never."""
    if d["median"] is None:
        return "never"
    return f"{fmt(d['median'], spec)} ({fmt(d['min'], spec)}–{fmt(d['max'], spec)})"


def heldout_bounds(mine: dict[str, Any], trl: dict[str, Any]) -> dict[str, float]:
    """Upper bounds on the held-out ratios when this side reached the target and TRL never did:
    TRL had not by its last evaluation, so its time to the target is longer than that one's
    (medians; ``*_bound`` keys, empty when the plain ratio exists or nothing bounds it)."""
    out: dict[str, float] = {}
    if trl["heldout_train_s_to_target"]["median"] is not None:
        return out
    for f in ("train", "wall"):
        a, b = mine[f"heldout_{f}_s_to_target"]["median"], trl.get(f"heldout_{f}_s_last", {}).get("median")
        if a is not None and b:
            out[f"heldout_{f}_s_to_target_bound"] = a / b
    return out


def _ratio(r: dict[str, Any], f: str) -> str:
    if r.get(f) is not None:
        return fmt(r[f])
    return f"< {fmt(r[f + '_bound'])}" if r.get(f + "_bound") is not None else "-"


def heldout_markdown(summ: dict[str, Any], st: dict[str, Any], label: Callable[[str], str]) -> list[str]:
    """The report's held-out table (nothing without a target)."""
    if st.get("heldout_target") is None:
        return []
    lines = ["", f"Held-out greedy accuracy ({st['eval_prompts']} prompts of the task's held-out split, every "
              f"{st['eval_every']} steps; TRL's evaluation time left out of its times); target "
              f"{st['heldout_target']}:", "",
              "| system | greedy, first -> last | steps to target | training time to target (s) | "
              "wall time to target (s) | ratio to TRL: training, wall |", "|---|---|---|---|---|---|"]
    for sys_, d in summ["systems"].items():
        r = summ["ratios_vs_trl"].get(sys_, {})
        lines.append(f"| {label(sys_)} | {fmt_range(d['greedy_first'], '.3f')} -> {fmt_range(d['greedy_last'], '.3f')} | "
                     f"{fmt_range(d['heldout_steps_to_target'], '.0f')} | {fmt_range(d['heldout_train_s_to_target'])} | "
                     f"{fmt_range(d['heldout_wall_s_to_target'])} | {_ratio(r, 'heldout_train_s_to_target')}, "
                     f"{_ratio(r, 'heldout_wall_s_to_target')} |")
    if any(k.endswith("_bound") for r in summ["ratios_vs_trl"].values() for k in r):
        trl = summ["systems"].get("trl", {})
        lines += ["", f"< x: TRL had not reached the target at its last evaluation "
                  f"({fmt(trl.get('heldout_train_s_last', {}).get('median'), '.0f')} s of training, "
                  f"{fmt(trl.get('heldout_wall_s_last', {}).get('median'), '.0f')} s of wall time), so the "
                  f"ratio is below this side's time over those."]
    return lines
