"""Producer side of the sample link: a rollout worker pushes encoded groups to the
buffer's receiver over ZeroMQ.

Why PUSH/PULL (not ROUTER/DEALER): samples flow one way, from many producers
to one buffer, and control (admission, versions, stop) goes through Ray.
PUSH is the one ZeroMQ pattern whose send *blocks* when its queue is full
instead of dropping (ROUTER drops on a full or unknown peer, PUB drops on a
full subscriber), and PULL fair-queues between producers, so one fast worker
cannot starve the others. No acknowledgements are needed: the buffer counts
what arrives per worker, and ``ReplayBuffer.worker_lost`` accounts for what a
dead worker never delivered.

Backpressure, end to end: the buffer's receiver stops reading while the
buffer is full; the receiver's queue for this connection (``RCVHWM``
messages) and the kernel's socket buffers fill; then this socket's own queue
(``SNDHWM`` messages) fills and ``send`` blocks. It waits at most
``send_timeout_s`` (the time waited is observable as ``wait_s``), then raises
:class:`BackpressureTimeout` -- or :class:`BufferUnreachable` if the buffer is
gone rather than full. Nothing is dropped and no queue grows without bound.

``IMMEDIATE`` is set, so messages are queued only on a live connection: the
constructor waits (bounded) until the buffer answers, and a wrong or dead
address is a one-line error instead of a silent hang.

With the run key (``key``) the socket proves it to the run's buffer
(``pipeline_rl.buffer.auth``): as a PLAIN client with the run's password when the
address is loopback, as a CURVE client (every message encrypted and authenticated)
otherwise, or as ``mechanism`` says (it must match the buffer's). A sender without the
key, or with another run's, is refused at the handshake (the one-line error says so).
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

from typing import TYPE_CHECKING

import zmq

from pipeline_rl.buffer.auth import Mechanism, make_client, mechanism_for
from pipeline_rl.buffer.types import BackpressureTimeout, BufferUnreachable, check_address
from pipeline_rl.samples import Group
from pipeline_rl.wire import DEFAULT_LIMITS, WireError, encode_group

if TYPE_CHECKING:
    from pipeline_rl.run_key import RunKey

DEFAULT_SNDHWM = 16  # messages; 8 -> 32 measured +14% groups/s (25 KB groups)
DEFAULT_SOCKET_BUFFER = 1 << 20  # bytes of kernel buffer per direction, per connection

_UP_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
_FAILED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class GroupSender:
    """Pushes groups to one buffer address. Thread-safe (one lock around the socket).

    ``wait_s``: total seconds spent inside ``send`` -- blocked by backpressure, plus
    the few microseconds each send takes to hand its message to ZeroMQ;
    ``sent``/``bytes_sent``: groups and bytes handed to ZeroMQ.
    """

    def __init__(self, address: str, worker_id: int, send_timeout_s: float = 60.0, *,
                 connect_timeout_s: float | None = None, sndhwm: int = DEFAULT_SNDHWM,
                 socket_buffer_bytes: int = DEFAULT_SOCKET_BUFFER,
                 max_message_bytes: int = DEFAULT_LIMITS.max_message_bytes,
                 key: RunKey | None = None, mechanism: Mechanism | None = None) -> None:
        """Connect to ``address`` (``tcp://HOST:PORT`` or ``ipc://PATH``) and wait up
        to ``connect_timeout_s`` (default: ``send_timeout_s``) for the buffer to answer;
        ``key``: the run key (None: plain ZeroMQ); ``mechanism``: how to prove it
        (default: PLAIN on a loopback address, CURVE otherwise, as the buffer chooses)."""
        check_address(address, bind=False)
        if send_timeout_s <= 0 or sndhwm < 1:
            raise ValueError(f"send_timeout_s ({send_timeout_s}) must be > 0 and sndhwm ({sndhwm}) >= 1")
        self.address = address
        self.worker_id = worker_id
        self.send_timeout_s = send_timeout_s
        self.max_message_bytes = max_message_bytes
        self.sent = 0
        self.bytes_sent = 0
        self._wait_s = 0.0
        self._blocked_since: float | None = None
        self._peer_up = False
        self._handshake_failed = False
        self._lock = threading.Lock()
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.PUSH)
        if key is not None:
            make_client(self._sock, key, mechanism or mechanism_for(address))
        for opt, value in ((zmq.SNDHWM, sndhwm), (zmq.IMMEDIATE, 1), (zmq.LINGER, 0),
                           (zmq.SNDTIMEO, max(1, int(send_timeout_s * 1000))),
                           (zmq.SNDBUF, socket_buffer_bytes), (zmq.RECONNECT_IVL, 100),
                           (zmq.RECONNECT_IVL_MAX, 2000)):
            self._sock.setsockopt(opt, value)
        self._monitor = self._sock.get_monitor_socket(_UP_EVENTS | _DOWN_EVENTS | _FAILED_EVENTS)
        try:
            self._sock.connect(address)
        except zmq.ZMQError as e:
            self._teardown(0)
            raise ValueError(f"cannot connect to buffer address {address!r}: {e}") from None
        self._await_peer(send_timeout_s if connect_timeout_s is None else connect_timeout_s)

    @property
    def wait_s(self) -> float:
        """Seconds spent inside ``send`` (see the class docstring), including a send in progress."""
        since = self._blocked_since
        return self._wait_s + (time.monotonic() - since if since is not None else 0.0)

    @property
    def blocked(self) -> bool:
        """True while a ``send`` is in progress (under backpressure: waiting for room)."""
        return self._blocked_since is not None

    def _await_peer(self, timeout_s: float) -> None:
        if not self._sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
            self._drain_monitor()
            err = self._unreachable(f"no buffer answered within {timeout_s:.1f} s")
            self._teardown(0)
            raise err

    def send(self, group: Group) -> None:
        """Encode and push one group; blocks under backpressure up to
        ``send_timeout_s``, then raises BackpressureTimeout (buffer full) or
        BufferUnreachable (connection gone). On either error nothing was sent."""
        payload = encode_group(group)
        if len(payload) > self.max_message_bytes:
            raise WireError("oversized", f"group {group.group_id} encodes to {len(payload)} bytes "
                            f"> limit {self.max_message_bytes}")
        with self._lock:
            start = self._blocked_since = time.monotonic()
            try:
                self._sock.send(payload)  # blocks (GIL released) up to SNDTIMEO
            except zmq.Again:
                self._drain_monitor()
                if not self._peer_up:
                    raise self._unreachable(f"connection lost; group {group.group_id} not sent within "
                                            f"{self.send_timeout_s:.1f} s") from None
                raise BackpressureTimeout(
                    f"buffer at {self.address} stayed full for {self.send_timeout_s:.1f} s; group "
                    f"{group.group_id} not sent (is the trainer consuming?)") from None
            finally:
                self._blocked_since = None
                self._wait_s += time.monotonic() - start
            self.sent += 1
            self.bytes_sent += len(payload)

    def _unreachable(self, what: str) -> BufferUnreachable:
        hint = (" (a peer answered but the ZeroMQ handshake failed: wrong port, another protocol, "
                "or the buffer refused this process: it does not hold the run's key?)"
                if self._handshake_failed
                else " (is the buffer running? right host and port?)")
        return BufferUnreachable(f"buffer at {self.address}: {what}{hint}")

    def _drain_monitor(self) -> None:
        """Replay connection events queued since the last call (non-blocking)."""
        while self._monitor.poll(0):
            frames = self._monitor.recv_multipart()
            event = int.from_bytes(frames[0][:2], "little")
            if event & _UP_EVENTS:
                self._peer_up = True
            elif event & _DOWN_EVENTS:
                self._peer_up = False
            elif event & _FAILED_EVENTS:
                self._peer_up, self._handshake_failed = False, True

    def close(self, linger_s: float = 5.0) -> None:
        """Flush queued groups for up to ``linger_s``, then close the socket and
        the context (its I/O threads are joined). Idempotent."""
        with self._lock:
            if not self._ctx.closed:
                self._teardown(int(linger_s * 1000))

    def _teardown(self, linger_ms: int) -> None:
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(linger_ms)
        self._ctx.term()

    def __enter__(self) -> GroupSender:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
