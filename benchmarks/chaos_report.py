"""The chaos benchmark's report (``benchmarks.chaos``): what a run's records say once it
ended, the Markdown tables and the acceptance lines.

Provenance: a result's ``sources`` names, per column (``chaos``, ``unbroken``), the invocation
that measured it (:func:`invocation`: how it was run, when it started, the commit). One
invocation stamps both columns alike; a result put together from more than one (a column
rerun apart) carries different stamps, and its table then shows a row saying which column
came from where, so the page cannot present them as one sitting.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT


#: Held-out evaluations averaged beside the final one (32 prompts: one evaluation moves by
#: 0.03 per prompt, and the default run's swings by 0.06-0.12 between evaluations).
LAST = 5


def records(folder: Path, steps: int) -> dict[str, Any]:
    """The run's records as they ended: steps reached, twice and missing; the same for
    its evaluations; the final held-out greedy accuracy, and the mean of the last ``LAST``."""
    from collections import Counter

    from pipeline_rl.metrics import read_evals, read_metrics

    rows = read_metrics(folder / "metrics.jsonl") if (folder / "metrics.jsonl").exists() else []
    counts = Counter(int(r["step"]) for r in rows)
    evals = read_evals(folder / "eval.jsonl")
    eval_counts = Counter(e.step for e in evals)
    return {"reached": max(counts, default=0), "rows": len(rows),
            "twice": sorted(s for s, n in counts.items() if n > 1),
            "missing": sorted(set(range(1, steps + 1)) - set(counts)),
            "evals_twice": sorted(s for s, n in eval_counts.items() if n > 1),
            "final_greedy": evals[-1].greedy_accuracy if evals and evals[-1].step == steps else None,
            "last_greedy_mean": (sum(e.greedy_accuracy for e in evals[-LAST:]) / len(evals[-LAST:])
                                 if evals else None),
            "train_s": float(rows[-1]["time_s"]) if rows else 0.0}



def invocation(how: str = "benchmarks.chaos") -> dict[str, Any]:
    """This invocation's stamp for ``sources``: ``how``, the UTC minute it started and the
    repository's commit (None outside a git checkout; ``dirty`` when files differ from it)."""
    def git(*argv: str) -> str | None:
        try:
            out = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    return {"how": how, "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": commit,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None}


def _source(s: dict[str, Any] | None) -> str:
    if s is None:
        return "not recorded"
    commit = "commit not recorded" if not s.get("commit") else (
        f"commit {s['commit']}" + (" with local changes" if s.get("dirty") else ""))
    return f"{s['how']}, {s['started_utc']} UTC, {commit}"


