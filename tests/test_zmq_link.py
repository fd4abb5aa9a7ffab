"""The ZeroMQ link end to end with real sockets: addresses, backpressure, bad
input, dying and reconnecting producers, clean shutdown, and 4 producer
processes x 5,000 groups without loss."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import msgpack
import pytest
import zmq

from pipeline_rl.buffer import (
    BackpressureTimeout,
    BufferServer,
    BufferUnreachable,
    GroupSender,
    ReplayBuffer,
)
from benchmarks.synthetic import SyntheticGroups
from pipeline_rl.wire import WireLimits, encode_group

SMALL = WireLimits(max_message_bytes=64 * 1024)


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def link() -> Iterator[tuple[ReplayBuffer, BufferServer]]:
    buf = ReplayBuffer(capacity_groups=64, staleness=100, groups_per_step=4)
    server = BufferServer(buf, limits=SMALL)
    yield buf, server
    server.close()


def raw_push(address: str) -> tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    return ctx, sock


# ------------------------------------------------------------------ addresses
@pytest.mark.parametrize("address", ["localhost:5555", "tcp://127.0.0.1", "udp://127.0.0.1:5",
                                     "tcp://127.0.0.1:99999", "tcp://*:5555", "ipc://", ""])
def test_bad_address_is_a_one_line_error(address: str) -> None:
    with pytest.raises(ValueError) as err:
        GroupSender(address, 0, send_timeout_s=1)
    assert address in str(err.value) and "\n" not in str(err.value)


def test_bad_bind_address_and_port_in_use() -> None:
    buf = ReplayBuffer(4, 0, 1)
    with pytest.raises(ValueError, match="not tcp://HOST:PORT"):
        BufferServer(buf, "http://x")
    with BufferServer(buf) as first:
        with pytest.raises(OSError, match="cannot bind the buffer") as err:
            BufferServer(buf, first.address)
        assert "\n" not in str(err.value)


def test_unreachable_address_fails_fast_with_a_clear_error() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(BufferUnreachable, match="no buffer answered within 0.5 s") as err:
        GroupSender(address, 0, send_timeout_s=30, connect_timeout_s=0.5)
    assert time.monotonic() - t0 < 3 and address in str(err.value)


def test_a_peer_failing_the_handshake_is_named_in_the_error() -> None:
    """A ZeroMQ peer with another security mechanism (CURVE) at the address. (A
    non-ZeroMQ service such as HTTP cannot always be told apart: libzmq takes
    unknown greetings for the unversioned ZMTP 1.0.)"""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    curve_greeting = _zmtp_push_greeting()[0].replace(b"NULL".ljust(20, b"\x00"), b"CURVE".ljust(20, b"\x00"))

    def answer() -> None:
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.sendall(curve_greeting)
            time.sleep(0.05)
            conn.close()

    th = threading.Thread(target=answer)
    th.start()
    try:
        with pytest.raises(BufferUnreachable, match="handshake failed"):
            GroupSender(f"tcp://127.0.0.1:{listener.getsockname()[1]}", 0, connect_timeout_s=0.5)
    finally:
        stop.set()
        th.join()
        listener.close()


def test_ipc_address_works(tmp_path: os.PathLike[str]) -> None:
    buf = ReplayBuffer(8, 0, 1)
    with BufferServer(buf, f"ipc://{tmp_path}/buf.sock") as server:
        assert server.address.startswith("ipc://")
        with GroupSender(server.address, 0, send_timeout_s=5) as sender:
            sender.send(SyntheticGroups(0, n=2, tokens=4).make(7))
        assert [g.group_id for g in buf.get_batch(1, 0, timeout_s=5) or []] == [7]


# ------------------------------------------------------------------ backpressure
def test_stalled_consumer_blocks_producer_with_flat_memory_then_resumes_without_loss() -> None:
    capacity, hwm, count = 8, 4, 300
    gen = SyntheticGroups(1, n=8, tokens=2048)  # ~200 KB per message; 300 of them = 60 MB
    msg = len(encode_group(gen.make(0)))
    buf = ReplayBuffer(capacity_groups=capacity, staleness=0, groups_per_step=4)
    with BufferServer(buf, rcvhwm=hwm, socket_buffer_bytes=256 * 1024) as server, \
            GroupSender(server.address, 1, send_timeout_s=30, sndhwm=hwm,
                        socket_buffer_bytes=256 * 1024) as sender:
        groups = [gen.make(i) for i in range(count)]  # share token arrays: ~no memory
        rss_before = _rss_bytes()
        def produce() -> None:
            for g in groups:
                sender.send(g)

        th = threading.Thread(target=produce)
        th.start()
        wait_until(lambda: sender.blocked and len(buf) == capacity)
        time.sleep(0.3)
        in_flight = sender.sent
        time.sleep(0.3)
        # Producer blocked, nothing more accepted, nothing dropped, memory bounded:
        # at most capacity + both HWMs + the kernel buffers (2 x 2 x 256 KB) worth.
        assert sender.sent == in_flight and sender.blocked and sender.wait_s >= 0.5
        assert in_flight <= capacity + 2 * hwm + (4 * 256 * 1024) // msg + 2
        assert _rss_bytes() - rss_before < 25 * 2**20  # vs ~60 MB if sends queued up
        stats = buf.stats()
        assert stats.fill == capacity and stats.full_wait_s >= 0.5 and stats.rejected == {}
        got: list[int] = []
        while len(got) < count:  # the consumer resumes
            got += [g.group_id for g in buf.get_batch(4, 0, timeout_s=10) or []]
        th.join()
    assert got == list(range(count))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_send_times_out_with_backpressure_timeout() -> None:
    buf = ReplayBuffer(capacity_groups=1, staleness=0, groups_per_step=1)
    gen = SyntheticGroups(0, n=8, tokens=4096)  # 400 KB: kernel buffers hold few
    with BufferServer(buf, rcvhwm=1, socket_buffer_bytes=64 * 1024) as server, \
            GroupSender(server.address, 0, send_timeout_s=0.4, sndhwm=1,
                        socket_buffer_bytes=64 * 1024) as sender:
        with pytest.raises(BackpressureTimeout, match="stayed full for 0.4 s") as err:
            for i in range(100):
                sender.send(gen.make(i))
        assert "\n" not in str(err.value) and 0.35 < sender.wait_s < 5 and sender.sent < 10
        sender.close(linger_s=0)  # the buffer is full: do not wait to flush


def test_buffer_gone_is_reported_as_unreachable_not_backpressure() -> None:
    buf = ReplayBuffer(capacity_groups=8, staleness=0, groups_per_step=1)
    server = BufferServer(buf)
    sender = GroupSender(server.address, 0, send_timeout_s=0.5)
    server.close()
    gen = SyntheticGroups(0, n=2, tokens=4)
    with pytest.raises(BufferUnreachable, match="connection lost"):
        for i in range(50):
            sender.send(gen.make(i))
    sender.close(linger_s=0)


# ------------------------------------------------------------------ bad input
def test_bad_messages_are_counted_by_reason_and_never_reach_a_batch(
        link: tuple[ReplayBuffer, BufferServer]) -> None:
    buf, server = link
    good = encode_group(SyntheticGroups(0, n=2, tokens=8).make(42))
    bad_schema = msgpack.packb([99] + msgpack.unpackb(good)[1:])
    nan_reward = encode_group(SyntheticGroups(0, n=2, tokens=8).make(1))
    fields = msgpack.unpackb(nan_reward)
    fields[9] = struct.pack("<2d", float("nan"), 0.0)
    ctx, sock = raw_push(server.address)
    for payload in [b"\xc1garbage", bad_schema, good[: len(good) // 2], b"\x00" * 100_000,
                    msgpack.packb(fields)]:
        sock.send(payload)
    sock.send_multipart([good, b"extra frame"])
    sock.send(good)
    sock.close()
    ctx.term()
    wait_until(lambda: buf.stats().groups_in == 1 and sum(buf.stats().rejected.values()) == 6)
    assert buf.stats().rejected == {"not_msgpack": 2, "schema_version": 1, "oversized": 1,
                                    "bad_value": 1, "multipart": 1}
    assert [g.group_id for g in buf.get_batch(1, 0, timeout_s=1) or []] == [42]
    assert buf.get_batch(1, 0, timeout_s=0.1) is None


def test_message_above_the_hard_cap_drops_only_that_connection(
        link: tuple[ReplayBuffer, BufferServer]) -> None:
    buf, server = link
    ctx, sock = raw_push(server.address)
    sock.send(b"\x00" * (4 * SMALL.max_message_bytes))  # never allocated by the receiver
    wait_until(lambda: buf.stats().disconnections >= 1)
    sock.close(0)
    ctx.term()
    with GroupSender(server.address, 3, send_timeout_s=5) as sender:
        sender.send(SyntheticGroups(3, n=2, tokens=4).make(5))
    assert [g.group_id for g in buf.get_batch(1, 0, timeout_s=5) or []] == [5]


def test_sender_refuses_to_send_an_oversized_group() -> None:
    buf = ReplayBuffer(4, 0, 1)
    with BufferServer(buf) as server, GroupSender(server.address, 0, max_message_bytes=1000) as sender:
        with pytest.raises(ValueError, match="oversized: group 3 encodes to"):
            sender.send(SyntheticGroups(0, n=2, tokens=256).make(3))


def test_non_zeromq_garbage_on_the_port_is_counted(link: tuple[ReplayBuffer, BufferServer]) -> None:
    buf, server = link
    port = int(server.address.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 8)
    # Depending on timing libzmq fails the handshake (handshake_failed) or, taking the
    # bytes for unversioned ZMTP 1.0 frames, delivers junk that the decoder refuses.
    wait_until(lambda: sum(buf.stats().rejected.values()) >= 1)
    with GroupSender(server.address, 0, send_timeout_s=5) as sender:
        sender.send(SyntheticGroups(0, n=2, tokens=4).make(9))
    assert [g.group_id for g in buf.get_batch(1, 0, timeout_s=5) or []] == [9]


def _zmtp_push_greeting() -> tuple[bytes, bytes]:
    """ZMTP 3.0 greeting (NULL mechanism) and READY command of a PUSH socket."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
    return greeting, b"\x04" + bytes([len(body)]) + body


