"""The real-model correction study: off-policy corrections and objectives compared where stale
data hurts, judged by held-out greedy accuracy.

Design (every cell is one run of the real pipeline, as in ``benchmarks.ablation``, whose
cells, Ray placement and records it reuses):

- the *regime*: ``none`` (REINFORCE, no correction) at staleness 0 against ``none`` at
  ``--staleness`` (default 8). The regime stresses ``none`` when the stale arm's final
  held-out greedy accuracy is at least ``--stress`` (default 0.1) below the fresh one's;
- the *arms*, at ``--staleness``: ``--arms`` (default none, seq-mask-tis, gspo and cispo against the
  generator's log-probs, m2po),
  each against ``none`` at the same staleness (Welch t-tests, Holm-corrected over the arms);
- ``--seeds`` seeds of every cell (default 3); cells run seed by seed, the regime's pair
  first, so a partial study already shows whether its regime stresses ``none``;
- held-out greedy accuracy on the same ``--eval-prompts`` prompts at step 0 and after the last
  step (``--eval.every`` = ``--steps``), the figure compared;
- the smallest difference in final held-out greedy the study could detect: the two-sample
  t-test's (two-sided ``--alpha``, power ``--power``) at its seeds per arm and the arms'
  pooled spread, ``(t_{1-alpha/2} + t_{power}) * sd * sqrt(2 / n)`` with ``2n - 2`` degrees
  of freedom; and the same at Holm's first threshold, ``alpha / arms``.

The built-in study flags (``STUDY_FLAGS``: SmolLM2-135M-Instruct with a rank-16 LoRA adapter,
word problems, 32 sequences per step, learning rate 1e-3: 2.5x the pretrained profile's LoRA rate, at which
staleness 8 did not hurt ``none`` in 20 steps, held-out greedy 0.203 -> 0.406 against staleness 0's 0.359;
at 1e-3 and 2e-3 with 16 sequences per step staleness 0 itself lost held-out greedy), generation in
``--dtype``); flags
after ``--`` are added after them (the last of a flag wins).

Usage: ``python -m benchmarks.correction_study [--steps 16] [--staleness 8] [--seeds 3]
[--dtype float32] [--arms none,seq-mask-tis,gspo@behaviour+none,m2po] [--md PATH] [-- flags]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.ablation import DTYPE_ALIASES, Plan, parse_arms, run_unfinished
from benchmarks.ablation_cells import Arm, Cell, CellResult, GridSettings, treatment
from benchmarks.common import BadFlag, Outcome, at_least, config, hardware, main as bench_main, ray_session
from benchmarks.stats import holm, mean_interval, t_ppf, welch_t_test
from pipeline_rl.metrics import version_span

#: GSPO's and CISPO's ratio against the generator's log-probs (``@behaviour``): against the trainer's own
#: at the step's start (proximal, the default) their ratio is 1 on a batch's one optimizer step, and they
#: would not see the staleness at all.
ARMS = "none,seq-mask-tis,gspo@behaviour+none,cispo@behaviour+none,m2po"
STUDY_FLAGS: tuple[str, ...] = ("--task.name", "word_problems", "--lora.rank", "16", "--trainer.lr", "1e-3")


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arms", default=ARMS, help="Comma list of arms at --staleness (as benchmarks.ablation's "
                   f"--arms: a correction preset, loss+correction, loss@reference+correction; default {ARMS}).")
    p.add_argument("--staleness", type=int, default=8, help="The stale arms' --staleness (default 8).")
    p.add_argument("--steps", type=int, default=16, help="Optimizer steps per cell (default 16).")
    p.add_argument("--seeds", type=int, default=3, help="Seeds per arm (default 3; at least 2).")
    p.add_argument("--seed", type=int, default=0, help="First seed (default 0).")
    p.add_argument("--dtype", default="bfloat16", help="Generation dtype, float32/fp32 or bfloat16/bf16 "
                   "(default bfloat16; the trainer is fp32).")
    p.add_argument("--model", default="smollm2-135m-instruct", help="Model folder or built-in name "
                   "(default smollm2-135m-instruct).")
    p.add_argument("--eval-prompts", type=int, default=64, help="Held-out prompts per evaluation (default 64).")
    p.add_argument("--stress", type=float, default=0.1, help="Held-out greedy that stale 'none' must lose "
                   "against fresh 'none' for the regime to stress it (default 0.1).")
    p.add_argument("--alpha", type=float, default=0.05, help="Family-wise significance level (default 0.05).")
    p.add_argument("--power", type=float, default=0.8, help="Power of the minimum detectable difference "
                   "(default 0.8).")


def resolve(args: argparse.Namespace) -> Plan:
    """The study of the command line (a bad flag: :class:`BadFlag`), checked before anything starts."""
    at_least(args, steps=1, seeds=2, seed=0, eval_prompts=1, staleness=1)
    if not (0.0 < args.alpha < 1.0 and 0.0 < args.power < 1.0):
        raise BadFlag(f"--alpha and --power must be in (0, 1), got {args.alpha} and {args.power}")
    if args.dtype not in DTYPE_ALIASES:
        raise BadFlag(f"--dtype: one of {', '.join(DTYPE_ALIASES)} (got {args.dtype!r})")
    dtype = DTYPE_ALIASES[args.dtype]
    arms = [("reinforce", "proximal", "none"), *parse_arms(args.arms)]
    stale = [Arm(dtype, args.staleness, c, o, r) for o, r, c in dict.fromkeys(arms)]
    cells = [Cell(arm, s) for s in range(args.seed, args.seed + args.seeds)
             for arm in (Arm(dtype, 0, "none"), *stale)]
    shared = (*STUDY_FLAGS, "--eval.every", str(args.steps), "--eval.num_prompts", str(args.eval_prompts),
              "--eval.k", "1", *args.run_flags)
    from pipeline_rl.driver import resolve_model_dir
    from pipeline_rl.resources import cpus_needed

    base = config(["--model", args.model, *shared])
    model_dir = str(Path(resolve_model_dir(base)).resolve())
    return Plan(cells, GridSettings(args.steps, model_dir, shared), cpus_needed(base))


def run(args: argparse.Namespace) -> Outcome:
    """Run every unfinished cell (finished ones, under the same settings, are kept), then report."""
    study = resolve(args)
    t0 = time.perf_counter()
    done, ran = run_unfinished("correction study", study, args.out,
                               about=lambda res: f", held-out greedy {final_greedy(res)}")
    results = [r for r in done.values() if r is not None]
    result = summarise(results, args, time.perf_counter() - t0, ran=ran)
    return Outcome(result, markdown(result), 0 if len(results) == len(study.cells) else 1)


def final_eval(res: CellResult) -> dict[str, Any] | None:
    """The held-out evaluation after the cell's last step (None: no such evaluation)."""
    last = [e for e in res.evals if res.rows and int(e["step"]) == len(res.rows)]
    return last[-1] if last else None


