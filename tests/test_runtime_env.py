"""The one module that sets each role's environment (pipeline_rl.runtime_env)."""

from __future__ import annotations

import os

import pytest

from pipeline_rl import runtime_env


def test_a_trainer_actor_is_local_rank_0_whatever_the_driver_inherited(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver started under torchrun or SLURM passes its LOCAL_RANK to a local Ray's actors;
    a trainer actor sees only its own device, so it must not pick ``cuda:LOCAL_RANK``."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    runtime_env.for_rendezvous("127.0.0.1", 29500, 1, 2)
    assert os.environ["LOCAL_RANK"] == "3"   # a plain process keeps what its launcher set
    runtime_env.for_rendezvous("127.0.0.1", 29500, 1, 2, local_rank=0)
    assert (os.environ["LOCAL_RANK"], os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) \
        == ("0", "1", "2", "29500")