def test_producer_dying_mid_message_loses_only_that_message(
        link: tuple[ReplayBuffer, BufferServer]) -> None:
    buf, server = link
    port = int(server.address.rsplit(":", 1)[1])
    greeting, ready = _zmtp_push_greeting()
    good = encode_group(SyntheticGroups(5, n=2, tokens=8).make(1))
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.sendall(greeting + ready)
        answer = b""
        while not answer.endswith(b"Socket-Type\x00\x00\x00\x04PULL"):  # greeting + READY
            answer += raw.recv(128)
        raw.sendall(b"\x02" + struct.pack(">Q", len(good)) + good)  # one complete frame
        raw.sendall(b"\x02" + struct.pack(">Q", 50_000) + good[:1000])  # then dies mid-frame
        wait_until(lambda: buf.stats().groups_in == 1, 3)
    wait_until(lambda: buf.stats().disconnections >= 1)
    with GroupSender(server.address, 6, send_timeout_s=5) as sender:
        sender.send(SyntheticGroups(6, n=2, tokens=4).make(2))
    assert [g.group_id for g in buf.get_batch(2, 0, timeout_s=5) or []] == [1, 2]
    assert buf.stats().rejected == {}


def _send_forever(address: str, worker_id: int) -> None:
    gen = SyntheticGroups(worker_id, n=2, tokens=64)
    with GroupSender(address, worker_id, send_timeout_s=60) as sender:
        for i in range(10**9):
            sender.send(gen.make(i))