def final_greedy(res: CellResult) -> float | None:
    """The held-out greedy accuracy after the cell's last step (None: no such evaluation)."""
    last = final_eval(res)
    return float(last["greedy_accuracy"]) if last else None


def label(arm: Arm) -> str:
    return f"{treatment(asdict(arm))} @ staleness {arm.staleness}"


def arm_summary(cells: list[CellResult]) -> dict[str, Any]:
    """One arm's figures over its seeds: final held-out greedy (mean, 95% interval, per seed,
    and the weight versions that served it per seed), the step-0 greedy, train reward over the
    last 5 steps, and the off-policy diagnostics."""
    rows = [r for c in cells for r in c.rows]
    last = [e for e in map(final_eval, cells) if e is not None]
    finals = [float(e["greedy_accuracy"]) for e in last]
    starts = [float(e["greedy_accuracy"]) for c in cells for e in c.evals if int(e["step"]) == 0]
    iv = mean_interval(finals)

    def mean_of(key: str, default: float) -> float:
        return statistics.fmean(float(r.get(key, default)) for r in rows) if rows else float("nan")

    return {"final_greedy": finals, "mean": iv.mean, "lo": iv.lo, "hi": iv.hi,
            "start_greedy": statistics.fmean(starts) if starts else float("nan"),
            "train_reward_last5": statistics.fmean(float(r["reward_mean"]) for c in cells for r in c.rows[-5:])
            if rows else float("nan"),
            "lag_mean": mean_of("lag_mean", 0.0), "mismatch_kl_k3": mean_of("mismatch_kl_k3", 0.0),
            "ess": mean_of("ess", 1.0), "masked_token_frac": mean_of("masked_frac", 0.0),
            "masked_seq_frac": mean_of("masked_seq_frac", 0.0),
            "entropy_last": statistics.fmean(float(c.rows[-1].get("entropy", math.nan)) for c in cells if c.rows)
            if rows else float("nan"),
            "final_versions": [version_span(int(e["version_min"]), int(e["version_max"])) for e in last],
            "greedy_len_final": statistics.fmean(float(e.get("greedy_len_mean", math.nan)) for e in last)
            if last else float("nan"),
            "cell_wall_s": statistics.fmean(c.wall_s for c in cells)}


