"""pipeline_rl/run/local_ray.py: the prompt wait for the raylet's registration patches Ray's
node lookup only inside its block and falls back to Ray's own wait on any error; the lean
head and the actors' environment hold only inside theirs (every local run of the suite
starts Ray through :func:`start_local`)."""

from __future__ import annotations

from typing import Any

import os

import pytest

from pipeline_rl.run import local_ray as ray_start


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