def test_killed_producer_process_is_refunded_by_worker_lost() -> None:
    buf = ReplayBuffer(capacity_groups=16, staleness=0, groups_per_step=4)
    with BufferServer(buf) as server:
        assert buf.acquire(7, 400).granted == 4  # (0 + 0 + 1) * 4
        # Pretend training went on, so the worker gets a grant larger than anything that
        # can be in flight when it dies (queues + kernel socket buffers: ~2,700 of these
        # 1.6 KB groups at most), so every group it sent was granted.
        buf.set_version(10_000)
        assert buf.acquire(7, 40_000).granted == 40_000
        proc = mp.get_context("spawn").Process(target=_send_forever, args=(server.address, 7))
        proc.start()
        got = 0
        while got < 40:  # consume while it produces, then kill it mid-stream
            got += len(buf.get_batch(4, 0, timeout_s=30) or [])
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        # What it sent before dying is still delivered (ZeroMQ notices the closed
        # connection only once it has read everything before it).
        deadline = time.monotonic() + 20
        while buf.get_batch(1, 0, timeout_s=0.3) is not None or buf.stats().disconnections < 1:
            assert time.monotonic() < deadline
        received = buf.stats().groups_in
        granted = buf.stats().admission.granted
        assert buf.worker_lost(7) == granted - received
        adm = buf.stats().admission
        assert adm.lost == granted - received and adm.outstanding == 0
        with GroupSender(server.address, 8, send_timeout_s=5) as sender:  # the run goes on
            sender.send(SyntheticGroups(8, n=2, tokens=4).make(10**6))
        assert [g.group_id for g in buf.get_batch(1, 0, timeout_s=5) or []] == [10**6]
        assert buf.stats().rejected == {}