def min_detectable(sd: float, n: int, alpha: float, power: float) -> float:
    """The smallest true difference of two means a two-sided two-sample t-test at level ``alpha``
    detects with probability ``power``, ``n`` per group, common spread ``sd`` (2n - 2 df)."""
    df = 2 * n - 2
    return (t_ppf(1.0 - alpha / 2.0, df) + t_ppf(power, df)) * sd * math.sqrt(2.0 / n)


def summarise(results: list[CellResult], args: argparse.Namespace, wall_s: float, ran: int = 0) -> dict[str, Any]:
    """The study's figures: per arm, the regime's test, each arm against stale ``none`` (Holm),
    the minimum detectable difference and the wall times."""
    by_arm: dict[Arm, list[CellResult]] = {}
    for r in results:
        if r.status == "done":
            by_arm.setdefault(r.cell.arm, []).append(r)
    arms = {label(a): {"arm": a, **arm_summary(cs)} for a, cs in by_arm.items()}
    fresh = next((v for v in arms.values() if v["arm"].staleness == 0), None)
    stale_none = next((v for v in arms.values() if v["arm"].staleness > 0 and label(v["arm"]).startswith("none ")),
                      None)
    regime = None
    if fresh and stale_none:
        t = welch_t_test(stale_none["final_greedy"], fresh["final_greedy"])
        regime = {"diff": stale_none["mean"] - fresh["mean"], "p": t.p,
                  "stressed": stale_none["mean"] - fresh["mean"] <= -args.stress}
    tested = [n for n, v in arms.items() if v["arm"].staleness > 0 and v is not stale_none]
    tests = [welch_t_test(arms[n]["final_greedy"], stale_none["final_greedy"] if stale_none else [])
             for n in tested]
    adjusted = holm([t.p for t in tests])
    vs_none = {n: {"diff": t.diff, "p": t.p, "p_holm": ph, "separates": ph < args.alpha}
               for n, t, ph in zip(tested, tests, adjusted)}
    spreads = [statistics.variance(v["final_greedy"]) for v in arms.values() if len(v["final_greedy"]) >= 2]
    sd = math.sqrt(statistics.fmean(spreads)) if spreads else float("nan")
    n = min((len(v["final_greedy"]) for v in arms.values()), default=0)
    mdd = {"sd_pooled": sd, "n": n, "alpha": args.alpha, "power": args.power,
           "mdd": min_detectable(sd, n, args.alpha, args.power) if n >= 2 else float("nan"),
           "mdd_holm_first": min_detectable(sd, n, args.alpha / max(1, len(tested)), args.power)
           if n >= 2 else float("nan")}
    return {"hardware": hardware(), "steps": args.steps, "staleness": args.staleness, "dtype": args.dtype,
            "flags": [*STUDY_FLAGS, *args.run_flags], "eval_prompts": args.eval_prompts, "stress": args.stress,
            "cells": len(results), "cell_wall_s_sum": sum(r.wall_s for r in results), "wall_s": wall_s, "ran": ran,
            "arms": {k: {**{x: y for x, y in v.items() if x != "arm"}, "staleness": v["arm"].staleness}
                     for k, v in arms.items()},
            "regime": regime, "vs_none": vs_none, "mdd": mdd}


