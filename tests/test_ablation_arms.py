"""benchmarks/ablation.py takes the new arms: every ``--correction.type`` preset (``m2po``) in
``--corrections`` and every ``--algorithm.loss`` (``gspo``, ``gspo-token``, ``cispo``) in ``--losses``;
an arm's flags and label carry its loss, and it is compared against reinforce with ``none``
(no grid is run: the grid, a cell's flags and the report's comparison on synthetic records)."""

from __future__ import annotations

import pytest

from benchmarks import ablation
from benchmarks.ablation_cells import Arm, Cell, CellResult, GridSettings, treatment
from benchmarks.ablation_report import build_result, markdown


def test_losses_cross_corrections_and_each_cell_carries_its_loss() -> None:
    cells = ablation.grid("8", "none,m2po", "bf16", [0], "reinforce,gspo,cispo")
    assert [c.name for c in cells] == ["bf16_s8_none_seed0", "bf16_s8_m2po_seed0", "bf16_s8_gspo_none_seed0",
                                       "bf16_s8_gspo_m2po_seed0", "bf16_s8_cispo_none_seed0",
                                       "bf16_s8_cispo_m2po_seed0"]
    flags = cells[3].flags()
    assert flags[flags.index("--algorithm.loss") + 1] == "gspo" and flags[flags.index("--correction.type") + 1] == "m2po"
    assert "--algorithm.loss" not in cells[1].flags()            # reinforce: the flags of before
    assert Cell.from_dict({"arm": {"dtype": "bfloat16", "staleness": 2, "correction": "tis"}, "seed": 0}).arm.loss \
        == "reinforce"                                           # records written before the loss existed
    assert treatment({"correction": "tis", "loss": "gspo-token"}) == "gspo-token+tis"


def test_arms_lists_the_pairs_instead_of_the_cross_product() -> None:
    cells = ablation.grid("0,8", "", "bf16", [0], arms="none,m2po,gspo+none,cispo@behaviour+none")
    assert [c.name for c in cells] == ["bf16_s0_none_seed0", "bf16_s0_m2po_seed0", "bf16_s0_gspo_none_seed0",
                                       "bf16_s0_cispo_behaviour_none_seed0", "bf16_s8_none_seed0",
                                       "bf16_s8_m2po_seed0", "bf16_s8_gspo_none_seed0",
                                       "bf16_s8_cispo_behaviour_none_seed0"]
    flags = cells[3].flags()
    assert flags[flags.index("--algorithm.ratio_reference") + 1] == "behaviour"
    assert "--algorithm.ratio_reference" not in cells[2].flags()
    assert treatment({"correction": "none", "loss": "cispo", "reference": "behaviour"}) == "cispo@behaviour+none"


@pytest.mark.parametrize(("argv", "message"), [
    (["--losses", "gspo,bogus"], "--losses: unknown value(s) bogus"),
    (["--corrections", "m2po,custom"], "--corrections: unknown value(s) custom"),
    (["--arms", "none,gspo+bogus"], "--arms: unknown arm 'gspo+bogus'"),
    (["--arms", "reinforce@behaviour+none"], "--arms: unknown arm 'reinforce@behaviour+none'"),
    (["--arms", "none", "--corrections", "tis"], "--arms: give either --arms or --losses/--corrections"),
])
def test_bad_names_are_one_line_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        ablation.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_every_new_name_is_accepted() -> None:
    cells = ablation.grid("0", "none,tis,icepop,seq-mask-tis,m2po", "bf16", [0], "reinforce,ppo,gspo,gspo-token,cispo")
    assert len(cells) == 25


def test_an_arm_of_another_loss_is_compared_against_reinforce_none() -> None:
    def result(arm: Arm, seed: int, reward: float) -> CellResult:
        rows = [{"step": i + 1, "time_s": float(i), "reward_mean": reward + 0.01 * i + 0.001 * seed, "loss": 0.1,
                 "masked_frac": 0.0, "lag_mean": 8.0, "mismatch_kl_k3": 1e-3, "ess": 0.9} for i in range(10)]
        return CellResult(Cell(arm, seed), "k", "done", 1.0, rows)
    arms = [Arm("bfloat16", 8, "none"), Arm("bfloat16", 8, "none", "gspo"), Arm("bfloat16", 8, "m2po", "cispo")]
    res = build_result([result(a, s, 0.1 * i) for i, a in enumerate(arms) for s in range(3)],
                       GridSettings(10, "m", ()), None, 0.05, 0.05, 1.0)
    assert set(res["arms"]) == {"bf16_s8_none", "bf16_s8_gspo_none", "bf16_s8_cispo_m2po"}
    assert "vs_none" not in res["arms"]["bf16_s8_none"]
    assert res["arms"]["bf16_s8_cispo_m2po"]["vs_none"]["final_reward"]["diff"] == pytest.approx(0.2)
    assert "| 8 | cispo+m2po |" in markdown(res)