def test_producer_reconnects_and_survives_a_buffer_restart() -> None:
    buf = ReplayBuffer(capacity_groups=64, staleness=0, groups_per_step=1)
    gen = SyntheticGroups(2, n=2, tokens=4)
    address = f"tcp://127.0.0.1:{free_port()}"
    server = BufferServer(buf, address)
    with GroupSender(address, 2, send_timeout_s=5) as first:
        first.send(gen.make(0))
    with GroupSender(address, 2, send_timeout_s=5) as again:  # same worker, new connection
        again.send(gen.make(1))
        wait_until(lambda: buf.stats().groups_in == 2)
        server.close()
        server = BufferServer(buf, address)  # the buffer comes back on the same address
        # PUSH has no acks: a group handed to ZeroMQ before it has seen the old
        # connection drop dies with that connection. Once it has seen the drop,
        # sends wait for the reconnect (IMMEDIATE), so at most that one is lost.
        sent = 2
        while buf.stats().groups_in < 3:
            assert sent < 4, "the sender did not reconnect to the restarted buffer"
            again.send(gen.make(sent))  # ZeroMQ reconnects underneath
            sent += 1
            deadline = time.monotonic() + 5.0
            while buf.stats().groups_in < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
    server.close()
    ids = [g.group_id for g in buf.get_batch(3, 0, timeout_s=1) or []]
    assert ids[:2] == [0, 1] and ids[2] == sent - 1
    assert buf.stats().connections >= 3


# ------------------------------------------------------------------ load and shutdown
def _produce(address: str, worker_id: int, count: int) -> None:
    gen = SyntheticGroups(worker_id, n=2, tokens=4)
    with GroupSender(address, worker_id, send_timeout_s=60) as sender:
        for i in range(count):
            sender.send(gen.make(worker_id * 1_000_000 + i))


def test_four_producer_processes_5000_groups_each_arrive_exactly_once_in_order() -> None:
    producers, count = 4, 5000
    buf = ReplayBuffer(capacity_groups=256, staleness=0, groups_per_step=64)
    with BufferServer(buf) as server:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_produce, args=(server.address, w, count)) for w in range(producers)]
        for p in procs:
            p.start()
        got: list[int] = []
        while len(got) < producers * count:
            batch = buf.get_batch(min(64, producers * count - len(got)), 0, timeout_s=60)
            assert batch is not None, f"stalled after {len(got)} groups"
            got += [g.group_id for g in batch]
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
        stats = buf.stats()
    assert len(got) == len(set(got)) == producers * count
    for w in range(producers):
        mine = [g for g in got if g // 1_000_000 == w]
        assert mine == [w * 1_000_000 + i for i in range(count)]  # per-producer FIFO
    assert stats.groups_in == stats.groups_out == producers * count
    assert stats.evicted == {} and stats.rejected == {} and stats.fill == 0


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_clean_shutdown_leaks_no_threads_or_sockets() -> None:
    def cycle() -> None:
        buf = ReplayBuffer(capacity_groups=8, staleness=0, groups_per_step=1)
        server = BufferServer(buf)
        senders = [GroupSender(server.address, w, send_timeout_s=5) for w in range(2)]
        for w, s in enumerate(senders):
            s.send(SyntheticGroups(w, n=2, tokens=4).make(w))
        wait_until(lambda: buf.stats().groups_in == 2)
        for s in senders:
            s.close()
        server.close()
        server.close()  # idempotent
        with pytest.raises(BufferUnreachable):  # a failed connect cleans up too
            GroupSender(server.address, 9, connect_timeout_s=0.05)

    cycle()  # warm-up: one-time allocations (logging, numpy) are not leaks
    threads, fds, py_threads = _native_threads(), _open_fds(), threading.active_count()
    for _ in range(3):
        cycle()
    assert (_native_threads(), _open_fds(), threading.active_count()) == (threads, fds, py_threads)
