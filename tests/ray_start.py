"""A Ray cluster started the way a user starts one, ``ray start``, on this machine: a head
and, on demand, a second node, each its own ``ray start --block`` process that this helper
owns (its own session), on ports chosen free, with a custom resource each.

Its Ray files live in a private folder (``RAY_TMPDIR``), which also holds the record
(``ray_current_cluster``) a plain ``ray.init()`` looks for: a program is pointed at this
cluster's record only by giving it that ``RAY_TMPDIR``, so nobody else's run on the
machine finds it. Stopping it signals only the processes this helper started and their
descendants (never ``ray stop``, which would stop every Ray on the machine): each ``ray
start --block`` process, then whatever of its process tree is left, then any process whose
command line names the private folder. A test process that dies without stopping it takes
the ``ray start`` processes with it (their parent-death signal), and Ray's reaper their nodes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from pipeline_rl.net import free_port

_READY = "block forever"
_START_TIMEOUT_S = 120.0
_STOP_GRACE_S = 10.0


def node_ip() -> str:
    """The address Ray gives a node on this machine (its network address, not loopback)."""
    import ray.util

    return str(ray.util.get_node_ip_address())


@dataclass
class RayStartCluster:
    """The cluster (see the module docstring); ``address`` is what ``--ray.address`` or
    ``RAY_ADDRESS`` take; ``env`` the environment that finds its record."""

    scratch: str
    ip: str
    port: int
    env: dict[str, str]
    nodes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _seen: set[int] = field(default_factory=set)
    _taken: set[int] = field(default_factory=set)   # the ports handed to its nodes

    def _free_ports(self, n: int) -> list[str]:
        """``n`` free ports, distinct from each other and from every port this cluster took: a
        probe frees its port again, so two probes can return the same one (ray start then
        refused two components on one port)."""
        ports: list[str] = []
        while len(ports) < n:
            port = free_port()
            if port != self.port and port not in self._taken:
                self._taken.add(port)
                ports.append(str(port))
        return ports

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    def _start(self, name: str, args: list[str]) -> None:
        log = Path(self.scratch) / f"{name}.out"
        ray_cli = str(Path(sys.executable).with_name("ray"))
        node, objects, metrics, agent, runtime_env = self._free_ports(5)
        ports = ["--node-manager-port", node, "--object-manager-port", objects, "--metrics-export-port", metrics,
                 "--dashboard-agent-listen-port", agent, "--runtime-env-agent-port", runtime_env,
                 "--min-worker-port", "10002", "--max-worker-port", "19999"]
        with log.open("wb") as out:
            proc = subprocess.Popen([ray_cli, "start", "--block", "--disable-usage-stats",
                                     "--node-ip-address", self.ip, *ports, *args],
                                    stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                                    preexec_fn=_end_with_parent)
        self.nodes.append(proc)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while _READY not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start ({name}) did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        self._remember()

    def start_head(self, cpus: int, resources: dict[str, float]) -> None:
        dashboard, client = self._free_ports(2)
        self._start("head", ["--head", "--port", str(self.port), "--num-cpus", str(cpus),
                             "--resources", json.dumps(resources), "--include-dashboard", "false",
                             "--dashboard-port", dashboard, "--ray-client-server-port", client,
                             "--object-store-memory", str(100 * 2**20)])

    def add_node(self, cpus: int, resources: dict[str, float]) -> None:
        self._start("node", ["--address", self.address, "--num-cpus", str(cpus),
                             "--resources", json.dumps(resources), "--object-store-memory", str(100 * 2**20)])
        self.wait_for_nodes(len(self.nodes))

    def wait_for_nodes(self, n: int) -> None:
        """Return once the cluster lists ``n`` live nodes (asked from a fresh process)."""
        code = ("import ray; ray.init(address=%r, log_to_driver=False, logging_level=40); "
                "print('ALIVE', len([n for n in ray.nodes() if n['Alive']]))" % self.address)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=self.env,
                                 timeout=_START_TIMEOUT_S, check=False).stdout
            if f"ALIVE {n}" in out:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the cluster never listed {n} live nodes")

    def node_processes(self, index: int) -> list[psutil.Process]:
        """Node ``index``'s processes now (its ``ray start``, raylet, workers, ...)."""
        try:
            root = psutil.Process(self.nodes[index].pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        self._seen.update(p.pid for p in procs)
        return procs

    def _remember(self) -> None:
        for i in range(len(self.nodes)):
            self.node_processes(i)

    def stop(self) -> None:
        """Stop this cluster's processes only (see the module docstring); safe to call twice."""
        self._remember()
        for proc in self.nodes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.nodes:
            try:
                proc.wait(timeout=_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=_STOP_GRACE_S)
        left = [p for p in _alive(self._seen) if p.pid not in {n.pid for n in self.nodes}]
        left += [p for p in psutil.process_iter() if p.pid not in self._seen and _names(p, self.scratch)]
        for p in left:
            _signal(p, signal.SIGTERM)
        _, still = psutil.wait_procs(left, timeout=_STOP_GRACE_S)
        for p in still:
            _signal(p, signal.SIGKILL)
        psutil.wait_procs(still, timeout=_STOP_GRACE_S)
        shutil.rmtree(self.scratch, ignore_errors=True)


def _end_with_parent() -> None:
    """In the child, before ``ray start`` runs: SIGTERM when the test process ends, however
    it ends (Linux), so a killed test leaves no cluster behind (``ray start --block`` then
    ends its node's processes through Ray's reaper)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _alive(pids: set[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return out


def _names(proc: psutil.Process, scratch: str) -> bool:
    try:
        return any(scratch in arg for arg in proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def new_cluster() -> RayStartCluster:
    """An empty cluster record (nothing started): a private folder, a free head port."""
    scratch = tempfile.mkdtemp(prefix="prl-rs-", dir="/tmp")   # short: Unix socket paths
    env = {**os.environ, "RAY_TMPDIR": scratch, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    return RayStartCluster(scratch, node_ip(), free_port(), env)
