"""benchmarks/startup.py: the report of a run and its bound, and a bad flag (the real
measurement runs the default command and is left to the benchmark)."""

from __future__ import annotations

import pytest

from benchmarks import startup


def test_report_names_every_phase_and_the_bound() -> None:
    run = {name: float(i + 1) for i, (name, _) in enumerate(startup.PHASES)}
    result = {"hardware": {"cpu": "x", "cores": 2, "memory_gib": 1.0}, "repeats": 1, "command": [run],
              "pieces": {"ray_init": [2.0], "import_vllm": [3.0], "vllm_engine": [4.0]},
              "bound_s": 9.0, "first_step_s": 6.0}
    md = startup.markdown(result)
    assert all(f"| {name} | " in md for name, _ in startup.PHASES)
    assert "**9.0 s**" in md and "0.67x the bound" in md


def test_bad_repeats_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        startup.main(["--repeats", "0"])
    assert e.value.code == 2 and "--repeats must be >= 1" in capsys.readouterr().err
