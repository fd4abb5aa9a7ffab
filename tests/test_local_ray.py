"""pipeline_rl/run/local_ray.py: the prompt wait for the raylet's registration patches Ray's
node lookup only inside its block and falls back to Ray's own wait on any error; the lean
head and the actors' environment hold only inside theirs (every local run of the suite
starts Ray through :func:`start_local`)."""

from __future__ import annotations

from typing import Any

import os
import socket

import pytest

from pipeline_rl.run import local_ray as ray_start
from pipeline_rl.run import ray_agents


class _Accessor:
    def __init__(self, tables: list[list[dict[str, Any]]]) -> None:
        self.tables = tables

    def get_node_table(self) -> list[dict[str, Any]]:
        return self.tables.pop(0) if len(self.tables) > 1 else self.tables[0]


def test_registered_needs_the_node_alive() -> None:
    assert not ray_start._registered(_Accessor([[]]), "ab")
    assert not ray_start._registered(_Accessor([[{"NodeID": "ab", "Alive": False}]]), "ab")
    assert not ray_start._registered(_Accessor([[{"NodeID": "cd", "Alive": True}]]), "ab")
    assert ray_start._registered(_Accessor([[{"NodeID": "ab", "Alive": True}]]), "ab")


def test_patch_is_scoped_and_falls_back_to_rays_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray._private.services as services

    calls: list[tuple[str, str]] = []

    def rays_own(gcs_address: str, node_id: str) -> dict[str, str]:
        calls.append((gcs_address, node_id))
        return {"NodeID": node_id}

    def broken(gcs_address: str, node_id: str) -> None:
        raise AttributeError("a changed Ray internal")

    monkeypatch.setattr(services, "get_node", rays_own)
    monkeypatch.setattr(ray_start, "_wait_registered", broken)
    with ray_start.prompt_node_wait():
        assert services.get_node is not rays_own
        assert services.get_node("gcs:1", "ab") == {"NodeID": "ab"}
    assert services.get_node is rays_own and calls == [("gcs:1", "ab")]


def test_gcs_port_is_looked_for_promptly_within_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray._private.node as node

    calls: list[dict[str, Any]] = []

    def rays_own(session: str, node_id: str, name: str, timeout_ms: int = 30000,
                 poll_interval_ms: int = 100) -> int:
        calls.append({"timeout_ms": timeout_ms, "poll_interval_ms": poll_interval_ms})
        return 6379

    monkeypatch.setattr(node, "wait_for_persisted_port", rays_own)
    with ray_start.prompt_gcs_port():
        assert node.wait_for_persisted_port("s", "n", "gcs_server_port", timeout_ms=5) == 6379
    assert node.wait_for_persisted_port is rays_own
    assert calls == [{"timeout_ms": 5, "poll_interval_ms": ray_start.POLL_MS}]


def test_lean_head_is_scoped() -> None:
    from ray._private.node import Node

    api, monitor, logs = Node.start_api_server, Node.start_monitor, Node.start_log_monitor
    with ray_start.lean_head():
        assert Node.start_api_server is not api and Node.start_monitor is not monitor
        assert Node.start_log_monitor is not logs
        assert Node.start_monitor(object()) is None   # starts nothing
    with ray_start.lean_head(dashboard=True, log_monitor=True):
        assert (Node.start_api_server, Node.start_monitor, Node.start_log_monitor) == (api, monitor, logs)
    with ray_start.lean_head(log_monitor=True):
        assert Node.start_log_monitor is logs and Node.start_api_server is not api
    assert (Node.start_api_server, Node.start_monitor, Node.start_log_monitor) == (api, monitor, logs)


def test_environment_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_RL_TEST_KEEP", "before")
    monkeypatch.delenv("PIPELINE_RL_TEST_NEW", raising=False)
    with ray_start.environment({"PIPELINE_RL_TEST_KEEP": "during", "PIPELINE_RL_TEST_NEW": "1"}):
        assert os.environ["PIPELINE_RL_TEST_KEEP"] == "during" and os.environ["PIPELINE_RL_TEST_NEW"] == "1"
    assert os.environ["PIPELINE_RL_TEST_KEEP"] == "before" and "PIPELINE_RL_TEST_NEW" not in os.environ


# -- the raylet's agents (run/ray_agents.py) -----------------------------------------------------
def _agent_args(tmp: str, *extra: str) -> list[str]:
    return ["agent.py", "--node-id=abc", f"--session-dir={tmp}", "--node-ip-address=127.0.0.1", *extra]


