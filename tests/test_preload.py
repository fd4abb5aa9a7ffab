"""pipeline_rl/run/ray_worker.py and preload.py: how a local Ray's worker processes start.

A stand-in process (``ray_worker.py``, as the raylet runs it) either runs the worker script
itself or, past the first ``PRELOAD_AFTER`` processes, gets a child forked from the preload
server that runs it with the stand-in's arguments, environment, folder and streams. Checked
with a small worker script in place of Ray's: what the child runs, the exit status and
signals passing through the stand-in, a child ending with its stand-in, the quota, and the
plain start whenever there is no server to serve (none running, or one that loaded Ray's core).
The real command's run, served by a real server, is checked in ``test_shutdown.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from pipeline_rl.run import preload, ray_worker

REPO = Path(__file__).resolve().parent.parent
STAND_IN = REPO / "pipeline_rl" / "run" / "ray_worker.py"

#: In place of Ray's ``default_worker.py``: writes what it ran with, then exits 3 (or sleeps).
WORKER = """
import json, os, sys, time
out = os.environ["TEST_OUT"]
with open(out + ".tmp", "w") as f:
    json.dump({"argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(), "ppid": os.getppid(),
               "marker": os.environ.get("TEST_MARKER"), "path0": sys.path[0]}, f)
os.replace(out + ".tmp", out)
print("worker says hello", flush=True)
if "--sleep" in sys.argv:
    time.sleep(60)
