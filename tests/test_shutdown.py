"""Ctrl-C on a real run: ``launch/async_grpo.py`` in a subprocess (its own local Ray,
vLLM worker, DeepSpeed trainer, ZeroMQ buffer) gets SIGINT mid-run, as a terminal
sends it: to the whole foreground process group. Checked: exit status 130 within
seconds; no process of the run left; no shared-memory segment and no socket file
left behind.

The run is started in a new session with ``TMPDIR`` pointing at a private folder,
so everything it starts is recognisable (the session id, or that ``TMPDIR`` in its
environment) and every temporary or socket file it makes lands in that folder.
Only processes identified that way are ever signalled by this test.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from pipeline_rl.training.checkpoint import latest_checkpoint, read_run_state
from tiny_run import TINY_RUN_FLAGS

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
_STOP_WITHIN_S = 30.0


def _run_processes(session: int, scratch: str) -> list[psutil.Process]:
    """Live processes of the run: in its session, or with its private ``TMPDIR``."""
    marker = f"TMPDIR={scratch}"
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid == os.getpid():
                continue
            if os.getsid(p.pid) == session or marker in "\0".join(
                    f"{k}={v}" for k, v in p.environ().items()):
                if p.status() != psutil.STATUS_ZOMBIE:
                    found.append(p)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return found


def _shm_in_use_elsewhere() -> set[str]:
    """``/dev/shm`` files some live process has mapped or open (a neighbour's, once the
    run is gone): a file nobody holds any more is a leak."""
    names: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                names.update(line.split("/dev/shm/", 1)[1].strip() for line in maps
                             if "/dev/shm/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    names.add(target.removeprefix("/dev/shm/"))
        except OSError:
            continue
    return names


def _socket_files(root: Path) -> list[Path]:
    out = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            try:
                if stat.S_ISSOCK(path.lstat().st_mode):
                    out.append(path)
            except OSError:
                continue
    return out


def _wait_for_lines(path: Path, n: int, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) >= n:
            return True
        time.sleep(0.2)
    return False


@pytest.fixture
def scratch() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="prl-", dir="/tmp")  # short: Unix socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_ctrl_c_stops_everything_and_leaves_nothing(tiny_model_dir: str, tmp_path: Path,
                                                     scratch: str) -> None:
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled", "TMPDIR": scratch}
    for key in ("RAY_ADDRESS", "RAY_TMPDIR"):
        env.pop(key, None)
    argv = [sys.executable, str(REPO / "launch" / "async_grpo.py"), "--model.path", tiny_model_dir,
            "--out-dir", str(out), "--max-steps", "1000", "--staleness", "2", *TINY_RUN_FLAGS,
            "--ray.num_cpus", "2"]
    shm_before = set(os.listdir("/dev/shm"))
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        started = _wait_for_lines(out / "metrics.jsonl", 2, proc, 300)
        assert started, f"the run did not log 2 steps:\n{log.read_text()[-4000:]}"
        running = _run_processes(proc.pid, scratch)
        assert len(running) >= 4, running  # driver, Ray's own processes, the actors

        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the foreground group
        try:
            rc = proc.wait(timeout=_STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {_STOP_WITHIN_S:.0f} s after Ctrl-C:\n{log.read_text()[-4000:]}")
        stopped_s = time.monotonic() - t0
        assert rc == 130, f"exit status {rc}:\n{log.read_text()[-4000:]}"

        _, alive = psutil.wait_procs(running, timeout=5.0)
        left = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        left += [p for p in _run_processes(proc.pid, scratch) if p not in left]
        assert not left, f"processes left {stopped_s:.1f} s after Ctrl-C: " + "; ".join(
            f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in left)
        new_shm = sorted(set(os.listdir("/dev/shm")) - shm_before - _shm_in_use_elsewhere())
        assert not new_shm, f"shared-memory files left: {new_shm}"
        sockets = _socket_files(Path(scratch))  # ZeroMQ ipc, vLLM, Ray's session sockets
        assert not sockets, f"socket files left: {[str(s) for s in sockets]}"
        assert stopped_s < _STOP_WITHIN_S
        rows = (out / "metrics.jsonl").read_text().splitlines()
        assert 2 <= len(rows) < 1000
        # Stopped with a resumable checkpoint at (or past) the last logged step.
        ckpt = latest_checkpoint(out / "checkpoints")
        assert ckpt is not None, "Ctrl-C left no checkpoint"
        assert read_run_state(ckpt).version >= len(rows)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for p in _run_processes(proc.pid, scratch):
            try:
                p.kill()
            except psutil.Error:
                pass
