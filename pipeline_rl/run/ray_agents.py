"""What a private local Ray's raylet runs for its dashboard agent (see ``local_ray``'s
``quick_agents``): a script of the standard library only, started as
``python -S -u ray_agents.py COMPONENT AGENT_SCRIPT [AGENT_ARGS...]`` (``-S``: no site
packages, so it is up in about 10 ms, not the 0.4-1 s of the agent's imports).

The raylet registers with the GCS only once its agents have written their port files
into the session folder, and the agents' imports compete with everything else starting
then. The dashboard agent with ``--minimal`` (Ray without its dashboard extras) serves
nothing here (no metrics, no HTTP: it writes -1 for its three ports), so this script
writes the same three files at once and stays alive, as the raylet expects of its agent,
until the raylet is gone. Without ``--minimal``, or for another component, it becomes the
real agent.

(The runtime-env agent is left to start as it does: choosing its port here and starting
it later left a port chosen but not yet bound for a second, and the trainers' rendezvous,
which probes for a free port at that moment, once took the same one.)

Invariant: the files hold what the real agent would write (-1: a service not offered),
each written whole (a temporary file renamed into place).
"""

from __future__ import annotations

import os
import sys
import time

#: Ray's name of the dashboard agent (``ray_constants.PROCESS_TYPE_DASHBOARD_AGENT``).
DASHBOARD_AGENT = "dashboard_agent"
#: The port files the minimal dashboard agent writes, each with -1.
DASHBOARD_PORTS = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port")
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


def become(agent: list[str]) -> None:
    """Replace this process by the real agent (``agent``: its script and arguments)."""
    os.execv(sys.executable, [sys.executable, "-u", *agent])


def wait_for_parent() -> None:
    """Return when the raylet that started this process is gone."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(POLL_S)


def main(argv: list[str]) -> None:
    component, agent = argv[0], argv[1:]
    if component == DASHBOARD_AGENT and "--minimal" in agent:
        opts = flags(agent[1:])
        for name in DASHBOARD_PORTS:
            persist_port(opts["--session-dir"], opts["--node-id"], name, -1)
        wait_for_parent()
        return
    become(agent)


if __name__ == "__main__":
    main(sys.argv[1:])