sys.exit(3)
"""


def _wait(predicate: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def folder() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="prl-", dir="/tmp"))   # short: a Unix socket's path
    (path / "workers").mkdir()
    (path / "workers" / "default_worker.py").write_text(WORKER)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _server(folder: Path, quota: int, modules: str = "json") -> Iterator[subprocess.Popen[bytes]]:
    sock = folder / "server"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline_rl.run.preload", str(sock), str(quota), "", modules],
                            cwd=REPO, stdout=(folder / "server.log").open("wb"), stderr=subprocess.STDOUT)
    try:
        assert _wait(sock.exists), "the server did not listen"
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def server(folder: Path) -> Iterator[subprocess.Popen[bytes]]:
    with _server(folder, quota=2) as proc:
        yield proc


def _stand_in(folder: Path, name: str, *extra: str, after: int = 0, served: bool = True) -> subprocess.Popen[bytes]:
    env = {**os.environ, "TEST_OUT": str(folder / f"{name}.json"), "TEST_MARKER": name,
           ray_worker.COUNTER_ENV: str(folder / "counter"), ray_worker.AFTER_ENV: str(after)}
    if served:
        env[ray_worker.SOCKET_ENV] = str(folder / "server")
    argv = [sys.executable, str(STAND_IN), str(folder / "workers" / "default_worker.py"), "--a=1", *extra,
            "--language=PYTHON"]
    return subprocess.Popen(argv, cwd=folder, env=env, stdout=(folder / f"{name}.out").open("wb"),
                            stderr=subprocess.STDOUT)


def _ran(folder: Path, name: str) -> dict[str, object]:
    path = folder / f"{name}.json"
    assert _wait(path.exists), (folder / f"{name}.out").read_text()
    return dict(json.loads(path.read_text()))


def _child(folder: Path, name: str) -> int:
    """The id of the process that ran worker ``name``."""
    return int(str(_ran(folder, name)["pid"]))


def _gone(pid: int) -> bool:
    """``pid`` has ended (gone, or a zombie its parent has yet to collect)."""
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_plain_worker_takes_out_what_rays_setup_reads() -> None:
    args = ["/r/default_worker.py", "--x=1", "--language=PYTHON", "--serialized-runtime-env-context={}"]
    assert ray_worker.plain_worker(args) == ["/r/default_worker.py", "--x=1"]
    assert ray_worker.plain_worker(["/r/default_worker.py", "--language", "PYTHON"]) == ["/r/default_worker.py"]
    assert ray_worker.plain_worker(["/r/default_worker.py", "--language=JAVA"]) is None
    assert ray_worker.plain_worker(["-S", "/r/default_worker.py", "--language=PYTHON"]) is None
    context = '--serialized-runtime-env-context={"env_vars": {"A": "1"}}'
    assert ray_worker.plain_worker(["/r/default_worker.py", "--language=PYTHON", context]) is None


def test_ordinal_counts_the_processes(tmp_path: Path) -> None:
    counter = str(tmp_path / "counter")
    assert [ray_worker.ordinal(counter) for _ in range(3)] == [1, 2, 3]


def test_a_served_worker_runs_in_a_child_as_its_stand_in_was_started(
        folder: Path, server: subprocess.Popen[bytes]) -> None:
    proc = _stand_in(folder, "one")
    assert proc.wait(timeout=30) == 3   # the child's exit status, through the stand-in
    ran = _ran(folder, "one")
    worker = str(folder / "workers" / "default_worker.py")
    assert ran["argv"] == [worker, "--a=1"] and ran["cwd"] == str(folder) and ran["marker"] == "one"
    assert ran["path0"] == str(folder / "workers")
    assert ran["ppid"] == server.pid and ran["pid"] != proc.pid   # forked by the server
    assert "worker says hello" in (folder / "one.out").read_text()   # the stand-in's streams


def test_the_first_processes_and_those_past_the_quota_start_plainly(folder: Path) -> None:
    with _server(folder, quota=1) as server:
        names = ["first", "served", "late"]
        for name in names:   # one at a time: the counter gives each its number in turn
            assert _stand_in(folder, name, after=1).wait(timeout=30) == 3
        ran = {name: _ran(folder, name) for name in names}
        assert ran["served"]["ppid"] == server.pid
        assert ran["first"]["ppid"] != server.pid and ran["late"]["ppid"] != server.pid
        assert "served worker process" in (folder / "server.log").read_text()


def test_without_a_server_the_worker_starts_plainly(folder: Path) -> None:
    proc = _stand_in(folder, "alone")   # the socket's path names nothing
    assert proc.wait(timeout=30) == 3
    assert _ran(folder, "alone")["pid"] == proc.pid
    proc = _stand_in(folder, "unset", served=False)
    assert proc.wait(timeout=30) == 3 and _ran(folder, "unset")["pid"] == proc.pid


def test_a_server_that_loaded_rays_core_serves_no_one(folder: Path) -> None:
    with _server(folder, quota=1, modules="ray"):
        proc = _stand_in(folder, "plain")
        assert proc.wait(timeout=60) == 3
        assert _ran(folder, "plain")["pid"] == proc.pid
        assert "the workers start without the server" in (folder / "server.log").read_text()


def test_a_signal_to_the_stand_in_reaches_the_child(folder: Path, server: subprocess.Popen[bytes]) -> None:
    proc = _stand_in(folder, "sleeper", "--sleep")
    child = _child(folder, "sleeper")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM   # it ends as its child did
    assert _wait(lambda: _gone(child))


def test_the_drivers_handle_starts_and_stops_its_server(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "preload.log"
    server = preload.PreloadServer(str(tmp_path), quota=1, after=2, log_path=log)
    assert _wait(lambda: os.path.exists(server.socket_path))
    env = server.worker_env()
    assert env[ray_worker.AFTER_ENV] == "2" and env[ray_worker.SOCKET_ENV] == server.socket_path
    server.stop()   # while it imports: it ends at once
    server.stop()   # twice: no harm
    assert server._proc.wait(timeout=60) == 0
    assert log.exists() and not os.path.exists(os.path.dirname(server.socket_path))   # its folder removed


def test_a_child_ends_with_its_stand_in(folder: Path, server: subprocess.Popen[bytes]) -> None:
    proc = _stand_in(folder, "orphan", "--sleep")
    child = _child(folder, "orphan")
    proc.kill()   # the raylet ending the process it started
    proc.wait()
    assert _wait(lambda: _gone(child))