def sources_row(res: dict[str, Any]) -> tuple[str, str, str] | None:
    """The table's provenance row when its columns came from different invocations (or one
    column's is recorded and the other's not); None when one invocation measured both."""
    cols = ["chaos", *(["unbroken"] if res.get("unbroken") else [])]
    stamps = [(res.get("sources") or {}).get(c) for c in cols]
    if len(cols) < 2 or stamps[0] == stamps[1]:
        return None
    return ("measured by (invocation, start, commit)", _source(stamps[0]), _source(stamps[1]))


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def markdown(res: dict[str, Any]) -> str:
    c, u, hw = res["chaos"], res.get("unbroken"), res["hardware"]
    every = res["checkpoint_every"]
    actors = res.get("actor_kills", [])
    kinds = {kind: sum(k["kind"].startswith(kind) for k in actors) for kind in ("trainer", "buffer")}
    lines = [f"Chaos: {res['steps']:,} steps of `launch/async_grpo.py {' '.join(res['flags'])}`, "
             f"{len(res['worker_kills'])} rollout-worker kills, {kinds['trainer']} trainer kills and "
             f"{kinds['buffer']} buffer kills (each healed by the run itself), {len(res['run_kills'])} whole-run "
             f"kills (SIGKILL) each followed by `--resume RUN_DIR` (seed {res['seed']}).",
             f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB.", ""]
    if res["failure"]:
        lines += [f"**Failed:** {res['failure']}", ""]
    lines += ["| | chaos | unbroken |", "|---|---:|---:|"]
    source = sources_row(res)
    both: list[tuple[str, str, str]] = [*([source] if source else []),
        ("steps reached / target", f"{c['reached']:,} / {res['steps']:,}",
         f"{u['reached']:,} / {res['steps']:,}" if u else "-"),
        ("steps twice / missing in metrics.jsonl", f"{len(c['twice'])} / {len(c['missing'])}",
         f"{len(u['twice'])} / {len(u['missing'])}" if u else "-"),
        ("evaluations twice in eval.jsonl", f"{len(c['evals_twice'])}", f"{len(u['evals_twice'])}" if u else "-"),
        ("final held-out greedy accuracy", _num(c["final_greedy"], "{:.3f}"),
         _num(u["final_greedy"], "{:.3f}") if u else "-"),
        # Results from before ``last_greedy_mean`` was recorded have no such row.
        *([(f"held-out greedy, mean of the last {LAST} evaluations", _num(c.get("last_greedy_mean"), "{:.3f}"),
            _num(u.get("last_greedy_mean"), "{:.3f}") if u else "-")] if "last_greedy_mean" in c else []),
        ("wall time (start-ups included)", f"{res['chaos_wall_s']:,.0f} s",
         f"{res['unbroken_wall_s']:,.0f} s" if u else "-"),
        ("training time (the run's clock)", f"{c['train_s']:,.0f} s", f"{u['train_s']:,.0f} s" if u else "-"),
    ]
    lines += [f"| {a} | {b} | {x} |" for a, b, x in both]
    back = worker_back_p90(res)
    lines += ["", f"Median step: {res['median_step_s'] * 1e3:.0f} ms. Worker kill to the first step after "
              f"it is back, p90: {_num(back)} s.", "",
              "| worker kill | after step | groups lost in flight | back at step | kill to that step | time lost |",
              "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {i + 1} | {k['step']} | {_num(k['groups_lost'], '{:.0f}')} | {k['restart_step'] or 'n/a'} | "
              f"{_num(k.get('back_s'))} s | {_num(k['time_lost_s'])} s |" for i, k in enumerate(res["worker_kills"])]
    lines += ["", f"| trainer or buffer kill | what | after step | restarted at step | steps lost (bound {every}) "
              "| groups in the buffer (lost) | kill to first new step | kill to the step again |",
              "|---:|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {i + 1} | {k['kind']} | {k['step']} | {k['resumed_at']} | {k['steps_lost']} | {k['buffer_fill']} | "
              f"{_num(k['back_s'])} s | {_num(k['time_lost_s'])} s |" for i, k in enumerate(actors)]
    lines += ["", "| run kill | after step | resumed at step | steps lost "
              f"(bound {every}) | groups in the buffer (lost) | kill to first step | kill to the step again "
              "| processes outside its group |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {i + 1} | {k['step']} | {k['resumed_at']} | {k['steps_lost']} | "
              f"{k['buffer_fill']} | {_num(k['restart_s'])} s | {_num(k['time_lost_s'])} s | {k['outside_group']} |"
              for i, k in enumerate(res["run_kills"])]
    lines += ["", "| acceptance | met |", "|---|:---:|"]
    lines += [f"| {name} | {'yes' if ok else 'no'} |" for name, ok in res["acceptance"].items()]
    return "\n".join(lines)


def worker_back_p90(res: dict[str, Any]) -> float | None:
    """The 90th percentile of the worker kills' time to the first step after the worker is back."""
    backs = sorted(k["back_s"] for k in res["worker_kills"] if k.get("back_s") is not None)
    return backs[min(len(backs) - 1, int(0.9 * len(backs)))] if backs else None


def acceptance(res: dict[str, Any]) -> dict[str, bool]:
    c, u, every = res["chaos"], res.get("unbroken"), res["checkpoint_every"]
    kills = res.get("actor_kills", [])
    out = {f"reaches step {res['steps']:,}": c["reached"] >= res["steps"],
           "no step twice (or missing) in metrics.jsonl": not c["twice"] and not c["missing"],
           "no evaluation twice in eval.jsonl": not c["evals_twice"],
           f"steps lost per trainer or buffer kill <= one checkpoint interval ({every})":
               all(k["steps_lost"] is not None and 0 <= k["steps_lost"] <= every for k in kills),
           f"steps lost per whole-run kill <= one checkpoint interval ({every})":
               all(k["steps_lost"] is not None and 0 <= k["steps_lost"] <= every for k in res["run_kills"])}
    back = worker_back_p90(res)
    if back is not None:
        out["worker kill to the first step after it is back: p90 <= 20 s"] = back <= 20.0
    if u is not None and u["final_greedy"] is not None and c["final_greedy"] is not None:
        out["final held-out greedy within 0.1 of the unbroken run"] = abs(c["final_greedy"] - u["final_greedy"]) <= 0.1
    if u is not None and res.get("unbroken_wall_s"):
        out["wall time at most 2x the unbroken run's"] = res["chaos_wall_s"] <= 2 * res["unbroken_wall_s"]
    return out
