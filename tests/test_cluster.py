"""A real two-node Ray cluster on one machine: placement by node resources, the
ZeroMQ link over TCP between nodes, and a trainer death that stops the run with a
resumable checkpoint (then the resume), in one job to keep the test short.

Both nodes are full Ray nodes (their own raylet and object store) started by
``ray.cluster_utils.Cluster``: the head declares ``trainer_node``, the second node
``rollout_node``, one CPU each. The module shares that cluster; its Ray files live
in a private temporary folder, so a plain ``ray.init()`` elsewhere on the machine
never finds this cluster's address file and joins it by mistake.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from pipeline_rl.config import Config
from pipeline_rl.metrics import read_metrics
from ray_cluster import two_node_cluster
from tiny_run import tiny_run_config

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Any]:
    """A head node (1 CPU, ``trainer_node``) and a second node (1 CPU, ``rollout_node``),
    with this process connected as the driver (on the head node)."""
    import ray

    from pipeline_rl.runtime_env import ACTOR_ENV

    with two_node_cluster(1, {"trainer_node": 1}, {"rollout_node": 1}) as cluster:
        ray.init(address=cluster.address, runtime_env={"env_vars": ACTOR_ENV}, log_to_driver=False)
        try:
            yield cluster
        finally:
            ray.shutdown()


def _config(tiny_model_dir: str, out: Path, *extra: str) -> Config:
    return tiny_run_config(tiny_model_dir, out, "--staleness", "2", *extra)


def _node_of(handle: Any) -> str:
    """The Ray node id an actor runs on (asked of the actor itself)."""
    import ray

    return str(ray.get(handle.__ray_call__.remote(
        lambda self: ray.get_runtime_context().get_node_id()), timeout=30))


def _pid_of(handle: Any) -> int:
    import ray

    return int(ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=30))


@dataclass
class _Seen:
    """What the watcher thread saw of the running job before it killed the trainer."""

    buffer_address: str = ""
    worker_node: str = ""
    trainer_node: str = ""
    buffer_node: str = ""
    killed_pid: int = 0
    killed_mid_save: bool = False


def _watch_then_kill_trainer(orch: Any, ckpts_dir: Path, seen: _Seen) -> None:
    """Record where the actors run, then SIGKILL the trainer while it saves the step-2
    checkpoint (or just after, if the save is too quick to catch)."""
    import ray

    seen.buffer_address = str(ray.get(orch.actors.buffer.address.remote(), timeout=30))
    seen.worker_node = _node_of(orch.actors.workers[0].handle)
    seen.trainer_node = _node_of(orch.actors.trainers[0])
    seen.buffer_node = _node_of(orch.actors.buffer)
    pid = _pid_of(orch.actors.trainers[0])
    saving, saved = ckpts_dir / "step_000002.partial", ckpts_dir / "step_000002"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        mid_save = saving.exists()
        if mid_save or saved.exists():
            seen.killed_pid, seen.killed_mid_save = pid, mid_save
            os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.005)


def test_two_nodes_over_tcp_trainer_death_and_resume(two_nodes: Any, tiny_model_dir: str,
                                                     tmp_path: Path) -> None:
    """One job across the two nodes: the rollout worker on the ``rollout_node`` node, the
    trainer on the ``trainer_node`` node, groups sent over TCP. The trainer is SIGKILLed
    mid-run (while it saves the step-2 checkpoint): the run stops with a clear error that
    names ``--resume``; the last complete checkpoint resumes, and versions continue."""
    import ray

    from pipeline_rl.training.checkpoint import latest_checkpoint, read_run_state
    from pipeline_rl.run.life.one_life import Orchestrator
    from pipeline_rl.run.life.start import open_run
    from pipeline_rl.run.life.supervise import OrchestratorError

    placement = ("--ray.rollout_resource", "rollout_node", "--ray.trainer_resource", "trainer_node")
    cfg = _config(tiny_model_dir, tmp_path / "dies", "--max-steps", "50",
                  "--trainer.checkpoint_every", "1", *placement)
    ckpts_dir = Path(cfg.out_dir) / "checkpoints"
    seen = _Seen()
    t0 = time.monotonic()
    with pytest.raises(OrchestratorError) as err:
        with Orchestrator(cfg, tiny_model_dir, threading.Event(), open_run(cfg)) as orch:
            threading.Thread(target=_watch_then_kill_trainer, args=(orch, ckpts_dir, seen),
                             daemon=True).start()
            orch.train()
    assert seen.killed_pid, "the trainer was never killed"
    assert time.monotonic() - t0 < 300

    # Placement: two nodes, each actor where its resource is; the buffer on the driver's node.
    resources = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    assert len(resources) == 2
    assert seen.worker_node != seen.trainer_node
    assert "rollout_node" in resources[seen.worker_node]
    assert "trainer_node" in resources[seen.trainer_node]
    assert seen.buffer_node == ray.get_runtime_context().get_node_id() != seen.worker_node
    # The ZeroMQ link: TCP on the driver node's IP (every group crossed nodes).
    host = seen.buffer_address.removeprefix("tcp://").rsplit(":", 1)[0]
    assert seen.buffer_address.startswith("tcp://") and host == ray.util.get_node_ip_address()
    logged = read_metrics(Path(cfg.out_dir) / "metrics.jsonl")
    assert [r["step"] for r in logged] == list(range(1, len(logged) + 1)), logged
    assert len(logged) >= 2, logged

    # The trainer's death: one clear error, a complete checkpoint to resume from.
    message = str(err.value)
    assert "trainer" in message and "died" in message and "--resume" in message, message
    last = latest_checkpoint(ckpts_dir)
    assert last is not None, "no checkpoint was left to resume from"
    version = read_run_state(last).version
    assert version in (1, 2), (version, seen)  # 1 when the kill landed mid-save

    resumed = _config(tiny_model_dir, tmp_path / "resumed", "--resume", str(last),
                      "--max-steps", str(version + 2), *placement)
    with Orchestrator(resumed, tiny_model_dir, threading.Event(), open_run(resumed)) as orch:
        assert orch.version == version
        orch.train()
    rows = read_metrics(Path(resumed.out_dir) / "metrics.jsonl")
    assert [(r["step"], r["version"]) for r in rows] == [(version + 1, version + 1),
                                                         (version + 2, version + 2)], rows
    assert all(0 <= r["lag_max"] <= 2 for r in rows), rows
    assert read_run_state(Path(resumed.out_dir) / "checkpoints" / f"step_{version + 2:06d}").version \
        == version + 2
