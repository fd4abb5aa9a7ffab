"""benchmarks/cpu_profile.py: its parsing of /proc, its per-role sums and report, and bad
flags (the measurement itself runs the real pipeline and is left to the benchmark)."""

from __future__ import annotations

import pytest

from benchmarks import cpu_profile


def test_roles_by_command_line() -> None:
    assert cpu_profile.role_of("ray::TrainerActor.train_step", 1, 7) == "trainer"
    assert cpu_profile.role_of("ray::RolloutActor", 1, 7) == "rollout"
    assert cpu_profile.role_of("ray::BufferActor.get_batch", 1, 7) == "buffer"
    assert cpu_profile.role_of("/x/site-packages/ray/core/src/ray/raylet/raylet --a", 1, 7) == "ray"
    assert cpu_profile.role_of("python launch/async_grpo.py", 7, 7) == "driver"
    assert cpu_profile.role_of("bash", 1, 7) is None


def test_cpu_seconds_reads_utime_and_stime_past_a_spaced_command() -> None:
    fields = ["S"] + ["0"] * 10 + ["150", "50"] + ["0"] * 30       # fields 14 and 15 of stat(5)
    line = "123 (ray::Trainer Actor) " + " ".join(fields)
    assert cpu_profile.cpu_seconds(line, 100.0) == pytest.approx(2.0)


def test_per_role_cores_and_report() -> None:
    before = {1: ("trainer", 10.0), 2: ("rollout", 5.0), 3: ("ray", 1.0), 4: ("ray", 2.0)}
    after = {1: ("trainer", 18.0), 2: ("rollout", 12.0), 3: ("ray", 1.5), 4: ("ray", 2.5), 5: ("buffer", 9.0)}
    cores = cpu_profile.cores_by_role(before, after, 10.0)
    assert cores == {"trainer": 0.8, "rollout": 0.7, "ray": 0.1}    # pid 5 started inside the window
    steps = [{"time_s": 1.0 + 0.03 * i, "train_step_s": 0.02, "trainer_idle_frac": 0.1} for i in range(11)]
    r = cpu_profile.summarize(cores, steps)
    assert r["step_ms"] == pytest.approx(30.0) and r["cpu_ms_per_step"]["trainer"] == pytest.approx(24.0)
    r.update(hardware={"cpu": "x", "cores": 2, "memory_gib": 1.0}, run_flags=[], warmup_s=1.0, window_s=10.0)
    md = cpu_profile.markdown(r)
    assert "| trainer | 0.8 | 24.0 |" in md and "**1.6**" in md and "**30.0 ms**" in md
    with pytest.raises(RuntimeError, match="only 1 steps"):
        cpu_profile.summarize(cores, steps[:1])


@pytest.mark.parametrize("argv, message", [(["--window-s", "0"], "--window-s must be > 0"),
                                           (["--warmup-s", "-1"], "--warmup-s must be >= 0")])
def test_bad_flags_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cpu_profile.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
