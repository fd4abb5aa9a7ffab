"""A vLLM engine whose start fails never keeps its process alive.

Each engine (in-process and ``AsyncLLM``, whose engine core is a process of its own)
is started in a fresh Python process with a fault injected right after vLLM built it
(``EngineConfig.fault="engine_start@0"``). When the error reaches the caller, nothing the start
began is left (no event-loop thread, no non-daemon thread), every child process (such as
vLLM's engine core) exits within 5 s, and the process is gone within 10 s of the failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline_rl.models.tiny_llama import build_tiny_model

EXIT_WITHIN_S = 10.0
#: How long the children of a failed start may take to exit (polled), counted in EXIT_WITHIN_S.
CHILDREN_GONE_WITHIN_S = 5.0

SCRIPT = """
import json, sys, threading, time
import psutil
from pipeline_rl.rollout.engines.engine import EngineConfig
engine_kind, model_dir = sys.argv[1], sys.argv[2]
cfg = EngineConfig(model_dir=model_dir, max_num_seqs=4, max_model_len=64, fault="engine_start@0")
try:
    if engine_kind == "async":
        from pipeline_rl.rollout.engines.engine_async import AsyncEngine
        AsyncEngine(cfg)
    else:
        from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine
        InprocessEngine(cfg)
except Exception as e:
    t = time.monotonic()
    def alive_children():
        out = []
        for c in psutil.Process().children(recursive=True):
            try:   # multiprocessing's resource tracker lives as long as this process, by design
                line = " ".join(c.cmdline())
                if c.is_running() and c.status() != psutil.STATUS_ZOMBIE and "multiprocessing.resource_tracker" not in line:
                    out.append(line[-80:])
            except psutil.NoSuchProcess:   # gone meanwhile
                pass
        return out
    # a child on its way out (under load it may still be listed a moment, its command line
    # already empty) is given a bounded time to go; one still there after it is left
    kids = alive_children()
    while kids and time.monotonic() < t + float(sys.argv[3]):
        time.sleep(0.05)
        kids = alive_children()
    threads = [th.name for th in threading.enumerate()
               if th.is_alive() and th is not threading.main_thread() and (not th.daemon or th.name == "vllm-async")]
    print(f"LEFT {json.dumps({'children': kids, 'threads': threads})}", flush=True)
    print(f"FAILED {t:.3f} {type(e).__name__}: {e}", flush=True)
    sys.exit(1)
print("STARTED", flush=True)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("start") / "m", seed=0, hidden_size=64, num_layers=1,
                            num_heads=2, intermediate_size=128)


@pytest.mark.parametrize("engine_kind", ["inprocess", "async"])
def test_failed_engine_start_ends_the_process(engine_kind: str, model_dir: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, engine_kind, str(model_dir), str(CHILDREN_GONE_WITHIN_S)],
                            env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    try:
        assert proc.stdout is not None
        left = next((line for line in proc.stdout if line.startswith(("LEFT", "STARTED"))), "")
        assert left.startswith("LEFT"), left
        assert json.loads(left[5:]) == {"children": [], "threads": []}, f"the failed start left {left[5:]}"
        failed = next((line for line in proc.stdout if line.startswith(("FAILED", "STARTED"))), "")
        assert failed.startswith("FAILED") and "injected fault at engine_start" in failed, failed
        failed_at = float(failed.split()[1])
        try:
            proc.wait(timeout=max(0.1, failed_at + EXIT_WITHIN_S - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the process was still alive {EXIT_WITHIN_S:.0f} s after its failed start")
        gone_after = time.monotonic() - failed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1
    assert gone_after < EXIT_WITHIN_S, f"the process outlived its failed start by {gone_after:.1f} s"
