"""The statistics behind the ablation's intervals and significance marks, against
tabulated values, and the per-arm report on synthetic cell records (no Ray)."""

from __future__ import annotations

import math

import pytest

from benchmarks.ablation import Arm, Cell, CellResult, GridSettings
from benchmarks.ablation_report import build_result, markdown
from benchmarks.stats import betainc, holm, mean_interval, t_cdf, t_ppf, welch_t_test


@pytest.mark.parametrize(("df", "q975"), [(1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281),
                                          (30, 2.0423)])
def test_t_quantiles_match_the_table(df: int, q975: float) -> None:
    assert t_ppf(0.975, df) == pytest.approx(q975, abs=1e-4)
    assert t_ppf(0.025, df) == pytest.approx(-q975, abs=1e-4)
    assert t_cdf(q975, df) == pytest.approx(0.975, abs=1e-5)


def test_t_cdf_and_incomplete_beta() -> None:
    assert t_cdf(0.0, 3) == pytest.approx(0.5)
    assert t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy: 1/2 + atan(1)/pi
    assert t_cdf(2.0, 2) == pytest.approx(0.5 + 2.0 / (2 * math.sqrt(6.0)))  # closed form for df = 2
    assert betainc(1.0, 1.0, 0.3) == pytest.approx(0.3)
    assert betainc(2.0, 3.0, 0.4) == pytest.approx(0.5248)  # 1 - sum_{j<2} C(4,j) 0.4^j 0.6^(4-j)
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_cdf(1.0, 0)


def test_mean_interval() -> None:
    iv = mean_interval([0.7, 0.8, 0.75])
    assert iv.n == 3 and iv.mean == pytest.approx(0.75)
    assert iv.half_width == pytest.approx(4.3027 * 0.05 / math.sqrt(3), abs=1e-4)
    one = mean_interval([0.4, float("nan")])
    assert (one.n, one.lo, one.hi) == (1, 0.4, 0.4)
    assert math.isnan(mean_interval([]).mean)


def test_welch_against_a_worked_example() -> None:
    # Welch's t for [1, 2, 3, 4] vs [2, 4, 6, 8, 10]: t = -2.2514, df = 5.5208, p = 0.0691.
    t = welch_t_test([1, 2, 3, 4], [2, 4, 6, 8, 10])
    assert t.diff == pytest.approx(-3.5)
    assert t.t == pytest.approx(-2.2514, abs=1e-4) and t.df == pytest.approx(5.5208, abs=1e-4)
    assert t.p == pytest.approx(0.0691, abs=5e-4)
    assert math.isnan(welch_t_test([1.0], [2.0, 3.0]).p)  # one seed: no test
    assert welch_t_test([1.0, 1.0], [1.0, 1.0]).p == 1.0


def test_holm_is_step_down_and_monotone() -> None:
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    adjusted = holm([0.2, float("nan"), 0.01])
    assert adjusted[0] == pytest.approx(0.2) and math.isnan(adjusted[1]) and adjusted[2] == pytest.approx(0.02)


def _result(cell: Cell, rewards: list[float]) -> CellResult:
    rows = [{"step": i + 1, "time_s": 0.1 * (i + 1), "reward_mean": r, "loss": 0.0, "masked_frac": 0.0,
             "lag_mean": float(cell.arm.staleness), "mismatch_kl_k3": 1e-3, "ess": 0.9}
            for i, r in enumerate(rewards)]
    return CellResult(cell, "k", "done", 1.0, rows, None, "node-a" if cell.seed % 2 else "node-b")


def test_report_gives_intervals_and_marks_only_clear_differences() -> None:
    results = []
    for seed, jitter in enumerate((0.0, 0.01, -0.01)):
        for corr, final in (("none", 0.3), ("tis", 0.8), ("icepop", 0.31)):
            rewards = [0.2] * 5 + [final + jitter + (0.005 if corr == "icepop" and seed == 1 else 0.0)] * 5
            results.append(_result(Cell(Arm("bfloat16", 2, corr), seed), rewards))
    result = build_result(results, GridSettings(10, "/m", ()), None, 0.05, 0.05, 1.0)
    arms = result["arms"]
    assert set(arms) == {"bf16_s2_none", "bf16_s2_tis", "bf16_s2_icepop"}
    tis = arms["bf16_s2_tis"]
    assert tis["final_reward"]["n"] == 3 and tis["final_reward"]["mean"] == pytest.approx(0.8)
    assert tis["final_reward"]["lo"] < 0.8 < tis["final_reward"]["hi"]
    assert tis["vs_none"]["final_reward"]["significant"]  # +0.5 with a spread of 0.01
    assert not arms["bf16_s2_icepop"]["vs_none"]["final_reward"]["significant"]
    assert "vs_none" not in arms["bf16_s2_none"]
    assert result["nodes"] == ["node-a", "node-b"] and result["settings"]["seeds"] == [0, 1, 2]
    md = markdown(result)
    assert "0.800 [" in md and "**+**" in md and "p (Holm)" in md
