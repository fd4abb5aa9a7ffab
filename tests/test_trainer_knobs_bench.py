"""``benchmarks.trainer_knobs --add-to``: an earlier result of other settings is refused in one
line before any run starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import trainer_knobs


def test_add_to_a_result_of_other_settings_is_refused(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"model": "smollm2-135m-instruct", "steps": 20, "eval_every": 10,
                               "muon_lr": 1.6e-4, "runs": []}))
    with pytest.raises(SystemExit) as e:
        trainer_knobs.main(["--add-to", str(old), "--steps", "30", "--out", str(tmp_path / "out"),
                            "--json", str(tmp_path / "r.json"), "--md", str(tmp_path / "r.md")])
    assert "other settings (steps: 20)" in str(e.value.code)
    assert not (tmp_path / "r.json").exists()


def test_add_to_keeps_the_earlier_runs_and_runs_none_of_them_again(tmp_path: Path) -> None:
    run = {"variant": "adamw", "seed": 0, "flags": [], "wall_s": 700.0, "greedy": {"0": 0.2, "10": 0.4},
           "reward_last5": 0.5, "lr_first_last": [2e-5, 2e-5]}
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"model": "smollm2-135m-instruct", "steps": 30, "eval_every": 10,
                               "muon_lr": 1.6e-4, "runs": [run]}))
    status = trainer_knobs.main(["--add-to", str(old), "--seeds", "0", "--variants", "adamw",
                                 "--out", str(tmp_path / "out"), "--json", str(tmp_path / "r.json"),
                                 "--md", str(tmp_path / "r.md")])
    result = json.loads((tmp_path / "r.json").read_text())
    assert status == 0 and result["runs"] == [run] and result["not_run"] == []
    assert "| adamw | 0 | 0.200 | 0.400 | 700 |" in (tmp_path / "r.md").read_text()
