"""benchmarks.arms_rise: every arm's flags make a valid configuration, bad flags are one line,
and the reward windows are read from a run's rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import arms_rise
from benchmarks.common import config


def test_every_arm_is_a_valid_configuration() -> None:
    for flags in arms_rise.ARMS.values():
        config(["--staleness", "2", *flags])


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "10"], "--steps must be >= 20, got 10"),
    (["--arms", "m2po,bogus"], "--arms: unknown arm(s) bogus"),
    (["--", "--max-steps", "5"], "may not set --out-dir or --max-steps"),
])
def test_bad_flags_are_one_line(argv: list[str], message: str, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        arms_rise.main(["--out", str(tmp_path), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_reward_windows() -> None:
    rows = [{"reward_mean": 0.0}] * 10 + [{"reward_mean": 0.5}] * 5 + [{"reward_mean": 1.0}] * 10
    assert arms_rise.reward_window(rows) == (0.0, 1.0)
    with pytest.raises(ValueError, match="19 step rows, 20 needed"):
        arms_rise.reward_window(rows[:19])


def test_the_committed_page_is_its_json_rendered() -> None:
    import json

    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    result = json.loads((results / "arms_rise.json").read_text())
    assert (results / "arms_rise.md").read_text().rstrip("\n") == arms_rise.markdown(result).rstrip("\n")
