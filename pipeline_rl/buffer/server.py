"""Receiver side of the sample link: a ZeroMQ PULL socket and one thread that
decodes, validates and stores groups in a :class:`ReplayBuffer`.

Backpressure: the receiver thread reads only while the buffer has room. When
it is full the thread stops reading; ZeroMQ's queue for each producer
(``RCVHWM`` messages) and the kernel's socket buffers fill, then each
producer's ``SNDHWM`` queue, and the producers' ``send`` blocks (see
``sender.py``). No message is dropped for lack of room.

Memory bound. With ``C`` = capacity in groups, ``M`` = the hard per-message
cap (``2 * max_message_bytes``; ZeroMQ drops a connection that sends more),
``P`` = connected producers and ``K`` = the kernel socket buffer size (each
side; Linux doubles the value set), the bytes held for samples are at most
``C * M`` (stored groups; a decoded group holds its message -- its arrays are views
of it -- or, for a message under 8 KiB, the 8 KiB ZeroMQ buffer it arrived in) plus
``P * ((SNDHWM + RCVHWM) * M + 4 * K)`` in flight -- whatever producers try
to send. With the defaults (16 + 16 messages, 1 MiB buffers) and 25 KB groups
(8 x 256 tokens) that is about ``C * 25 KB + P * 4.8 MB``; the worst case
(every message at the hard cap) is what ``max_message_bytes`` is for.

Bad input never stops the thread: a message that fails ``wire.decode_group``
(garbage, wrong schema version, truncated, oversized, bad values) is counted
under its reason in ``ReplayBuffer.stats().rejected`` and logged (rate
limited); a multipart message is rejected whole (``multipart``); a peer that
does not speak ZeroMQ fails the handshake (``handshake_failed``) or, when libzmq
takes its bytes for unversioned ZMTP 1.0, delivers junk the decoder refuses. A producer
that dies mid-message loses only its unfinished message (ZeroMQ discards a
partial frame); a producer that reconnects just continues. Producer
connects/disconnects are counted in the stats.
"""

from __future__ import annotations

import logging
import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING

import zmq

from pipeline_rl.buffer.auth import Mechanism, ZapHandler, make_server, mechanism_for
from pipeline_rl.buffer.replay import ReplayBuffer
from pipeline_rl.buffer.types import check_address
from pipeline_rl.samples import Group
from pipeline_rl.wire import DEFAULT_LIMITS, WireError, WireLimits, decode_group, prepare_decoder

if TYPE_CHECKING:
    from pipeline_rl.config import Config
    from pipeline_rl.run_key import RunKey

log = logging.getLogger(__name__)

DEFAULT_RCVHWM = 16
DEFAULT_SOCKET_BUFFER = 1 << 20
_POLL_MS = 100          # how often the thread re-checks for stop and room
_MONITOR_S = 0.05       # how often connection events are read while messages flow
_BURST = 64             # messages decoded per buffer-lock acquisition at most
_LOG_FIRST = 10         # log the first rejects of each reason, then every _LOG_EVERY-th
_LOG_EVERY = 1000


