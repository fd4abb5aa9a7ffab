"""benchmarks/startup.py: the report of a run and its bound, and a bad flag (the real
measurement runs the default command and is left to the benchmark)."""

from __future__ import annotations

import pytest

from benchmarks import startup


def test_report_names_every_phase_and_the_bound() -> None:
    run = {name: float(i + 1) for i, (name, _) in enumerate(startup.PHASES)}
    result = {"hardware": {"cpu": "x", "cores": 2, "memory_gib": 1.0}, "repeats": 1, "command": [run],
              "pieces": {"ray_init": [2.0], "import_vllm": [3.0], "vllm_engine": [4.0], "trainer_start": [5.0]},
              "slowest_actor_s": 7.0, "chain_s": 8.75, "first_step_s": 8.4}
    md = startup.markdown(result)
    assert all(f"| {name} | " in md for name, _ in startup.PHASES)
    assert "**7.0 s**, the command at **1.20x** it" in md and "8.75 s, the command at 0.96x it" in md


def test_bad_repeats_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        startup.main(["--repeats", "0"])
    assert e.value.code == 2 and "--repeats must be >= 1" in capsys.readouterr().err
