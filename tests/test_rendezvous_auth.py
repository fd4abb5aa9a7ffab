"""The weight channel's rendezvous with real gloo: a process that is not part of the run
(another process on this machine, with another run's key or none) joins the trainer's
store and group, and is refused before any weight moves; the run's own worker is
admitted and receives. Also: a foreign *trainer* is refused by the run's worker."""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.pool
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from pipeline_rl.calls import in_daemon_thread
from pipeline_rl.run_key import RunKey
from pipeline_rl.weight_sync.channels import rendezvous_auth
from pipeline_rl.weight_sync.channels.gloo import Channel, GlooInitInfo
from pipeline_rl.weight_sync.channels.rendezvous_auth import RendezvousRefused

TIMEOUT_S = 20.0


_ports: "mp.SimpleQueue[int] | None" = None


def _pool_init(ports: "mp.SimpleQueue[int]") -> None:
    global _ports
    _ports = ports


@pytest.fixture(scope="module")
def outsider() -> Iterator[tuple["mp.pool.Pool", "mp.SimpleQueue[int]"]]:
    """One process outside the run (spawned once: importing torch there is the cost)."""
    ctx = mp.get_context("spawn")
    ports: "mp.SimpleQueue[int]" = ctx.SimpleQueue()
    with ctx.Pool(1, initializer=_pool_init, initargs=(ports,)) as pool:
        yield pool, ports


@pytest.fixture
def key() -> RunKey:
    """This test process plays the run: its key is handed to each end as an actor's would be."""
    return RunKey.new()


def foreign_join(port: int, with_key: bool) -> str:
    """Another process: joins the trainer's rendezvous as the worker would (the project's
    own code), holding another run's key or none. Returns how it ended."""
    secret = RunKey.new().rendezvous_secret() if with_key else b""
    try:
        channel = Channel.connect(GlooInitInfo("127.0.0.1", port, timeout_s=TIMEOUT_S), secret)
    except RendezvousRefused as e:
        return f"refused: {e}"
    buf = torch.zeros(4, dtype=torch.uint8)
    channel.broadcast(buf).wait()   # a weight byte would arrive here: it must never
    return f"joined, got {buf.tolist()}"


def test_a_foreign_process_is_refused_at_the_rendezvous(
        key: RunKey, outsider: tuple["mp.pool.Pool", "mp.SimpleQueue[int]"],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    before = rendezvous_auth.refusals()
    for with_key in (True, False):
        pending, port = Channel.serve("127.0.0.1", TIMEOUT_S, key.rendezvous_secret())
        attempt = outsider[0].apply_async(foreign_join, (port, with_key))
        with pytest.raises(RendezvousRefused, match="refused a peer .*does not hold this run's key"):
            pending.join()
        assert attempt.get(TIMEOUT_S).startswith("refused: weight channel: the trainer's end did not prove")
    assert rendezvous_auth.refusals() == before + 2
    assert caplog.text.count("refused a peer that says it is") == 1   # logged once per (claimed) host
    assert key.secret.hex() not in caplog.text


def test_the_runs_worker_is_admitted_and_receives(key: RunKey) -> None:
    pending, port = Channel.serve("127.0.0.1", TIMEOUT_S, key.rendezvous_secret())
    worker = in_daemon_thread(Channel.connect, GlooInitInfo("127.0.0.1", port, timeout_s=TIMEOUT_S),
                              key.rendezvous_secret())
    trainer = pending.join()
    joined = worker.result(TIMEOUT_S)
    sent = torch.from_numpy(np.arange(8, dtype=np.uint8))
    got = torch.zeros(8, dtype=torch.uint8)
    receiving = joined.broadcast(got)
    trainer.broadcast(sent).wait()
    receiving.wait()
    assert got.tolist() == list(range(8))
    trainer.close()
    joined.close()


def foreign_serve() -> str:
    """Another process plays the trainer, with another run's key (its port goes out first)."""
    pending, port = Channel.serve("127.0.0.1", TIMEOUT_S, RunKey.new().rendezvous_secret())
    assert _ports is not None
    _ports.put(port)
    try:
        pending.join()
        return "joined"
    except RendezvousRefused:
        return "refused"


def test_the_runs_worker_refuses_a_foreign_trainer(
        key: RunKey, outsider: tuple["mp.pool.Pool", "mp.SimpleQueue[int]"]) -> None:
    pool, ports = outsider
    attempt = pool.apply_async(foreign_serve)
    port = ports.get()
    with pytest.raises(RendezvousRefused, match="trainer's end did not prove"):
        Channel.connect(GlooInitInfo("127.0.0.1", port, timeout_s=TIMEOUT_S), key.rendezvous_secret())
    assert attempt.get(TIMEOUT_S) == "refused"
