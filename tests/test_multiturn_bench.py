"""benchmarks/multiturn.py: the report of a set of seeds and a bad flag (the real runs are
left to the benchmark)."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict

import pytest

from benchmarks import multiturn


def seed_run(seed: int, passed: bool) -> multiturn.SeedRun:
    return multiturn.SeedRun(seed=seed, steps=200, wall_s=70.0, train_s=40.0, greedy_start=0.0,
                             greedy_end=0.97 if passed else 0.5, sampled_start=0.2, sampled_end=0.9,
                             reached_step=20 if passed else None, reached_s=5.0 if passed else None,
                             reward_first=0.6, reward_last=0.95, stopped_early=not passed, passed=passed,
                             curve=[(0, 0.0), (20, 0.9), (200, 0.97 if passed else 0.5)])


def test_report_has_a_row_per_seed_and_the_verdict() -> None:
    result = {"hardware": {"cpu": "x", "cores": 2}, "argv": ["--seeds 2"], "flags": multiturn.FLAGS,
              "minutes": 10.0, "warm_start": {"folder": "builtin-calc4-x", "build_s": 1.0,
                                              "probe": {"sampled_reward": 0.24, "greedy_reward": 0.0}},
              "runs": [asdict(seed_run(0, True)), asdict(seed_run(1, False))]}
    md = multiturn.markdown(result)
    assert "| 0 | env | 0.000 -> 0.970 |" in md and "| 20, 5 s |" in md and "| yes |" in md
    assert "| 1 | env | 0.000 -> 0.500 |" in md and "never" in md and "(stopped)" in md and "| no |" in md
    assert "1 of 2 seeds met the bar" in md and "seed 0: 0 0.00, 20 0.90, 200 0.97" in md


def test_deadline_sets_stop_only_when_the_block_outlives_it() -> None:
    stop = threading.Event()
    with multiturn.deadline(stop, 5.0):
        pass
    assert not stop.is_set()
    with multiturn.deadline(stop, 0.01):
        time.sleep(0.1)
    assert stop.is_set()


def test_bad_seeds_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        multiturn.main(["--seeds", "0"])
    assert e.value.code == 2 and "--seeds must be >= 1" in capsys.readouterr().err


def test_the_agent_form_is_reported_beside_the_environment_form() -> None:
    from dataclasses import replace

    env, agent = replace(seed_run(0, True), tokens_per_s=1200.0), replace(seed_run(0, True), form="agent",
                                                                          tokens_per_s=1000.0)
    result = {"hardware": {"cpu": "x", "cores": 2}, "argv": ["--seeds 1", "--agent"], "flags": multiturn.FLAGS,
              "minutes": 10.0, "warm_start": {"folder": "builtin-calc4-x", "build_s": 1.0, "probe": {}},
              "runs": [asdict(env), asdict(agent)]}
    md = multiturn.markdown(result)
    assert "| 0 | agent | 0.000 -> 0.970 |" in md and "| 1000 |" in md and "per seed: 1.20x." in md
