"""The real command beside, and on, a Ray cluster a user started with ``ray start`` on this
machine (``tests/ray_start.py``; issue 43), in this order on one cluster:

1. With the cluster's record findable (its ``RAY_TMPDIR``), the default command runs on a
   private Ray of its own: it neither joins the cluster nor fails on it.
2. ``--ray.address`` on that one-node cluster: the run pins nothing (every actor on every
   CPU), as another run may hold the same cores.
3. A second node joins; ``RAY_ADDRESS`` without a flag (as ``ray job submit`` sets it) runs
   20 steps on the two nodes, the rollout worker on one and the trainer on the other, and
   the weights cross between them over the gloo channel on the node's network address, not
   loopback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from pipeline_rl.metrics import read_metrics
from ray_start import RayStartCluster, new_cluster
from tiny_run import TINY_RUN_FLAGS

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
_RUN_TIMEOUT_S = 400.0
#: What each node declares (the actors are placed by these).
HEAD = {"trainer_node": 1.0}
SECOND = {"rollout_node": 1.0}
#: The ports Ray gives its worker processes (``ray start``'s default range, named in
#: ``tests/ray_start.py``): a connection there is Ray's, not the weights'.
RAY_WORKER_PORTS = range(10002, 20000)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayStartCluster]:
    c = new_cluster()
    try:
        c.start_head(2, HEAD)
        yield c
    finally:
        c.stop()


def _command(model_dir: str, out: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "launch" / "async_grpo.py"), "--model.path", model_dir,
            "--out-dir", str(out), "--max-steps", str(steps), *TINY_RUN_FLAGS, *extra]


def _actors(procs: list[psutil.Process], name: str) -> list[psutil.Process]:
    """The processes among ``procs`` that run actor class ``name`` (Ray titles them ``ray::NAME``)."""
    out = []
    for p in procs:
        try:
            if " ".join(p.cmdline()).startswith(f"ray::{name}"):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def _finish(proc: subprocess.Popen[str], log: Path) -> str:
    try:
        proc.wait(timeout=_RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    return text


def test_default_command_runs_on_its_own_ray_beside_the_cluster(cluster: RayStartCluster, tiny_model_dir: str,
                                                                 tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(_command(tiny_model_dir, tmp_path / "out", 3), cwd=REPO, env=cluster.env,
                                stdout=sink, stderr=subprocess.STDOUT, text=True)
    text = _finish(proc, log)
    assert "Ray: started locally" in text and "joined" not in text, text[-4000:]
    assert [r["step"] for r in read_metrics(tmp_path / "out" / "metrics.jsonl")] == [1, 2, 3]


def _cores_while_running(proc: subprocess.Popen[str], cluster: RayStartCluster, metrics: Path
                         ) -> dict[str, list[int]]:
    """The CPUs the run's rollout worker and trainer may run on, once it has logged a step."""
    deadline = time.monotonic() + _RUN_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().strip():
            procs = cluster.node_processes(0)
            cores = {}
            for name in ("RolloutActor", "TrainerActor"):
                found = _actors(procs, name)
                if found:
                    cores[name] = sorted(found[0].cpu_affinity())
            if len(cores) == 2:
                return cores
        time.sleep(0.02)
    return {}


def test_ray_address_on_a_cluster_it_did_not_start_pins_nothing(cluster: RayStartCluster, tiny_model_dir: str,
                                                                 tmp_path: Path) -> None:
    log, metrics = tmp_path / "run.log", tmp_path / "out" / "metrics.jsonl"
    with log.open("w") as sink:
        proc = subprocess.Popen(_command(tiny_model_dir, tmp_path / "out", 40, "--ray.address", cluster.address),
                                cwd=REPO, env=cluster.env, stdout=sink, stderr=subprocess.STDOUT, text=True)
    cores = _cores_while_running(proc, cluster, metrics)
    text = _finish(proc, log)
    assert f"joined the cluster at {cluster.address}" in text, text[-4000:]
    everything = sorted(os.sched_getaffinity(0))
    assert cores == {"RolloutActor": everything, "TrainerActor": everything}, (cores, text[-3000:])


def _crossing(worker: psutil.Process, trainer: psutil.Process) -> tuple[str, int] | None:
    """A TCP connection from the worker to a port the trainer listens on, not over
    loopback and not Ray's own (its worker ports, :data:`RAY_WORKER_PORTS`: a gloo
    channel's store or pair): the address and port it reached the trainer at, or None."""
    try:
        listening = {c.laddr.port for c in trainer.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        for c in worker.net_connections("tcp"):
            if (c.raddr and c.status == psutil.CONN_ESTABLISHED and c.raddr.port in listening
                    and c.raddr.port not in RAY_WORKER_PORTS):
                ip = c.raddr.ip.removeprefix("::ffff:")
                if not ip.startswith("127.") and ip != "::1":
                    return ip, c.raddr.port
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        pass
    return None


def test_ray_address_variable_runs_20_steps_across_two_nodes(cluster: RayStartCluster, tiny_model_dir: str,
                                                             tmp_path: Path) -> None:
    if len(cluster.nodes) < 2:
        cluster.add_node(1, SECOND)
    log, out = tmp_path / "run.log", tmp_path / "out"
    env = {**cluster.env, "RAY_ADDRESS": cluster.address}
    with log.open("w") as sink:
        proc = subprocess.Popen(_command(tiny_model_dir, out, 20, "--ray.rollout_resource", "rollout_node",
                                         "--ray.trainer_resource", "trainer_node"),
                                cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
    seen: dict[str, int] = {}
    crossing: tuple[str, int] | None = None
    deadline = time.monotonic() + _RUN_TIMEOUT_S
    while proc.poll() is None and time.monotonic() < deadline and crossing is None:
        head, second = cluster.node_processes(0), cluster.node_processes(1)
        workers, trainers = _actors(second, "RolloutActor"), _actors(head, "TrainerActor")
        if workers and trainers:
            seen.update(worker_node=1, trainer_node=0)
            crossing = _crossing(workers[0], trainers[0])
        time.sleep(0.02)
    text = _finish(proc, log)
    assert f"joined the cluster at {cluster.address}" in text, text[-4000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert rows[-1]["version"] == 20
    # The worker ran on the second node and the trainer on the head; the weights reached the
    # worker over TCP to the trainer's node address.
    assert seen.get("worker_node") == 1 and seen.get("trainer_node") == 0, (seen, text[-3000:])
    assert crossing is not None, (seen, text[-3000:])
    assert crossing[0] == cluster.ip and not crossing[0].startswith("127."), crossing
