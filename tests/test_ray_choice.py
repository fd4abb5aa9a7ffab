"""Which Ray a run uses and whether it pins (``pipeline_rl/run/cluster.py``), without Ray:
``--ray.address`` first, then ``RAY_ADDRESS`` (as ``ray job submit`` sets it), else a private
Ray of its own; cores pinned only on a Ray the run started unless ``--ray.pin_cores`` says."""

from __future__ import annotations

import pytest

from pipeline_rl.cli import parse_config
from pipeline_rl.config import Config
from pipeline_rl.run.cluster import RAY_ADDRESS_ENV, Cluster, join_address


def _cfg(*argv: str) -> Config:
    return parse_config(list(argv), check_cpu=True)[0]


def test_the_flag_then_the_variable_name_the_cluster_to_join(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RAY_ADDRESS_ENV, raising=False)
    assert join_address(_cfg()) is None                                   # a private Ray
    monkeypatch.setenv(RAY_ADDRESS_ENV, "10.0.0.1:6379")
    assert join_address(_cfg()) == "10.0.0.1:6379"                        # ray job submit
    assert join_address(_cfg("--ray.address", "auto")) == "auto"         # the flag wins
    monkeypatch.setenv(RAY_ADDRESS_ENV, "")
    assert join_address(_cfg()) is None


@pytest.mark.parametrize("flag, started, pins", [
    (None, True, True), (None, False, False),         # unset: only on a Ray the run started
    ("true", False, True), ("true", True, True),       # asked for: on a joined Ray too
    ("false", True, False), ("false", False, False),
])
def test_cores_are_pinned_only_on_a_ray_the_run_started_unless_asked(flag: str | None, started: bool,
                                                                    pins: bool) -> None:
    cluster = Cluster(_cfg(*(["--ray.pin_cores", flag] if flag else [])))
    cluster._started = started
    assert cluster._pins() is pins
