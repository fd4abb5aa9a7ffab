"""Fault injection: whatever fails, the run ends quickly, non-zero, with one line naming it.

Each case starts the real pipeline (``launch/async_grpo.py``: local Ray, vLLM worker,
DeepSpeed trainer, ZeroMQ buffer) with ``PIPELINE_RL_FAULT=POINT@2``, which makes one
actor raise once the policy reaches version 2 (see ``pipeline_rl/faults.py``). Checked:
exit status 1; the last line is ``async_grpo.py: error: ...`` naming the actor and the
injected cause and where to resume from; and the run ends within 30 s of its last
progress line. A killed buffer process (not an exception: the process is gone) is named
as the buffer, not as the trainer that was waiting on it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tiny_run import TINY_RUN_FLAGS, tiny_run_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
_END_WITHIN_S = 30.0

CASES = [
    ("weight_update", "rollout worker 0 failed: WeightLoadFailed: taking new weights failed: "
                      "InjectedFault: injected fault at weight_update"),
    ("engine_step", "rollout worker 0 failed: InjectedFault: injected fault at engine_step"),
    ("trainer_step", "trainer failed: InjectedFault: injected fault at trainer_step"),
    ("buffer", "replay buffer failed: InjectedFault: injected fault at buffer"),
]


def _run_with_fault(point: str, model_dir: str, out: Path) -> tuple[int, list[str], float]:
    """Run until it ends; returns (exit status, output lines, seconds from the last step
    line, or from start-up's end if there was none, to the exit)."""
    env = {**os.environ, "PIPELINE_RL_FAULT": f"{point}@2", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(REPO / "launch" / "async_grpo.py"), "--model.path", model_dir,
           "--out-dir", str(out), "--max-steps", "40", *TINY_RUN_FLAGS]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []
    last_progress = time.monotonic()
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("step "):
            last_progress = time.monotonic()
    rc = proc.wait(timeout=120)
    return rc, lines, time.monotonic() - last_progress


@pytest.mark.parametrize("point,expected", CASES, ids=[c[0] for c in CASES])
def test_injected_fault_ends_run_with_one_line(point: str, expected: str, tiny_model_dir: str,
                                               tmp_path: Path) -> None:
    rc, lines, tail_s = _run_with_fault(point, tiny_model_dir, tmp_path / "run")
    errors = [ln for ln in lines if ln.startswith("async_grpo.py: error:")]
    assert rc == 1, lines[-30:]
    assert len(errors) == 1, lines[-30:]
    assert expected in errors[0], errors[0]
    assert "no checkpoint was saved yet" in errors[0] or "resume with --resume" in errors[0], errors[0]
    assert tail_s < _END_WITHIN_S, (tail_s, lines[-30:])
    print(f"{point}: ended {tail_s:.1f} s after its last step line: {errors[0]}")


def test_killed_buffer_is_named(tiny_model_dir: str, tmp_path: Path) -> None:
    """SIGKILL the buffer's process mid-run: the error names the replay buffer (the trainer
    that was waiting on it fails too, but it is not the cause)."""
    import ray

    from pipeline_rl.driver import ACTOR_ENV
    from pipeline_rl.orchestrator import Orchestrator, OrchestratorError

    cfg = tiny_run_config(tiny_model_dir, tmp_path / "run", "--max-steps", "200")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20,
             runtime_env={"env_vars": ACTOR_ENV}, log_to_driver=False)
    killed: list[float] = []

    def kill_buffer(orch: Any) -> None:
        while len(orch.history) < 3:
            time.sleep(0.01)
        pid = int(ray.get(orch._buffer.__ray_call__.remote(lambda self: os.getpid()), timeout=30))
        os.kill(pid, signal.SIGKILL)
        killed.append(time.monotonic())

    try:
        with pytest.raises(OrchestratorError) as err:
            with Orchestrator(cfg, tiny_model_dir, threading.Event()) as orch:
                threading.Thread(target=kill_buffer, args=(orch,), daemon=True).start()
                orch.train()
        ended = time.monotonic()
    finally:
        ray.shutdown()
    assert killed, "the buffer was never killed"
    message = str(err.value)
    assert message.startswith("replay buffer failed: its process died"), message
    assert "\n" not in message
    assert ended - killed[0] < _END_WITHIN_S