class BufferServer:
    """Binds a PULL socket at ``address`` (default: a free loopback TCP port) and
    feeds ``buffer`` from a background thread until :meth:`close`.

    ``address`` (after construction): the resolved endpoint, e.g.
    ``tcp://127.0.0.1:40123``; producers connect there. A wildcard bind
    (``tcp://*:PORT`` or ``tcp://0.0.0.0:PORT``) resolves to ``tcp://0.0.0.0:PORT``:
    remote producers must substitute this node's IP address. ``key``: the run key; with it
    only producers holding it are admitted (``pipeline_rl.buffer.auth``): PLAIN on a
    loopback address, CURVE on any other, unless ``mechanism`` says which.
    ``mechanism`` (after construction): the one in use, None without a key.
    """

    def __init__(self, buffer: ReplayBuffer, address: str | None = None, *,
                 limits: WireLimits = DEFAULT_LIMITS, rcvhwm: int = DEFAULT_RCVHWM,
                 socket_buffer_bytes: int = DEFAULT_SOCKET_BUFFER, key: RunKey | None = None,
                 mechanism: Mechanism | None = None) -> None:
        bind_to = check_address(address or "tcp://127.0.0.1:*", bind=True)
        prepare_decoder()
        self.buffer = buffer
        self.limits = limits
        self._stop = threading.Event()
        self._ctx = zmq.Context(io_threads=1)
        self.mechanism: Mechanism | None = (mechanism or mechanism_for(bind_to)) if key is not None else None
        self._zap = (ZapHandler(self._ctx, key, self._refuse, self.mechanism)
                     if key is not None and self.mechanism is not None else None)
        self._sock = self._ctx.socket(zmq.PULL)
        if key is not None and self.mechanism is not None:
            make_server(self._sock, key, self.mechanism)
        self.authenticated = key is not None
        for opt, value in ((zmq.RCVHWM, rcvhwm), (zmq.LINGER, 0), (zmq.RCVBUF, socket_buffer_bytes),
                           (zmq.RCVTIMEO, _POLL_MS),
                           (zmq.MAXMSGSIZE, 2 * limits.max_message_bytes)):
            self._sock.setsockopt(opt, value)
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        try:
            self._sock.bind(bind_to)
        except zmq.ZMQError as e:
            self._teardown()
            raise OSError(f"cannot bind the buffer at {bind_to!r}: {e}") from None
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._logged: dict[str, int] = {}
        #: What ended the receiver thread, if an exception did (samples no longer arrive).
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"buffer-recv {self.address}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- thread
    def _run(self) -> None:
        next_monitor = 0.0
        try:
            while not self._stop.is_set():
                # Full buffer: stop reading, so ZeroMQ pushes back on the producers.
                if ((self.buffer.free_slots() <= 0 or self.buffer.closed)
                        and not self.buffer.wait_for_space(_POLL_MS / 1000)):
                    self._drain_monitor()  # connection events still get counted
                    if self.buffer.closed:  # nothing will ever fit: idle until close()
                        self._stop.wait(_POLL_MS / 1000)
                    continue
                self._receive_burst(min(_BURST, max(1, self.buffer.free_slots())))
                if (now := time.monotonic()) >= next_monitor:
                    self._drain_monitor()
                    next_monitor = now + _MONITOR_S
        except Exception as e:  # a bug here must be loud, not a silently dead receiver
            self.error = e
            log.exception("buffer receiver thread crashed")
            raise

    def _receive_burst(self, limit: int) -> None:
        """Wait up to ``_POLL_MS`` for a message (the socket's ``RCVTIMEO``), then take
        whatever else is already queued, up to ``limit`` messages in all."""
        groups: list[Group] = []
        nbytes = 0
        flags = 0  # the first recv blocks (GIL released), the rest only take what is there
        for _ in range(limit):
            try:
                frame = self._sock.recv(flags, copy=False)
            except zmq.Again:
                break
            flags = zmq.NOBLOCK
            if frame.more:
                self._discard_rest()
                self._reject("multipart", "a group must be one single-frame message")
                continue
            raw = frame.buffer
            try:
                groups.append(decode_group(raw, self.limits))
            except WireError as e:
                self._reject(e.reason, str(e))
                continue
            nbytes += len(raw)
        self._store(groups, nbytes)

    def _store(self, groups: list[Group], nbytes: int) -> None:
        while groups and not self._stop.is_set():
            stored = self.buffer.put_many(groups, timeout_s=_POLL_MS / 1000, nbytes=nbytes)
            nbytes -= nbytes * stored // len(groups)
            groups = groups[stored:]
        if groups:
            self._reject("shutdown", f"{len(groups)} decoded groups dropped at shutdown")

    def _discard_rest(self) -> None:
        while self._sock.getsockopt(zmq.RCVMORE):
            self._sock.recv(copy=False)

    def _drain_monitor(self) -> None:
        while self._monitor.poll(0):
            frames = self._monitor.recv_multipart()
            event = int.from_bytes(frames[0][:2], "little")
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.buffer.connection_event(True)
                log.info("producer connected to %s", self.address)
            elif event == zmq.EVENT_DISCONNECTED:
                self.buffer.connection_event(False)
                log.info("producer disconnected from %s (closed, died, or sent a message above "
                         "%d bytes)", self.address, 2 * self.limits.max_message_bytes)
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and self._zap is not None:
                pass  # the ZAP handler refused it: counted and logged there, with its address
            else:
                value = int.from_bytes(frames[0][2:6], "little")
                why = (" (a peer without this run's key; libzmq does not name it)"
                       if self.authenticated else "")
                self._reject("handshake_failed", f"ZeroMQ handshake with a peer failed "
                             f"({zmq.Event(event).name}, code {value:#x}){why}")

    def _refuse(self, address: str) -> None:
        """The ZAP handler refused a producer at ``address`` (it logs once per address)."""
        self.buffer.reject("unauthorized")

    def _reject(self, reason: str, detail: str) -> None:
        self.buffer.reject(reason)
        seen = self._logged[reason] = self._logged.get(reason, 0) + 1
        if seen <= _LOG_FIRST or seen % _LOG_EVERY == 0:
            log.warning("buffer %s rejected a message (%d so far for this reason): %s",
                        self.address, seen, detail)

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Stop the thread (joined), close both sockets and terminate the context
        (linger 0: whatever is still queued in ZeroMQ is discarded). Idempotent."""
        if self._ctx.closed:
            return
        self._stop.set()
        self._thread.join()
        self._teardown()

    def _teardown(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)
        if self._zap is not None:
            self._zap.close()
        self._ctx.term()

    def __enter__(self) -> BufferServer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def configured_server(cfg: Config, bind_host: str = "127.0.0.1", start_version: int = 0,
                      key: RunKey | None = None) -> BufferServer:
    """A run's buffer and its server as the configuration sizes them (the buffer actor's,
    and the benchmarks' in-process pipeline's): capacity, staleness, batch, ranks,
    ``--buffer.address`` (else a free port on ``bind_host``), the message-size limit and
    the run key (None: plain ZeroMQ). The buffer is the server's ``buffer``."""
    buffer = ReplayBuffer(cfg.buffer.capacity_groups, cfg.staleness, cfg.groups_per_step,
                          num_ranks=cfg.trainer.num_ranks, start_version=start_version,
                          skip_zero_variance=cfg.algorithm.skip_zero_variance)
    limits = WireLimits(max_message_bytes=int(cfg.buffer.max_message_mb * 2**20))
    return BufferServer(buffer, cfg.buffer.address or f"tcp://{bind_host}:*", limits=limits, key=key)
