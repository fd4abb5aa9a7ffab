"""benchmarks/correction_study.py: the study's plan (the regime's pair first, seed by seed), its report
on synthetic records (regime, Holm-corrected tests against stale ``none``, the minimum detectable
difference by hand) and its one-line refusals. The cells themselves run the pipeline through
``benchmarks.ablation``'s runner, tested there."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from benchmarks import correction_study as study
from benchmarks.ablation import load_finished, save_record
from benchmarks.ablation_cells import Arm, Cell, CellResult
from benchmarks.stats import t_ppf


def args(**over: object) -> argparse.Namespace:
    base = {"arms": "none,gspo+none", "staleness": 8, "steps": 4, "seeds": 3, "seed": 0, "dtype": "fp32",
            "model": "smollm2-135m-instruct", "eval_prompts": 64, "stress": 0.1, "alpha": 0.05, "power": 0.8,
            "run_flags": []}
    return argparse.Namespace(**{**base, **over})


def record(arm: Arm, seed: int, greedy: float) -> CellResult:
    rows = [{"step": i + 1, "time_s": float(i), "reward_mean": 0.2, "lag_mean": float(arm.staleness > 0),
             "masked_frac": 0.0} for i in range(4)]
    evals = [{"step": 0, "greedy_accuracy": 0.25, "version_min": 0, "version_max": 0},
             {"step": 4, "greedy_accuracy": greedy, "version_min": 4 - (seed == 0), "version_max": 4}]
    return CellResult(Cell(arm, seed), "k", "done", 60.0, rows, None, None, evals)


def test_cells_run_seed_by_seed_with_the_regimes_pair_first(tiny_model_dir: str) -> None:
    plan = study.resolve(args(model=tiny_model_dir, arms="m2po,gspo+none"))
    names = [c.name for c in plan.cells]
    assert names[:4] == ["fp32_s0_none_seed0", "fp32_s8_none_seed0", "fp32_s8_m2po_seed0", "fp32_s8_gspo_none_seed0"]
    assert len(names) == 12 and names[4] == "fp32_s0_none_seed1"
    flags = plan.settings.flags
    assert flags[flags.index("--eval.every") + 1] == "4" and flags[flags.index("--eval.num_prompts") + 1] == "64"
    assert plan.settings.flags[:len(study.STUDY_FLAGS)] == study.STUDY_FLAGS


def test_the_record_carries_the_evaluations(tmp_path: Path) -> None:
    res = record(Arm("float32", 8, "none"), 0, 0.5)
    save_record(tmp_path, res)
    back = load_finished(tmp_path, "k")
    assert back is not None and back.evals == res.evals and study.final_greedy(back) == 0.5


def test_report_regime_tests_and_minimum_detectable_difference() -> None:
    fresh, stale, gspo = Arm("float32", 0, "none"), Arm("float32", 8, "none"), Arm("float32", 8, "none", "gspo")
    greedy = {fresh: (0.50, 0.55, 0.60), stale: (0.30, 0.35, 0.40), gspo: (0.52, 0.56, 0.60)}
    results = [record(a, s, g[s]) for a, g in greedy.items() for s in range(3)]
    res = study.summarise(results, args(), wall_s=600.0)
    assert res["regime"]["stressed"] and res["regime"]["diff"] == pytest.approx(-0.2)
    assert list(res["vs_none"]) == ["gspo+none @ staleness 8"]
    assert res["vs_none"]["gspo+none @ staleness 8"]["diff"] == pytest.approx(0.21)
    # Pooled sd: the variances 0.0025, 0.0025, 0.0016 averaged; n = 3, df = 4.
    sd = math.sqrt((0.0025 + 0.0025 + 0.0016) / 3)
    assert res["mdd"]["sd_pooled"] == pytest.approx(sd)
    assert res["mdd"]["mdd"] == pytest.approx((t_ppf(0.975, 4) + t_ppf(0.8, 4)) * sd * math.sqrt(2 / 3))
    assert res["arms"]["none @ staleness 0"]["start_greedy"] == 0.25
    md = study.markdown(res)
    assert "the regime stresses `none`" in md and "Minimum detectable difference" in md and "| gspo+none @" in md
    assert res["arms"]["none @ staleness 0"]["final_versions"] == ["v3-4", "v4", "v4"]   # per seed
    assert "| v3-4, v4, v4 |" in md


def test_a_regime_that_does_not_stress_none_says_so() -> None:
    fresh, stale = Arm("float32", 0, "none"), Arm("float32", 8, "none")
    results = [record(a, s, 0.5 + 0.01 * s) for a in (fresh, stale) for s in range(2)]
    res = study.summarise(results, args(seeds=2), wall_s=1.0)
    assert not res["regime"]["stressed"] and "does not stress" in study.markdown(res)


@pytest.mark.parametrize(("argv", "message"), [
    (["--arms", "none,bogus"], "--arms: unknown arm 'bogus'"),
    (["--seeds", "1"], "--seeds must be >= 2"),
    (["--staleness", "0"], "--staleness must be >= 1"),
    (["--dtype", "fp16"], "--dtype: one of"),
    (["--power", "1.5"], "--alpha and --power must be in (0, 1)"),
])
def test_bad_flags_are_one_line_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        study.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
