"""Starting a local Ray without its waits: :func:`start_local`.

``ray.init`` of a new local cluster starts the GCS and the raylet, then asks the GCS
for the raylet's node record (``ray._private.services.get_node``). Ray's C++ side of that
call (``GlobalStateAccessor::GetNode``) looks once and, if the raylet has not registered
yet, sleeps a whole second before looking again: a raylet that registers 0.2-0.6 s after
it starts (measured on 2 cores) costs a full second, one that takes 1.1 s costs two.
:func:`prompt_node_wait` polls the GCS's node table every 20 ms first, so the call finds
the record on its first look: ``ray.init`` took 1.6-1.8 s with it against 2.4-3.4 s
without, on the same machine.

It touches only that one private function, for the duration of one ``ray.init``, and
falls back to Ray's own wait on any error (another Ray version, a changed internal).

:data:`FAST_CONNECT` is the same cure for a second wait, inside the raylet: its client
of the object store (and every worker's client of the raylet) connects to a socket that
may come up a few milliseconds late, and Ray retries 10 times 1 s apart. On 2 cores the
raylet lost that whole second in 5 of 8 starts (``ray.init`` 2.5 s, else 1.7 s); with
the same 10 s of patience in 20 ms steps, in none of 8.

:func:`lean_head` leaves out head processes a private single-node Ray does not need
(the dashboard's API server, the autoscaler's monitor): ``ray.init`` waits for the first
to publish its address, a second of Python start-up on 2 cores, and both take CPU from the
actors starting beside them. ``ray.init`` took 1.2-1.3 s without them against 1.8-1.9 s.
Nor the log monitor, when no one reads the workers' output on the driver's console: it
starts just before the raylet, whose registration waits for two Python agents that it
takes CPU from (a local Ray and three actors: 1.69 s without it, 1.91 s with it).

:func:`quick_agents` shortens the last wait before the raylet registers: its two
Python agents (the dashboard agent and the runtime-env agent) must first write their
port files, after 0.4-1 s of imports each, beside everything else starting then. Through
``ray_agents.py`` the minimal dashboard agent (which serves nothing: it writes -1 for its
ports) is replaced by a script that writes the same files at once, and the runtime-env
agent's port is chosen (below the kernel's ephemeral range, so that no one asking for a
free port can be given it before the agent binds it), listened on and written at once; the
real agent starts on it only when called, i.e. when an actor has a runtime env (a local
run's have none), at a lower CPU priority. ``ray.init`` took 1.39 s with the dashboard agent
alone replaced against 1.53 s without (medians of 4 alternated starts), and 0.76-0.85 s
with both against 1.1-1.3 s. The command's first step: 8.40 s with the agent started only
when called against 8.67 s with it started at once (8 alternated starts).

:func:`start_local` also gives every Ray process the actors' environment by inheritance
(set in this process while Ray starts) instead of a job ``runtime_env``: with a runtime
env Ray cannot hand the workers it pre-starts to the actors, starts new ones after asking
its runtime-env agent, and three actors took 1.1 s to answer instead of 0.35 s. And the
actors run at the driver's priority (:data:`EQUAL_PRIORITY`), not at Ray's default
niceness 15 for its worker processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

log = logging.getLogger(__name__)

POLL_S = 0.02
POLL_MS = 5
#: Ray system settings for a local start (``ray.init(_system_config=...)``): connection
#: retries every 20 ms instead of every second, 500 of them instead of 10.
FAST_CONNECT: dict[str, int] = {"raylet_client_connect_timeout_milliseconds": 20,
                                "raylet_client_num_connect_attempts": 500}
#: Ray runs its worker processes (every actor) at niceness 15, below the driver and its own
#: processes; a local run's actors are the work, so they run at the driver's priority. On
#: 2 cores, 11 alternated runs of 150 steps: median step 4-8% shorter (28.2-28.9 ms against
#: 30.1-30.6 ms), the run 4-11% shorter; start-up unchanged.
EQUAL_PRIORITY: dict[str, int] = {"worker_niceness": 0}
#: Ray's own limit on the raylet's registration (``raylet_start_wait_time_s``).
WAIT_S = 30.0


def _registered(accessor: Any, node_id: str) -> bool:
    return any(n.get("NodeID") == node_id and n.get("Alive") for n in accessor.get_node_table())


def _wait_registered(gcs_address: str, node_id: str) -> None:
    """Return once the GCS lists ``node_id`` alive (or after ``WAIT_S``: Ray's call decides)."""
    from ray._private.services import _get_gcs_client_options
    from ray._private.state import GlobalState

    state = GlobalState()
    state._initialize_global_state(_get_gcs_client_options(gcs_address))
    try:
        accessor = state._connect_and_get_accessor()
        deadline = time.monotonic() + WAIT_S
        while not _registered(accessor, node_id) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    finally:
        state.disconnect()   # its own GCS connection: Ray's call opens another


@contextlib.contextmanager
def replaced(owner: Any, **values: Any) -> Iterator[None]:
    """Within the block, ``owner``'s attributes named in ``values`` hold those values;
    the originals are back on exit, however the block ends."""
    originals = {name: getattr(owner, name) for name in values}
    for name, value in values.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(owner, name, value)


@contextlib.contextmanager
def prompt_gcs_port() -> Iterator[None]:
    """Within the block, ``ray.init`` looks for its new GCS's port file every
    :data:`POLL_MS` ms instead of every 100 ms: the GCS writes it some 50 ms after it
    starts, on 2 cores, so Ray's first look misses it and the next comes 100 ms later."""
    try:
        import ray._private.node as node

        original = node.wait_for_persisted_port
    except (ImportError, AttributeError):   # another Ray: its own wait
        yield
        return

    def wait_for_persisted_port(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **{**kwargs, "poll_interval_ms": POLL_MS})

    with replaced(node, wait_for_persisted_port=wait_for_persisted_port):
        yield


@contextlib.contextmanager
def prompt_node_wait() -> Iterator[None]:
    """Within the block, ``ray.init`` waits for its raylet in 20 ms polls (see above)."""
    try:
        import ray._private.services as services

        original = services.get_node
    except (ImportError, AttributeError):   # another Ray: its own wait
        yield
        return

    def get_node(gcs_address: str, node_id: str) -> Any:
        try:
            _wait_registered(gcs_address, node_id)
        except Exception as e:  # a changed internal: Ray's own wait still works
            log.debug("prompt node wait unavailable (%s: %s)", type(e).__name__, e)
        return original(gcs_address, node_id)

    with replaced(services, get_node=get_node):
        yield


#: The ``Node`` methods that start the processes :func:`lean_head` can leave out.
_DASHBOARD = ("start_api_server", "start_monitor")
_LOG_MONITOR = ("start_log_monitor",)


@contextlib.contextmanager
def lean_head(*, dashboard: bool = False, log_monitor: bool = False) -> Iterator[None]:
    """Within the block, a new local Ray starts its dashboard process and autoscaler
    monitor only if ``dashboard``, its log monitor (which streams the workers' output to
    the driver) only if ``log_monitor`` (see above); another Ray version without those
    methods starts as it would."""
    skipped = (() if dashboard else _DASHBOARD) + (() if log_monitor else _LOG_MONITOR)
    try:
        from ray._private.node import Node
    except ImportError:
        yield
        return
    if not all(hasattr(Node, name) for name in skipped):   # another Ray: it starts as it would
        yield
        return

    def start_nothing(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    with replaced(Node, **{name: start_nothing for name in skipped}):
        yield


#: The script the raylet runs for its agents under :func:`quick_agents`.
AGENT_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_agents.py")


@contextlib.contextmanager
def quick_agents(*, minimal: bool = True) -> Iterator[None]:
    """Within the block, a new local Ray's raylet starts its two Python agents through
    ``ray_agents.py`` (see above and there); unchanged when Ray is asked to profile a
    component's memory, or for another Ray version without the function it touches.

    ``minimal`` (a Ray without its dashboard): the dashboard agent is started minimal
    without Ray first importing the dashboard's dependencies to find out whether they
    are installed (~0.1 s of this process's start-up, before the raylet starts), so
    ``ray_agents.py`` stands in for it whatever is installed."""
    try:
        import ray._private.ray_constants as constants
        import ray._private.services as services
        import ray._private.utils as utils

        original = services._build_python_executable_command_memory_profileable
        agents = {constants.PROCESS_TYPE_DASHBOARD_AGENT, constants.PROCESS_TYPE_RUNTIME_ENV_AGENT}
        profiled = os.environ.get(services.RAY_MEMRAY_PROFILE_COMPONENT_ENV, "")
    except (ImportError, AttributeError):
        yield
        return
    if profiled:
        yield
        return

    def command(component: str, session_dir: str, unbuffered: bool = True) -> list[str]:
        if component in agents:
            return [sys.executable, "-S", "-u", AGENT_SCRIPT, component]
        return list(original(component, session_dir, unbuffered))

    def no_dashboard() -> ImportError:
        return ImportError("a private local Ray without its dashboard")

    with contextlib.ExitStack() as stack:
        stack.enter_context(replaced(services, _build_python_executable_command_memory_profileable=command))
        if minimal and hasattr(utils, "get_dashboard_dependency_error"):
            stack.enter_context(replaced(utils, get_dashboard_dependency_error=no_dashboard))
        yield


#: The script the raylet runs to start a worker under :func:`lean_worker_start`.
WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_worker.py")


@contextlib.contextmanager
def lean_worker_start() -> Iterator[None]:
    """Within the block, a new local Ray's raylet starts its worker processes through
    ``ray_worker.py`` instead of Ray's ``setup_worker.py`` (see above and there); a Ray
    without the constant it reads starts them as it would. Ray joins the constant to its
    own folder, and an absolute path joined so is that path."""
    try:
        import ray._private.ray_constants as constants
    except ImportError:
        yield
        return
    if not isinstance(getattr(constants, "SETUP_WORKER_FILENAME", None), str):
        yield
        return
    with replaced(constants, SETUP_WORKER_FILENAME=WORKER_SCRIPT):
        yield


@contextlib.contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` in this process's environment within the block (previous values restored)."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_local(*, num_cpus: int, object_store_mb: int, env: Mapping[str, str], logging_level: int,
                log_to_driver: bool = True, dashboard: bool = False) -> Any:
    """Start a private single-node Ray for this process; returns ``ray.init``'s context.

    ``env``: environment variables of every process Ray starts (the actors'), inherited
    from this process at start; this process's own environment is as before on return.
    ``dashboard``: also start Ray's dashboard process (its job and state APIs, without
    the web UI, which needs ``ray[default]``) and autoscaler monitor (``ray status``), at
    ~0.6 s more start-up on 2 cores. ``log_to_driver``: the workers' output reaches this
    process's console; without it Ray's log monitor is not started at all."""
    import ray

    with contextlib.ExitStack() as stack:
        stack.enter_context(environment(env))
        stack.enter_context(prompt_node_wait())
        stack.enter_context(prompt_gcs_port())
        stack.enter_context(lean_head(dashboard=dashboard, log_monitor=log_to_driver))
        stack.enter_context(quick_agents(minimal=not dashboard))
        stack.enter_context(lean_worker_start())
        return ray.init(num_cpus=num_cpus, include_dashboard=False,   # the web UI needs ray[default]
                        object_store_memory=object_store_mb * 2**20, log_to_driver=log_to_driver,
                        logging_level=logging_level, _system_config={**FAST_CONNECT, **EQUAL_PRIORITY})
