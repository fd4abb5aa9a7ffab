"""benchmarks.standby_cost: its flags are checked in one line, and it reads a run's summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import standby_cost

_SUMMARY = """| metric | value |
|---|---|
| wall time                                               | 18.4 s |
| weight sync, step end -> every worker on it (p50 / p90) | 14.2 / 31.0 ms |
"""


def test_bad_flags_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        standby_cost.main(["--rounds", "0", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--rounds must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        standby_cost.main(["--out", str(tmp_path), "--", "--rollout.standby", "true"])
    assert e.value.code == 2 and "may not set --rollout.standby" in capsys.readouterr().err


def test_reads_the_runs_summary() -> None:
    assert standby_cost.summary_figures(_SUMMARY) == (18.4, 14.2, 31.0)
    with pytest.raises(ValueError, match="no weight sync row"):
        standby_cost.summary_figures(_SUMMARY.splitlines()[2])


def test_the_committed_page_is_its_json_rendered() -> None:
    import json

    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    result = json.loads((results / "standby_cost.json").read_text())
    assert (results / "standby_cost.md").read_text().rstrip("\n") == standby_cost.markdown(result).rstrip("\n")
