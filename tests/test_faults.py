"""Fault injection: whatever fails, the run ends quickly, non-zero, with one line naming it.

Each case runs the real pipeline through the launcher's entry point
(``pipeline_rl.driver.run``: vLLM worker, DeepSpeed trainer, ZeroMQ buffer, on one
Ray shared by the module) with ``--fault POINT@2``, which makes one actor
raise once the policy reaches version 2 (see ``pipeline_rl/faults.py``). Checked:
exit status 1; exactly one ``async_grpo.py: error: ...`` line naming the actor, the
injected cause and where to resume from; and the run ends within 30 s of its last
step. A killed buffer process (not an exception: the process is gone) is named as
the buffer, not as the trainer that was waiting on it.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tiny_run import tiny_run_config

pytestmark = pytest.mark.slow

_END_WITHIN_S = 30.0

CASES = [
    ("weight_update", "rollout worker 0 failed: WeightLoadFailed: taking new weights failed: "
                      "InjectedFault: injected fault at weight_update"),
    ("engine_step", "rollout worker 0 failed: InjectedFault: injected fault at engine_step"),
    ("trainer_step", "trainer failed: InjectedFault: injected fault at trainer_step"),
    ("buffer", "replay buffer failed: InjectedFault: injected fault at buffer"),
]


def _run_with_fault(point: str, model_dir: str, out: Path, capsys: pytest.CaptureFixture[str],
                    monkeypatch: pytest.MonkeyPatch, *extra: str) -> tuple[int, list[str], float]:
    """Run until it ends; returns (exit status, the driver's error lines, seconds from the
    last completed step, or from the start if none completed, to the end)."""
    from pipeline_rl.driver import run

    cfg = tiny_run_config(model_dir, out, "--max-steps", "40", "--fault", f"{point}@2", *extra)
    capsys.readouterr()
    t0 = time.time()
    rc = run(cfg)
    ended = time.time()
    metrics = out / "metrics.jsonl"
    last_step = metrics.stat().st_mtime if metrics.is_file() and metrics.stat().st_size else t0
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("async_grpo.py: error:")]
    return rc, errors, ended - last_step


@pytest.mark.parametrize("point,expected", CASES, ids=[c[0] for c in CASES])
def test_injected_fault_ends_run_with_one_line(point: str, expected: str, ray_local: None,
                                               tiny_model_dir: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Exceptions are not retried (a restart would repeat them); a weight update is, once
    # (tests/test_restarts.py): here it ends the run as the others do.
    no_restart = ("--run.max_restarts", "0") if point == "weight_update" else ()
    rc, errors, tail_s = _run_with_fault(point, tiny_model_dir, tmp_path / "run", capsys, monkeypatch, *no_restart)
    assert rc == 1 and len(errors) == 1, errors
    assert expected in errors[0], errors[0]
    assert "no checkpoint was saved yet" in errors[0] or "resume with --resume" in errors[0], errors[0]
    assert tail_s < _END_WITHIN_S, (tail_s, errors)
    with capsys.disabled():
        print(f"\n{point}: ended {tail_s:.1f} s after its last step: {errors[0]}")


def test_watchdog_says_who_waits_for_what(ray_local: None, tiny_model_dir: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that stops generating without an error (a hung engine): the watchdog ends
    the run once no step came within its bound, in one line saying who waits for what."""
    rc, errors, tail_s = _run_with_fault("engine_hang", tiny_model_dir, tmp_path / "run", capsys,
                                         monkeypatch, "--watchdog-s", "5")
    assert rc == 1 and len(errors) == 1, errors
    message = errors[0]
    for needle in ("no step completed for", "the trainer waits for a batch of 2 groups at version",
                   "the buffer holds", "admission budget", "rollout worker 0 holds weights v"):
        assert needle in message, message
    bound_s = float(re.search(r"watchdog bound (\d+) s", message).group(1))  # type: ignore[union-attr]
    assert tail_s < bound_s + _END_WITHIN_S, (tail_s, message)
    with capsys.disabled():
        print(f"\nwatchdog: ended {tail_s:.1f} s after its last step: {message}")


def test_killed_buffer_is_named(ray_local: None, tiny_model_dir: str, tmp_path: Path) -> None:
    """SIGKILL the buffer's process mid-run: the error names the replay buffer (the trainer
    that was waiting on it fails too, but it is not the cause)."""
    import ray

    from pipeline_rl.run.life.one_life import Orchestrator
    from pipeline_rl.run.life.start import open_run
    from pipeline_rl.run.life.supervise import OrchestratorError

    cfg = tiny_run_config(tiny_model_dir, tmp_path / "run", "--max-steps", "200")
    killed: list[float] = []

    def kill_buffer(orch: Any) -> None:
        while orch.steps_done < 3:
            time.sleep(0.01)
        pid = int(ray.get(orch.actors.buffer.__ray_call__.remote(lambda self: os.getpid()), timeout=30))
        os.kill(pid, signal.SIGKILL)
        killed.append(time.monotonic())

    with pytest.raises(OrchestratorError) as err:
        with Orchestrator(cfg, tiny_model_dir, threading.Event(), open_run(cfg)) as orch:
            threading.Thread(target=kill_buffer, args=(orch,), daemon=True).start()
            orch.train()
    ended = time.monotonic()
    assert killed, "the buffer was never killed"
    message = str(err.value)
    assert message.startswith("replay buffer failed: its process died"), message
    assert "\n" not in message
    assert ended - killed[0] < _END_WITHIN_S
