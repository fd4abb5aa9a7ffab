"""The run key and the buffer's authenticated socket with real ZeroMQ, on loopback (PLAIN,
the default there) and with CURVE forced (the cluster path): only the run's producers get
in. Foreign pushes of well-formed groups (the project's own ``Completion``, ``Group`` and
``encode_group``, reward 1000) from another process over plain ZeroMQ, from a sender with
another run's key or none, and from a rogue client of the same mechanism (PLAIN with a
guessed password; CURVE knowing the server's key but not the client's) are all refused
and counted, and never reach a batch."""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import time
from collections.abc import Callable

import numpy as np
import pytest
import zmq

from pipeline_rl.buffer import BufferServer, BufferUnreachable, GroupSender, ReplayBuffer
from pipeline_rl.buffer.auth import PLAIN_USERNAME, Mechanism, client_pair, mechanism_for, server_pair
from pipeline_rl.run_key import Purpose, RunKey
from pipeline_rl.samples import Completion, Group
from pipeline_rl.wire import encode_group

FOREIGN_REWARD = 1000.0


def group(group_id: int, reward: float) -> Group:
    ids = np.arange(3, 11, dtype=np.int32)
    comps = tuple(Completion(ids, np.full(8, -0.5, np.float32), np.zeros(8, np.int32), reward, "stop")
                  for _ in range(2))
    return Group(group_id, group_id, 0, np.arange(3, 7, dtype=np.int32), comps)


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def push_plain(address: str, count: int) -> int:
    """A process outside the run: plain ZeroMQ PUSH of well-formed groups (the issue's attack)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 0
    sock.sndtimeo = 200
    sock.connect(address)
    sent = 0
    for i in range(count):
        try:
            sock.send(encode_group(group(10_000 + i, FOREIGN_REWARD)))
            sent += 1
        except zmq.Again:
            pass
    time.sleep(0.5)
    sock.close(0)
    ctx.term()
    return sent


def test_run_key_never_shows_its_secret_and_survives_pickling() -> None:
    key = RunKey.new()
    for text in (repr(key), str(key), f"{key}", repr([key])):
        assert key.secret.hex() not in text and "hidden" in text
    assert pickle.loads(pickle.dumps(key)) == key != RunKey.new()
    assert key.derive(Purpose.HASH) != key.derive(Purpose.BUFFER_PLAIN) and len(key.derive(Purpose.HASH)) == 32
    assert server_pair(key) != client_pair(key) and key.secret.hex() not in repr(server_pair(key))
    with pytest.raises(ValueError, match="32 bytes"):
        RunKey(b"short")


def test_the_mechanism_follows_the_bind_address() -> None:
    for local in ("tcp://127.0.0.1:*", "tcp://127.0.0.5:9", "tcp://localhost:9", "tcp://[::1]:9", "ipc:///tmp/b"):
        assert mechanism_for(local) == "plain", local
    for network in ("tcp://*:9", "tcp://0.0.0.0:9", "tcp://10.0.0.7:9", "tcp://node-1:9"):
        assert mechanism_for(network) == "curve", network


def rogue_client(ctx: zmq.Context[zmq.Socket[bytes]], key: RunKey, mechanism: Mechanism) -> zmq.Socket[bytes]:
    """A client of the right mechanism without the run key: PLAIN with a guessed password,
    or CURVE knowing the server's public key but not the run's client key."""
    rogue = ctx.socket(zmq.PUSH)
    rogue.linger, rogue.immediate, rogue.sndtimeo = 0, 1, 1000
    if mechanism == "plain":
        rogue.plain_username, rogue.plain_password = PLAIN_USERNAME, b"guess"
    else:
        rogue.curve_serverkey = server_pair(key).public
        rogue.curve_publickey, rogue.curve_secretkey = zmq.curve_keypair()
    return rogue


@pytest.mark.parametrize("mechanism", ["plain", "curve"])
def test_foreign_producers_are_refused_and_only_the_runs_groups_are_trained(
        caplog: pytest.LogCaptureFixture, mechanism: Mechanism) -> None:
    key = RunKey.new()
    buf = ReplayBuffer(capacity_groups=64, staleness=100, groups_per_step=4)
    caplog.set_level(logging.WARNING)
    forced: Mechanism | None = "curve" if mechanism == "curve" else None  # loopback: PLAIN by default
    with BufferServer(buf, key=key, mechanism=forced) as server:
        assert server.mechanism == mechanism
        # 1. another process on this machine, plain ZeroMQ, well-formed groups
        proc = mp.get_context("spawn").Process(target=push_plain, args=(server.address, 50))
        proc.start()
        # 2. a sender of the project holding another run's key, and one holding none
        for other in (RunKey.new(), None):
            with pytest.raises(BufferUnreachable, match="handshake failed.*run's key"):
                GroupSender(server.address, 7, connect_timeout_s=1.0, key=other, mechanism=forced)
        # 3. a client of the same mechanism without the run key
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        rogue = rogue_client(ctx, key, mechanism)
        try:
            rogue.connect(server.address)
            with pytest.raises(zmq.Again):   # never admitted, so nothing can be queued
                rogue.send(encode_group(group(20_000, FOREIGN_REWARD)))
            # the run's own producer gets in and delivers
            with GroupSender(server.address, 0, send_timeout_s=5.0, key=key, mechanism=forced) as own:
                for i in range(8):
                    own.send(group(i, 0.5))
            proc.join(20)
            assert proc.exitcode == 0
            # PLAIN: the plain pusher and the keyless sender fail the handshake, the other
            # run's sender and the rogue reach ZAP; CURVE: only the rogue reaches ZAP
            failed, refused = (2, 2) if mechanism == "plain" else (3, 1)
            wait_until(lambda: buf.stats().rejected.get("unauthorized", 0) >= refused
                       and buf.stats().rejected.get("handshake_failed", 0) >= failed)
            batches = [buf.get_batch(4, 0, timeout_s=2.0) for _ in range(2)]
        finally:
            rogue.close(0)
            ctx.term()
            if proc.is_alive():
                proc.kill()
        stats = buf.stats()
    groups = [g for b in batches for g in (b or [])]
    assert sorted(g.group_id for g in groups) == list(range(8))
    assert all(float(r) == 0.5 for g in groups for r in g.rewards)
    assert stats.fill == 0   # nothing foreign waits behind them either
    assert stats.rejected.get("handshake_failed", 0) >= failed and stats.rejected["unauthorized"] >= refused
    refusals = [r.getMessage() for r in caplog.records if "refused a producer at 127.0.0.1" in r.getMessage()]
    assert len(refusals) == 1   # logged once per peer address, however often it retries
    assert key.secret.hex() not in caplog.text


def test_without_a_key_the_link_is_plain_zeromq() -> None:
    buf = ReplayBuffer(capacity_groups=8, staleness=100, groups_per_step=2)
    with BufferServer(buf) as server:
        assert not server.authenticated
        assert push_plain(server.address, 2) == 2
        wait_until(lambda: buf.stats().fill == 2)