def test_minimal_dashboard_agent_writes_its_ports_and_waits(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    waited: list[bool] = []
    monkeypatch.setattr(ray_agents, "wait_for_parent", lambda listener=None: waited.append(True))
    monkeypatch.setattr(ray_agents, "become", lambda agent: pytest.fail("became the real agent"))
    ray_agents.main([ray_agents.DASHBOARD_AGENT, *_agent_args(str(tmp_path), "--minimal", "--head")])
    for name in ray_agents.DASHBOARD_PORTS:
        assert (tmp_path / f"{name}_abc").read_text() == "-1"
    assert waited == [True] and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("component,flag", [
    (ray_agents.DASHBOARD_AGENT, "--head"),                                 # Ray with its dashboard extras
    (ray_agents.RUNTIME_ENV_AGENT, "--runtime-env-agent-port=45678"),      # a port chosen by the caller
    ("another_agent", "--runtime-env-agent-port=0")])
def test_the_real_agent_unchanged(component: str, flag: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    became: list[list[str]] = []
    monkeypatch.setattr(ray_agents, "become", became.append)
    args = _agent_args(str(tmp_path), flag)
    ray_agents.main([component, *args])
    assert became == [args] and not list(tmp_path.iterdir())


@pytest.mark.parametrize("called", [True, False])
def test_runtime_env_agent_listens_first_and_starts_when_called(called: bool, tmp_path: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The port file is written at once; the real agent starts on that port only when
    someone calls (else the script ends with the raylet)."""
    became: list[list[str]] = []
    niced: list[int] = []
    listened: list[int] = []

    def wait_for_parent(listener: socket.socket | None = None) -> bool:
        listened.append(listener.getsockname()[1] if listener is not None else -1)
        return called

    monkeypatch.setattr(ray_agents, "become", became.append)
    monkeypatch.setattr(ray_agents.os, "nice", niced.append)
    monkeypatch.setattr(ray_agents, "wait_for_parent", wait_for_parent)
    ray_agents.main([ray_agents.RUNTIME_ENV_AGENT, *_agent_args(str(tmp_path), "--runtime-env-agent-port=0")])
    port = int((tmp_path / f"{ray_agents.RUNTIME_ENV_PORT}_abc").read_text())
    low = ray_agents.ephemeral_low()
    assert low is not None and ray_agents.QUIET_PORT_MIN <= port < low   # never a free-port probe's answer
    assert listened == [port]
    if called:
        assert f"--runtime-env-agent-port={port}" in became[0] and "--runtime-env-agent-port=0" not in became[0]
        assert niced == [ray_agents.RUNTIME_ENV_NICE]
    else:
        assert became == [] and niced == []
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))   # the script let the port go: the real agent can take it


def test_the_wait_for_the_raylet_ends_on_a_connection() -> None:
    listener = ray_agents.quiet_listener("127.0.0.1")
    assert listener is not None
    with listener, socket.create_connection(listener.getsockname()):
        assert ray_agents.wait_for_parent(listener)


@pytest.mark.parametrize("range_text", ["", "1024 60999", "not a range"])
def test_runtime_env_agent_as_ray_starts_it_without_a_quiet_port(range_text: str, tmp_path: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """No room below the ephemeral range (or no readable range): Ray's own agent, unchanged."""
    ports = tmp_path / "range"
    ports.write_text(range_text)
    monkeypatch.setattr(ray_agents, "EPHEMERAL_RANGE", str(ports))
    became: list[list[str]] = []
    monkeypatch.setattr(ray_agents, "become", became.append)
    session = tmp_path / "session"
    session.mkdir()
    args = _agent_args(str(session), "--runtime-env-agent-port=0")
    ray_agents.main([ray_agents.RUNTIME_ENV_AGENT, *args])
    assert became == [args] and not list(session.iterdir())


def test_quick_agents_is_scoped_and_steps_aside_for_memory_profiling(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray._private.ray_constants as constants
    import ray._private.services as services

    original = services._build_python_executable_command_memory_profileable
    with ray_start.quick_agents():
        command = services._build_python_executable_command_memory_profileable
        assert command(constants.PROCESS_TYPE_DASHBOARD_AGENT, "/tmp")[-2:] == [
            ray_start.AGENT_SCRIPT, constants.PROCESS_TYPE_DASHBOARD_AGENT]
        assert command(constants.PROCESS_TYPE_RUNTIME_ENV_AGENT, "/tmp")[-1] == constants.PROCESS_TYPE_RUNTIME_ENV_AGENT
        assert command(constants.PROCESS_TYPE_RAYLET, "/tmp") == original(constants.PROCESS_TYPE_RAYLET, "/tmp")
    assert services._build_python_executable_command_memory_profileable is original
    import ray._private.utils as utils

    asks = utils.get_dashboard_dependency_error
    with ray_start.quick_agents():   # minimal: Ray is not sent to import the dashboard's packages
        assert isinstance(utils.get_dashboard_dependency_error(), ImportError)
    with ray_start.quick_agents(minimal=False):
        assert utils.get_dashboard_dependency_error is asks
    assert utils.get_dashboard_dependency_error is asks
    monkeypatch.setenv(services.RAY_MEMRAY_PROFILE_COMPONENT_ENV, constants.PROCESS_TYPE_DASHBOARD_AGENT)
    with ray_start.quick_agents():
        assert services._build_python_executable_command_memory_profileable is original


def test_an_actor_with_a_runtime_env_still_starts(ray_local: None) -> None:
    """The real runtime-env agent comes up behind the quick start and serves such an actor."""
    import ray

    @ray.remote(num_cpus=0)
    class Env:
        def value(self) -> str | None:
            return os.environ.get("PIPELINE_RL_TEST_AGENT")

    actor = Env.options(runtime_env={"env_vars": {"PIPELINE_RL_TEST_AGENT": "served"}}).remote()  # type: ignore[attr-defined]
    try:
        assert ray.get(actor.value.remote(), timeout=60) == "served"
    finally:
        ray.kill(actor)


def test_the_actors_run_at_the_drivers_priority(ray_local: None) -> None:
    """A local Ray's worker processes are not niced below the driver (Ray's default: 15)."""
    import ray

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)

    assert ray.get(niceness.remote(), timeout=60) == os.getpriority(os.PRIO_PROCESS, 0)
