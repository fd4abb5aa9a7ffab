"""What a private local Ray's raylet runs for its two Python agents (see ``local_ray``'s
``quick_agents``): a script of the standard library only, started as
``python -S -u ray_agents.py COMPONENT AGENT_SCRIPT [AGENT_ARGS...]`` (``-S``: no site
packages, so it is up in about 10 ms, not the 0.4-1 s of an agent's imports).

The raylet registers with the GCS only once both agents have written their port files
into the session folder, and the agents' imports compete with everything else starting
then. So:

- ``dashboard_agent`` with ``--minimal`` (Ray without its dashboard extras): the agent
  would serve nothing here (no metrics, no HTTP: it writes -1 for its three ports). This
  script writes the same three files at once and stays alive, as the raylet expects of its
  agent, until the raylet is gone. Without ``--minimal`` it becomes the real agent.
- ``runtime_env_agent``: the script listens on a port of its choosing and writes its file
  at once, then waits. Only an actor with a runtime env makes the raylet call the agent,
  and a local run's actors have none: the agent's second of imports (and its memory) is
  spent only when someone calls. Then the script closes the port (the call is refused,
  and Ray's client retries it) and becomes the real agent on that port, at a lower CPU
  priority. The port is chosen below the kernel's ephemeral range (and above Ray's worker
  ports, 10002-19999): it is unbound for the second the agent takes to import, and a port
  in the ephemeral range could meanwhile be handed to anyone asking the kernel for a free
  one (the trainers' rendezvous once took it so). Where no such port is free, or the range
  cannot be read, the agent starts as Ray starts it.

Invariant: the files hold what the real agent would write (a port number, or -1 for a
service not offered), each written whole (a temporary file renamed into place).
"""

from __future__ import annotations

import os
import random
import select
import socket
import sys

#: Ray's names of the two agents (``ray_constants.PROCESS_TYPE_*``).
DASHBOARD_AGENT = "dashboard_agent"
RUNTIME_ENV_AGENT = "runtime_env_agent"
#: The port files the minimal dashboard agent writes, each with -1.
DASHBOARD_PORTS = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port")
RUNTIME_ENV_PORT = "runtime_env_agent_port"
#: How much lower the real runtime-env agent runs than the processes of a run's start.
RUNTIME_ENV_NICE = 10
#: The lowest port the runtime-env agent is given: above Ray's worker ports (10002-19999).
QUIET_PORT_MIN = 20000
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
POLL_S = 1.0


def flags(args: list[str]) -> dict[str, str]:
    """``--name=value`` arguments by name (``--name``)."""
    return dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)


def persist_port(session_dir: str, node_id: str, name: str, port: int) -> None:
    """Write ``port`` where Ray's raylet looks for it (``<session>/<name>_<node id>``)."""
    path = os.path.join(session_dir, f"{name}_{node_id}")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, path)


def ephemeral_low() -> int | None:
    """The lowest port the kernel hands out for a bind to port 0 (None: unknown)."""
    try:
        with open(EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def quiet_listener(host: str, tries: int = 50) -> socket.socket | None:
    """A socket listening on a port in ``[QUIET_PORT_MIN, ephemeral low)``, which no
    request for any free port can be given (None: no such range, or none of ``tries``
    random ones was free)."""
    low = ephemeral_low()
    if low is None or low <= QUIET_PORT_MIN:
        return None
    for _ in range(tries):
        s = socket.socket()
        try:
            s.bind((host, random.randrange(QUIET_PORT_MIN, low)))
            s.listen()
        except OSError:
            s.close()
            continue
        return s
    return None


def with_port(args: list[str], port: int) -> list[str]:
    """The agent's arguments with ``--runtime-env-agent-port`` set to ``port``."""
    key = "--runtime-env-agent-port="
    return [f"{key}{port}" if a.startswith(key) else a for a in args]


def become(agent: list[str]) -> None:
    """Replace this process by the real agent (``agent``: its script and arguments)."""
    os.execv(sys.executable, [sys.executable, "-u", *agent])


def wait_for_parent(listener: socket.socket | None = None) -> bool:
    """Wait until the raylet that started this process is gone (False) or, given a
    ``listener``, someone connects to it (True)."""
    parent = os.getppid()
    while os.getppid() == parent:
        ready, _, _ = select.select([] if listener is None else [listener], [], [], POLL_S)
        if ready:
            return True
    return False


def main(argv: list[str]) -> None:
    component, agent = argv[0], argv[1:]
    opts = flags(agent[1:])
    if component == DASHBOARD_AGENT and "--minimal" in agent:
        for name in DASHBOARD_PORTS:
            persist_port(opts["--session-dir"], opts["--node-id"], name, -1)
        wait_for_parent()
        return
    if component == RUNTIME_ENV_AGENT and opts.get("--runtime-env-agent-port", "0") == "0":
        listener = quiet_listener(opts.get("--node-ip-address", "127.0.0.1"))
        if listener is not None:
            with listener:
                port = listener.getsockname()[1]
                persist_port(opts["--session-dir"], opts["--node-id"], RUNTIME_ENV_PORT, port)
                if not wait_for_parent(listener):
                    return
            # closed: the caller's connection is refused, and Ray's client retries it
            agent = with_port(agent, port)
            os.nice(RUNTIME_ENV_NICE)
    become(agent)


if __name__ == "__main__":
    main(sys.argv[1:])
