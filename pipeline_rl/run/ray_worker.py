"""What a private local Ray's raylet runs to start a worker process (every actor's), in
place of Ray's ``setup_worker.py`` (see ``local_ray``'s ``lean_worker_start``): a
script of the standard library only, started as
``python ray_worker.py DEFAULT_WORKER_SCRIPT [WORKER_ARGS...] --language=PYTHON``.

Ray's own path to a worker is three programs: ``setup_worker.py`` (which imports Ray,
0.3-0.5 s on 2 cores, to read the worker's runtime-env context), then ``bash -c
"exec python default_worker.py ..."``, then the worker, which imports Ray again. With no
runtime env (a local run's actors have none: the raylet passes no context at all) the
context is empty and the first two only hand the same arguments on. This script runs
``default_worker.py`` itself, in this process: one interpreter and one ``import ray``
per worker instead of two of each, on the start-up's critical path (an actor's process
is started when the actor is created). Anything else (a runtime-env context, another
language, interpreter flags before the worker's script) goes to Ray's own script,
unchanged.

When the driver runs a preload server (``preload.py``), processes started after the
first ``PRELOAD_AFTER`` ask it for a child that has the rollout worker's imports done and
stand in for that child (:func:`stand_in`); a refusal, or no server, starts the worker here.

Invariant: the worker runs as ``python default_worker.py ARGS`` would: the same
arguments (those ``setup_worker.py`` consumes removed), ``sys.argv[0]`` and
``sys.path[0]`` its script's, this process's id (which the raylet started and tracks)
or, preloaded, a child this process stands in for until it ends.
"""

from __future__ import annotations

import fcntl
import json
import os
import runpy
import signal
import socket
import sys
from dataclasses import dataclass
from typing import NoReturn

#: The options Ray's ``setup_worker.py`` reads (and does not pass on to the worker).
CONTEXT = "--serialized-runtime-env-context"
LANGUAGE = "--language"
#: Ray's script, beside ``default_worker.py``.
RAY_SETUP_WORKER = "setup_worker.py"
#: The environment variables that lead to a preload server (set by the driver's
#: ``preload.PreloadServer`` in every worker process's environment).
SOCKET_ENV = "PIPELINE_RL_PRELOAD_SOCKET"
AFTER_ENV = "PIPELINE_RL_PRELOAD_AFTER"
COUNTER_ENV = "PIPELINE_RL_PRELOAD_COUNTER"
#: A child's end, as the server reports it: ``exit CODE`` (negative: killed by signal -CODE).
EXIT = b"exit "


@dataclass(frozen=True, slots=True)
class Request:
    """What a stand-in asks the preload server for: the worker's command (its script
    first) and the rest of its process as the raylet started it (its standard streams go
    beside, as file descriptors)."""

    argv: list[str]
    env: dict[str, str]
    cwd: str

    def encode(self) -> bytes:
        return json.dumps({"argv": self.argv, "env": self.env, "cwd": self.cwd}).encode()

    @staticmethod
    def decode(data: bytes) -> "Request":
        d = json.loads(data)
        return Request([str(a) for a in d["argv"]], {str(k): str(v) for k, v in d["env"].items()},
                       str(d["cwd"]))


def option(args: list[str], name: str) -> tuple[str | None, list[str]]:
    """``name``'s value (``--name=value`` or ``--name value``; None when absent) and the
    arguments without it."""
    rest: list[str] = []
    value: str | None = None
    it = iter(args)
    for a in it:
        if a == name:
            value = next(it, "")
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
        else:
            rest.append(a)
    return value, rest


def plain_worker(args: list[str]) -> list[str] | None:
    """The worker's own command (its script first) when ``args`` ask for a Python worker
    with an empty runtime-env context and no interpreter flags; None otherwise."""
    context, rest = option(args, CONTEXT)
    language, rest = option(rest, LANGUAGE)
    if language != "PYTHON" or context not in (None, "", "{}"):
        return None
    if not rest or not rest[0].endswith(".py"):   # "-S"/"-s" first: Ray's script passes them on
        return None
    return rest


def ordinal(counter: str) -> int:
    """This process's number among the worker processes started (1 for the first), from
    the shared ``counter`` file, under an exclusive lock."""
    fd = os.open(counter, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        n = int(os.read(fd, 32) or b"0") + 1
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, str(n).encode())
        return n
    finally:
        os.close(fd)


def preloaded(worker: list[str]) -> tuple[socket.socket, int] | None:
    """Ask the preload server, if there is one and this process comes after the first
    ``PRELOAD_AFTER``, for a child running ``worker``: the connection and the child's id,
    None to start the worker here (no server, too early, or refused)."""
    path, counter = os.environ.get(SOCKET_ENV), os.environ.get(COUNTER_ENV)
    if not path or not counter:
        return None
    try:
        if ordinal(counter) <= int(os.environ.get(AFTER_ENV, "0")):
            return None
        request = Request(worker, dict(os.environ), os.getcwd())
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except (OSError, ValueError):
        return None
    try:
        conn.connect(path)
        socket.send_fds(conn, [request.encode()], [0, 1, 2])
        reply = conn.recv(64)   # the server answers once its imports are done
        return conn, int(reply)
    except (OSError, ValueError):
        conn.close()
        return None


def stand_in(conn: socket.socket, child: int) -> NoReturn:
    """Be the process the raylet started for ``child``: pass on the signals it sends, end
    with the child's exit status; if the server goes away first, end the child too."""
    def pass_on(sig: int, _: object) -> None:
        try:
            os.kill(child, sig)
        except OSError:   # already gone: its end is on its way
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, pass_on)
    try:
        reply = conn.recv(64)
    except OSError:
        reply = b""
    if not reply.startswith(EXIT):
        os.kill(child, signal.SIGKILL)
        os._exit(1)
    code = int(reply[len(EXIT):])
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 1)


def run_worker(argv: list[str]) -> int:
    """Run Ray's worker script ``argv[0]`` with ``argv`` as ``python`` would, in this
    process; its exit status."""
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def main(args: list[str]) -> None:
    worker = plain_worker(args)
    if worker is None:
        script = next((a for a in args if a.endswith(".py")), "")
        setup = os.path.join(os.path.dirname(script), RAY_SETUP_WORKER)
        os.execv(sys.executable, [sys.executable, setup, *args])
    served = preloaded(worker)
    if served is not None:
        stand_in(*served)
    sys.exit(run_worker(worker))


if __name__ == "__main__":
    main(sys.argv[1:])
