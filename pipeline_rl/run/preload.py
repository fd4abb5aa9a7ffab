"""The rollout workers' imports, done while Ray starts: a *preload server*.

A rollout worker's own start is almost all imports: ``import vllm`` and, inside the engine
build, vLLM's lazily imported modules (``vllm.config``, the engine, the CPU model runner,
the model's class): 5.3 s of a 5.7 s start on 2 cores. Done in the worker's actor, they
begin only once Ray is up and has started the actor's process (about 1.1 s into the
command). The driver instead starts this server first, before Ray: a process that imports
all of them at once, then forks the rollout workers' processes from itself. A forked child
has every module already loaded (shared with the server, copy-on-write), so the worker's
engine build is left with its real work (the model, the KV cache).

How Ray's worker processes get here (``ray_worker.py``, which a local Ray's raylet runs to
start every worker): the driver creates the buffer and the trainers first, then the rollout
workers, and tells every worker process how many come first (``PRELOAD_AFTER``). Processes
numbered beyond that (a counter file, under a lock) ask this server for a child instead of
starting Ray's worker themselves: they send their arguments, environment, folder and
standard streams, and wait. The child becomes that Ray worker, with those
arguments, streams and environment; the process the raylet started stays beside it as its
stand-in, ending when the child ends (with its exit status) and passing on the signals the
raylet sends it. Ray hands waiting actors the workers that register first: the buffer and
the trainers (created first) get the plain, quick processes, and the rollout workers get the
preloaded ones.

Invariants:

- The server starts no thread before it forks (only its imports' own, idle): a child never
  inherits a lock held by another thread.
- A child runs exactly as ``python default_worker.py ARGS`` would, with the stand-in's
  environment, folder and streams, on the server's CPUs (the rollout workers' cores when
  they are pinned, where the actor then pins itself; else all); it ends (SIGKILL) if its
  stand-in ends first,
  and a stand-in ends when its child ends or the server goes away (then killing the child).
- The server ignores Ctrl-C (SIGINT, which a terminal sends the whole process group): the
  driver handles it and stops the server (SIGTERM); a child handles signals as Python does.
- The server forks at most ``quota`` children (one per rollout worker); later requests are
  refused and those processes start as Ray's plain workers. It exits once its children have
  all ended and it serves no more (or when the driver that started it is gone).
- Only for a private local Ray on CPU: a forked process must not inherit a CUDA context.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline_rl.run.ray_worker import AFTER_ENV, COUNTER_ENV, EXIT, SOCKET_ENV, Request, run_worker

log = logging.getLogger(__name__)

#: What the server imports: what a rollout worker's engine build imports on CPU (its modules
#: over 20 ms, by ``python -X importtime``), except those that load Ray's core (:data:`RAY_CORE`).
MODULES = (
    "torch",
    "vllm",
    "vllm.config",
    "vllm.engine.arg_utils",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.executor.abstract",
    "vllm.v1.engine.input_processor",
    "vllm.v1.engine.output_processor",
    "vllm.v1.sample.logits_processor",
    "vllm.v1.sample.ops.penalties",
    "vllm.model_executor.model_loader",
    "vllm.model_executor.layers.quantization.online.base",
)
#: Ray's compiled core: its internal settings (the job id the raylet gives each worker in its
#: environment, among them) are read from the environment once, when it loads. Loaded here,
#: every child would keep the server's empty ones (Ray's worker aborts on start), so the
#: server imports nothing that loads it, and serves no one if something did.
RAY_CORE = "ray._raylet"
#: Largest request a stand-in sends (arguments and environment, JSON).
MAX_REQUEST = 1 << 20
POLL_S = 0.2


class PreloadServer:
    """The driver's handle on the server process (see the module docstring)."""

    def __init__(self, model_dir: str, quota: int, after: int, log_path: Path) -> None:
        """Start the server for ``quota`` rollout workers, whose processes come after the
        first ``after`` (the buffer and the trainer ranks); its own output goes to ``log_path``."""
        self._dir = tempfile.mkdtemp(prefix="pipeline_rl_preload_")
        self.socket_path = os.path.join(self._dir, "server")
        self.counter_path = os.path.join(self._dir, "started")
        self.after = after
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline_rl.run.preload", self.socket_path, str(quota), model_dir],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=server_env(),
                cwd=str(Path(__file__).resolve().parents[2]))

    def pin(self, cpus: set[int]) -> None:
        """Run the server, and the children it forks until they pin themselves, on ``cpus``."""
        with contextlib.suppress(OSError):
            os.sched_setaffinity(self._proc.pid, cpus)

    def worker_env(self) -> dict[str, str]:
        """The variables every Ray worker process needs to find the server."""
        return {SOCKET_ENV: self.socket_path, AFTER_ENV: str(self.after), COUNTER_ENV: self.counter_path}

    def stop(self) -> None:
        """Stop serving (the children, Ray's workers, live on until Ray ends them; the
        server waits for them) and remove the socket's folder."""
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                self._proc.send_signal(signal.SIGTERM)
        shutil.rmtree(self._dir, ignore_errors=True)