def fmt(x: float, spec: str = ".3f") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def markdown(res: dict[str, Any]) -> str:
    """The study's page: conditions, the regime, the arms' table, the tests and the detectable difference."""
    hw, m = res["hardware"], res["mdd"]
    lines = [f"Hardware: {hw.get('cpu', '?')}, {hw.get('cores', '?')} cores. Generation {res['dtype']} against "
             f"the fp32 trainer; {res['steps']} steps per cell; held-out greedy on {res['eval_prompts']} prompts "
             f"at step 0 and after the last step. Flags: `{' '.join(res['flags'])}`. {res['cells']} cells, "
             f"{res['cell_wall_s_sum'] / 60:.1f} min of cells (the study's wall time, one cell at a time); this "
             f"invocation ran {res['ran']} of them in {res['wall_s'] / 60:.1f} min.", ""]
    reg = res["regime"]
    if reg:
        verdict = "stresses" if reg["stressed"] else "does not stress"
        lines += [f"**Regime:** `none` at staleness {res['staleness']} against staleness 0: final held-out greedy "
                  f"{reg['diff']:+.3f} (Welch p {fmt(reg['p'])}); the regime {verdict} `none` "
                  f"(threshold -{res['stress']}).", ""]
    lines += ["| arm | final held-out greedy, mean [95% CI] | per seed | greedy at step 0 | train reward, last 5 "
              "| final eval versions | lag | mismatch KL k3 | ESS | masked tok. | masked seq. | entropy, last step "
              "| greedy length, last | cell wall (s) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, a in res["arms"].items():
        seeds = ", ".join(f"{g:.3f}" for g in a["final_greedy"])
        lines.append(f"| {name} | {fmt(a['mean'])} [{fmt(a['lo'])}, {fmt(a['hi'])}] | {seeds} | "
                     f"{fmt(a['start_greedy'])} | {fmt(a['train_reward_last5'])} | {', '.join(a['final_versions'])} | "
                     f"{fmt(a['lag_mean'], '.2f')} | "
                     f"{fmt(a['mismatch_kl_k3'], '.2e')} | {fmt(a['ess'])} | {fmt(a['masked_token_frac'])} | "
                     f"{fmt(a['masked_seq_frac'])} | {fmt(a['entropy_last'], '.2f')} | "
                     f"{fmt(a['greedy_len_final'], '.1f')} | {a['cell_wall_s']:.0f} |")
    lines += ["", f"Against `none` at staleness {res['staleness']} (final held-out greedy; Welch, Holm over "
              f"{len(res['vs_none'])} arms, family-wise alpha {m['alpha']}):", "",
              "| arm | difference | p | p (Holm) | separates |", "|---|---|---|---|---|"]
    for name, t in res["vs_none"].items():
        lines.append(f"| {name} | {fmt(t['diff'], '+.3f')} | {fmt(t['p'])} | {fmt(t['p_holm'])} | "
                     f"{'yes' if t['separates'] else 'no'} |")
    lines += ["", f"**Minimum detectable difference** in final held-out greedy (two-sided alpha {m['alpha']}, "
              f"power {m['power']}, n = {m['n']} seeds per arm, pooled sd {fmt(m['sd_pooled'])}): "
              f"**{fmt(m['mdd'])}** for one comparison, {fmt(m['mdd_holm_first'])} at Holm's first threshold "
              f"(alpha / {max(1, len(res['vs_none']))})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return bench_main("correction_study", __doc__, list(sys.argv[1:] if argv is None else argv), run, flags=flags,
                      out="runs/bench_correction_study",
                      run_flags="Extra pipeline flags, after -- (e.g. -- --trainer.lr 1e-3).")


if __name__ == "__main__":
    raise SystemExit(main())
