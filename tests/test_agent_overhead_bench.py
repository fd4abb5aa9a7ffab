"""benchmarks/agent_overhead.py: its report, its thread roles and its bad input (the real runs
are left to the benchmark)."""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest

from benchmarks import agent_overhead as bench


def form_run(round_: int, form: str, tokens_per_s: float) -> bench.FormRun:
    return bench.FormRun(round=round_, form=form, groups=100, seconds=10.0, tokens_per_s=tokens_per_s, batch=60.0,
                         engine_cpu=200.0, serving_cpu=50.0 if form == "agent" else 15.0, other_cpu=5.0,
                         host_ms_per_turn=1.3 if form == "agent" else 0.0, turns_per_episode=2.0)


def test_report_has_a_row_per_form_and_round_and_the_ratio_per_round() -> None:
    runs = [form_run(0, "env", 4400.0), form_run(0, "agent", 4000.0), form_run(1, "env", 3900.0),
            form_run(1, "agent", 3000.0)]
    assert [round(x, 2) for x in bench.ratios(runs)] == [1.1, 1.3]
    md = bench.markdown({"hardware": {"cpu": "x", "cores": 2}, "argv": ["--rounds 2"], "worker_cpu": 0,
                         "runs": [asdict(r) for r in runs]})
    assert "| 0 | env | 4400 | 60.0 | 200 | 15 | 5 | - | 2.00 |" in md
    assert "| 1 | agent | 3000 | 60.0 | 200 | 50 | 5 | 1.30 | 2.00 |" in md
    assert "per round: 1.10x, 1.30x; mean **1.20x** (bound 1.25x)" in md


def test_worker_threads_count_by_role() -> None:
    assert bench.role(bench.ENGINE_THREAD) == "engine"
    assert bench.role("endpoint-0") == bench.role("envs-3") == "serving"
    assert bench.role("send-0_0") == bench.role("agent-host-0") == "other"
    assert bench.thread_cpu()["MainThread"] >= 0.0


def test_bad_rounds_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bench.main(["--rounds", "0"])
    assert e.value.code == 2 and "--rounds must be >= 1" in capsys.readouterr().err


def test_one_cpu_is_a_usage_error_before_anything_starts(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    with pytest.raises(SystemExit) as e:
        bench.main(["--rounds", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: this benchmark needs 2 CPUs" in err.strip().splitlines()[-1]