def server_env() -> dict[str, str]:
    """The server's environment: the driver's with the actors' settings (a child gets its
    stand-in's whole environment at fork; these hold for what the imports read)."""
    from pipeline_rl.runtime_env import ACTOR_ENV

    return {**os.environ, **ACTOR_ENV}


def preload(modules: Sequence[str], model_dir: str | None) -> None:
    """Import ``modules`` and the vLLM module of ``model_dir``'s architecture; one that
    fails is left to fail again, with its own error, in the worker."""
    for name in [*modules, *arch_modules(model_dir)]:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - the worker's own import will say
            log.warning("preload: %s not imported (%s: %s)", name, type(e).__name__, e)


def arch_modules(model_dir: str | None) -> list[str]:
    """The vLLM model modules of the architectures in ``model_dir``'s ``config.json``."""
    if not model_dir:
        return []
    try:
        archs = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or []
        from vllm.model_executor.models.registry import _VLLM_MODELS
    except Exception:  # noqa: BLE001 - no config, another vLLM: the worker imports it
        return []
    return [f"vllm.model_executor.models.{_VLLM_MODELS[a][0]}" for a in archs if a in _VLLM_MODELS]


@dataclass
class Serving:
    """The server's state: its listening socket, and each child's stand-in connection."""

    listener: socket.socket
    quota: int
    children: dict[int, socket.socket] = field(default_factory=dict)
    stopping: bool = False

    def serving(self) -> bool:
        return not self.stopping and self.quota > 0

    def stop_serving(self) -> None:
        if not self.stopping:
            self.stopping = True
            self.listener.close()


def serve(path: str, quota: int, model_dir: str | None, modules: Sequence[str] = MODULES) -> None:
    """The server's main: listen at once (stand-ins wait in the backlog), import
    ``modules``, then fork children until the quota is spent, reaping them; see the module
    docstring. Stopped (SIGTERM) while importing, it ends at once."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C is the driver's to handle
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)
    parent = os.getppid()
    state = Serving(listener, quota)
    gc.disable()
    preload(modules, model_dir)
    gc.freeze()
    gc.enable()
    signal.signal(signal.SIGTERM, lambda *_: state.stop_serving())
    if RAY_CORE in sys.modules:
        log.warning("preload: %s was imported; the workers start without the server", RAY_CORE)
        state.stop_serving()
    flush()
    while state.serving() or state.children:
        if os.getppid() != parent:
            state.stop_serving()
        watched = ([listener] if state.serving() else []) + list(state.children.values())
        ready, _, _ = select.select(watched, [], [], POLL_S)
        for s in ready:
            if s is listener:
                accept(state)
            else:   # a stand-in closed its end: it is gone, so is its child
                pid = next(p for p, c in state.children.items() if c is s)
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        reap(state)


def accept(state: Serving) -> None:
    """Take one stand-in's request and fork its child (refusing a bad request)."""
    try:
        conn, _ = state.listener.accept()
    except OSError:
        return
    try:
        data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
        request = Request.decode(data)
        if len(fds) != 3:
            raise ValueError(f"{len(fds)} streams, not 3")
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("preload: bad request (%s)", e)
        conn.close()   # its stand-in starts the worker itself
        return
    pid = os.fork()
    if pid == 0:
        become_worker(request, fds, [state.listener, conn, *state.children.values()])
    for fd in fds:
        os.close(fd)
    state.children[pid] = conn
    try:
        conn.sendall(str(pid).encode())
    except OSError:   # its stand-in gave up meanwhile: the child must not live on without it
        os.kill(pid, signal.SIGKILL)
    state.quota -= 1
    print(f"preload: served worker process {pid} ({state.quota} more to serve)", flush=True)
    if state.quota <= 0:
        state.stop_serving()


def reap(state: Serving) -> None:
    """Collect ended children and tell each one's stand-in its exit status."""
    for pid in list(state.children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done == 0:
            continue
        conn = state.children.pop(pid)
        with contextlib.suppress(OSError):
            conn.sendall(EXIT + str(os.waitstatus_to_exitcode(status)).encode())
        conn.close()


def flush() -> None:
    """Write out what this process printed (before a fork, or an exit without teardown)."""
    sys.stdout.flush()
    sys.stderr.flush()


def become_worker(request: Request, fds: list[int], inherited: list[socket.socket]) -> None:
    """In a forked child: take on the stand-in's process and run Ray's worker; never returns."""
    code = 1
    try:
        for s in inherited:
            s.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request.env)
        os.chdir(request.cwd)
        code = run_worker(request.argv)
    except BaseException:  # noqa: BLE001 - the child must never return into the server
        import traceback

        traceback.print_exc()
    finally:
        flush()
        os._exit(code)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    # SOCKET QUOTA [MODEL_DIR [MODULES]]: MODULES, comma-separated, replaces MODULES (tests)
    args = sys.argv[1:]
    serve(args[0], int(args[1]), args[2] if len(args) > 2 and args[2] else None,
          args[3].split(",") if len(args) > 3 else MODULES)
    flush()
    os._exit(0)   # no interpreter teardown: nothing is left to clean up, and vLLM's bindings complain
