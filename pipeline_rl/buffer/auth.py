"""Who may push samples into the buffer: ZeroMQ CURVE with key pairs derived from the run
key (``pipeline_rl.run_key``), and a ZAP handler that admits only the run's client key.

Both key pairs come from the run key, so every actor that was handed it computes them
and nothing else has to travel: the buffer's socket is a CURVE server with the server
pair, each rollout worker's a CURVE client with the one client pair, and it checks the
server's public key. A peer is refused at the handshake, before any message is read:

- a peer without CURVE (plain ZeroMQ) or that does not know the server's key fails the
  handshake in libzmq (the socket monitor says so but does not name the peer: the buffer
  counts it under ``handshake_failed``);
- a CURVE client with another client key reaches the ZAP handler, which refuses it
  (counted under ``unauthorized``) and logs it once per peer address.

Every message on an admitted connection is encrypted and authenticated by CURVE, so a
group is from a process that holds the run key. ZAP (RFC 27) runs on this module's
thread, on the server's own context (``inproc://zeromq.zap.01``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

from pipeline_rl.run_key import RunKey

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = "pipeline_rl"
_POLL_MS = 100


@dataclass(frozen=True, slots=True)
class CurvePair:
    """One CURVE key pair, Z85-encoded as libzmq takes it. ``repr`` hides the secret half."""

    public: bytes
    secret: bytes = field(repr=False)


def _pair(key: RunKey, label: str) -> CurvePair:
    secret = z85.encode(key.derive(label))
    return CurvePair(zmq.curve_public(secret), secret)


def server_pair(key: RunKey) -> CurvePair:
    """The buffer's CURVE key pair for this run."""
    return _pair(key, "buffer/curve-server")


def client_pair(key: RunKey) -> CurvePair:
    """The rollout workers' CURVE key pair for this run (one for all: each holds the run key)."""
    return _pair(key, "buffer/curve-client")


def make_server(sock: zmq.Socket[bytes], key: RunKey) -> None:
    """Make ``sock`` (before it binds) a CURVE server with the run's key pair, asking ZAP."""
    pair = server_pair(key)
    sock.curve_server = True
    sock.curve_secretkey = pair.secret
    sock.curve_publickey = pair.public
    sock.zap_domain = ZAP_DOMAIN.encode()


def make_client(sock: zmq.Socket[bytes], key: RunKey) -> None:
    """Make ``sock`` (before it connects) a CURVE client of the run's buffer."""
    pair = client_pair(key)
    sock.curve_serverkey = server_pair(key).public
    sock.curve_publickey = pair.public
    sock.curve_secretkey = pair.secret


class ZapHandler:
    """Answers libzmq's ZAP requests for one context on a daemon thread until :meth:`close`:
    a CURVE client whose public key is the run's client key is admitted, anything else is
    refused; ``refused(address)`` is called for each refusal (the buffer counts it), and
    each peer address is logged once. Bind it before the server socket binds."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], key: RunKey,
                 refused: Callable[[str], None]) -> None:
        self._allowed = z85.decode(client_pair(key).public)
        self._refused = refused
        self._logged: set[str] = set()
        self._stop = threading.Event()
        self._sock = ctx.socket(zmq.REP)
        self._sock.linger = 0
        self._sock.bind(ZAP_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="buffer-zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(_POLL_MS):
                continue
            frames = self._sock.recv_multipart()
            self._sock.send_multipart(self._answer(frames))

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        """The reply to one ZAP request (``1.0``, id, domain, address, identity,
        mechanism, credentials...)."""
        if len(frames) < 6:
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"malformed", b"", b""]
        request_id, address, mechanism = frames[1], frames[3].decode(errors="replace"), frames[5]
        if mechanism == b"CURVE" and len(frames) > 6 and frames[6] == self._allowed:
            return [b"1.0", request_id, b"200", b"OK", b"run", b""]
        self._refused(address)
        if address not in self._logged:
            self._logged.add(address)
            log.warning("buffer: refused a producer at %s: it does not hold this run's key "
                        "(%s client); further refusals of this address are only counted",
                        address, mechanism.decode(errors="replace"))
        return [b"1.0", request_id, b"400", b"not a member of this run", b"", b""]

    def close(self) -> None:
        """Stop the thread (joined) and close its socket. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._sock.close(0)
